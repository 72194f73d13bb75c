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
from gcore.controller import Controller
from gcore.data import DataConfig, PromptSampler, load_prompts
from gcore.engines.base import Engine
from gcore.errors import ConfigError
from gcore.model import ModelConfig, context_length, load_tokenizer, materialize
from gcore.placement.base import PlacementPolicy
from gcore.rewards.base import RewardModel
from gcore.types import SamplingParams


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
        logger: ``csv``, ``tensorboard``, or both as a list.
        enable_progress_bar: show a progress bar with the live reward.
        save_final: save the trained policy as an HF checkpoint at the end.
    """

    max_steps: int = 30
    accelerator: Literal["cpu", "cuda", "gpu", "auto"] = "auto"
    devices: int = 1
    num_nodes: int = 1
    precision: str = "32-true"
    seed: int = 42
    default_root_dir: str = "gcore_runs"
    name: str = "gcore"
    logger: Literal["csv", "tensorboard"] | list[Literal["csv", "tensorboard"]] = "csv"
    enable_progress_bar: bool = True
    save_final: bool = True


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
        from lightning.fabric.loggers import TensorBoardLogger

        c = self.config
        accelerator = c.accelerator
        if accelerator == "auto":
            import torch

            accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        device_type = "cuda" if accelerator in ("cuda", "gpu") else "cpu"
        world = c.devices * c.num_nodes
        names = [c.logger] if isinstance(c.logger, str) else list(c.logger)
        loggers = []
        for name in names:
            if name == "csv":
                loggers.append(CSVLogger(c.default_root_dir, name=c.name, flush_logs_every_n_steps=1))
            elif name == "tensorboard":
                loggers.append(TensorBoardLogger(c.default_root_dir, name=c.name, default_hp_metric=False))
            else:
                raise ConfigError(f"--trainer.logger {name!r}: valid choices: csv, tensorboard")
        return Fabric(
            accelerator=accelerator,
            devices=c.devices,
            num_nodes=c.num_nodes,
            strategy=self.backend.strategy(world, device_type),
            precision=c.precision,
            loggers=loggers,
        ), device_type

    def fit(self) -> FitResult:
        """Launch the controllers and train for ``max_steps``; returns the run's results on rank 0."""
        _quiet_dependencies()
        fabric, device_type = self._fabric()
        fabric.launch()
        workdir = tempfile.mkdtemp(prefix="gcore-model-")
        try:
            return self._fit(fabric, device_type, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            self.engine.shutdown()

    def _fit(self, fabric, device_type: str, workdir: str) -> FitResult:  # noqa: ANN001
        c, rank = self.config, fabric.global_rank
        tokenizer = load_tokenizer(self.model_config)
        model_path = materialize(self.model_config, tokenizer, c.seed, workdir)
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
        self.engine.setup(model_path, fabric.device, self.model_config.torch_dtype, trust)
        self.reward.setup(fabric.device)
        sampler = PromptSampler(len(prompts), self.data_config.prompts_per_step, rank, fabric.world_size,
                                c.seed, self.data_config.shuffle)
        # dynamic sampling draws extra prompts from a stream of this rank's own (no other rank waits)
        extra = PromptSampler(len(prompts), 1, 0, 1, c.seed + 7919 * (rank + 1), self.data_config.shuffle)
        controller = Controller(fabric, self.engine, self.reward, self.algorithm, self.backend,
                                self.placement, tokenizer, self.sampling,
                                draw_prompts=lambda k: [prompts[extra.next_global()[0]] for _ in range(k)])

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
        for step in range(c.max_steps):
            shard = [prompts[i] for i in sampler.shard(sampler.next_global())]
            metrics = controller.step(step, shard, on_stage=lambda stage: bar.set_description(stage, refresh=False))
            metrics["step"] = float(step)
            fabric.log_dict(metrics, step=step)
            history.append(metrics)
            bar.set_description("step", refresh=False)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", s=f"{metrics['time/step']:.2f}")
            bar.update(1)
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


def _quiet_dependencies() -> None:
    """Keep the console for gcore's own progress: no per-load bars or notices from dependencies."""
    import logging

    import transformers

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
