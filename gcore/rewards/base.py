"""The ``RewardModel`` contract, and the per-sample base class for rule-based rewards."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal

from gcore.errors import RewardError
from gcore.types import Sample


class RewardModel(ABC):
    """Scores completions: ``score(samples)`` returns one float per sample.

    ``last_errors`` counts the samples whose scoring failed in the last call (logged each step).
    """

    last_errors: int = 0

    def setup(self, device) -> None:  # noqa: ANN001 - torch.device; kept untyped to stay light
        """Load whatever the reward needs (a classifier, a judge engine); no-op by default."""

    @abstractmethod
    def score(self, samples: Sequence[Sample]) -> list[float]:
        """One reward per sample."""


class RuleReward(RewardModel):
    """A reward computed per sample by plain Python: subclass and implement ``score_one``.

    Args:
        on_error: ``raise`` stops the run naming the sample whose scoring raised; ``zero``
            scores it 0, counts it in the ``reward/errors`` metric and goes on.
    """

    def __init__(self, on_error: Literal["raise", "zero"] = "raise") -> None:
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
        self.on_error = on_error

    @abstractmethod
    def score_one(self, sample: Sample) -> float:
        """The reward of one sample."""

    def score(self, samples: Sequence[Sample]) -> list[float]:
        scores, self.last_errors = [], 0
        for sample in samples:
            try:
                value = float(self.score_one(sample))
            except Exception as err:  # a user's reward code may raise anything
                if self.on_error == "raise":
                    raise RewardError(
                        f"{type(self).__name__} raised {type(err).__name__}: {err} on sample "
                        f"(prompt {sample.prompt.source or sample.prompt.index}: {sample.prompt.text!r}, "
                        f"response: {sample.response_text!r}); pass --reward.on_error zero to score such "
                        "samples 0 and go on"
                    ) from err
                self.last_errors += 1
                value = 0.0
            scores.append(value)
        return scores
