"""The ``RewardModel`` contract, and the per-sample base class for rule-based rewards."""

from __future__ import annotations

import ctypes
import functools
import math
import numbers
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from gcore.engines.base import Engine
from gcore.errors import ConfigError, RewardError
from gcore.model import ModelSource
from gcore.types import Prompt, Sample
from gcore.user_code import describe, ending_as

#: the default ``--reward.timeout`` of the rule-based rewards, in seconds per sample
DEFAULT_TIMEOUT = 30.0
#: the largest float32: a reward beyond it would be inf in the training batch
FLOAT32_MAX = 3.4028234663852886e38
#: timed-out reward calls that may still run in the background (blocked where Python cannot stop them)
#: before a run stops even with ``--reward.on_error zero``
MAX_STUCK_CALLS = 8


def as_reward(value: object) -> float:
    """``value`` as a reward: a finite real number.

    Numbers (``int``, ``float``, numpy scalars, one-element arrays and tensors) are taken; ``bool``
    is taken as 1.0 / 0.0 (a reward ``answer == target`` is common). Anything else, a numeric string
    such as ``"0.5"`` included, raises ``TypeError`` naming its type; NaN and infinities raise
    ``ValueError``: one would discard the whole step's update. So does a number beyond float32's range (a
    huge Python int, ``1e300``): the training batch holds rewards as float32, where it would be infinite.
    """
    if not isinstance(value, (numbers.Real, str, bytes)) and callable(getattr(value, "item", None)):
        try:
            value = cast(Any, value).item()  # numpy scalars and one-element arrays / tensors
        except (ValueError, RuntimeError):
            pass  # several elements: reported as the wrong type below
    if not isinstance(value, numbers.Real):
        raise TypeError(f"a reward must be a number, got {type(value).__name__} {_short(value)}")
    try:
        result = float(value)
    except OverflowError:  # an int (or Fraction) too large for a float
        raise ValueError(f"a reward must be within float32's range (+-{FLOAT32_MAX:.4g}), got "
                         f"{_short(value)}") from None
    if not math.isfinite(result):
        raise ValueError(f"a reward must be finite, got {result}")
    if abs(result) > FLOAT32_MAX:
        raise ValueError(f"a reward must be within float32's range (+-{FLOAT32_MAX:.4g}), got {result:.4g}")
    return result


def describe_sample(sample: Sample) -> str:
    """``prompt data.jsonl:3: '7=', response: '777'``: where an error message points the user."""
    return (f"prompt {sample.prompt.source or sample.prompt.index}: {sample.prompt.text!r}, "
            f"response: {sample.response_text!r}")


def _short(value: object, limit: int = 60) -> str:
    if isinstance(value, int) and value.bit_length() > 192:  # repr of a huge int is long, or refused (> 4300 digits)
        return f"an int of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    try:
        text = repr(value)
    except Exception as err:  # noqa: BLE001  a user's object whose repr fails is still named
        text = f"<{type(value).__name__} whose repr raised {type(err).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _guarded_score(score: Callable[..., list[float]]) -> Callable[..., list[float]]:
    """``score`` of a ``RewardModel`` whose ``SystemExit``, ``KeyboardInterrupt`` (its own, not a signal's)
    or other ``BaseException`` becomes a ``RewardError`` naming the samples: not an exit 0 with nothing
    saved. Ordinary exceptions pass through with their traceback."""

    @functools.wraps(score)
    def guarded(self: RewardModel, samples: Sequence[Sample]) -> list[float]:
        def error(cause: BaseException) -> RewardError:
            first = f"; the first: {describe_sample(samples[0])}" if samples else ""
            return RewardError(f"{type(self).__name__}.score raised {describe(cause)} on {len(samples)} "
                               f"samples{first}")

        with ending_as(error):
            return score(self, samples)

    guarded.__gcore_guarded__ = True  # type: ignore[attr-defined]
    return guarded


class RewardTimeout(BaseException):
    """Raised inside a reward call that ran past ``--reward.timeout``, to stop it.

    A ``BaseException``, so that the reward's own ``except Exception`` does not swallow it.
    """


_SIGNAL_POLL_S = 0.5
_stuck: list[threading.Thread] = []  # timed-out calls that had not ended when last looked at
_stuck_lock = threading.Lock()


def _stop_thread(thread: threading.Thread) -> None:
    """Raise ``RewardTimeout`` in ``thread`` at its next Python instruction (CPython's
    ``PyThreadState_SetAsyncExc``). Code blocked in C (``time.sleep``, a read without timeout, a lock) sees
    it only when it gets back to Python."""
    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(RewardTimeout))
    with _stuck_lock:
        _stuck[:] = [t for t in _stuck if t.is_alive()]
        _stuck.append(thread)


