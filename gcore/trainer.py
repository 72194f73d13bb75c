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
from gcore.data import CostBalancer, DataConfig, PromptSampler, load_prompts
from gcore.engines.base import Engine
from gcore.errors import ConfigError, GcoreError
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
        resume: ``auto`` (the latest complete checkpoint, if any) or a checkpoint folder.
        collective_timeout: seconds a collective may wait for the other controllers before the run
            fails (instead of hanging when one of them died).
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
        workdir = tempfile.mkdtemp(prefix="gcore-model-")
        try:
            # before the process group exists: transformers saves only on rank 0 once it does, and
            # every controller builds (and loads) its own copy of the embedded model
            tokenizer = load_tokenizer(self.model_config)
            model_path = materialize(self.model_config, tokenizer, self.config.seed, workdir)
            fabric.launch()
            try:
                return self._fit(fabric, device_type, tokenizer, model_path)
            except Exception as err:
                if fabric.world_size == 1:
                    raise
                _report_rank_failure(fabric.global_rank, err)
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

        self.placement.setup(fabric.world_size, device_type)
        self.backend.setup(fabric, model_path, self.model_config.torch_dtype, trust, self.algorithm,
                           embedded=self.model_config.embedded)
        # the placement policy starts the engines where it places them (in this process by default)
        self.rollout_engine = self.placement.launch(self.engine, self.reward, model_path, self.model_config.torch_dtype,
                                                    trust, fabric.device, seed=c.seed + 1000 * rank)
        balancer = CostBalancer(prompts, self.sampling.n, self.sampling.max_new_tokens) if self.data_config.balance else None
        sampler = PromptSampler(len(prompts), self.data_config.prompts_per_step, rank, fabric.world_size,
                                c.seed, self.data_config.shuffle, balancer)
        # dynamic sampling draws extra prompts from a stream of this rank's own (no other rank waits)
        extra = PromptSampler(len(prompts), 1, 0, 1, c.seed + 7919 * (rank + 1), self.data_config.shuffle)
        controller = Controller(fabric, self.rollout_engine, self.reward, self.algorithm, self.backend,
                                self.placement, tokenizer, self.sampling,
                                draw_prompts=lambda k: [prompts[extra.next_global()[0]] for _ in range(k)])
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
        stall = None
        for step in range(start_step, c.max_steps):
            shard = [prompts[i] for i in sampler.shard(sampler.next_global())]
            metrics = controller.step(step, shard, on_stage=lambda stage: bar.set_description(stage, refresh=False))
            metrics["step"] = float(step)
            metrics["balance/predicted_imbalance"] = sampler.last_imbalance
            if balancer is not None:
                _learn_lengths(fabric, balancer, controller.last_samples, self.data_config.prompts_per_step)
            if stall is not None:  # the previous step's checkpoint save
                metrics["checkpoint/stall_s"], stall = stall, None
            fabric.log_dict(metrics, step=step)
            history.append(metrics)
            bar.set_description("step", refresh=False)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", s=f"{metrics['time/step']:.2f}")
            bar.update(1)
            checkpoints.poll()
            if c.checkpoint_every and ((step + 1) % c.checkpoint_every == 0 or step == c.max_steps - 1):
                stall = checkpoints.save(step, self.backend.state_dict(), self._trainer_state(step, sampler),
                                         {"rng": rng_state(), "extra_sampler": extra.state_dict()}, asynchronous=c.async_checkpoint, hf_files=model_path)
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

    def _checkpoint_manager(self, fabric) -> CheckpointManager:  # noqa: ANN001
        c = self.config
        group = None
        if fabric.world_size > 1 and (c.checkpoint_every or c.resume):
            import torch.distributed as dist

            group = dist.new_group(backend="gloo")  # DCP's background collectives stay off the training group
        root = os.path.join(c.default_root_dir, c.name, "checkpoints")
        return CheckpointManager(root, c.keep_checkpoints, fabric.global_rank, fabric.world_size,
                                 barrier=fabric.barrier, process_group=group)

    def _trainer_state(self, step: int, sampler: PromptSampler) -> dict:
        state = {"step": step, "sampler": sampler.state_dict(), "seed": self.config.seed}
        for name, plugin in (("algorithm", self.algorithm), ("placement", self.placement)):
            if callable(getattr(plugin, "state_dict", None)):
                state[name] = plugin.state_dict()
        return state

    def _resume(self, fabric, checkpoints: CheckpointManager, sampler: PromptSampler,  # noqa: ANN001
                extra: PromptSampler) -> int:
        """Restore the latest (or given) checkpoint; returns the first step to run."""
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
        if rank_state is not None and "extra_sampler" in rank_state:  # a per-rank stream: same rank count only
            extra.load_state_dict(rank_state["extra_sampler"])
        for name, plugin in (("algorithm", self.algorithm), ("placement", self.placement)):
            if name in trainer_state and callable(getattr(plugin, "load_state_dict", None)):
                plugin.load_state_dict(trainer_state[name])
        start = int(trainer_state["step"]) + 1
        if rank_state is not None:
            set_rng_state(rank_state["rng"])  # same rank count: continue exactly
        else:
            fabric.seed_everything(c.seed + rank + 100_003 * start, verbose=False)  # resharded: reseed
        self.rollout_engine.update_weights(self.backend.named_weights())
        if rank == 0:
            print(f"resumed from {path} at step {start}")
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


def _report_rank_failure(rank: int, err: Exception) -> None:
    """Say which controller failed and why; a controller that only lost its peers says so."""
    import sys

    message = str(err).splitlines()[0] if str(err) else type(err).__name__
    lost = any(s in message for s in ("Connection closed by peer", "Connection reset", "timed out", "Timed out",
                                      "Broken pipe", "connection", "Connection refused"))
    if lost and not isinstance(err, GcoreError):
        raise GcoreError(
            f"controller {rank}: lost contact with another controller ({message}); that controller's own "
            "error is reported above"
        ) from err
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
