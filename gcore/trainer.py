"""The ``Trainer``: launches the controllers with Lightning Fabric and runs the step loop."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Literal

import yaml
from lightning.fabric.loggers import CSVLogger

from gcore.algorithms.base import Algorithm
from gcore.backends.base import TrainingBackend
from gcore.checkpoint import CheckpointManager, resolve_resume, rng_state, set_rng_state
from gcore.controller import Controller
from gcore.data import CostBalancer, DataConfig, PromptSampler, load_prompts, with_synthetic_feature
from gcore.engines.base import Engine
from gcore.errors import ConfigError, GcoreError
from gcore.liveness import ControllerWatch
from gcore.model import ModelConfig, context_length, load_tokenizer, materialize
from gcore.placement.base import PlacementPolicy
from gcore.rewards.base import RewardModel
from gcore.types import SamplingParams


LoggerName = Literal["csv", "tensorboard", "wandb", "mlflow"]


def make_logger(name: str, root: str, run_name: str):  # noqa: ANN201
    """A Lightning logger by name; Weights & Biases and MLflow through Lightning's own loggers."""
    from lightning.fabric.loggers import TensorBoardLogger

    if name == "csv":
        return CSVLogger(root, name=run_name, flush_logs_every_n_steps=1)
    if name == "tensorboard":
        return TensorBoardLogger(root, name=run_name, default_hp_metric=False)
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
        resume: ``auto`` (the latest complete checkpoint, if any) or a checkpoint folder; it may
            have been written by another number of controllers (elastic resume).
        collective_timeout: seconds a collective may wait for the other controllers before the run
            fails (instead of hanging when one of them died); also how long a controller may send no
            heartbeat before the others declare it lost. A controller that is killed is named at once.
        controllers: ``None``: one controller per process (G-Core's parallel controllers); ``1``: one
            controller on rank 0 drives the engines and training shards of every process, and all
            rollout data passes through it (the single-driver baseline, for comparison).
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
    controllers: int | None = None


@dataclass
class FitResult:
    """What ``fit`` returns on rank 0 (``None`` fields on other ranks)."""

    run_dir: str | None
    final_model_dir: str | None
    history: list[dict[str, float]] = field(default_factory=list)


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
        self._validate()

    def _validate(self) -> None:
        c, s = self.config, self.sampling
        checks = [
            (c.max_steps >= 1, f"--trainer.max_steps must be >= 1, got {c.max_steps}"),
            (c.devices >= 1, f"--trainer.devices must be >= 1, got {c.devices}"),
            (s.n >= 1, f"--sampling.n must be >= 1, got {s.n}"),
            (s.max_new_tokens >= 1, f"--sampling.max_new_tokens must be >= 1, got {s.max_new_tokens}"),
            (s.temperature > 0, f"--sampling.temperature must be > 0 for RL sampling, got {s.temperature}"),
            (0 < s.top_p <= 1, f"--sampling.top_p must be in (0, 1], got {s.top_p}"),
        ]
        if self.algorithm.needs_critic and not self.backend.supports_critic:
            checks.append((False, f"--algorithm {type(self.algorithm).__name__} needs a critic, which backend "
                                  f"{type(self.backend).__name__} does not provide (use --backend torch)"))
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def _fabric(self):  # noqa: ANN202
        from lightning.fabric import Fabric

        c = self.config
        accelerator = c.accelerator
        if accelerator == "auto":
            import torch

            accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        device_type = "cuda" if accelerator in ("cuda", "gpu") else "cpu"
        world = c.devices * c.num_nodes
        names = [c.logger] if isinstance(c.logger, str) else list(c.logger)
        loggers = [make_logger(name, c.default_root_dir, c.name) for name in names]
        strategy = self.backend.strategy(world, device_type)
        if strategy == "ddp":
            from datetime import timedelta

            from lightning.fabric.strategies import DDPStrategy

            strategy = DDPStrategy(timeout=timedelta(seconds=c.collective_timeout))
        elif type(strategy).__name__ == "ModelParallelStrategy":  # the torch backend's fsdp
            from datetime import timedelta

            # the constructor's ``timeout``: the backend builds the strategy without the trainer's config
            strategy._timeout = timedelta(seconds=c.collective_timeout)
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
        fabric, device_type = self._fabric()
        # invalid combinations fail here, once, before any controller process or engine is launched
        world = self.config.devices * self.config.num_nodes
        self._single_controller(world)
        self.placement.setup(world, device_type, self.reward)
        workdir = tempfile.mkdtemp(prefix="gcore-model-")
        try:
            # before the process group exists: transformers saves only on rank 0 once it does, and
            # every controller builds (and loads) its own copy of the embedded model
            tokenizer = load_tokenizer(self.model_config)
            model_path = materialize(self.model_config, tokenizer, self.config.seed, workdir)
            fabric.launch()
            watch = None
            if fabric.world_size > 1:  # names a controller that dies, and stops this one if it is lost
                watch = ControllerWatch.for_fabric(fabric, silence_limit=self.config.collective_timeout)
            try:
                result = self._fit(fabric, device_type, tokenizer, model_path)
                if watch is not None:
                    watch.stop()
                    fabric.barrier()  # no controller exits (taking the store with it) while another still watches
                return result
            except Exception as err:
                if fabric.world_size == 1:
                    raise
                _report_rank_failure(fabric.global_rank, err, watch)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            self.placement.shutdown()
            self.engine.shutdown()

    def _fit(self, fabric, device_type: str, tokenizer, model_path: str) -> FitResult:  # noqa: ANN001
        c, rank = self.config, fabric.global_rank
        trust = self.model_config.trust_remote_code
        prompts = load_prompts(
            self.data_config, tokenizer, self.sampling.max_new_tokens, context_length(model_path, trust)
        )
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in self.sampling.stop_token_ids:
            self.sampling.stop_token_ids = (*self.sampling.stop_token_ids, tokenizer.eos_token_id)
        fabric.seed_everything(c.seed + rank, verbose=False)  # different samples per controller

        central = self._single_controller(fabric.world_size)
        self.backend.setup(fabric, model_path, self.model_config.torch_dtype, trust, self.algorithm,
                           embedded=self.model_config.embedded)
        # the placement policy starts the engines where it places them (in this process by default)
        if rank == 0 and self.placement.describe():
            print(self.placement.describe(), flush=True)
        self.rollout_engine = self.placement.launch(self.engine, self.reward, model_path, self.model_config.torch_dtype,
                                                    trust, fabric.device, seed=c.seed + 1000 * rank)
        balancer = CostBalancer(prompts, self.sampling.n, self.sampling.max_new_tokens) if self.data_config.balance else None
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
                                      draw_prompts=lambda k: take([extra.next_global()[0] for _ in range(k)]))
        checkpoints = self._checkpoint_manager(fabric)
        start_step = self._resume(fabric, checkpoints, sampler, extra)

        run_dir = None
        if rank == 0 and fabric.loggers:
            fabric.loggers[0].experiment  # creates the run folder before we write into it
            run_dir = fabric.loggers[0].log_dir
            with open(os.path.join(run_dir, "config.yaml"), "w") as f:
                yaml.safe_dump(self.hyperparameters(), f, sort_keys=False)
            for logger in fabric.loggers:
                if not isinstance(logger, CSVLogger):  # Fabric's CSV logger takes no hyperparameters
                    logger.log_hyperparams(self.hyperparameters())
        history: list[dict[str, float]] = []
        bar = _progress(c.max_steps, enabled=c.enable_progress_bar and rank == 0)
        bar.update(start_step)
        for step in range(start_step, c.max_steps):
            shard = sampler.shard(sampler.next_global())
            shard = take(shard) if not central or rank == 0 else []
            metrics = controller.step(step, shard, on_stage=lambda stage: bar.set_description(stage, refresh=False))
            metrics["step"] = float(step)
            metrics["balance/predicted_imbalance"] = sampler.last_imbalance
            if balancer is not None:
                _learn_lengths(fabric, balancer, controller.last_samples, self.data_config.prompts_per_step)
            metrics.update(self._checkpoint_step(fabric, step, checkpoints, sampler, extra, model_path))
            fabric.log_dict(metrics, step=step)
            history.append(metrics)
            bar.set_description("step", refresh=False)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", s=f"{metrics['time/step']:.2f}")
            bar.update(1)
        checkpoints.wait()
        bar.close()
        for logger in fabric.loggers:
            logger.finalize("success")

        final_dir = None
        if c.save_final and rank == 0 and run_dir is not None:
            final_dir = os.path.join(run_dir, "final")
            self.backend.save_pretrained(final_dir)
            tokenizer.save_pretrained(final_dir)
        fabric.barrier()
        if rank == 0:
            return FitResult(run_dir, final_dir, history)
        return FitResult(None, None, history)

    def _single_controller(self, world_size: int) -> bool:
        """Whether one controller drives every process (``--trainer.controllers 1`` with several)."""
        controllers = self.config.controllers
        if controllers not in (None, 1, world_size):
            raise ConfigError(f"--trainer.controllers {controllers}: valid choices are 1 (one controller drives "
                              f"every process) or {world_size} (one per process, the default)")
        central = controllers == 1 and world_size > 1
        from gcore.placement.dynamic import DynamicPlacement

        if central and (isinstance(self.placement, DynamicPlacement) or getattr(self.placement, "workers", 0)):
            raise ConfigError("--trainer.controllers 1 runs with --placement static and no --placement.workers "
                              "(the engine worker pools are per controller)")
        if central and getattr(self.backend, "sequence_parallel_size", 1) > 1:
            raise ConfigError("--trainer.controllers 1 does not support --backend.sequence_parallel_size > 1")
        return central

    def _checkpoint_manager(self, fabric) -> CheckpointManager:  # noqa: ANN001
        c = self.config
        group = None
        if fabric.world_size > 1 and (c.checkpoint_every or c.resume):
            from datetime import timedelta

            import torch.distributed as dist

            # DCP's background collectives stay off the training group
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
        state = {"step": step, "sampler": sampler.state_dict(), "seed": self.config.seed, "world_size": world_size}
        for name, plugin in (("algorithm", self.algorithm), ("placement", self.placement)):
            if callable(getattr(plugin, "state_dict", None)):
                state[name] = plugin.state_dict()
        return state

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
        path = resolve_resume(c.resume, checkpoints.root)
        if path is None:
            if c.resume == "auto" and rank == 0:
                print(f"no checkpoint under {checkpoints.root}: starting from step 0")
            return 0
        state = self.backend.state_dict()
        trainer_state, rank_state = checkpoints.load(path, state)
        self.backend.load_state_dict(state)
        sampler.load_state_dict(trainer_state["sampler"])
        if rank_state is not None and "extra_sampler" in rank_state:
            extra.load_state_dict(rank_state["extra_sampler"])
        for name, plugin in (("algorithm", self.algorithm), ("placement", self.placement)):
            if name in trainer_state and callable(getattr(plugin, "load_state_dict", None)):
                plugin.load_state_dict(trainer_state[name])
        start = int(trainer_state["step"]) + 1
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
            public = {k: v for k, v in vars(obj).items() if not k.startswith("_") and isinstance(v, (int, float, str, bool, tuple, type(None)))}
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

    import transformers

    import warnings

    warnings.filterwarnings("ignore", message=r".*all_gather is deprecated")  # inside Fabric's all_gather
    warnings.filterwarnings("ignore", message=r"torch.distributed is disabled")  # DCP, single process
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for name in ("lightning.fabric", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _progress(total: int, enabled: bool):  # noqa: ANN202
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, unit="step", dynamic_ncols=True)


def fit(**kwargs) -> FitResult:
    """Shortcut for ``Trainer(**kwargs).fit()``."""
    return Trainer(**kwargs).fit()
