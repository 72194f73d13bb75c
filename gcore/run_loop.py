"""One controller process's run: the step loop, the evaluations, the checkpoints and the final save.

``Trainer`` (``gcore/trainer.py``) launches the controllers and wires, in each, a ``ControllerRun``: the
controller, the rollouts in flight that draw each step's prompts, the checkpointer, the loggers' folder.
``loop`` runs the steps; each draws its prompts (``InFlightRollouts.draw``), runs ``Controller.step`` and
logs the step's metrics with its checkpoint's.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gcore import threads
from gcore.algorithms.stall import StallWatch
from gcore.checkpointer import Checkpointer
from gcore.controller import Controller
from gcore.data import CostBalancer
from gcore.errors import GcoreError, Interrupted, PluginExit, RewardError
from gcore.inflight import InFlightRollouts
from gcore.liveness import SIGNALS
from gcore.run_config import FitResult, TrainerConfig
from gcore.tracing import Tracer, open_tracer
from gcore.types import Prompt
from gcore.user_code import ending_as

if TYPE_CHECKING:
    from lightning_fabric import Fabric
    from tqdm import tqdm
    from transformers import PreTrainedTokenizerBase


@dataclass
class ControllerRun:
    """One controller process's run, as ``Trainer`` wired it: the steps from ``start_step`` (``loop``), the
    evaluations every ``eval_every``, the checkpoints, the final save."""

    fabric: Fabric
    tokenizer: PreTrainedTokenizerBase
    controller: Controller
    #: each step's prompts, drawn ahead of it with ``max_staleness``, and their rollouts in flight
    rollouts: InFlightRollouts
    balancer: CostBalancer | None  # learns response lengths, with --data.balance
    checkpointer: Checkpointer
    start_step: int  # 0, or the step after the checkpoint resumed from
    run_dir: str | None  # the loggers' folder (rank 0)
    eval_prompts: list[Prompt]  # held-out prompts of --trainer.eval_every (none when 0)
    central: bool  # one controller drives every process (--trainer.controllers 1)
    config: TrainerConfig
    prompts_per_step: int  # the global batch (``CostBalancer.learn``)
    evaluate: Callable[[], dict[str, float]]  # the ``eval/*`` metrics of the policy now
    plugin_exit: Callable[[BaseException], PluginExit | None]  # a plugin's code that ended the process, named
    #: this controller's torch threads, re-chosen before each stage (``None``: a fixed count, docs/threads.md)
    governor: threads.ThreadGovernor | None = None
    tracer: Tracer | None = None  # rollout tracing (``--trainer.trace_every``), opened by ``loop``

    def loop(self) -> FitResult:
        """Run the steps from ``self.start_step`` to ``max_steps`` (evaluating every ``eval_every``), then
        save the final policy; Ctrl-C or SIGTERM finishes the checkpoint in flight and says where to go on."""
        c, fabric = self.config, self.fabric
        rank = fabric.global_rank
        history: list[dict[str, float]] = []
        evaluations: list[dict[str, float]] = []
        bar = _progress(c.max_steps, enabled=c.enable_progress_bar and rank == 0)
        bar.update(self.start_step)
        step = self.start_step
        streaks = _Streaks()  # steps in a row that skipped their update, or whose every episode failed
        stall = StallWatch()  # steps in a row that trained no sample (every group tied): one line when they pile up
        self.tracer = self.tracer or open_tracer(fabric, self.run_dir, self.central, c, self.start_step, self.tokenizer)
        # what setup built (modules, models, data) lives for the run: out of the collector's sight, so that a full
        # collection inside a step does not walk it (a pause of 0.3 s on the tiny model, which the stage times and
        # so dynamic placement would charge to whichever stage it fell in)
        gc.collect()
        gc.freeze()
        try:
            with ending_as(self.plugin_exit):  # here, so that the save in flight is completed (below)
                for step in range(self.start_step, c.max_steps):
                    if self.eval_prompts and step % c.eval_every == 0:
                        evaluations.append(self._evaluate(step, bar))
                    metrics = self._step(step, bar)
                    history.append(metrics)
                    if (note := stall.update(step, metrics)) and rank == 0:
                        print(note, file=sys.stderr, flush=True)
                    bar.set_description("step", refresh=False)
                    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", s=f"{metrics['time/step']:.2f}")
                    bar.update(1)
                    if stop := streaks.update(step, metrics, c):
                        self.checkpointer.wait()
                        raise GcoreError(stop)
                if self.eval_prompts and self.start_step < c.max_steps:  # the trained policy
                    evaluations.append(self._evaluate(c.max_steps, bar))
                self.checkpointer.wait()
        except (PluginExit, RewardError):  # a plugin's code failed: the save in flight is still completed
            bar.close()
            self.checkpointer.finish_for_exit()
            raise
        except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (``Interrupted``)
            bar.close()
            last = self.checkpointer.finish_for_exit()
            if rank == 0:
                name = signal.Signals(interrupt.signum if isinstance(interrupt, Interrupted) else signal.SIGINT).name
                where = (f"continue it from {last} with --trainer.resume auto" if last else
                         "no checkpoint was written (--trainer.checkpoint_every N writes them): a new run "
                         "starts from step 0")
                print(f"gcore: {name} during step {step}: {where}", file=sys.stderr, flush=True)
            raise
        bar.close()
        for logger in fabric.loggers:
            logger.finalize("success")

        final_dir = None
        if c.save_final and rank == 0 and self.run_dir is not None:
            final_dir = self.checkpointer.save_final(os.path.join(self.run_dir, "final"), self.tokenizer)
        fabric.barrier()
        if rank == 0:
            return FitResult(self.run_dir, final_dir, history, evaluations)
        return FitResult(None, None, history, evaluations)

    def _step(self, step: int, bar: tqdm) -> dict[str, float]:
        """One training step on this controller's share of the step's prompts; returns its logged metrics."""
        drawn = self.rollouts.draw(step)
        prompts = drawn.prompts if not self.central or self.fabric.global_rank == 0 else []

        def on_stage(stage: str) -> None:
            bar.set_description(stage, refresh=False)
            if self.governor is not None:
                self.governor.update()

        record = self.controller.step(step, prompts, on_stage=on_stage)
        metrics = record.metrics
        metrics["step"] = float(step)
        if self.governor is not None:  # the count the step's last stage ran with, and what it was chosen from
            metrics["threads/torch"] = float(self.governor.threads)
            metrics["threads/others_cores"] = self.governor.others
        metrics["balance/predicted_imbalance"] = drawn.imbalance
        if self.tracer is not None:  # rollout tracing: some of the step's samples to samples.jsonl and the loggers
            metrics["time/trace"] = self.tracer.trace(step, record.samples, record.kept, record.batch)
        if self.balancer is not None:
            all_gather = self.fabric.all_gather if self.fabric.world_size > 1 else None
            self.balancer.learn(record.samples, self.prompts_per_step, all_gather)  # type: ignore[arg-type]
        # an interrupt here is held until the save is started and the step logged: a checkpoint
        # of step N always comes with N's metrics row, and the save is then finished
        with SIGNALS.deferred():
            metrics.update(self.checkpointer.save(step, last_step=step == self.config.max_steps - 1))
            self.fabric.log_dict(metrics, step=step)
        return metrics

    def _evaluate(self, step: int, bar: tqdm) -> dict[str, float]:
        """Evaluate the policy after ``step`` updates; logged at once, on a row of its own."""
        fabric = self.fabric
        bar.set_description("eval", refresh=False)
        metrics = {"step": float(step), **self.evaluate()}
        fabric.log_dict(metrics, step=step)
        if fabric.global_rank == 0 and self.config.enable_progress_bar:
            bar.write(f"step {step}: held-out accuracy greedy {metrics['eval/accuracy_greedy']:.3f}, "
                      f"sampled {metrics['eval/accuracy_sampled']:.3f} ({metrics['eval/prompts']:.0f} prompts)")
        return metrics

def _progress(total: int, enabled: bool) -> tqdm:
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, unit="step", dynamic_ncols=True)


class _Streaks:
    """Steps in a row that went wrong in a way the run cannot recover from by itself; ``update`` returns the
    one-line reason to stop once a streak reaches its ``--trainer`` limit, else ``None``. Every controller sees the
    same figures (``skipped_updates`` and ``env/*`` are summed over the controllers), so all stop together."""

    def __init__(self) -> None:
        self.skipping = 0  # steps that skipped their update (a non-finite loss or gradient)
        self.failing = 0  # steps whose every episode ended on an environment error

    def update(self, step: int, metrics: dict[str, float], c: TrainerConfig) -> str | None:
        self.skipping = self.skipping + 1 if metrics.get("skipped_updates", 0.0) > 0 else 0
        if c.max_skipped_updates and self.skipping >= c.max_skipped_updates:
            return (f"step {step}: {self.skipping} steps in a row skipped their update because the loss or the "
                    f"gradient was NaN or infinite (loss {metrics.get('loss', float('nan')):g}, grad_norm "
                    f"{metrics.get('grad_norm', float('nan')):g}); stopping (see --trainer.max_skipped_updates)")
        episodes = metrics.get("env/episodes", 0.0)
        self.failing = self.failing + 1 if episodes > 0 and metrics.get("env/errors", 0.0) >= episodes else 0
        if c.max_failed_env_steps and self.failing >= c.max_failed_env_steps:
            return (f"step {step}: every episode of the last {self.failing} steps ended on an environment error "
                    f"({episodes:g} of {episodes:g} on this step; the warnings above name each rollout's first "
                    "error); stopping (see --trainer.max_failed_env_steps)")
        return None
