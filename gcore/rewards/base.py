"""The ``RewardModel`` contract, and the per-sample base class for rule-based rewards."""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from gcore.engines.base import Engine
from gcore.errors import RewardError
from gcore.model import ModelSource
from gcore.types import Sample


def as_reward(value: object) -> float:
    """``value`` as a reward: a finite real number.

    Numbers (``int``, ``float``, numpy scalars, one-element arrays and tensors) are taken; ``bool``
    is taken as 1.0 / 0.0 (a reward ``answer == target`` is common). Anything else, a numeric string
    such as ``"0.5"`` included, raises ``TypeError`` naming its type; NaN and infinities raise
    ``ValueError``: one would discard the whole step's update.
    """
    if not isinstance(value, (numbers.Real, str, bytes)) and callable(getattr(value, "item", None)):
        try:
            value = cast(Any, value).item()  # numpy scalars and one-element arrays / tensors
        except (ValueError, RuntimeError):
            pass  # several elements: reported as the wrong type below
    if not isinstance(value, numbers.Real):
        raise TypeError(f"a reward must be a number, got {type(value).__name__} {_short(value)}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"a reward must be finite, got {result}")
    return result


def describe_sample(sample: Sample) -> str:
    """``prompt data.jsonl:3: '7=', response: '777'``: where an error message points the user."""
    return (f"prompt {sample.prompt.source or sample.prompt.index}: {sample.prompt.text!r}, "
            f"response: {sample.response_text!r}")


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class Judge:
    """A judge LLM inside a reward (``RewardModel.judges``): how to build its engine elsewhere.

    A placement policy that runs the judge in engine processes of its own builds a copy of
    ``engine`` (configured, not set up) there from ``source``, and calls ``use`` with the engine that
    reaches those processes, before the reward's ``setup``: the reward then asks that one.
    """

    engine: Engine
    source: ModelSource
    use: Callable[[Engine], None]


class RewardModel(ABC):
    """Scores completions: ``score(samples)`` returns one float per sample.

    ``last_errors`` counts the samples whose scoring failed in the last call (summed per step into
    the ``reward/errors`` metric); ``last_error`` describes the first of them (the controller warns
    once per step with it). A reward that asks an LLM judge on an engine of its own says so in
    ``judges``, so that a placement policy can place that engine.
    """

    last_errors: int = 0
    last_error: str | None = None

    def setup(self, device) -> None:  # noqa: ANN001 - torch.device; kept untyped to stay light
        """Load whatever the reward needs (a classifier, a judge engine); no-op by default."""

    @abstractmethod
    def score(self, samples: Sequence[Sample]) -> list[float]:
        """One reward per sample."""

    def judges(self) -> list[Judge]:
        """The generative judges this reward asks (none by default; a reward made of other rewards
        returns theirs)."""
        return []


class RuleReward(RewardModel):
    """A reward computed per sample by plain Python: subclass and implement ``score_one``.

    ``score_one`` must return a finite number (``bool`` counts as 1 or 0, see ``as_reward``).

    Args:
        on_error: ``raise`` stops the run naming the sample whose scoring raised or returned a
            non-number, NaN or an infinity; ``zero`` scores such a sample 0, counts it in the
            ``reward/errors`` metric and goes on.
    """

    def __init__(self, on_error: Literal["raise", "zero"] = "raise") -> None:
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
        self.on_error = on_error

    @abstractmethod
    def score_one(self, sample: Sample) -> float:
        """The reward of one sample."""

    def score(self, samples: Sequence[Sample]) -> list[float]:
        scores, self.last_errors, self.last_error = [], 0, None
        for sample in samples:
            cause: Exception | None = None
            try:
                returned = self.score_one(sample)
            except Exception as err:  # noqa: BLE001  a user's reward code may raise anything
                problem, cause = f"raised {type(err).__name__}: {err}", err
            else:
                try:
                    scores.append(as_reward(returned))
                    continue
                except (TypeError, ValueError) as err:
                    problem = f"returned {_short(returned)}: {err}"
            if self.on_error == "raise":
                raise RewardError(
                    f"{type(self).__name__} {problem} on sample ({describe_sample(sample)}); pass "
                    "--reward.on_error zero to score such samples 0 and go on"
                ) from cause
            self.last_errors += 1
            if self.last_error is None:
                self.last_error = f"{type(self).__name__} {problem} on sample ({describe_sample(sample)})"
            scores.append(0.0)
        return scores
