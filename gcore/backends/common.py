"""What the training backends share: the optimizer options, the per-token log-probabilities, and
the concatenation of several ranks' batches."""

from __future__ import annotations

from dataclasses import fields

import torch

from gcore.errors import ConfigError
from gcore.types import RolloutBatch


class OptimizerOptions:
    """How a backend updates the policy: AdamW, gradient clipping, warm-up and gradient accumulation.

    The backends inherit these options and take them as their own flags (``--backend.lr`` etc.) by
    passing ``**optimizer`` on to this ``__init__``, so every backend spells, checks and documents
    them alike.

    Args:
        lr: learning rate; ``None`` picks 1e-6 for a checkpoint given with ``--model.path`` and
            5e-3 for the embedded tiny model (1e-3 for the embedded tiny VLM of image prompts).
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

    def base_lr(self, embedded: bool, vision: bool = False) -> float:
        """The learning rate after warm-up: ``lr``, or the default for the model's kind (the embedded tiny VLM,
        ``vision``, learns its visual task with 1e-3 and not with the text model's 5e-3: BENCHMARKS.md)."""
        if self.lr is not None:
            return self.lr
        if embedded:
            return 1e-3 if vision else 5e-3
        return 1e-6

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


def concat_batches(parts: list[RolloutBatch]) -> RolloutBatch:
    """Stack batches of different lengths, in order, right-padding every ``[B, L]`` and ``[B, L-1]``
    tensor with zeros to the longest; a field that is ``None`` in every part stays ``None``, one that
    is ``None`` in only some parts, or has different dimensions in different parts, is an error
    (the sequence-parallel group's union and megatron's data-parallel union both use it)."""
    if len(parts) == 1:
        return parts[0]
    length = max(p.input_ids.shape[1] for p in parts)
    out = {}
    for f in fields(RolloutBatch):
        values = [getattr(p, f.name) for p in parts]
        if not isinstance(values[0], torch.Tensor):
            out[f.name] = values[0]
            continue
        if any(v is None for v in values):
            raise ValueError(f"cannot stack batches where only some have {f.name}")
        padded = []
        for p, v in zip(parts, values, strict=False):
            if v.dim() == 2:
                width = length if v.shape[1] == p.input_ids.shape[1] else length - 1
                v = torch.nn.functional.pad(v, (0, width - v.shape[1]))
            elif f.name == "routed_experts":  # [B, L-1, layers, k]: -1 where no route was recorded
                v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, length - 1 - v.shape[1]), value=-1)
            padded.append(v)
        if len({v.dim() for v in padded}) > 1:  # advantages: [B] on some ranks, [B, L-1] on others
            raise ValueError(f"cannot stack batches whose {f.name} have different ranks")
        out[f.name] = torch.cat(padded)
    # rollout tracing's per-sample gaps name rows of one controller's batch: a union of several has no such rows
    out["row_ids"], out["logprob_gaps"] = None, None
    return RolloutBatch(**out)