def _stuck_calls() -> int:
    """How many timed-out reward calls still run (pruning those that have ended)."""
    with _stuck_lock:
        _stuck[:] = [t for t in _stuck if t.is_alive()]
        return len(_stuck)


class _Calls:
    """``fn(item)`` for each item, one after another, in a daemon thread of its own.

    The caller waits in ``wait``, with a deadline per call: a call that does not return in time is
    abandoned (and stopped where Python can stop it). Whatever a call raises, ``BaseException``
    included, is its outcome: signals reach the caller's thread, not this one.
    """

    def __init__(self, fn: Callable[[Sample], object], items: Sequence[Sample], stop_at_error: bool) -> None:
        self.fn, self.items, self.stop_at_error = fn, items, stop_at_error
        self.outcomes: list[tuple[bool, object]] = []  # (returned, value or exception) per finished call
        self.started = time.monotonic()  # when the call of item len(outcomes) began
        self.done = self.abandoned = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="gcore-reward", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for item in self.items:
                outcome: tuple[bool, object]
                try:
                    outcome = (True, self.fn(item))
                except BaseException as err:  # noqa: BLE001  SystemExit, KeyboardInterrupt...: the call's error
                    outcome = (False, err)
                with self.cond:
                    if self.abandoned:
                        return
                    self.outcomes.append(outcome)
                    self.started = time.monotonic()
                    if not outcome[0] and self.stop_at_error:
                        break
            with self.cond:
                self.done = True
                self.cond.notify_all()
        except RewardTimeout:  # stopped after the caller gave up on it
            return

    def wait(self, timeout: float | None) -> tuple[list[tuple[bool, object]], bool]:
        """The outcomes of the calls that finished, and whether the next one ran past ``timeout``."""
        with self.cond:
            while not self.done:
                remaining = math.inf if timeout is None else self.started + timeout - time.monotonic()
                if remaining <= 0:
                    self.abandoned = True
                    return list(self.outcomes), True
                # a signal (Ctrl-C) that the kernel hands to another thread wakes no wait: it is seen here at
                # the latest after a slice, when this thread runs Python again
                self.cond.wait(min(remaining, _SIGNAL_POLL_S))
            return list(self.outcomes), False

    def abandon(self) -> None:
        """Stop waiting for the call in progress, and stop it where Python can."""
        with self.cond:
            if self.done:
                return
            self.abandoned = True
        _stop_thread(self.thread)



@dataclass
class Judge:
    """A judge LLM inside a reward (``RewardModel.judges``): how to build its engine elsewhere.

    A placement policy that runs the judge in engine processes of its own builds a copy of
    ``engine`` (configured, not set up) there from ``source``, and calls ``use`` with the engine that
    reaches those processes, before the reward's ``setup``: the reward then asks that one. ``prepare``, where
    given, makes the judge's checkpoint folder once per run (a ``.gguf`` judge's conversion) under the folder
    it is called with; the trainer calls it in every controller process before any engine starts
    (``prepare_judges``), and ``source`` then names that folder.
    """

    engine: Engine
    source: ModelSource
    use: Callable[[Engine], None]
    prepare: Callable[[str], None] | None = None


def prepare_judges(reward: RewardModel, folder: str) -> None:
    """Let each of ``reward``'s judges make its checkpoint under ``folder`` (``Judge.prepare``)."""
    for judge in reward.judges():
        if judge.prepare is not None:
            judge.prepare(folder)


class RewardModel(ABC):
    """Scores completions: ``score(samples)`` returns one float per sample.

    ``last_errors`` counts the samples whose scoring failed in the last call (summed per step into
    the ``reward/errors`` metric); ``last_error`` describes the first of them (the controller warns
    once per step with it). A reward that asks an LLM judge on an engine of its own says so in
    ``judges``, so that a placement policy can place that engine.
    """

    last_errors: int = 0
    last_error: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:  # noqa: ANN401  as object.__init_subclass__
        super().__init_subclass__(**kwargs)
        score = cls.__dict__.get("score")
        if callable(score) and not getattr(score, "__gcore_guarded__", False):
            cls.score = _guarded_score(score)  # type: ignore[method-assign]

    def setup(self, device) -> None:  # noqa: ANN001 - torch.device; kept untyped to stay light
        """Load whatever the reward needs (a classifier, a judge engine); no-op by default."""

    @abstractmethod
    def score(self, samples: Sequence[Sample]) -> list[float]:
        """One reward per sample."""

    def judges(self) -> list[Judge]:
        """The generative judges this reward asks (none by default; a reward made of other rewards
        returns theirs)."""
        return []

    def judged(self, prompt: Prompt) -> bool:
        """Whether a sample of ``prompt`` is scored by a generative judge: a placement predicts the next
        rollout's judging from it. Default: whether this reward has a judge (a reward that routes prompts
        answers per prompt)."""
        return bool(self.judges())

    def score_part(self, part: RewardModel, samples: Sequence[Sample]) -> list[float]:
        """For a reward made of other rewards: ``part.score(samples)``, checked to give one score per sample,
        with the part's errors added to this reward's ``last_errors`` (and its first kept in ``last_error``)."""
        scores = part.score(samples)
        if len(scores) != len(samples):
            raise RuntimeError(f"{type(part).__name__} returned {len(scores)} scores for {len(samples)} samples")
        self.last_errors += part.last_errors
        self.last_error = self.last_error or part.last_error
        return scores


