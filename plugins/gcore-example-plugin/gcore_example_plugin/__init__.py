"""An example gcore plugin package: one reward and one algorithm, registered by entry points."""

from __future__ import annotations

import torch

from gcore import Algorithm, RolloutBatch, RuleReward, Sample
from gcore.algorithms import group_normalize


class BrevityReward(RuleReward):
    """1 for an empty response, falling linearly to 0 at ``max_chars`` characters.

    Args:
        max_chars: length at which the reward reaches 0.
    """

    def __init__(self, max_chars: int = 16, on_error: str = "raise") -> None:
        super().__init__(on_error)
        self.max_chars = max_chars

    def score_one(self, sample: Sample) -> float:
        return max(0.0, 1.0 - len(sample.response_text) / self.max_chars)


class Reinforce(Algorithm):
    """REINFORCE with the group's mean reward as baseline: loss = -A * log pi(token)."""

    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        return group_normalize(batch.rewards, batch.group_ids, scale=False)

    def policy_loss(self, logprobs: torch.Tensor, batch: RolloutBatch):
        advantages = batch.advantages.unsqueeze(-1).expand_as(logprobs)
        return -advantages * logprobs, {}
