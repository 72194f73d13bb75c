"""``math`` reward: final-answer equivalence through the math-verify package."""

from __future__ import annotations

import re
from typing import Any

from gcore.errors import ConfigError
from gcore.rewards.base import RuleReward
from gcore.types import Sample

_ANSWER_IS = re.compile(r"answer is[:\s]*\$?([^\n$]+?)\$?\s*(?:\.\s|\.?$|\n)", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{") - 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def final_answer(text: str) -> str | None:
    """The response's final answer: the last ``\\boxed{}``, else what follows the last "answer is"."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    hits = _ANSWER_IS.findall(text)
    return hits[-1].strip() if hits else None


class MathReward(RuleReward):
    """``correct_score`` when the response's final answer equals the reference answer mathematically.

    The final answer is the last ``\\boxed{...}`` or, failing that, the text after "the answer is";
    equivalence (``1/2`` vs ``0.5``, ``\\frac{1}{2}``, sets, intervals) is decided by math-verify.
    A response with no final answer scores ``missing_score``.
    """

    def __init__(
        self,
        correct_score: float = 1.0,
        wrong_score: float = 0.0,
        missing_score: float = 0.0,
        **options: Any,  # noqa: ANN401  RuleReward's arguments, checked there
    ) -> None:
        super().__init__(**options)
        try:
            import math_verify  # noqa: F401
        except ImportError as err:
            raise ConfigError("--reward math needs the math-verify package: pip install 'gcore[math]'") from err
        self.correct_score, self.wrong_score, self.missing_score = correct_score, wrong_score, missing_score
        if self.timeout:  # math-verify's own timeouts need the main thread (SIGALRM); --reward.timeout stands in
            _quiet_math_verify_timeout_warning()

    def score_one(self, sample: Sample) -> float:
        if sample.prompt.answer is None:
            raise ValueError("the math reward needs an 'answer' for every prompt")
        answer = final_answer(sample.response_text)
        if answer is None:
            return self.missing_score
        return self.correct_score if answers_match(answer, sample.prompt.answer) else self.wrong_score


def _quiet_math_verify_timeout_warning() -> None:
    """math-verify warns once that it runs without a timeout when called off the main thread: the rule
    rewards' calls run in a worker thread of their own, bounded by ``--reward.timeout`` instead."""
    import math_verify.grader
    import math_verify.parser

    for module in (math_verify.parser, math_verify.grader):
        if hasattr(module, "TIMEOUT_WARNING_SHOWN"):
            module.TIMEOUT_WARNING_SHOWN = True


def answers_match(answer: str, reference: str) -> bool:
    """Whether two final answers are mathematically equal according to math-verify."""
    import threading

    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which works only in the main thread; a rule reward's calls run in
    # a worker thread, bounded by --reward.timeout
    timeout = 5 if threading.current_thread() is threading.main_thread() else None

    def parsed(text: str):  # noqa: ANN202
        return parse(f"${text}$", parsing_timeout=timeout) or parse(text, parsing_timeout=timeout)

    gold, guess = parsed(reference), parsed(answer)
    if not gold or not guess:
        return answer.strip() == reference.strip()
    return bool(verify(gold, guess, timeout_seconds=timeout))
