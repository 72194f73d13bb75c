"""RLOO as a short subclass: the documented example of writing a new algorithm.

REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv 2402.14740) baselines each sample with the
mean reward of the *other* samples of its prompt. Only ``advantages`` changes; GRPO's clipped
surrogate is kept (with one epoch and one mini-batch the ratio is 1, so it is plain REINFORCE).
"""

from __future__ import annotations

from typing import Any

import torch

from gcore.algorithms.base import KLEstimator, LossAggregation, group_normalize
from gcore.algorithms.grpo import GRPO
from gcore.types import RolloutBatch


class RLOO(GRPO):
    """GRPO with the leave-one-out baseline and no std scaling or KL term by default.

    ``r_i - mean_{j != i} r_j = k / (k - 1) * (r_i - mean_j r_j)`` for a group of ``k`` samples; a
    group of one sample gets advantage 0.

    Options: GRPO's (their help is GRPO's), ``loss_agg`` defaulting to ``token_mean``; no
    ``clip_eps_high``, ``scale_rewards`` (off) or ``entropy_coef`` (0). The rest (``**options``) pass
    on to GRPO by keyword.
    """

    def __init__(
        self,
        *,
        clip_eps: float = 0.2,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        loss_agg: LossAggregation = "token_mean",
        **options: Any,  # noqa: ANN401  GRPO's and Algorithm's other arguments, checked there
    ) -> None:
        super().__init__(clip_eps=clip_eps, clip_eps_high=None, scale_rewards=False, kl_coef=kl_coef,
                         kl_estimator=kl_estimator, loss_agg=loss_agg, entropy_coef=0.0, **options)

    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        centered = group_normalize(batch.rewards, batch.group_ids, scale=False)
        _, inverse, counts = torch.unique(batch.group_ids, return_inverse=True, return_counts=True)
        k = counts[inverse].to(centered.dtype)
        return torch.where(k > 1, centered * k / (k - 1).clamp(min=1), torch.zeros_like(centered))
