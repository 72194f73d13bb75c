"""DAPO (arXiv 2503.14476): clip-higher, token-level loss, overlong shaping, dynamic sampling."""

from __future__ import annotations

from typing import Any

import torch

from gcore.algorithms.base import KLEstimator, LossAggregation, check, overlong_penalty
from gcore.algorithms.grpo import GRPO
from gcore.types import RolloutBatch, Sample


class DAPO(GRPO):
    """Decoupled Clip and Dynamic sAmpling Policy Optimization: GRPO with four changes.

    - **Clip-higher**: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
    - **Token-level loss**: every response token of the mini-batch weighs the same (``token_mean``).
    - **Overlong shaping**: a response longer than ``max_new_tokens - overlong_buffer`` tokens loses
      up to ``overlong_penalty`` linearly; with ``filter_truncated`` a response cut at the length
      limit is masked out of the loss instead.
    - **Dynamic sampling**: groups whose rewards are all equal (zero advantage) are dropped, and the
      controller samples more prompts, up to ``max_rounds`` generation rounds, to fill its share.

    No KL term by default (the paper removes it). GRPO's options are DAPO's (with their help),
    ``loss_agg`` defaulting to ``token_mean``; ``scale_rewards``, ``kl_coef`` and ``kl_estimator`` are
    re-declared only to keep their place before it in ``--algorithm.help``.

    Args:
        clip_low: lower clip range (``1 - clip_low``).
        clip_high: upper clip range (``1 + clip_high``).
        overlong_buffer: length of the soft-penalty zone before the limit, in tokens (0: off).
        overlong_penalty: the penalty at the limit.
        filter_truncated: mask responses that hit the length limit out of the loss.
        dynamic_sampling: drop groups with equal rewards and re-sample to fill the batch.
        max_rounds: generation rounds per step at most (1: drop without re-sampling).
        **options: GRPO's other options, and ``Algorithm``'s, passed on by keyword.
    """

    def __init__(
        self,
        *,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        overlong_buffer: int = 0,
        overlong_penalty: float = 1.0,
        filter_truncated: bool = False,
        dynamic_sampling: bool = True,
        max_rounds: int = 3,
        scale_rewards: bool = True,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        loss_agg: LossAggregation = "token_mean",
        **options: Any,  # noqa: ANN401  GRPO's and Algorithm's other arguments, checked there
    ) -> None:
        super().__init__(clip_eps=clip_low, clip_eps_high=clip_high, scale_rewards=scale_rewards, kl_coef=kl_coef,
                         kl_estimator=kl_estimator, loss_agg=loss_agg, **options)
        check(max_rounds >= 1, f"--algorithm.max_rounds must be >= 1, got {max_rounds}")
        check(overlong_buffer >= 0, f"--algorithm.overlong_buffer must be >= 0, got {overlong_buffer}")
        self.clip_low, self.clip_high = clip_low, clip_high
        self.overlong_buffer, self.overlong_penalty = overlong_buffer, overlong_penalty
        self.filter_truncated = filter_truncated
        self.dynamic_sampling = dynamic_sampling
        self.max_rounds = max_rounds if dynamic_sampling else 1

    def setup(self, max_new_tokens: int) -> None:
        super().setup(max_new_tokens)
        check(self.overlong_buffer < max_new_tokens, f"--algorithm.overlong_buffer {self.overlong_buffer} must be "
              f"< --sampling.max_new_tokens {max_new_tokens}")

    def shape_reward(self, sample: Sample) -> float:
        if self.max_new_tokens is None:
            return sample.reward
        length = len(sample.response_ids)
        penalty = overlong_penalty(length, self.max_new_tokens, self.overlong_buffer, self.overlong_penalty)
        return sample.reward + penalty

    def keep_group(self, rewards: torch.Tensor) -> bool:
        return not self.dynamic_sampling or bool((rewards != rewards[0]).any())

    def loss_mask(self, batch: RolloutBatch) -> torch.Tensor:
        if self.filter_truncated and batch.truncated is not None:
            return batch.response_mask * (~batch.truncated).unsqueeze(-1).to(batch.response_mask.dtype)
        return batch.response_mask
