"""The ``Algorithm`` contract and the formulas shared by its implementations."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch

from gcore.types import RolloutBatch, Sample

LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]


@dataclass
class LossScale:
    """Global denominators of one mini-batch, summed over all its micro-batches and all ranks.

    Dividing each micro-batch's sums by these makes the micro-batch losses add up exactly to the
    mini-batch loss, whatever the micro-batch size and the number of ranks.
    """

    tokens: float  # response tokens
    sequences: float  # sequences
    max_length: float  # the generation budget (max_new_tokens), for the length-unbiased variant


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, scale: LossScale, mode: LossAggregation) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss.

    - ``token_mean``: every response token of the mini-batch weighs the same (DAPO).
    - ``seq_mean_token_mean``: mean over tokens per sequence, then over sequences (GRPO paper).
    - ``seq_mean_token_sum_norm``: token sums divided by a constant budget (Dr. GRPO).
    """
    masked = per_token * mask
    if mode == "token_mean":
        return masked.sum() / max(scale.tokens, 1.0)
    if mode == "seq_mean_token_mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / max(scale.sequences, 1.0)
    if mode == "seq_mean_token_sum_norm":
        return masked.sum() / max(scale.sequences * scale.max_length, 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}; valid: token_mean, seq_mean_token_mean, seq_mean_token_sum_norm")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's k1/k2/k3)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.pow(2)
    if estimator == "k3":  # unbiased and always >= 0: exp(-x) - 1 + x with x = log(pi / ref)
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: k1, k2, k3")


def group_normalize(rewards: torch.Tensor, group_ids: torch.Tensor, scale: bool, eps: float = 1e-6) -> torch.Tensor:
    """Reward minus its group's mean, divided by the group's (unbiased) std when ``scale``."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    rewards = rewards.double()
    sums = torch.zeros(len(counts), dtype=torch.double).index_add_(0, inverse, rewards)
    means = sums / counts
    centered = rewards - means[inverse]
    if not scale:
        return centered.float()
    squares = torch.zeros(len(counts), dtype=torch.double).index_add_(0, inverse, centered.pow(2))
    std = torch.where(counts > 1, (squares / (counts - 1).clamp(min=1)).sqrt(), torch.zeros_like(squares))
    return (centered / (std[inverse] + eps)).float()


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped policy loss per token; returns (loss, clipped indicator, ratio)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float(), ratio


class Algorithm(ABC):
    """An RL algorithm: the parts a researcher changes are separate methods.

    - ``shape_reward``: turn a sample's raw reward into the training reward (default: unchanged).
    - ``keep_group``: whether a prompt's group of samples is trained on (default: yes).
    - ``advantages``: per-sequence ``[B]`` or per-token ``[B, L-1]`` advantages of a batch.
    - ``policy_loss``: the per-token loss before aggregation.

    Args:
        kl_coef: weight of KL(policy || reference) in the loss; 0 disables the reference model.
        kl_estimator: ``k1``, ``k2`` or ``k3`` (low-variance, non-negative).
        loss_agg: how per-token losses become one number (see ``aggregate``).
        epochs: passes over each step's batch.
        mini_batches: optimizer steps per pass (the batch is split into this many parts).
    """

    def __init__(
        self,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        loss_agg: LossAggregation = "seq_mean_token_mean",
        epochs: int = 1,
        mini_batches: int = 1,
    ) -> None:
        if epochs < 1 or mini_batches < 1:
            raise ValueError("epochs and mini_batches must be >= 1")
        self.kl_coef = kl_coef
        self.kl_estimator = kl_estimator
        self.loss_agg = loss_agg
        self.epochs = epochs
        self.mini_batches = mini_batches

    @property
    def needs_reference(self) -> bool:
        """Whether reference-model log-probabilities must be computed (and the model kept)."""
        return self.kl_coef != 0.0

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the policy changes within a step, so old log-probabilities must be kept."""
        return self.epochs > 1 or self.mini_batches > 1

    def shape_reward(self, sample: Sample) -> float:
        return sample.reward

    def keep_group(self, rewards: torch.Tensor) -> bool:
        return True

    @abstractmethod
    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        """Advantages for every row of the batch: ``[B]`` or ``[B, L-1]``."""

    @abstractmethod
    def policy_loss(self, logprobs: torch.Tensor, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token policy loss ``[B, L-1]`` and per-token diagnostics to log (same shape)."""

    def loss(
        self, logprobs: torch.Tensor, batch: RolloutBatch, scale: LossScale
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the loss, and its share of each token-mean metric."""
        per_token, diagnostics = self.policy_loss(logprobs, batch)
        mask = batch.response_mask
        if self.needs_reference:
            if batch.ref_logprobs is None:
                raise RuntimeError("kl_coef is set but the batch has no reference log-probabilities")
            kl = kl_estimate(logprobs, batch.ref_logprobs, self.kl_estimator)
            per_token = per_token + self.kl_coef * kl
            diagnostics = {**diagnostics, "kl": kl}
        loss = aggregate(per_token, mask, scale, self.loss_agg)
        shares = {name: (value.detach() * mask).sum() / max(scale.tokens, 1.0) for name, value in diagnostics.items()}
        return loss, shares


def token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sequence advantages ``[B]`` to tokens ``[B, L-1]``."""
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages
