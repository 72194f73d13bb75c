"""An example gcore plugin package: a reward, an algorithm and an environment, registered by entry points."""

from __future__ import annotations

import torch

from gcore import Algorithm, Environment, RolloutBatch, RuleReward, Sample, Turn
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


class Echo(Environment):
    """A two-turn game: the environment shows the prompt's answer after the first turn, and says
    whether the second turn repeated it (reward 1) or not (0).

    Args:
        max_turns: model turns per episode.
    """

    def __init__(self, max_turns: int = 2) -> None:
        super().__init__(max_turns=max_turns)

    def reset(self, prompt):
        return {"answer": prompt.answer or "", "shown": False}

    def step(self, state, response):
        if state["shown"]:
            return Turn(reward=float(state["answer"] in response), done=True, metrics={"echoes": 1.0})
        state["shown"] = True
        return Turn(observation=f"|{state['answer']}=")
