"""PPO (Schulman et al. 2017) with a critic and GAE (Schulman et al. 2016), as used for RLHF."""

from __future__ import annotations

from typing import Any, Literal

import torch

from gcore.algorithms.base import (
    Algorithm,
    KLEstimator,
    LossAggregation,
    LossScale,
    aggregate,
    check,
    check_choice,
    check_clip_ratio_c,
    clipped_surrogate,
    clipped_value_loss,
    dual_clip,
    gae,
    kl_estimate,
    masked_whiten,
)
from gcore.types import RolloutBatch

KLPenalty = Literal["reward", "loss"]


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put each row's scalar reward on its last response token ``[B, L-1]``."""
    out = torch.zeros_like(mask, dtype=rewards.dtype)
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(-1).values
    rows = (last >= 0).nonzero().squeeze(-1)
    out[rows, last[rows]] = rewards[rows]
    return out


class PPO(Algorithm):
    """Proximal Policy Optimization with a learned critic.

    Per-token rewards are the sequence reward on the last response token, minus
    ``kl_coef * KL_t`` on every token when ``kl_penalty="reward"`` (the InstructGPT form); with
    ``kl_penalty="loss"`` the KL is a loss term instead, as in GRPO. Advantages are GAE over the
    response tokens, whitened over the batch; the critic regresses the GAE returns with a clipped
    value loss. The critic is a separate model built from the policy's checkpoint by the backend.

    Args:
        gamma: discount per token.
        lam: GAE lambda.
        clip_eps: policy ratio clip range (lower, and upper unless ``clip_eps_high``).
        clip_eps_high: upper clip range when it differs.
        clip_ratio_c: dual-clip bound for negative advantages: where ``A < 0`` a token's loss is at
            most ``-A * clip_ratio_c`` (dual-clip PPO, as verl); must be > 1; ``None``: off.
        value_clip: clip range of the value update around the old values; ``None`` disables it.
        kl_coef: weight of the KL penalty to the frozen reference (0, the default: no reference
            model is built; typical values 0.001-0.05).
        kl_estimator: ``k1`` (the usual reward-term estimator), ``k2`` or ``k3``.
        kl_penalty: ``reward`` (a per-token reward term) or ``loss`` (a loss term).
        whiten_advantages: normalise advantages to mean 0, std 1 over this controller's batch.
        loss_agg: aggregation of the policy and value losses.
        epochs: PPO epochs over each step's batch.
        mini_batches: optimizer steps per epoch.
        entropy_coef: entropy bonus weight.
        **options: the other options of ``Algorithm`` (``behaviour_is_cap``), passed on by keyword.
    """

    def __init__(
        self,
        *,
        gamma: float = 1.0,
        lam: float = 0.95,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        clip_ratio_c: float | None = None,
        value_clip: float | None = 0.2,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k1",
        kl_penalty: KLPenalty = "reward",
        whiten_advantages: bool = True,
        loss_agg: LossAggregation = "token_mean",
        epochs: int = 2,
        mini_batches: int = 2,
        entropy_coef: float = 0.0,
        **options: Any,  # noqa: ANN401  Algorithm's other arguments, checked there
    ) -> None:
        super().__init__(kl_coef=kl_coef, kl_estimator=kl_estimator, loss_agg=loss_agg, epochs=epochs,
                         mini_batches=mini_batches, entropy_coef=entropy_coef, **options)
        check(0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0,
              f"--algorithm.gamma and lam must be in [0, 1], got {gamma}, {lam}")
        check_choice("kl_penalty", kl_penalty, KLPenalty)
        check_clip_ratio_c(clip_ratio_c)
        self.gamma, self.lam = gamma, lam
        self.clip_eps = clip_eps
        self.clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
        self.clip_ratio_c = clip_ratio_c
        self.value_clip = value_clip
        self.kl_penalty = kl_penalty
        self.whiten_advantages = whiten_advantages

    @property
    def needs_critic(self) -> bool:
        return True

    @property
    def kl_in_loss(self) -> bool:
        return self.kl_penalty == "loss"

    def token_rewards(self, batch: RolloutBatch) -> torch.Tensor:
        """The reward of every response token: the outcome at the end, minus the KL penalty."""
        rewards = last_token_rewards(batch.rewards, batch.response_mask)
        if self.needs_reference and not self.kl_in_loss:
            if batch.ref_logprobs is None:
                raise RuntimeError("kl_coef is set but the batch has no reference log-probabilities")
            sampled = batch.old_logprobs if batch.old_logprobs is not None else batch.engine_logprobs
            kl = kl_estimate(sampled, batch.ref_logprobs, self.kl_estimator)
            rewards = rewards - self.kl_coef * kl * batch.response_mask
        return rewards

    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        if batch.values is None:
            raise RuntimeError("PPO needs the critic's values in the batch (backend.compute_values)")
        rewards = self.token_rewards(batch)
        advantages, batch.returns = gae(rewards, batch.values, batch.response_mask, self.gamma, self.lam)
        if self.whiten_advantages:
            advantages = masked_whiten(advantages, batch.response_mask)
        return advantages

    def policy_loss(self, logprobs: torch.Tensor, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        assert batch.advantages is not None  # set by the controller before the loss
        loss, clipped, ratio = clipped_surrogate(logprobs, old, batch.advantages, self.clip_eps, self.clip_eps_high)
        diagnostics = {"clip_frac": clipped, "ratio": ratio.detach()}
        if self.clip_ratio_c is not None:
            loss, diagnostics["clip_frac_lower"] = dual_clip(loss, batch.advantages, self.clip_ratio_c)
        return loss, diagnostics

    def value_loss(
        self, values: torch.Tensor, batch: RolloutBatch, scale: LossScale
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert batch.values is not None and batch.returns is not None  # PPO's batches carry both
        per_token, clipped = clipped_value_loss(values, batch.values, batch.returns, self.value_clip)
        mask = batch.response_mask
        loss = aggregate(per_token, mask, scale, self.loss_agg)
        shares = {
            "critic/value_loss": (per_token.detach() * mask).sum() / max(scale.tokens, 1.0),
            "critic/clip_frac": (clipped * mask).sum() / max(scale.tokens, 1.0),
            "critic/value_mean": (values.detach() * mask).sum() / max(scale.tokens, 1.0),
        }
        return loss, shares

