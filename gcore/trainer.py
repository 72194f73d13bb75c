"""The ``Trainer``: launches the controllers with Lightning Fabric and runs the step loop."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import yaml
from lightning.fabric.loggers import CSVLogger

from gcore import threads
from gcore.algorithms.base import Algorithm
from gcore.backends.base import TrainingBackend
from gcore.checkpoint import (
    TRAINER_STATE,
    CheckpointError,
    CheckpointManager,
    disk_error,
    latest_checkpoint,
    pick_checkpoint,
    resolve_resume,
    rng_state,
    set_rng_state,
    verify,
)
from gcore.controller import Controller
from gcore.data import CostBalancer, DataConfig, PromptSampler, load_eval_prompts, load_prompts, with_synthetic_feature
from gcore.engines.base import Engine
from gcore.errors import ConfigError, GcoreError, Interrupted
from gcore.liveness import ControllerWatch
from gcore.model import ModelConfig, ModelSource, load_tokenizer, make_workdir, materialize
from gcore.placement.base import PlacementPolicy
from gcore.rendezvous import loopback_store
from gcore.rewards.base import RewardModel
from gcore.types import Prompt, SamplingParams

LoggerName = Literal["csv", "tensorboard", "wandb", "mlflow"]


def make_logger(name: str, root: str, run_name: str, version: int | None = None):  # noqa: ANN201
    """A Lightning logger by name; Weights & Biases and MLflow through Lightning's own loggers.

    ``version``: the ``version_N`` folder to write into (a resumed run continues its own); ``None``: a new one.
    """
    from lightning.fabric.loggers import TensorBoardLogger

    if name == "csv":
        return CSVLogger(root, name=run_name, version=version, flush_logs_every_n_steps=1)
    if name == "tensorboard":
        return TensorBoardLogger(root, name=run_name, version=version, default_hp_metric=False)
    if name in ("wandb", "mlflow"):
        package = {"wandb": "wandb", "mlflow": "mlflow"}[name]
        import importlib.util

        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"--trainer.logger {name} needs the {package} package: pip install {package}")
        from lightning.pytorch import loggers

        if name == "wandb":
            return loggers.WandbLogger(name=run_name, save_dir=root)
        return loggers.MLFlowLogger(experiment_name=run_name, save_dir=os.path.join(root, "mlruns"))
    raise ConfigError(f"--trainer.logger {name!r}: valid choices: csv, tensorboard, wandb, mlflow")


@dataclass
class TrainerConfig:
    """Run-level options, named as in Lightning where they mean the same.

    Args:
        max_steps: training steps to run.
        accelerator: ``cpu``, ``cuda`` or ``auto``.
        devices: controllers (processes) per node; one per GPU on GPUs.
        num_nodes: machines (launched by torchrun or SLURM, as Fabric does).
        precision: Fabric precision, e.g. ``32-true`` or ``bf16-mixed``.
        seed: seeds model initialisation, data order and sampling.
        default_root_dir: where runs are written (``<root>/<name>/version_N``).
        name: the run's folder name under ``default_root_dir``.
        logger: ``csv``, ``tensorboard``, ``wandb``, ``mlflow``, or several as a list (the last two
            when their packages are installed).
        enable_progress_bar: show a progress bar with the live reward.
        save_final: save the trained policy as an HF checkpoint at the end.
        checkpoint_every: save a resumable checkpoint every N steps (0: never) under
            ``<default_root_dir>/<name>/checkpoints``.
        keep_checkpoints: how many complete checkpoints to keep.
        async_checkpoint: write checkpoints in the background while training goes on.
        resume: ``auto`` (the latest complete checkpoint that verifies, if any: a corrupt newer one is
            passed over with a one-line note) or a checkpoint folder; it may have been written by
            another number of controllers (elastic resume). A resumed run appends to its own
            ``metrics.csv`` (the steps it redoes are replaced).
        collective_timeout: seconds a collective may wait for the other controllers before the run
            fails (instead of hanging when one of them died). A controller that is killed is named at
            once; one that is frozen is found by ``heartbeat_timeout``, usually much sooner.
        heartbeat_timeout: seconds a controller may send no heartbeat (sent every half second by a
            thread of its own, also while it computes) before the others declare it lost, name it,
            and end every process of the run, the silent one included.
        max_skipped_updates: stop the run after this many consecutive steps that skipped an update
            because the loss or the gradient was NaN or infinite (0: never stop).
        eval_every: evaluate on the held-out prompts (``--data.eval_path`` or the embedded task's test
            split) before the first step, every N steps and after the last (0: never); see
            ``gcore/evaluation.py`` for the ``eval/*`` metrics.
        controllers: ``None``: one controller per process (G-Core's parallel controllers); ``1``: one
            controller on rank 0 drives the engines and training shards of every process, and all
            rollout data passes through it (the single-driver baseline, for comparison).
        max_staleness: 0: the synchronous step. 1: the next step's rollout runs on the engine worker
            processes while this step trains (``--placement dynamic``, or ``static`` with
            ``--placement.workers``), so a sample is at most one version old; the loss corrects for it
            (``--algorithm.behaviour_is_cap``). See docs/asynchronous.md.
    """

    max_steps: int = 30
    accelerator: Literal["cpu", "cuda", "gpu", "auto"] = "auto"
    devices: int = 1
    num_nodes: int = 1
    precision: str = "32-true"
    seed: int = 42
    default_root_dir: str = "gcore_runs"
    name: str = "gcore"
    logger: LoggerName | list[LoggerName] = "csv"
    enable_progress_bar: bool = True
    save_final: bool = True
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    async_checkpoint: bool = True
    resume: str | None = None
    collective_timeout: float = 600.0
    heartbeat_timeout: float = 30.0
    max_skipped_updates: int = 3
    controllers: int | None = None
    eval_every: int = 0
    max_staleness: int = 0


@dataclass
class FitResult:
    """What ``fit`` returns on rank 0 (``None`` fields on other ranks).

    ``evaluations`` holds the ``--trainer.eval_every`` results, each with the ``step`` (updates
    done) it measured.
    """

    run_dir: str | None
    final_model_dir: str | None
    history: list[dict[str, float]] = field(default_factory=list)
    evaluations: list[dict[str, float]] = field(default_factory=list)


@dataclass
class _Run:
    """What ``Trainer._setup`` wires for ``Trainer._loop``, on one controller process."""

    tokenizer: Any
    source: ModelSource  # the policy checkpoint this run loaded (its files go into every checkpoint)
    controller: Controller
    sampler: PromptSampler  # the global prompt stream; each step's share of this controller
    extra: PromptSampler  # this controller's own stream, for dynamic sampling's extra prompts
    take: Callable[[list[int]], list[Prompt]]  # prompt indices -> prompts
    balancer: CostBalancer | None  # learns response lengths, with --data.balance
    checkpoints: CheckpointManager
    start_step: int  # 0, or the step after the checkpoint resumed from
    run_dir: str | None  # the loggers' folder (rank 0)
    eval_prompts: list[Prompt]  # held-out prompts of --trainer.eval_every (none when 0)
    central: bool  # one controller drives every process (--trainer.controllers 1)
    #: (shard, its predicted imbalance) of this step and the next ``max_staleness``, drawn that many steps early
    ahead: list[tuple[list[int], float]] = field(default_factory=list)
    #: this controller's torch threads, re-chosen before each stage (``None``: a fixed count, docs/threads.md)
    governor: threads.ThreadGovernor | None = None


class Trainer:
    """Trains a policy with RL: ``Trainer(algorithm=GRPO(), ...).fit()``.

    Every argument has a default, so ``Trainer().fit()`` trains the embedded default task. Plugins
    are passed as instances, so a notebook can subclass any of them and pass its own.
    """

    def __init__(
        self,
        trainer: TrainerConfig | None = None,
        model: ModelConfig | None = None,
        data: DataConfig | None = None,
        sampling: SamplingParams | None = None,
        engine: Engine | None = None,
        reward: RewardModel | None = None,
        algorithm: Algorithm | None = None,
        placement: PlacementPolicy | None = None,
        backend: TrainingBackend | None = None,
    ) -> None:
        from gcore.algorithms.grpo import GRPO
        from gcore.backends.torch import TorchBackend
        from gcore.engines.hf import HFEngine
        from gcore.placement.static import StaticPlacement
        from gcore.rewards.rule import TargetCharReward

        self.config = trainer or TrainerConfig()
        self.model_config = model or ModelConfig()
        self.data_config = data or DataConfig()
        self.sampling = sampling or SamplingParams()
        self.engine = engine or HFEngine()
        self.reward = reward or TargetCharReward(length=self.sampling.max_new_tokens)
        self.algorithm = algorithm or GRPO()
        self.placement = placement or StaticPlacement()
        self.backend = backend or TorchBackend()
        self.rollout_engine: Engine = self.engine  # what the controller calls; set by the placement's launch
        self._resume_from: tuple[str | None, dict | None] = (None, None)  # (checkpoint, its manifest), set by fit
        self._log_version: int | None = None
        self._validate()

    def _validate(self) -> None:
        """Every check that needs no process: the trainer's own flags, then the plugins' (``validate``)."""
        c, s = self.config, self.sampling
        checks = [
            (c.max_steps >= 1, f"--trainer.max_steps must be >= 1, got {c.max_steps}"),
            (c.devices >= 1, f"--trainer.devices must be >= 1, got {c.devices}"),
            (c.checkpoint_every >= 0,
             f"--trainer.checkpoint_every must be >= 0 (0: no checkpoints), got {c.checkpoint_every}"),
            (c.keep_checkpoints >= 1, f"--trainer.keep_checkpoints must be >= 1, got {c.keep_checkpoints}"),
            (c.heartbeat_timeout > 0, f"--trainer.heartbeat_timeout must be > 0 seconds, got {c.heartbeat_timeout}"),
            (c.collective_timeout > 0, f"--trainer.collective_timeout must be > 0 seconds, got {c.collective_timeout}"),
            (c.max_skipped_updates >= 0, f"--trainer.max_skipped_updates must be >= 0, got {c.max_skipped_updates}"),
            (c.eval_every >= 0, f"--trainer.eval_every must be >= 0, got {c.eval_every}"),
            (s.n >= 1, f"--sampling.n must be >= 1, got {s.n}"),
            (s.max_new_tokens >= 1, f"--sampling.max_new_tokens must be >= 1, got {s.max_new_tokens}"),
            (s.temperature > 0, f"--sampling.temperature must be > 0 for RL sampling, got {s.temperature}"),
            (0 < s.top_p <= 1, f"--sampling.top_p must be in (0, 1], got {s.top_p}"),
            (s.top_k >= 0, f"--sampling.top_k must be >= 0 (0: no top-k), got {s.top_k}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if c.max_staleness not in (0, 1):
            raise ConfigError(f"--trainer.max_staleness {c.max_staleness}: valid choices are 0 (synchronous) and 1 "
                              "(the next step's rollout runs while this one trains)")
        if c.max_staleness and not self.placement.supports_overlap:
            raise ConfigError(f"--trainer.max_staleness {c.max_staleness} needs engine worker processes to generate "
                              f"while the controller trains: --placement dynamic, or --placement static with "
                              f"--placement.workers N; {type(self.placement).__name__} here runs its engine in the "
                              "controller's process")
        world = self._world_size()
        if c.controllers not in (None, 1, world):
            raise ConfigError(f"--trainer.controllers {c.controllers}: valid choices are 1 (one controller drives "
                              f"every process) or {world} (one per process, the default)")
        if c.eval_every and self._single_controller():
            raise ConfigError("--trainer.eval_every runs with one controller per process (not --trainer.controllers 1)")
        self.backend.validate(self.algorithm, world, single_controller=self._single_controller())
        self.placement.validate(world, single_controller=self._single_controller())

    def _world_size(self) -> int:
        return self.config.devices * self.config.num_nodes

    def _single_controller(self) -> bool:
        """Whether one controller drives every process (``--trainer.controllers 1`` with several)."""
        return self.config.controllers == 1 and self._world_size() > 1

    def _fabric(self):  # noqa: ANN202
        from datetime import timedelta

        from lightning.fabric import Fabric

        c = self.config
        accelerator = c.accelerator
        if accelerator == "auto":
            import torch

            accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        device_type = "cuda" if accelerator in ("cuda", "gpu") else "cpu"
        names = [c.logger] if isinstance(c.logger, str) else list(c.logger)
        version = self._resumed_log_version()
        loggers = [make_logger(name, c.default_root_dir, c.name, version) for name in names]
        strategy = self.backend.strategy(self._world_size(), device_type, timedelta(seconds=c.collective_timeout))
        return Fabric(
            accelerator=accelerator,
            devices=c.devices,
            num_nodes=c.num_nodes,
            strategy=strategy,
            precision=c.precision,
            loggers=loggers,
        ), device_type

    def fit(self) -> FitResult:
        """Launch the controllers and train for ``max_steps``; returns the run's results on rank 0."""
        _quiet_dependencies()
        threads.warn_if_spinning()
        _check_writable(self.config.default_root_dir)
        self._resume_from = self._pick_resume()
        self._check_resume_steps(self._resume_from[0])  # before anything is built: nothing to do fails at once
        fabric, device_type = self._fabric()
        # invalid combinations failed in __init__ (``_validate``); the placement's fit to the devices fails
        # here, once, before any controller process or engine is launched
        self.placement.setup(self._world_size(), device_type, self.reward)
        workdir = make_workdir()
        restore_signals = _SIGNALS.install()
        store = contextlib.ExitStack()  # the single-node rendezvous store lives as long as the run
        try:
            # before the process group exists: transformers saves only on rank 0 once it does, and
            # every controller builds (and loads) its own copy of the embedded model
            tokenizer = load_tokenizer(self.model_config)
            source = self.model_config.source(materialize(self.model_config, tokenizer, self.config.seed, workdir))
            store.enter_context(loopback_store(fabric, self.config.num_nodes, self.config.collective_timeout))
            store.enter_context(threads.launching())  # Fabric's OMP_NUM_THREADS in a controller is not the user's
            fabric.launch()
            watch = None
            if fabric.world_size > 1:  # names a controller that dies, and stops this one if it is lost
                watch = ControllerWatch.for_fabric(fabric, silence_limit=self.config.heartbeat_timeout)
            try:
                run = self._setup(fabric, tokenizer, source)
                try:
                    result = self._loop(fabric, run)
                finally:
                    if run.governor is not None:
                        run.governor.restore()
                if watch is not None:
                    watch.stop()
                    fabric.barrier()  # no controller exits (taking the store with it) while another still watches
                    import torch.distributed

                    torch.distributed.destroy_process_group()  # no rank exits with gloo's threads still attached
                return result
            except Exception as err:
                if fabric.world_size == 1:
                    raise
                _report_rank_failure(fabric.global_rank, err, watch)
        finally:
            store.close()
            restore_signals()
            shutil.rmtree(workdir, ignore_errors=True)
            self.placement.shutdown()
            self.engine.shutdown()

    # WIRING: what the loop runs on, built once per controller process ---------------------------

    def _setup(self, fabric, tokenizer, source: ModelSource) -> _Run:  # noqa: ANN001
        """Load the prompts, set up the backend, let the placement policy start the engines, then build
        the prompt streams, the controller and the checkpoint manager, resume, and open the run folder."""
        c, rank = self.config, fabric.global_rank
        prompts = load_prompts(self.data_config, tokenizer, self.sampling.max_new_tokens, source.context_length())
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in self.sampling.stop_token_ids:
            self.sampling.stop_token_ids = (*self.sampling.stop_token_ids, tokenizer.eos_token_id)
        fabric.seed_everything(c.seed + rank, verbose=False)  # different samples per controller

        central = self._single_controller()
        self.backend.setup(fabric, source, self.algorithm, embedded=self.model_config.embedded)
        # the placement policy starts the engines where it places them (in this process by default)
        if rank == 0 and self.placement.describe():
            print(self.placement.describe(), flush=True)
        self.rollout_engine = self.placement.launch(self.engine, self.reward, source, fabric.device,
                                                    seed=c.seed + 1000 * rank)
        balancer = (CostBalancer(prompts, self.sampling.n, self.sampling.max_new_tokens)
                    if self.data_config.balance else None)
        # with one controller, rank 0 takes every step's whole batch and the other ranks take none
        shard_rank, shards = (0, 1) if central else (rank, fabric.world_size)
        sampler = PromptSampler(len(prompts), self.data_config.prompts_per_step, shard_rank, shards,
                                c.seed, self.data_config.shuffle, balancer)
        # dynamic sampling draws extra prompts from a stream of this rank's own (no other rank waits)
        extra = PromptSampler(len(prompts), 1, 0, 1, c.seed + 7919 * (rank + 1), self.data_config.shuffle)
        feature_mb = self.data_config.synthetic_feature_mb

        def take(indices: list[int]) -> list:
            return [with_synthetic_feature(prompts[i], feature_mb) for i in indices]

        controller_class = Controller
        if central:
            from gcore.single_controller import SingleController

            controller_class = SingleController
        controller = controller_class(fabric, self.rollout_engine, self.reward, self.algorithm, self.backend,
                                      self.placement, tokenizer, self.sampling,
                                      draw_prompts=lambda k: take([extra.next_global()[0] for _ in range(k)]),
                                      max_staleness=c.max_staleness)
        checkpoints = self._checkpoint_manager(fabric)
        start_step = self._resume(fabric, checkpoints, sampler, extra)
        run_dir = self._open_run_dir(fabric, start_step) if rank == 0 else None
        return _Run(tokenizer, source, controller, sampler, extra, take, balancer, checkpoints, start_step,
                    run_dir, self._eval_prompts(tokenizer, source), central,
                    governor=threads.governor(fabric.device.type))

    def _open_run_dir(self, fabric, start_step: int) -> str | None:  # noqa: ANN001
        """On rank 0: create the loggers' run folder (a resumed run continues its ``metrics.csv``) and
        write ``config.yaml`` there; returns the folder (``None`` without loggers)."""
        if not fabric.loggers:
            return None
        for logger in fabric.loggers:
            if isinstance(logger, CSVLogger):  # a resumed run continues its own metrics.csv
                _continue_metrics(logger, start_step)
        _ = fabric.loggers[0].experiment  # creates the run folder before we write into it
        run_dir = fabric.loggers[0].log_dir
        self._log_version = _version_number(fabric.loggers[0].version)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(self.hyperparameters(), f, sort_keys=False)
        for logger in fabric.loggers:
            if not isinstance(logger, CSVLogger):  # Fabric's CSV logger takes no hyperparameters
                logger.log_hyperparams(self.hyperparameters())
        return run_dir

    def _eval_prompts(self, tokenizer, source: ModelSource) -> list:  # noqa: ANN001
        """The held-out prompts of ``--trainer.eval_every`` (none when it is 0)."""
        if not self.config.eval_every:
            return []
        return load_eval_prompts(self.data_config, tokenizer, self.sampling.max_new_tokens, source.context_length())

    # THE LOOP: steps, evaluations, the final save ------------------------------------------------

    def _loop(self, fabric, run: _Run) -> FitResult:  # noqa: ANN001
        """Run the steps from ``run.start_step`` to ``max_steps`` (evaluating every ``eval_every``), then
        save the final policy; Ctrl-C or SIGTERM finishes the checkpoint in flight and says where to go on."""
        c, rank = self.config, fabric.global_rank
        history: list[dict[str, float]] = []
        evaluations: list[dict[str, float]] = []
        bar = _progress(c.max_steps, enabled=c.enable_progress_bar and rank == 0)
        bar.update(run.start_step)
        step = run.start_step
        skipping = 0  # consecutive steps that skipped an update (non-finite loss or gradient)
        try:
            for step in range(run.start_step, c.max_steps):
                if run.eval_prompts and step % c.eval_every == 0:
                    evaluations.append(self._evaluate(fabric, run, step, bar))
                metrics = self._step(fabric, run, step, bar)
                history.append(metrics)
                bar.set_description("step", refresh=False)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", s=f"{metrics['time/step']:.2f}")
                bar.update(1)
                skipping = skipping + 1 if metrics.get("skipped_updates", 0.0) > 0 else 0
                if c.max_skipped_updates and skipping >= c.max_skipped_updates:
                    run.checkpoints.wait()
                    raise GcoreError(
                        f"step {step}: {skipping} steps in a row skipped their update because the loss or the "
                        f"gradient was NaN or infinite (loss {metrics.get('loss', float('nan')):g}, grad_norm "
                        f"{metrics.get('grad_norm', float('nan')):g}); stopping (see --trainer.max_skipped_updates)")
            if run.eval_prompts and run.start_step < c.max_steps:  # the trained policy
                evaluations.append(self._evaluate(fabric, run, c.max_steps, bar))
            run.checkpoints.wait()
        except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (``Interrupted``)
            bar.close()
            last = run.checkpoints.finish_for_exit()
            if rank == 0:
                name = signal.Signals(getattr(interrupt, "signum", signal.SIGINT)).name
                where = (f"continue it from {last} with --trainer.resume auto" if last else
                         "no checkpoint was written (--trainer.checkpoint_every N writes them): a new run "
                         "starts from step 0")
                print(f"gcore: {name} during step {step}: {where}", file=sys.stderr, flush=True)
            raise
        bar.close()
        for logger in fabric.loggers:
            logger.finalize("success")

        final_dir = None
        if c.save_final and rank == 0 and run.run_dir is not None:
            final_dir = self._save_final(os.path.join(run.run_dir, "final"), run.tokenizer, run.checkpoints.root)
        fabric.barrier()
        if rank == 0:
            return FitResult(run.run_dir, final_dir, history, evaluations)
        return FitResult(None, None, history, evaluations)

    def _step(self, fabric, run: _Run, step: int, bar) -> dict[str, float]:  # noqa: ANN001
        """One training step on this controller's share of the step's prompts; returns its logged metrics."""
        while len(run.ahead) <= self.config.max_staleness and step + len(run.ahead) < self.config.max_steps:
            run.ahead.append((run.sampler.shard(run.sampler.next_global()), run.sampler.last_imbalance))
        (shard, imbalance), upcoming = run.ahead.pop(0), [run.take(s) for s, _ in run.ahead]
        prompts = run.take(shard) if not run.central or fabric.global_rank == 0 else []

        def on_stage(stage: str) -> None:
            bar.set_description(stage, refresh=False)
            if run.governor is not None:
                run.governor.update()

        metrics = run.controller.step(step, prompts, upcoming=upcoming, on_stage=on_stage)
        metrics["step"] = float(step)
        if run.governor is not None:  # the count the step's last stage ran with, and what it was chosen from
            metrics["threads/torch"] = float(run.governor.threads)
            metrics["threads/others_cores"] = run.governor.others
        metrics["balance/predicted_imbalance"] = imbalance
        if run.balancer is not None:
            _learn_lengths(fabric, run.balancer, run.controller.last_samples, self.data_config.prompts_per_step)
        # an interrupt here is held until the save is started and the step logged: a checkpoint
        # of step N always comes with N's metrics row, and the save is then finished
        with _SIGNALS.deferred():
            metrics.update(self._checkpoint_step(fabric, step, run.checkpoints, run.sampler, run.extra,
                                                 run.source.path))
            fabric.log_dict(metrics, step=step)
        return metrics

    def _evaluate(self, fabric, run: _Run, step: int, bar) -> dict[str, float]:  # noqa: ANN001
        """Evaluate the policy after ``step`` updates; logged at once, on a row of its own."""
        from gcore.evaluation import evaluate

        bar.set_description("eval", refresh=False)
        metrics = {"step": float(step), **evaluate(self.rollout_engine, self.reward, run.tokenizer, run.eval_prompts,
                                                   self.sampling, fabric)}
        fabric.log_dict(metrics, step=step)
        if fabric.global_rank == 0 and self.config.enable_progress_bar:
            bar.write(f"step {step}: held-out accuracy greedy {metrics['eval/accuracy_greedy']:.3f}, "
                      f"sampled {metrics['eval/accuracy_sampled']:.3f} ({metrics['eval/prompts']:.0f} prompts)")
        return metrics

    def _save_final(self, final_dir: str, tokenizer, checkpoint_root: str) -> str:  # noqa: ANN001
        """Write the trained policy to ``final_dir`` atomically (``final.tmp``, then renamed).

        When that fails (a full disk), the half-written folder is removed and the policy is written
        to the temp dir instead; the error says where the weights are, so they are never lost silently.
        """

        def write(folder: str) -> None:
            shutil.rmtree(folder, ignore_errors=True)
            self.backend.save_pretrained(folder)
            tokenizer.save_pretrained(folder)

        tmp = final_dir + ".tmp"
        try:
            write(tmp)
            shutil.rmtree(final_dir, ignore_errors=True)
            os.replace(tmp, final_dir)
            return final_dir
        except Exception as err:
            shutil.rmtree(tmp, ignore_errors=True)
            needed = sum(w.numel() * w.element_size() for _, w in self.backend.named_weights())
            reason = (disk_error("the final policy", os.path.dirname(final_dir), err, needed)
                      or f"writing the final policy to {final_dir} failed ({type(err).__name__}: {err})")
            fallback = tempfile.mkdtemp(prefix="gcore-final-")
            try:
                write(fallback)
                kept = f"the trained policy was saved to {fallback} instead"
            except Exception:  # noqa: BLE001  the fallback failing in any way is reported below
                shutil.rmtree(fallback, ignore_errors=True)
                last = latest_checkpoint(checkpoint_root)
                kept = (f"it could not be written to the temp dir either; the newest checkpoint is {last}" if last
                        else "it could not be written to the temp dir either, and no checkpoint holds it: "
                        "the trained weights are lost (free space, or use --trainer.checkpoint_every)")
            raise GcoreError(f"{reason}; {kept}") from err

    def _check_resume_steps(self, path: str | None = None, start: int | None = None) -> None:
        """Fail when the checkpoint to resume from is already past ``--trainer.max_steps``.

        Called before the model is built (reading the chosen checkpoint's ``trainer_state.json``;
        an unreadable one is left to the resume to report) and again with the loaded step.
        """
        c = self.config
        if start is None:
            if path is None:
                return
            try:
                with open(os.path.join(path, "trainer_state.json"), encoding="utf-8") as f:
                    start = int(json.load(f)["step"]) + 1
            except Exception:  # noqa: BLE001  no checkpoint, or a broken one: the resume itself says which
                return
        if start > c.max_steps:
            raise ConfigError(f"--trainer.max_steps {c.max_steps} is below the {start} steps already trained in "
                              f"the checkpoint {path}: nothing to train; pass a larger --trainer.max_steps to go on")

    def _checkpoint_manager(self, fabric) -> CheckpointManager:  # noqa: ANN001
        c = self.config
        import torch.distributed as dist

        group = None
        # whenever a process group exists: several ranks, or one whose strategy started a one-rank group, as FSDP
        # does; DCP would use that group, and an NCCL-only group cannot run an asynchronous save
        if dist.is_initialized() and (c.checkpoint_every or c.resume):
            from datetime import timedelta

            # DCP's background collectives stay off the training group, on a backend that moves CPU tensors
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=c.collective_timeout))
        root = os.path.join(c.default_root_dir, c.name, "checkpoints")
        return CheckpointManager(root, c.keep_checkpoints, fabric.global_rank, fabric.world_size,
                                 barrier=fabric.barrier, process_group=group)

    def _checkpoint_step(self, fabric, step: int, checkpoints: CheckpointManager,  # noqa: ANN001
                         sampler: PromptSampler, extra: PromptSampler, model_path: str) -> dict[str, float]:
        """Finish saves whose writes are done; start this step's save when one is due.

        Returns the metrics to log with this step: ``checkpoint/stall_s``, the seconds training
        waited for the save it started (with async saves, only the copy of the state to memory),
        and ``checkpoint/write_s``, the seconds a save took until it was complete and visible
        (rank 0, when one completes).
        """
        c, metrics = self.config, {}
        checkpoints.poll()
        for _, seconds in checkpoints.take_finished():
            metrics["checkpoint/write_s"] = seconds
        if c.checkpoint_every and ((step + 1) % c.checkpoint_every == 0 or step == c.max_steps - 1):
            metrics["checkpoint/stall_s"] = checkpoints.save(
                step, self.backend.state_dict(), self._trainer_state(step, sampler, fabric.world_size),
                {"rng": rng_state(), "extra_sampler": extra.state_dict()},
                asynchronous=c.async_checkpoint, hf_files=model_path)
        return metrics

    def _trainer_state(self, step: int, sampler: PromptSampler, world_size: int) -> dict:
        """What every rank shares: the step, the global prompt stream (with the learnt lengths), plugin state."""
        state = {"step": step, "sampler": sampler.state_dict(), "seed": self.config.seed, "world_size": world_size,
                 "run": self._run_signature(), "log_version": self._log_version}
        for name, plugin in (("algorithm", self.algorithm), ("placement", self.placement)):
            if callable(getattr(plugin, "state_dict", None)):
                state[name] = plugin.state_dict()
        return state

    def _run_signature(self) -> dict:
        """What a checkpoint must match to be resumed by this run: the algorithm, backend and model shape."""
        m = self.model_config
        model = {"path": os.path.abspath(m.path)} if not m.embedded else {
            key: getattr(m, key) for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "num_key_value_heads", "intermediate_size")}
        name = lambda obj: f"{type(obj).__module__}.{type(obj).__qualname__}"  # noqa: E731
        return {"algorithm": name(self.algorithm), "backend": name(self.backend), "model": model}

    def _check_signature(self, path: str, saved: dict | None) -> None:
        if not saved:
            return  # written by an older gcore: DCP's own checks still name a shape mismatch
        mine = self._run_signature()
        flags = {"algorithm": "--algorithm", "backend": "--backend"}
        for key in ("algorithm", "backend"):
            if saved.get(key) != mine[key]:
                raise CheckpointError(f"{path} was written by a run with {flags[key]} {saved.get(key)}, this run has "
                                      f"{mine[key]}: resume with the same {flags[key]}, or start a new run "
                                      "(another --trainer.name)")
        differ = [f"--model.{k} {v} (this run: {mine['model'].get(k)})" for k, v in saved.get("model", {}).items()
                  if k != "path" and mine["model"].get(k) != v]
        if differ:
            raise CheckpointError(f"{path} was written with another model: {', '.join(differ)}; resume with the "
                                  "same model options, or start a new run (another --trainer.name)")

    def _pick_resume(self) -> tuple[str | None, dict | None]:
        """The checkpoint to resume from, verified, and its manifest; with ``auto``, a corrupt newest one
        is passed over for the one before it, with one line that says so."""
        c = self.config
        root = os.path.join(c.default_root_dir, c.name, "checkpoints")
        if c.resume != "auto":
            path = resolve_resume(c.resume, root)
            return (path, verify(path)) if path else (None, None)
        path, manifest, notes = pick_checkpoint(root)
        if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0":
            for note in notes:
                print(f"gcore: warning: {note}", file=sys.stderr, flush=True)
        return path, manifest

    def _resumed_log_version(self) -> int | None:
        """The ``version_N`` a resumed run continues: the one its checkpoint names, else the newest."""
        path = self._resume_from[0]
        if path is None:
            return None
        with contextlib.suppress(OSError, ValueError), open(os.path.join(path, TRAINER_STATE)) as f:
            version = json.load(f).get("log_version")
            if isinstance(version, int):
                return version
        run_root = os.path.join(self.config.default_root_dir, self.config.name)
        versions = [_version_number(name) for name in os.listdir(run_root)] if os.path.isdir(run_root) else []
        versions = [v for v in versions if v is not None]
        return max(versions) if versions else None

    def _resume(self, fabric, checkpoints: CheckpointManager, sampler: PromptSampler,  # noqa: ANN001
                extra: PromptSampler) -> int:
        """Restore the latest (or given) checkpoint; returns the first step to run.

        On the rank count that wrote it, everything continues exactly. On another rank count
        (elastic resume) the weights, optimizer and scheduler are resharded by DCP; the global
        prompt stream and the learnt lengths are shared state and continue as they were; a rank
        that existed before keeps its own dynamic-sampling prompt stream, a new rank starts its
        own; the random generators are reseeded from the seed, the rank and the step.
        """
        c, rank = self.config, fabric.global_rank
        path, manifest = self._resume_from
        if path is None:
            if c.resume == "auto" and rank == 0:
                print(f"no checkpoint under {checkpoints.root}: starting from step 0")
            return 0
        with open(os.path.join(path, TRAINER_STATE)) as f:
            self._check_signature(path, json.load(f).get("run"))
        state = self.backend.state_dict()
        trainer_state, rank_state = checkpoints.load(path, state, manifest)
        self.backend.load_state_dict(state)
        sampler.load_state_dict(trainer_state["sampler"])
        if rank_state is not None and "extra_sampler" in rank_state:
            extra.load_state_dict(rank_state["extra_sampler"])
        for name, plugin in (("algorithm", self.algorithm), ("placement", self.placement)):
            if name in trainer_state and callable(getattr(plugin, "load_state_dict", None)):
                plugin.load_state_dict(trainer_state[name])
        start = int(trainer_state["step"]) + 1
        self._check_resume_steps(path, start)
        saved_world = int(trainer_state["world_size"])
        if saved_world == fabric.world_size:
            set_rng_state(rank_state["rng"])  # same rank count: continue exactly
        else:
            fabric.seed_everything(c.seed + rank + 100_003 * start, verbose=False)  # resharded: reseed
        self.rollout_engine.update_weights(self.backend.named_weights())
        if rank == 0:
            print(f"resumed from {path} at step {start}")
            if saved_world != fabric.world_size:
                world, kept = fabric.world_size, min(saved_world, fabric.world_size)
                print(f"elastic resume: written by {saved_world} controller(s), running on {world}: weights and "
                      f"optimizer resharded, prompt stream at epoch {sampler.epoch} position {sampler.position}, "
                      f"controller(s) {_span(0, kept)} keep their extra prompt streams, "
                      + (f"{_span(kept, world)} start their own" if world > kept
                         else f"those of {_span(kept, saved_world)} are dropped")
                      + "; random generators reseeded")
        return start

    def hyperparameters(self) -> dict:
        """The run's configuration as plain values, for loggers."""

        def plugin(obj: object) -> dict:
            public = {k: v for k, v in vars(obj).items()
                      if not k.startswith("_") and isinstance(v, (int, float, str, bool, tuple, type(None)))}
            return {"class": f"{type(obj).__module__}.{type(obj).__qualname__}", **public}

        return {
            "trainer": asdict(self.config),
            "model": asdict(self.model_config),
            "data": asdict(self.data_config),
            "sampling": asdict(self.sampling),
            "engine": plugin(self.engine),
            "reward": plugin(self.reward),
            "algorithm": plugin(self.algorithm),
            "placement": plugin(self.placement),
            "backend": plugin(self.backend),
        }


def _check_writable(root: str) -> None:
    """A one-line error, before any model is built, when runs cannot be written under ``root``."""
    try:
        os.makedirs(root, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".gcore-write-test-"):
            pass
    except OSError as err:
        raise ConfigError(f"--trainer.default_root_dir {root}: cannot write there ({err.strerror or err})") from None


class _Signals:
    """SIGINT and SIGTERM raise ``KeyboardInterrupt`` / ``Interrupted`` in the main thread, so that a run
    finishes its save in flight and says where to continue; ``deferred()`` holds one signal back
    while a save is being started (a second one goes through at once)."""

    def __init__(self) -> None:
        self._deferring, self._held = False, None

    def install(self) -> Callable[[], object]:
        """Take over both signals; returns the function that gives them back."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return lambda: [signal.signal(sig, handler) for sig, handler in previous.items()]

    def _handle(self, signum: int, frame) -> None:  # noqa: ANN001
        if self._deferring and self._held is None:
            self._held = signum
            return
        self._raise(signum)

    @staticmethod
    def _raise(signum: int) -> None:
        raise KeyboardInterrupt if signum == signal.SIGINT else Interrupted(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
            held, self._held = self._held, None
            if held is not None:
                self._raise(held)


_SIGNALS = _Signals()


def _version_number(version: object) -> int | None:
    """``3``, ``"version_3"`` -> 3; anything else -> None."""
    if isinstance(version, int):
        return version
    if isinstance(version, str) and version.startswith("version_") and version[8:].isdigit():
        return int(version[8:])
    return None


def _continue_metrics(logger: CSVLogger, start_step: int) -> None:
    """Keep the rows of an existing ``metrics.csv`` before ``start_step`` (the steps a resumed run
    redoes are dropped), across Lightning's writer, which deletes the file when it opens the folder."""
    import csv

    path = os.path.join(logger.log_dir, "metrics.csv")
    rows, header = [], None
    if start_step > 0 and os.path.isfile(path):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames
            rows = [row for row in reader if row.get("step") and float(row["step"]) < start_step]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
        writer = logger.experiment  # opens the folder (and deletes metrics.csv in it)
    if header and rows:
        with open(path, "w", newline="") as f:
            csv_writer = csv.DictWriter(f, fieldnames=header)
            csv_writer.writeheader()
            csv_writer.writerows(rows)
        writer.metrics_keys = sorted(header)  # new columns still widen the header; known ones append


def _span(first: int, end: int) -> str:
    """Ranks ``first..end-1`` as text: ``1`` or ``1-3``."""
    return str(first) if end - first == 1 else f"{first}-{end - 1}"


def _report_rank_failure(rank: int, err: Exception, watch: ControllerWatch | None = None) -> None:
    """Say which controller failed and why; a controller that only lost its peers names the lost one."""
    import sys

    message = str(err).splitlines()[0] if str(err) else type(err).__name__
    lost = any(s in message for s in ("Connection closed by peer", "Connection reset", "timed out", "Timed out",
                                      "Broken pipe", "connection", "Connection refused"))
    if lost and not isinstance(err, GcoreError):
        found = watch.wait_for_loss(timeout=10.0) if watch is not None else {}
        if watch is not None:
            watch.mark(f"failed: lost contact ({message})")
        if found:
            raise GcoreError(
                f"controller {rank}: {watch.describe(found)}; the run stopped at the broken collective "
                f"({message}). Continue it from the last complete checkpoint with --trainer.resume auto"
            ) from err
        raise GcoreError(
            f"controller {rank}: lost contact with another controller ({message}); that controller's own "
            "error is reported above"
        ) from err
    if watch is not None:
        watch.mark(f"failed: {type(err).__name__}: {message}")
    print(f"gcore: controller {rank} failed: {type(err).__name__}: {message}", file=sys.stderr, flush=True)
    raise err


def _learn_lengths(fabric, balancer: CostBalancer, samples, per_step: int) -> None:  # noqa: ANN001
    """Every rank learns the same response lengths: one all-gather of (prompt, mean length) rows."""
    import torch

    by_prompt: dict[int, list[int]] = {}
    for sample in samples:
        by_prompt.setdefault(sample.prompt.index, []).append(len(sample.response_ids))
    rows = torch.full((per_step, 2), -1.0, dtype=torch.float64)
    for row, (index, lengths) in enumerate(sorted(by_prompt.items())[:per_step]):
        rows[row, 0], rows[row, 1] = index, sum(lengths) / len(lengths)
    gathered = fabric.all_gather(rows).reshape(-1, 2) if fabric.world_size > 1 else rows
    for index, length in gathered.tolist():
        if index >= 0:
            balancer.observe(int(index), length)


def _quiet_dependencies() -> None:
    """Keep the console for gcore's own progress: no per-load bars or notices from dependencies."""
    import logging
    import warnings

    import transformers

    warnings.filterwarnings("ignore", message=r".*all_gather is deprecated")  # inside Fabric's all_gather
    warnings.filterwarnings("ignore", message=r"torch.distributed is disabled")  # DCP, single process
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for name in ("lightning.fabric", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _progress(total: int, enabled: bool):  # noqa: ANN202
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, unit="step", dynamic_ncols=True)


def fit(**kwargs: Any) -> FitResult:  # noqa: ANN401  Trainer's arguments
    """Shortcut for ``Trainer(**kwargs).fit()``."""
    return Trainer(**kwargs).fit()
