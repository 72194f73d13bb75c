"""The ``Trainer``: launches the controllers with Lightning Fabric and runs the step loop."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import yaml
from lightning.fabric.loggers import CSVLogger

from gcore import threads
from gcore.algorithms.base import Algorithm
from gcore.algorithms.stall import StallWatch
from gcore.backends.base import TrainingBackend
from gcore.checkpointer import Checkpointer, version_number
from gcore.controller import Controller
from gcore.data import (
    CostBalancer,
    DataConfig,
    PromptSampler,
    check_images,
    check_tokenizer,
    load_eval_prompts,
    load_prompts,
    with_synthetic_feature,
)
from gcore.engines.base import Engine
from gcore.envs.base import Environment
from gcore.errors import ConfigError, GcoreError, Interrupted, PluginExit, RewardError
from gcore.liveness import SIGNALS, ControllerWatch, report_rank_failure
from gcore.loggers import LoggerName, continue_metrics, make_logger, quiet_dependencies
from gcore.model import ModelConfig, ModelSource, image_text_to_text, load_tokenizer, make_workdir, materialize
from gcore.placement.base import PlacementPolicy
from gcore.rendezvous import loopback_store
from gcore.rewards.base import RewardModel
from gcore.run_lock import RunLock
from gcore.types import Prompt, SamplingParams
from gcore.user_code import culprit, describe, ending_as

if TYPE_CHECKING:
    from lightning.fabric import Fabric
    from lightning.fabric.loggers import Logger
    from tqdm import tqdm
    from transformers import PreTrainedTokenizerBase


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
            ``metrics.csv`` (the steps it redoes are replaced). A checkpoint written with another
            seed or other data is refused in one line (see ``resume_changed_run``).
        resume_changed_run: resume even though this run's seed or data differ from those of the run
            that wrote the checkpoint (another algorithm, backend or model is always refused).
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
        max_staleness: 0: the synchronous step. K >= 1: the rollouts of the next K steps run on the
            engine worker processes while this step trains (``--placement dynamic``, or ``static`` with
            ``--placement.workers``), so a sample is at most K versions old (a group with a sample that
            would be older is generated again, ``async/regenerated_stale``); the loss corrects for it
            (``--algorithm.behaviour_is_cap``). A checkpoint holds the prompts drawn ahead and the rollouts in
            flight, so a resumed run continues exactly over static engine workers. See docs/asynchronous.md.
        partial_rollouts: with ``max_staleness`` K >= 1, a weight update does not wait behind the generation in
            flight: the engine workers stop between tokens, load the new weights and continue the unfinished
            responses with them (no token thrown away; the prompt and tokens so far are prefilled again). Each
            token records the version that sampled it (``Sample.token_versions``); a sample's staleness is its
            oldest token's. Needs an engine that can stop between tokens (``EngineCapabilities.interrupt``:
            ``--engine hf``, or ``--engine vllm`` in its default in-process mode). docs/asynchronous.md.
        dispatch: with ``max_staleness`` K >= 1, when the rollout of a step goes out to the engine workers.
            ``device``: as soon as the weights it may be generated with exist (after the sync of the step K + 1
            before it): its requests queue behind the rollouts in flight, and each worker starts on it when it has
            finished its own share of those, without waiting for the slowest worker. ``step``: when the step K
            before it starts training, i.e. after that step's rollout came in from every worker. The weights and
            the seed are the same either way, so the samples are too; only when they are generated differs.
        oversample: with dynamic sampling (``--algorithm dapo``, ``max_rounds`` > 1), a step's rollout starts with
            the extra prompts that the last step's keep rate says its share will need, instead of drawing them in a
            second round once the verdicts of the first are in (a round that, with a generative judge, waits for
            it, and, with ``max_staleness``, queues behind the rollouts of later steps). Groups kept beyond the
            share are not trained (``filter/groups_surplus``); a second round is drawn only if the share is still
            short. docs/asynchronous.md.
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
    resume_changed_run: bool = False
    collective_timeout: float = 600.0
    heartbeat_timeout: float = 30.0
    max_skipped_updates: int = 3
    controllers: int | None = None
    eval_every: int = 0
    max_staleness: int = 0
    partial_rollouts: bool = False
    dispatch: Literal["step", "device"] = "device"
    oversample: bool = False

    def validate(self) -> None:
        """A one-line ``ConfigError`` for the first flag out of its range."""
        checks = [
            (self.max_steps >= 1, f"--trainer.max_steps must be >= 1, got {self.max_steps}"),
            (self.devices >= 1, f"--trainer.devices must be >= 1, got {self.devices}"),
            (self.checkpoint_every >= 0,
             f"--trainer.checkpoint_every must be >= 0 (0: no checkpoints), got {self.checkpoint_every}"),
            (self.keep_checkpoints >= 1, f"--trainer.keep_checkpoints must be >= 1, got {self.keep_checkpoints}"),
            (self.heartbeat_timeout > 0,
             f"--trainer.heartbeat_timeout must be > 0 seconds, got {self.heartbeat_timeout}"),
            (self.collective_timeout > 0,
             f"--trainer.collective_timeout must be > 0 seconds, got {self.collective_timeout}"),
            (self.max_skipped_updates >= 0,
             f"--trainer.max_skipped_updates must be >= 0, got {self.max_skipped_updates}"),
            (self.eval_every >= 0, f"--trainer.eval_every must be >= 0, got {self.eval_every}"),
            (self.max_staleness >= 0, f"--trainer.max_staleness must be >= 0 (0: synchronous; K: the rollouts of "
             f"the next K steps run while this one trains), got {self.max_staleness}"),
            (not self.partial_rollouts or self.max_staleness >= 1,
             "--trainer.partial_rollouts true continues the rollouts in flight across a weight update: it needs "
             "--trainer.max_staleness >= 1 (rollouts that run while a step trains)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


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

    fabric: Fabric
    tokenizer: PreTrainedTokenizerBase
    controller: Controller
    sampler: PromptSampler  # the global prompt stream; each step's share of this controller
    take: Callable[[list[int]], list[Prompt]]  # prompt indices -> prompts
    balancer: CostBalancer | None  # learns response lengths, with --data.balance
    checkpointer: Checkpointer
    start_step: int  # 0, or the step after the checkpoint resumed from
    run_dir: str | None  # the loggers' folder (rank 0)
    eval_prompts: list[Prompt]  # held-out prompts of --trainer.eval_every (none when 0)
    central: bool  # one controller drives every process (--trainer.controllers 1)
    #: (global batch, this controller's shard, its predicted imbalance) of this step and the next ``max_staleness``
    #: (one more with ``--trainer.dispatch device``), drawn that many steps early (``_Pipeline``: a checkpoint
    #: records those drawn ahead)
    ahead: list[tuple[list[int], list[int], float]] = field(default_factory=list)
    #: this controller's torch threads, re-chosen before each stage (``None``: a fixed count, docs/threads.md)
    governor: threads.ThreadGovernor | None = None


class _Pipeline:
    """The asynchronous pipeline (``--trainer.max_staleness``) in a checkpoint, as two parts: ``drawn`` (every
    rank alike, in ``trainer_state.json``) holds the global batches drawn ahead of their steps with their predicted
    imbalance, and ``own`` (``rank_<r>.pt``) this rank's shards of them and its rollouts in flight
    (``Controller.in_flight_state``). A resumed run takes the same prompts for those steps and collects the
    rollouts recorded for them (``resume``), instead of drawing new prompts and starting its pipeline afresh."""

    def __init__(self, ahead: list[tuple[list[int], list[int], float]], controller: Controller, world_size: int,
                 max_staleness: int) -> None:
        self.ahead, self.controller, self.world_size, self.max_staleness = ahead, controller, world_size, max_staleness
        self.drawn, self.own = _Part(self._drawn_state), _Part(self._own_state)

    def _drawn_state(self) -> dict:
        return {"max_staleness": self.max_staleness,
                "batches": [{"batch": batch, "imbalance": imbalance} for batch, _, imbalance in self.ahead]}

    def _own_state(self) -> dict:
        return {"world_size": self.world_size, "shards": [shard for _, shard, _ in self.ahead],
                "rollouts": self.controller.in_flight_state(), "keep_rate": self.controller.keep_rate}

    def resume(self, sampler: PromptSampler) -> list[str]:
        """After ``Checkpointer.load``: the batches drawn ahead, dealt out as they were (on another number of
        controllers, anew), and the rollouts in flight handed to the controller; returns the notes on what a
        resumed run cannot reproduce of the uninterrupted one."""
        drawn: dict[str, Any] = self.drawn.loaded or {}
        own = self.own.loaded
        notes = []
        if own is not None and own.get("world_size") != self.world_size:
            own = None  # another number of controllers: the shards and the rollouts in flight are dealt out anew
        if own is None and drawn.get("batches"):
            notes.append("the checkpoint was written by another number of controllers: the prompts drawn ahead are "
                         "dealt out anew and generated again, with the weights resumed")
        for i, entry in enumerate(drawn.get("batches", [])):
            batch = [int(x) for x in entry["batch"]]
            shard = [int(x) for x in own["shards"][i]] if own is not None else sampler.shard(batch)
            self.ahead.append((batch, shard, float(entry["imbalance"])))
        if own is not None:
            self.controller.load_in_flight(own["rollouts"])
            self.controller.keep_rate = own.get("keep_rate")  # how many extra prompts the next rollouts draw
        again = self.controller.not_reproduced()
        if again:
            notes.append(f"{again} rollout(s) in flight at the checkpoint could not be recorded (they ran in a "
                         "thread, with a generative judge or multi-turn episodes, or the placement gives no record "
                         "of them): they are generated again, with the weights resumed")
        if self.max_staleness and drawn.get("max_staleness") and not drawn.get("batches"):
            notes.append("the checkpoint was written at the last step of its run, with no rollout in flight: the "
                         "pipeline starts afresh (the first step generates now, as step 0 does)")
        return notes


class _Part:
    """A checkpoint part (``state_dict``/``load_state_dict``) whose state is made by ``save`` and kept as loaded."""

    def __init__(self, save: Callable[[], dict]) -> None:
        self.save = save
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        return self.save()

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


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
        env: Environment | None = None,
    ) -> None:
        from gcore.algorithms.grpo import GRPO
        from gcore.backends.torch import TorchBackend
        from gcore.engines.hf import HFEngine
        from gcore.envs.base import SingleTurn
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
        self.env = env or SingleTurn()
        self.rollout_engine: Engine = self.engine  # what the controller calls; set by the placement's launch
        self._loggers: list[Logger] = []  # made with the run's Fabric
        with ending_as(self._plugin_exit):
            self._validate()

    def _validate(self) -> None:
        """Every check that needs no process: the trainer's own flags, then the plugins' (``validate``)."""
        c = self.config
        c.validate()
        self.sampling.validate_for_training()
        if c.max_staleness and not self.placement.supports_overlap:
            raise ConfigError(f"--trainer.max_staleness {c.max_staleness} needs engine worker processes to generate "
                              f"while the controller trains: --placement dynamic, or --placement static with "
                              f"--placement.workers N; {type(self.placement).__name__} here runs its engine in the "
                              "controller's process")
        if c.partial_rollouts and not self.engine.capabilities.interrupt:
            raise ConfigError(f"--trainer.partial_rollouts true: the {type(self.engine).__name__} engine cannot stop "
                              "between tokens for a weight update (EngineCapabilities.interrupt); use --engine hf with "
                              "--engine.use_generate false, or --engine vllm without --engine.separate_process")
        if c.oversample and self.algorithm.max_rounds <= 1:
            raise ConfigError(f"--trainer.oversample true draws dynamic sampling's extra prompts up front: the "
                              f"{type(self.algorithm).__name__} algorithm draws none (max_rounds "
                              f"{self.algorithm.max_rounds}); use --algorithm dapo (dynamic_sampling, max_rounds > 1)")
        world = self._world_size()
        if c.controllers not in (None, 1, world):
            raise ConfigError(f"--trainer.controllers {c.controllers}: valid choices are 1 (one controller drives "
                              f"every process) or {world} (one per process, the default)")
        if c.eval_every and self._single_controller():
            raise ConfigError("--trainer.eval_every runs with one controller per process (not --trainer.controllers 1)")
        self.backend.validate(self.algorithm, world, single_controller=self._single_controller())
        self.placement.validate(world, single_controller=self._single_controller())
        if self.data_config.has_images:
            self._validate_images()

    def _validate_images(self) -> None:
        """Image prompts (docs/multimodal.md): refuse, in one line naming the option, what does not take them yet."""
        d = self.data_config
        what = f"--data.image_key {d.image_key}" if d.image_key is not None else f"--data.task {d.task}"
        if not self.engine.capabilities.images:
            raise ConfigError(f"{what}: image prompts need --engine hf or vllm; {type(self.engine).__name__} is given "
                              "token ids only in gcore (SGLang: its image inputs are not wired, and its CPU build was "
                              "not tried with an image-text-to-text model)")
        if not self.placement.supports_images:
            raise ConfigError(f"{what}: --placement {type(self.placement).__name__} does not hand its engines the "
                              "prompts' images (supports_images); use --placement static or dynamic")
        if self._single_controller():
            raise ConfigError(f"{what}: --trainer.controllers 1 sends prompts as token tensors, without their "
                              "images; use one controller per process")
        if self.env.multi_turn:
            raise ConfigError(f"{what}: multi-turn episodes (--env {type(self.env).__name__}) do not carry images "
                              "yet; use --env single_turn")
        self.backend.validate_images()

    def _plugin_exit(self, cause: BaseException) -> PluginExit | None:
        """The one-line error for a plugin's code that ended the process (``user_code.ending_as``), naming the
        plugin's family, class and method; ``None`` when no plugin's code was running."""
        plugins = [("engine", self.engine), ("engine", self.rollout_engine), ("reward", self.reward),
                   ("algorithm", self.algorithm), ("placement", self.placement), ("backend", self.backend),
                   ("env", self.env), *(("logger", logger) for logger in self._loggers)]
        where = culprit(cause, plugins)
        if where is None:
            return None
        return PluginExit(f"{where} raised {describe(cause)}; a plugin's code must raise an exception, not end "
                          "the process")

    def _world_size(self) -> int:
        return self.config.devices * self.config.num_nodes

    def _single_controller(self) -> bool:
        """Whether one controller drives every process (``--trainer.controllers 1`` with several)."""
        return self.config.controllers == 1 and self._world_size() > 1

    def _fabric(self, log_version: int | None) -> tuple[Fabric, str]:
        """Fabric with this run's loggers (a resumed run writes into its own ``version_N``) and the
        backend's strategy; and the device type, ``cpu`` or ``cuda``."""
        from datetime import timedelta

        from lightning.fabric import Fabric

        c = self.config
        accelerator = c.accelerator
        if accelerator == "auto":
            import torch

            accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        device_type = "cuda" if accelerator in ("cuda", "gpu") else "cpu"
        names = [c.logger] if isinstance(c.logger, str) else list(c.logger)
        loggers = [make_logger(name, c.default_root_dir, c.name, log_version) for name in names]
        self._loggers = list(loggers)
        strategy = self.backend.strategy(self._world_size(), device_type, timedelta(seconds=c.collective_timeout))
        fabric = Fabric(accelerator=accelerator, devices=c.devices, num_nodes=c.num_nodes, strategy=strategy,
                        precision=c.precision, loggers=loggers)  # type: ignore[arg-type]  # a precision string
        return fabric, device_type

    def fit(self) -> FitResult:
        """Launch the controllers and train for ``max_steps``; returns the run's results on rank 0."""
        c = self.config
        quiet_dependencies()
        threads.warn_if_spinning()
        _check_root_writable(c.default_root_dir)
        lock = RunLock(os.path.join(c.default_root_dir, c.name))
        if _launching_process():  # one run per run folder; the controllers it launches share its lock
            lock.acquire()
        try:
            with ending_as(self._plugin_exit):  # a plugin's ``sys.exit`` anywhere in the run: one line, exit 2
                return self._fit()
        finally:
            lock.release()

    def _fit(self) -> FitResult:
        c = self.config
        checkpointer = Checkpointer(os.path.join(c.default_root_dir, c.name, "checkpoints"),
                                    every=c.checkpoint_every, keep=c.keep_checkpoints, asynchronous=c.async_checkpoint,
                                    resume=c.resume, seed=c.seed, signature=self._run_signature(),
                                    collective_timeout=c.collective_timeout, allow_changed_run=c.resume_changed_run)
        checkpointer.pick(c.max_steps)  # before anything is built: nothing to do fails at once
        self._check_run_writable(checkpointer)
        fabric, device_type = self._fabric(checkpointer.resumed_log_version())
        # invalid combinations failed in __init__ (``_validate``); the placement's fit to the devices fails
        # here, once, before any controller process or engine is launched
        self.placement.setup(self._world_size(), device_type, self.reward)
        workdir = make_workdir()
        # undone in reverse order, each step also when one before it raised (a Ctrl-C during the teardown): the
        # caller's signal handlers always come back
        cleanup = contextlib.ExitStack()
        cleanup.callback(self.engine.shutdown)
        cleanup.callback(self.placement.shutdown)
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        cleanup.callback(SIGNALS.install())
        try:
            # before the process group exists: transformers saves only on rank 0 once it does, and
            # every controller builds (and loads) its own copy of the embedded model
            images = self.data_config.has_images
            tokenizer = load_tokenizer(self.model_config, vision=images)
            check_tokenizer(self.data_config, tokenizer)  # before the model is built and controllers launched
            check_images(self.data_config)  # every image of the data files read once, here
            self.env.setup(tokenizer)  # the same for the environment's (a tools environment needs a chat template)
            source = self.model_config.source(materialize(self.model_config, tokenizer, c.seed, workdir, images))
            if images and not image_text_to_text(source.path, source.trust_remote_code):
                raise ConfigError(f"--model.path {source.path}: image prompts need an image-text-to-text checkpoint "
                                  "(one AutoModelForImageTextToText loads), with its processor")
            # the single-node rendezvous store lives as long as the run
            cleanup.enter_context(loopback_store(fabric, c.num_nodes, c.collective_timeout))
            cleanup.enter_context(threads.launching())  # Fabric's OMP_NUM_THREADS in a controller is not the user's
            fabric.launch()
            return self._run(fabric, tokenizer, source, checkpointer)
        finally:
            cleanup.close()

    def _run(self, fabric: Fabric, tokenizer: PreTrainedTokenizerBase, source: ModelSource,
             checkpointer: Checkpointer) -> FitResult:
        """In every controller: set up, run the loop; with several controllers a watch names one that
        is lost, and a failure says which controller failed and why."""
        watch = None
        if fabric.world_size > 1:  # names a controller that dies, and stops this one if it is lost
            watch = ControllerWatch.for_fabric(fabric, silence_limit=self.config.heartbeat_timeout)
        try:
            run = self._setup(fabric, tokenizer, source, checkpointer)
            try:
                result = self._loop(run)
            finally:
                gc.unfreeze()  # (``_loop`` froze what setup built) collected as usual again after the run
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
            report_rank_failure(fabric.global_rank, err, watch)

    # WIRING: what the loop runs on, built once per controller process ---------------------------

    def _setup(self, fabric: Fabric, tokenizer: PreTrainedTokenizerBase, source: ModelSource,
               checkpointer: Checkpointer) -> _Run:
        """Load the prompts, set up the backend, let the placement policy start the engines, then build
        the prompt streams and the controller, hand the run's state to the checkpointer, resume, and
        open the run folder."""
        c, rank = self.config, fabric.global_rank
        processor = self._processor(source)
        prompts = load_prompts(self.data_config, tokenizer, self.sampling.max_new_tokens, source.context_length(),
                               processor)
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

        def take(indices: list[int]) -> list[Prompt]:
            return [with_synthetic_feature(prompts[i], feature_mb) for i in indices]

        controller_class = Controller
        if central:
            from gcore.single_controller import SingleController

            controller_class = SingleController
        controller = controller_class(fabric, self.rollout_engine, self.reward, self.algorithm, self.backend,
                                      self.placement, tokenizer, self.sampling,
                                      draw_prompts=lambda k: take([extra.next_global()[0] for _ in range(k)]),
                                      max_staleness=c.max_staleness, partial_rollouts=c.partial_rollouts,
                                      early_dispatch=c.dispatch == "device", oversample=c.oversample,
                                      prompts_at=take, env=self.env, seed=c.seed)
        controller.setup()
        ahead: list[tuple[list[int], list[int], float]] = []
        pipeline = _Pipeline(ahead, controller, fabric.world_size, c.max_staleness)
        checkpointer.setup(fabric, self.backend, shared={"sampler": sampler, "algorithm": self.algorithm,
                                                         "placement": self.placement, "drawn_ahead": pipeline.drawn},
                           own={"extra_sampler": extra, "in_flight": pipeline.own}, hf_files=source.path)
        start_step = checkpointer.load()
        if start_step:  # the engines generate with the weights resumed
            self.rollout_engine.update_weights(self.backend.named_weights())
            notes = pipeline.resume(sampler)
            if c.max_staleness and not self.placement.reproducible:
                notes.append(f"{type(self.placement).__name__} does not sample the same on every run (its split of "
                             "the workers follows measured times): the rollouts in flight are collected as recorded, "
                             "but the resumed run is not an exact continuation")
            if c.partial_rollouts:
                notes.append("partial rollouts continue across a weight update from wherever it stopped them (a "
                             "matter of timing): the resumed run is not an exact continuation")
            for note in notes if rank == 0 else []:
                print(f"gcore: note: resume with --trainer.max_staleness {c.max_staleness}: {note}", flush=True)
        run_dir = self._open_run_dir(fabric, start_step, checkpointer) if rank == 0 else None
        return _Run(fabric, tokenizer, controller, sampler, take, balancer, checkpointer, start_step,
                    run_dir, self._eval_prompts(tokenizer, source, processor), central, ahead,
                    governor=threads.governor(fabric.device.type))

    def _open_run_dir(self, fabric: Fabric, start_step: int, checkpointer: Checkpointer) -> str | None:
        """On rank 0: create the loggers' run folder (a resumed run continues its ``metrics.csv``) and
        write ``config.yaml`` there; returns the folder (``None`` without loggers)."""
        if not fabric.loggers:
            return None
        for logger in fabric.loggers:
            if isinstance(logger, CSVLogger):  # a resumed run continues its own metrics.csv
                continue_metrics(logger, start_step)
        # creates the run folder before we write into it (every Lightning logger has ``experiment``)
        _ = fabric.loggers[0].experiment  # type: ignore[attr-defined]
        run_dir = fabric.loggers[0].log_dir
        assert run_dir is not None  # every logger gcore makes writes to a folder
        checkpointer.log_version = version_number(fabric.loggers[0].version)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(self.hyperparameters(), f, sort_keys=False)
        for logger in fabric.loggers:
            if not isinstance(logger, CSVLogger):  # Fabric's CSV logger takes no hyperparameters
                logger.log_hyperparams(self.hyperparameters())
        return run_dir

    def _processor(self, source: ModelSource) -> Any:  # noqa: ANN401  a transformers processor
        """The model's processor, for image prompts (``None`` without)."""
        if not self.data_config.has_images:
            return None
        from gcore.vision import load_processor

        return load_processor(source.path, source.trust_remote_code)

    def _eval_prompts(self, tokenizer: PreTrainedTokenizerBase, source: ModelSource, processor: Any = None,  # noqa: ANN401
                      ) -> list[Prompt]:
        """The held-out prompts of ``--trainer.eval_every`` (none when it is 0)."""
        if not self.config.eval_every:
            return []
        return load_eval_prompts(self.data_config, tokenizer, self.sampling.max_new_tokens, source.context_length(),
                                 processor)

    # THE LOOP: steps, evaluations, the final save ------------------------------------------------

    def _loop(self, run: _Run) -> FitResult:
        """Run the steps from ``run.start_step`` to ``max_steps`` (evaluating every ``eval_every``), then
        save the final policy; Ctrl-C or SIGTERM finishes the checkpoint in flight and says where to go on."""
        c, fabric = self.config, run.fabric
        rank = fabric.global_rank
        history: list[dict[str, float]] = []
        evaluations: list[dict[str, float]] = []
        bar = _progress(c.max_steps, enabled=c.enable_progress_bar and rank == 0)
        bar.update(run.start_step)
        step = run.start_step
        skipping = 0  # consecutive steps that skipped an update (non-finite loss or gradient)
        stall = StallWatch()  # steps in a row that trained no sample (every group tied): one line when they pile up
        # what setup built (modules, models, data) lives for the run: out of the collector's sight, so that a full
        # collection inside a step does not walk it (a pause of 0.3 s on the tiny model, which the stage times and
        # so dynamic placement would charge to whichever stage it fell in)
        gc.collect()
        gc.freeze()
        try:
            with ending_as(self._plugin_exit):  # here, so that the save in flight is completed (below)
                for step in range(run.start_step, c.max_steps):
                    if run.eval_prompts and step % c.eval_every == 0:
                        evaluations.append(self._evaluate(run, step, bar))
                    metrics = self._step(run, step, bar)
                    history.append(metrics)
                    if (note := stall.update(step, metrics)) and rank == 0:
                        print(note, file=sys.stderr, flush=True)
                    bar.set_description("step", refresh=False)
                    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", s=f"{metrics['time/step']:.2f}")
                    bar.update(1)
                    skipping = skipping + 1 if metrics.get("skipped_updates", 0.0) > 0 else 0
                    if c.max_skipped_updates and skipping >= c.max_skipped_updates:
                        run.checkpointer.wait()
                        raise GcoreError(
                            f"step {step}: {skipping} steps in a row skipped their update because the loss or the "
                            f"gradient was NaN or infinite (loss {metrics.get('loss', float('nan')):g}, grad_norm "
                            f"{metrics.get('grad_norm', float('nan')):g}); stopping (see "
                            "--trainer.max_skipped_updates)")
                if run.eval_prompts and run.start_step < c.max_steps:  # the trained policy
                    evaluations.append(self._evaluate(run, c.max_steps, bar))
                run.checkpointer.wait()
        except (PluginExit, RewardError):  # a plugin's code failed: the save in flight is still completed
            bar.close()
            run.checkpointer.finish_for_exit()
            raise
        except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (``Interrupted``)
            bar.close()
            last = run.checkpointer.finish_for_exit()
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
        if c.save_final and rank == 0 and run.run_dir is not None:
            final_dir = run.checkpointer.save_final(os.path.join(run.run_dir, "final"), run.tokenizer)
        fabric.barrier()
        if rank == 0:
            return FitResult(run.run_dir, final_dir, history, evaluations)
        return FitResult(None, None, history, evaluations)

    def _judge_scale(self, run: _Run, step: int, batch: list[int]) -> float:
        """The judged prompts (``RewardModel.judged``) of the rollout that starts after this step (step + K + 1's
        global batch), over those of this step's global batch ``batch``: the same on every controller. 1 without
        a judge, when this step judges nothing (no cost to scale), or when no rollout starts after this step in
        this run."""
        if not self.reward.judges() or step + self.config.max_staleness + 1 >= self.config.max_steps:
            return 1.0
        judged_now = sum(map(self.reward.judged, run.take(batch)))
        # step + K + 1's batch: drawn already where it is dispatched early, else the next one to draw
        k = self.config.max_staleness
        following = run.ahead[k][0] if len(run.ahead) > k else run.sampler.peek_global()
        judged_next = sum(map(self.reward.judged, run.take(following)))
        return judged_next / judged_now if judged_now else 1.0

    def _step(self, run: _Run, step: int, bar: tqdm) -> dict[str, float]:
        """One training step on this controller's share of the step's prompts; returns its logged metrics."""
        # this step's batch, the next K (started ahead before it trains) and, dispatched early, the one after them
        drawn = self.config.max_staleness + (1 if self.config.max_staleness and self.config.dispatch == "device" else 0)
        while len(run.ahead) <= drawn and step + len(run.ahead) < self.config.max_steps:
            batch = run.sampler.next_global()
            run.ahead.append((batch, run.sampler.shard(batch), run.sampler.last_imbalance))
        (batch, shard, imbalance), upcoming = run.ahead.pop(0), [run.take(s) for _, s, _ in run.ahead]
        prompts = run.take(shard) if not run.central or run.fabric.global_rank == 0 else []

        def on_stage(stage: str) -> None:
            bar.set_description(stage, refresh=False)
            if run.governor is not None:
                run.governor.update()

        record = run.controller.step(step, prompts, upcoming=upcoming, on_stage=on_stage,
                                     judge_scale=self._judge_scale(run, step, batch))
        metrics = record.metrics
        metrics["step"] = float(step)
        if run.governor is not None:  # the count the step's last stage ran with, and what it was chosen from
            metrics["threads/torch"] = float(run.governor.threads)
            metrics["threads/others_cores"] = run.governor.others
        metrics["balance/predicted_imbalance"] = imbalance
        if run.balancer is not None:
            all_gather = run.fabric.all_gather if run.fabric.world_size > 1 else None
            run.balancer.learn(record.samples, self.data_config.prompts_per_step, all_gather)  # type: ignore[arg-type]
        # an interrupt here is held until the save is started and the step logged: a checkpoint
        # of step N always comes with N's metrics row, and the save is then finished
        with SIGNALS.deferred():
            metrics.update(run.checkpointer.save(step, last_step=step == self.config.max_steps - 1))
            run.fabric.log_dict(metrics, step=step)
        return metrics

    def _evaluate(self, run: _Run, step: int, bar: tqdm) -> dict[str, float]:
        """Evaluate the policy after ``step`` updates; logged at once, on a row of its own."""
        from gcore.evaluation import evaluate

        fabric = run.fabric
        bar.set_description("eval", refresh=False)
        metrics = {"step": float(step), **evaluate(self.rollout_engine, self.reward, run.tokenizer, run.eval_prompts,
                                                   self.sampling, fabric, self.env)}
        fabric.log_dict(metrics, step=step)
        if fabric.global_rank == 0 and self.config.enable_progress_bar:
            bar.write(f"step {step}: held-out accuracy greedy {metrics['eval/accuracy_greedy']:.3f}, "
                      f"sampled {metrics['eval/accuracy_sampled']:.3f} ({metrics['eval/prompts']:.0f} prompts)")
        return metrics

    def _run_signature(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed by this run: the algorithm, backend and model shape."""
        m = self.model_config
        model = {"path": os.path.abspath(m.path)} if m.path is not None else {
            key: getattr(m, key) for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "num_key_value_heads", "intermediate_size")}

        def name(obj: object) -> str:
            return f"{type(obj).__module__}.{type(obj).__qualname__}"

        d = self.data_config
        data = {"path": os.path.abspath(d.path) if d.path else None, "task": None if d.path else d.task}
        return {"algorithm": name(self.algorithm), "backend": name(self.backend), "model": model,
                "seed": self.config.seed, "data": data}

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
            "env": plugin(self.env),
        }


    def _check_run_writable(self, checkpointer: Checkpointer) -> None:
        """A one-line error, before the model is built, when the run cannot write where it will: the
        checkpoint folder (with ``checkpoint_every``), and the ``version_N`` folder and ``metrics.csv`` a
        resumed run continues (a read-only mount, another user's folder)."""
        c = self.config
        run = os.path.join(c.default_root_dir, c.name)
        if c.checkpoint_every:
            _check_writable(checkpointer.root, "checkpoints are written there (--trainer.checkpoint_every)")
        version = checkpointer.resumed_log_version()
        if version is not None:
            why = "a resumed run continues its metrics (or start a new run with another --trainer.name)"
            folder = os.path.join(run, f"version_{version}")
            _check_writable(folder, why)
            metrics = os.path.join(folder, "metrics.csv")
            if os.path.exists(metrics) and not os.access(metrics, os.W_OK):
                raise ConfigError(f"{metrics}: cannot write there ({os.strerror(errno.EACCES)}); {why}")


def _check_writable(folder: str, why: str) -> None:
    """A one-line ``ConfigError`` when ``folder`` (or, while it does not exist, the nearest folder above it
    that does) takes no new file; ``why`` says what is written there."""
    existing = os.path.abspath(folder)
    while not os.path.isdir(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        _write_probe(existing)
    except OSError as err:
        raise ConfigError(f"{existing}: cannot write there ({err.strerror or err}); {why}") from None


def _check_root_writable(root: str) -> None:
    """A one-line error, before any model is built, when runs cannot be written under ``root``."""
    try:
        os.makedirs(root, exist_ok=True)
        _write_probe(root)
    except OSError as err:
        raise ConfigError(f"--trainer.default_root_dir {root}: cannot write there ({err.strerror or err})") from None


def _write_probe(folder: str) -> None:
    """Create and delete a file in ``folder``; raises the ``OSError`` when it takes none."""
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".gcore-write-test-"):
        pass


def _launching_process() -> bool:
    """Whether this is the process that launches the run (not a controller Fabric or torchrun started)."""
    ranks = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID")
    return all(os.environ.get(var, "0") == "0" for var in ranks)


def _progress(total: int, enabled: bool) -> tqdm:
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, unit="step", dynamic_ncols=True)


def fit(**kwargs: Any) -> FitResult:  # noqa: ANN401  Trainer's arguments
    """Shortcut for ``Trainer(**kwargs).fit()``."""
    return Trainer(**kwargs).fit()
