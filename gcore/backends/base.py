"""The ``TrainingBackend`` contract: the policy's trainable shards on this rank."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

import torch
from torch.distributed.constants import default_pg_timeout

from gcore.algorithms.base import Algorithm, is_max_metric
from gcore.errors import ConfigError
from gcore.model import ModelSource
from gcore.types import RolloutBatch

if TYPE_CHECKING:
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import Strategy


class TrainingBackend(ABC):
    """Holds the policy (and reference/critic when needed) and trains it.

    Lifecycle: ``strategy`` tells the launcher which Fabric strategy to use; ``setup`` loads the
    model from an HF checkpoint directory (a ``ModelSource``); every step calls ``compute_logprobs`` (PREPARE),
    ``compute_values`` when the algorithm has a critic, ``train`` (TRAIN), then ``named_weights``
    to feed the engine (SYNC).

    A backend that can train a critic sets ``supports_critic``; it then builds the critic in
    ``setup`` when ``algorithm.needs_critic`` and updates it inside ``train`` with
    ``algorithm.value_loss``, alongside the policy.
    """

    #: whether this backend builds and trains a critic for algorithms that need one (PPO)
    supports_critic: bool = False
    #: whether this backend loads a frozen teacher for algorithms that have one (``Algorithm.teacher_path``)
    #: and computes its log-probabilities (``compute_logprobs(batch, "teacher")``)
    supports_teacher: bool = False

    def strategy(self, world_size: int, device_type: str, timeout: timedelta = default_pg_timeout) -> str | Strategy:
        """The Lightning Fabric strategy this backend trains under; a collective waits at most ``timeout``
        for the other ranks (the trainer passes ``--trainer.collective_timeout``). Default: DDP."""
        if world_size == 1:
            return "auto"
        from lightning_fabric.strategies import DDPStrategy

        return DDPStrategy(timeout=timeout)

    def validate(self, algorithm: Algorithm, world_size: int, single_controller: bool) -> None:
        """Raise a one-line ``ConfigError`` (naming the flag and what works) when this backend cannot
        run the configuration; the trainer calls it before anything is launched.

        ``world_size``: the number of processes; ``single_controller``: one controller drives them all
        (``--trainer.controllers 1``). An override adds its own checks to these (call ``super()``).
        """
        if algorithm.needs_critic and not self.supports_critic:
            raise ConfigError(f"--algorithm {type(algorithm).__name__} needs a critic, which backend "
                              f"{type(self).__name__} does not provide (use --backend torch)")
        if algorithm.teacher_path is not None and not self.supports_teacher:
            raise ConfigError(f"--algorithm {type(algorithm).__name__} needs a teacher model (--algorithm.teacher), "
                              f"which backend {type(self).__name__} does not load (use --backend torch)")

    def validate_images(self) -> None:
        """Raise a one-line ``ConfigError`` when this backend (with its options) cannot train on image prompts
        (``--data.image_key``, a visual task); the trainer calls it before anything is launched. Default: it
        cannot (a backend that feeds the visual inputs to its models overrides this)."""
        raise ConfigError(f"--backend {type(self).__name__} does not train on image prompts (it feeds the model "
                          "token ids only); use --backend torch")

    @abstractmethod
    def setup(self, fabric: Fabric, source: ModelSource, algorithm: Algorithm, embedded: bool) -> None:
        """Load the policy from ``source``, the reference model if ``algorithm.needs_reference``, and the critic if
        ``algorithm.needs_critic``, the frozen teacher from ``algorithm.teacher_path`` when set (``supports_teacher``);
        nothing is built for a role the algorithm does not use."""

    @abstractmethod
    def compute_logprobs(self, batch: RolloutBatch, role: Literal["policy", "reference", "teacher"]) -> torch.Tensor:
        """Per-token log-probabilities ``[B, L-1]`` of the batch's tokens under one model."""

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """The critic's value ``[B, L-1]`` of the state before each next token (0 off-response)."""
        raise ConfigError(f"backend {type(self).__name__} has no critic; the algorithm needs one (use --backend torch)")

    def train(self, batch: RolloutBatch, algorithm: Algorithm) -> dict[str, float]:
        """Run the algorithm's updates on this step's batch; return metrics (global over ranks).

        ``algorithm.epochs`` passes over the batch (in a seeded random order after the first), each
        cut into ``algorithm.mini_batches`` parts of one optimizer step each: ``train_mini_batch``
        accumulates a part's gradients and returns its global metrics, ``optimizer_step`` clips and
        steps. The metrics are averaged over the steps (a maximum, ``is_max_metric``, is their maximum).
        A backend implements those two (and ``learning_rate``), or overrides ``train`` whole.
        """
        sums: dict[str, float] = {}
        optimizer_steps = skipped = 0
        generator = torch.Generator().manual_seed(int(batch.input_ids.sum()) % (2**31))
        for epoch in range(algorithm.epochs):
            order = torch.randperm(len(batch), generator=generator) if epoch > 0 else torch.arange(len(batch))
            for rows in torch.tensor_split(order, algorithm.mini_batches):
                stats = self.train_mini_batch(batch, rows, algorithm)
                # the loss is already summed over ranks, so every rank takes the same decision
                grad_norm, stepped = self.optimizer_step(stats, loss_finite=math.isfinite(stats["loss"]))
                skipped += 0 if stepped else 1  # a non-finite loss or gradient skips the update
                optimizer_steps += 1
                stats["grad_norm"] = grad_norm
                for key, value in stats.items():
                    sums[key] = max(sums.get(key, 0.0), value) if is_max_metric(key) else sums.get(key, 0.0) + value
        metrics = {key: value if is_max_metric(key) else value / optimizer_steps for key, value in sums.items()}
        metrics["skipped_updates"] = float(skipped)
        metrics["lr"] = self.learning_rate()
        return metrics

    def train_mini_batch(self, batch: RolloutBatch, rows: torch.Tensor, algorithm: Algorithm) -> dict[str, float]:
        """Accumulate the gradients of the mini-batch ``rows`` of ``batch``; return its global metrics
        (``loss`` among them). The loss's denominators are ``algorithm.loss_scale(tokens, sequences)``."""
        raise NotImplementedError(f"{type(self).__name__} implements neither train nor train_mini_batch")

    def optimizer_step(self, stats: dict[str, float], loss_finite: bool) -> tuple[float, bool]:
        """Clip the accumulated gradients and step (not when the loss or the norm is non-finite), then
        clear them; may add metrics to ``stats``. Returns the gradient norm and whether it stepped."""
        raise NotImplementedError(f"{type(self).__name__} implements neither train nor optimizer_step")

    def learning_rate(self) -> float:
        """The policy's current learning rate (logged as ``lr``)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither train nor learning_rate")

    @abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's full weights with HF names, for the engine."""

    @abstractmethod
    def save_pretrained(self, path: str) -> None:
        """Write the policy as an HF checkpoint (called on rank 0)."""

    def state_dict(self) -> dict:
        """Everything needed to resume training, as a ``torch.distributed.checkpoint`` state dict."""
        raise NotImplementedError(f"{type(self).__name__} does not support checkpoints")

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (after DCP loaded it in place)."""
        raise NotImplementedError(f"{type(self).__name__} does not support checkpoints")
