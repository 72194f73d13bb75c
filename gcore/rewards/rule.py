"""Rule-based rewards: the embedded task's reward, regular expressions, and any Python callable."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from gcore.errors import ConfigError
from gcore.registry import load_callable
from gcore.rewards.base import RewardModel, RuleReward
from gcore.types import Sample


class TargetCharReward(RuleReward):
    """The embedded task: the share of ``length`` response characters equal to the answer.

    The prompt names a character (``answer``); the reward is ``count / length``, capped at 1, so a
    response that stops early scores less than one that fills all ``length`` characters.
    """

    def __init__(self, length: int = 16, **options: Any) -> None:  # noqa: ANN401  RuleReward's, checked there
        super().__init__(**options)
        if length <= 0:
            raise ValueError("length must be positive")
        self.length = length

    def score_one(self, sample: Sample) -> float:
        if not sample.prompt.answer:
            raise ValueError("target_char needs an 'answer' (the target character) for every prompt")
        return min(sample.response_text.count(sample.prompt.answer[0]), self.length) / self.length


class RegexReward(RuleReward):
    """``match_score`` when the response matches ``pattern`` (``re.search``), else ``miss_score``.

    A ``{answer}`` placeholder in the pattern is replaced by the escaped reference answer.
    """

    def __init__(
        self,
        pattern: str,
        match_score: float = 1.0,
        miss_score: float = 0.0,
        **options: Any,  # noqa: ANN401  RuleReward's arguments, checked there
    ) -> None:
        super().__init__(**options)
        try:
            re.compile(pattern.replace("{answer}", "x"))
        except re.error as err:
            raise ConfigError(f"--reward.pattern {pattern!r} is not a valid regular expression: {err}") from err
        self.pattern, self.match_score, self.miss_score = pattern, match_score, miss_score

    def score_one(self, sample: Sample) -> float:
        pattern = self.pattern
        if "{answer}" in pattern:
            pattern = pattern.replace("{answer}", re.escape(sample.prompt.answer or ""))
        return self.match_score if re.search(pattern, sample.response_text) else self.miss_score


class CallableReward(RuleReward):
    """Any Python function ``fn(prompt: str, response: str, answer: str | None) -> float``.

    Args:
        function: ``package.module:function`` or ``path/to/file.py:function``.
    """

    def __init__(self, function: str, **options: Any) -> None:  # noqa: ANN401  RuleReward's, checked there
        super().__init__(**options)
        self.function = function
        self._fn = load_callable(function)

    def score_one(self, sample: Sample) -> float:
        return self._fn(sample.prompt.text, sample.response_text, sample.prompt.answer)

    def __getstate__(self) -> dict:  # the function is loaded again where it is unpickled (a worker process)
        return {key: value for key, value in vars(self).items() if key != "_fn"}

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._fn = load_callable(self.function)


class NoReward(RewardModel):
    """0 for every sample: with a multi-turn environment (``--env``), the environment's turn rewards are
    the whole reward (docs/agents.md)."""

    def score(self, samples: Sequence[Sample]) -> list[float]:
        return [0.0] * len(samples)