class RuleReward(RewardModel):
    """A reward computed per sample by plain Python: subclass and implement ``score_one``.

    ``score_one`` must return a finite number within float32's range (``bool`` counts as 1 or 0, see
    ``as_reward``). Each call runs in a worker thread of the reward's own, so that one that never
    returns can be given up on (see docs/failure-modes.md); whatever it raises, ``SystemExit`` and
    ``KeyboardInterrupt`` included, is the reward's error on that sample.

    The options below are every rule reward's, declared here only: a subclass takes its own options and
    passes the rest on with ``**options``, by keyword, so an option added here reaches every rule reward's
    CLI (``--reward.help``) with no other edit.

    Args:
        on_error: ``raise`` stops the run naming the sample whose scoring raised, did not return within
            ``timeout``, or returned a non-number, NaN, an infinity or a number beyond float32; ``zero``
            scores such a sample 0, counts it in the ``reward/errors`` metric and goes on.
        timeout: seconds one sample's scoring may take; a call still running then is an error on that
            sample (and is stopped where Python can stop it). ``0`` or ``None``: no limit.
    """

    #: the defaults, also for a subclass that does not call this ``__init__``
    on_error: Literal["raise", "zero"] = "raise"
    timeout: float | None = DEFAULT_TIMEOUT

    def __init__(self, on_error: Literal["raise", "zero"] = "raise", timeout: float | None = DEFAULT_TIMEOUT) -> None:
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
        if timeout is not None and not timeout >= 0:
            raise ConfigError(f"--reward.timeout must be >= 0 seconds (0: no limit), got {timeout}")
        self.on_error = on_error
        self.timeout = timeout

    @abstractmethod
    def score_one(self, sample: Sample) -> float:
        """The reward of one sample."""

    def score(self, samples: Sequence[Sample]) -> list[float]:
        scores: list[float] = []
        self.last_errors, self.last_error = 0, None
        timeout = self.timeout or None
        stop_at_error = self.on_error == "raise"
        samples = list(samples)
        while len(scores) < len(samples):
            start = len(scores)
            calls = _Calls(self.score_one, samples[start:], stop_at_error)
            try:
                outcomes, timed_out = calls.wait(timeout)
            except BaseException:  # a signal (Ctrl-C, SIGTERM) while waiting: the run stops, and so does the call
                calls.abandon()
                raise
            for sample, (returned, value) in zip(samples[start:], outcomes, strict=False):
                scores.append(self._checked(sample, returned, value))
            if timed_out:
                calls.abandon()
                sample = samples[len(scores)]
                scores.append(self._failed(sample, f"did not return within {timeout:g} s (--reward.timeout)", None))
                if _stuck_calls() >= MAX_STUCK_CALLS:
                    raise RewardError(
                        f"{_stuck_calls()} calls of {type(self).__name__} that ran past --reward.timeout are still "
                        "running (blocked where Python cannot stop them, e.g. in time.sleep or a read without a "
                        f"timeout); the last on sample ({describe_sample(sample)}); stopping the run"
                    )
        return scores

    def _checked(self, sample: Sample, returned: bool, value: object) -> float:
        """The reward of a call that returned ``value`` (or raised it, when not ``returned``)."""
        if not returned:
            err = cast(BaseException, value)
            return self._failed(sample, f"raised {describe(err)}", err)
        try:
            return as_reward(value)
        except (TypeError, ValueError) as err:
            return self._failed(sample, f"returned {_short(value)}: {err}", None)

    def _failed(self, sample: Sample, problem: str, cause: BaseException | None) -> float:
        """Raise naming the sample (``on_error raise``), or count it and score it 0."""
        where = f"{type(self).__name__} {problem} on sample ({describe_sample(sample)})"
        if self.on_error == "raise":
            raise RewardError(f"{where}; pass --reward.on_error zero to score such samples 0 and go on") from cause
        self.last_errors += 1
        if self.last_error is None:
            self.last_error = where
        return 0.0

    score.__gcore_guarded__ = True  # type: ignore[attr-defined]  # each call's BaseException is handled above
