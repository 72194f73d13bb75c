"""``combined`` reward: a weighted sum of several rewards."""

from __future__ import annotations

from collections.abc import Sequence

from gcore.errors import ConfigError
from gcore.rewards.base import Judge, RewardModel
from gcore.types import Prompt, Sample


class CombinedReward(RewardModel):
    """``sum(weight_i * reward_i)`` per sample; each part is also kept in ``sample.reward_info``.

    Args:
        rewards: the reward models to combine (from YAML: a list of ``class_path``/``init_args``).
        weights: one weight per reward (default: all 1).
    """

    def __init__(self, rewards: list[RewardModel], weights: list[float] | None = None) -> None:
        if not rewards:
            raise ConfigError("--reward combined needs at least one reward in --reward.rewards")
        weights = [1.0] * len(rewards) if weights is None else list(weights)
        if len(weights) != len(rewards):
            raise ConfigError(f"--reward.weights has {len(weights)} values for {len(rewards)} rewards")
        self.rewards, self.weights = list(rewards), [float(w) for w in weights]

    def setup(self, device) -> None:  # noqa: ANN001
        for reward in self.rewards:
            reward.setup(device)

    def judges(self) -> list[Judge]:
        return [judge for reward in self.rewards for judge in reward.judges()]

    def judged(self, prompt: Prompt) -> bool:
        return any(reward.judged(prompt) for reward in self.rewards)

    def score(self, samples: Sequence[Sample]) -> list[float]:
        totals = [0.0] * len(samples)
        self.last_errors, self.last_error = 0, None
        for index, (reward, weight) in enumerate(zip(self.rewards, self.weights, strict=False)):
            scores = self.score_part(reward, samples)
            name = f"{index}_{type(reward).__name__}"
            for i, (sample, value) in enumerate(zip(samples, scores, strict=False)):
                sample.reward_info[name] = float(value)
                totals[i] += weight * float(value)
        return totals
