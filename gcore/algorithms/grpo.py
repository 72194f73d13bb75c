"""GRPO (DeepSeekMath, arXiv 2402.03300): group-normalised advantages, clipped ratio loss, KL in the loss."""

from __future__ import annotations

from typing import Any

import torch

from gcore.algorithms.base import (
    Algorithm,
    KLEstimator,
    LossAggregation,
    check_clip_ratio_c,
    clipped_surrogate,
    dual_clip,
    group_normalize,
    token_advantages,
)
from gcore.types import RolloutBatch


class GRPO(Algorithm):
    """Group Relative Policy Optimization.

    The advantage of a sample is its reward minus the mean reward of its group (the samples of the
    same prompt), divided by the group's std when ``scale_rewards``; every token of the sample gets
    it (outcome supervision). The loss is PPO's clipped surrogate, plus ``kl_coef`` times a KL
    estimate to the reference model (k3 in the paper, which uses ``kl_coef`` 0.04; gcore defaults to
    0, as TRL and Dr. GRPO/DAPO do, and 0 needs no reference model: docs/algorithms.md).

    The options every algorithm has are ``Algorithm``'s; GRPO re-declares those it documents in the
    paper's terms and passes them, and ``**options`` (``behaviour_is_cap``, any later one), on by keyword.

    Args:
        clip_eps: clip range of the probability ratio (lower side, and upper unless ``clip_eps_high``).
        clip_eps_high: upper clip range when it differs (DAPO's clip-higher).
        clip_ratio_c: dual-clip bound for negative advantages: where ``A < 0`` a token's loss is at
            most ``-A * clip_ratio_c`` (dual-clip PPO, as verl); must be > 1; ``None``: off.
        scale_rewards: divide by the group's std (off: Dr. GRPO's unscaled advantages).
        kl_coef: weight of the KL term in the loss (0 skips the reference model entirely).
        kl_estimator: ``k1``, ``k2`` or ``k3``.
        loss_agg: ``seq_mean_token_mean`` (the paper), ``token_mean`` (DAPO) or
            ``seq_mean_token_sum_norm`` (Dr. GRPO, length-unbiased).
        epochs: passes over each step's batch (the paper's mu).
        mini_batches: optimizer steps per pass.
        entropy_coef: entropy bonus weight (not in the paper; 0 by default).
        **options: the other options of ``Algorithm`` (``behaviour_is_cap``).
    """

    def __init__(
        self,
        *,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        clip_ratio_c: float | None = None,
        scale_rewards: bool = True,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        loss_agg: LossAggregation = "seq_mean_token_mean",
        epochs: int = 1,
        mini_batches: int = 1,
        entropy_coef: float = 0.0,
        **options: Any,  # noqa: ANN401  Algorithm's other arguments, checked there
    ) -> None:
        super().__init__(kl_coef=kl_coef, kl_estimator=kl_estimator, loss_agg=loss_agg, epochs=epochs,
                         mini_batches=mini_batches, entropy_coef=entropy_coef, **options)
        check_clip_ratio_c(clip_ratio_c)
        self.clip_eps = clip_eps
        self.clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
        self.clip_ratio_c = clip_ratio_c
        self.scale_rewards = scale_rewards

    @property
    def zero_advantage_is_inert(self) -> bool:
        # true of the clipped surrogate below; a subclass with its own ``policy_loss`` must say so again
        return type(self).policy_loss is GRPO.policy_loss

    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        return group_normalize(batch.rewards, batch.group_ids, self.scale_rewards)

    def policy_loss(self, logprobs: torch.Tensor, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        assert batch.advantages is not None  # set by the controller before the loss
        adv = token_advantages(batch.advantages, logprobs)
        loss, clipped, ratio = clipped_surrogate(logprobs, old, adv, self.clip_eps, self.clip_eps_high)
        diagnostics = {"clip_frac": clipped, "ratio": ratio.detach()}
        if self.clip_ratio_c is not None:
            loss, diagnostics["clip_frac_lower"] = dual_clip(loss, adv, self.clip_ratio_c)
        return loss, diagnostics
