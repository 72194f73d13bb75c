"""What the training backends share: the optimizer options and the per-token log-probabilities."""

from __future__ import annotations

import torch

from gcore.errors import ConfigError


class OptimizerOptions:
    """How a backend updates the policy: AdamW, gradient clipping, warm-up and gradient accumulation.

    The backends inherit these options and take them as their own flags (``--backend.lr`` etc.) by
    passing ``**optimizer`` on to this ``__init__``, so every backend spells, checks and documents
    them alike.

    Args:
        lr: learning rate; ``None`` picks 1e-6 for a checkpoint given with ``--model.path`` and
            5e-3 for the embedded tiny model.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        max_grad_norm: clip the global gradient norm to this (0: no clipping).
        micro_batch_size: sequences per forward/backward pass (gradients accumulate over a mini-batch;
            megatron: of a tensor-parallel group, which runs on the union of its ranks' batches).
        warmup_steps: linear learning-rate warm-up, in optimizer steps.
    """

    def __init__(
        self,
        lr: float | None = None,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        max_grad_norm: float = 1.0,
        micro_batch_size: int = 32,
        warmup_steps: int = 0,
    ) -> None:
        if micro_batch_size < 1:
            raise ConfigError(f"--backend.micro_batch_size must be >= 1, got {micro_batch_size}")
        if warmup_steps < 0:
            raise ConfigError(f"--backend.warmup_steps must be >= 0, got {warmup_steps}")
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = (betas[0], betas[1])  # a YAML list is a tuple here
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        self.warmup_steps = warmup_steps

    def base_lr(self, embedded: bool) -> float:
        """The learning rate after warm-up: ``lr``, or the default for the model's kind."""
        if self.lr is not None:
            return self.lr
        return 5e-3 if embedded else 1e-6

    def warmup_factor(self, updates: int) -> float:
        """The share of the base learning rate for the update after ``updates`` updates (linear warm-up)."""
        warmup = self.warmup_steps
        return min(1.0, (updates + 1) / warmup) if warmup > 0 else 1.0


def check_sequence_parallel_controllers(sequence_parallel_size: int, single_controller: bool) -> None:
    """Refuse sequence parallelism under one controller (its groups split each controller's own batch)."""
    if single_controller and sequence_parallel_size > 1:
        raise ConfigError("--trainer.controllers 1 does not support --backend.sequence_parallel_size > 1")


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability ``[B, L-1]`` of each next token and the entropy of each next-token distribution."""
    logits = logits[:, :-1].float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return chosen, entropy
