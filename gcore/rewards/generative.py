"""``generative`` reward: an LLM judge (GenRM) on an ``Engine`` of its own."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from typing import Any, Literal

import torch

from gcore.engines.base import Engine
from gcore.errors import ConfigError, RewardError
from gcore.model import ModelSource
from gcore.rewards.base import Judge, RewardModel
from gcore.types import Sample, SamplingParams

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    "Question: {prompt}\nReference answer: {answer}\nResponse: {response}\n"
    "Is the response correct? Answer yes or no.\nVerdict:"
)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def parse_verdict(text: str, verdict: Literal["yes_no", "score"], max_score: float) -> float | None:
    """The judge's reward in [0, 1] from its text, or None when it cannot be parsed."""
    if verdict == "yes_no":
        hit = _YES_NO.search(text)
        return None if hit is None else float(hit.group(1).lower() == "yes")
    hit = _NUMBER.search(text)
    if hit is None:
        return None
    value = float(hit.group(0))
    return value / max_score if 0 <= value <= max_score else None


class GenerativeReward(RewardModel):
    """Asks a judge LLM about each sample and parses its verdict into a reward.

    Args:
        path: local checkpoint directory of the judge (with its tokenizer).
        engine: the engine that runs the judge (``hf`` on CPU).
        template: the judge prompt; ``{prompt}``, ``{response}`` and ``{answer}`` are filled in.
        verdict: ``yes_no`` (yes -> 1, no -> 0) or ``score`` (a number in ``[0, max_score]``, scaled to [0, 1]).
        max_score: the top of the judge's score scale.
        max_new_tokens: the judge's generation budget.
        batch_size: samples per judge call.
        unparsable_score: the reward of a sample whose verdict cannot be parsed (counted in
            ``reward/errors``; the controller warns once per step with the first such verdict);
            ``None`` fails the step instead.
        retries: attempts again on a judge call that raises before the step fails.
        timeout_s: a judge call slower than this counts as failed (checked after it returns).
    """

    def __init__(
        self,
        path: str,
        engine: Engine | None = None,
        template: str = DEFAULT_TEMPLATE,
        verdict: Literal["yes_no", "score"] = "yes_no",
        max_score: float = 10.0,
        max_new_tokens: int = 8,
        batch_size: int = 16,
        unparsable_score: float | None = 0.0,
        retries: int = 1,
        timeout_s: float = 0.0,
        trust_remote_code: bool = False,
    ) -> None:
        if verdict not in ("yes_no", "score"):
            raise ConfigError(f"--reward.verdict must be 'yes_no' or 'score', got {verdict!r}")
        if "{response}" not in template:
            raise ConfigError("--reward.template must contain {response}")
        if batch_size <= 0 or max_new_tokens <= 0 or retries < 0:
            raise ConfigError("--reward.batch_size and max_new_tokens must be positive, retries >= 0")
        from gcore.engines.hf import HFEngine

        self.path, self.engine = path, engine or HFEngine()
        self.template, self.verdict, self.max_score = template, verdict, max_score
        self.params = SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=0.0)
        self.batch_size, self.unparsable_score = batch_size, unparsable_score
        self.retries, self.timeout_s, self.trust_remote_code = retries, timeout_s, trust_remote_code
        self.tokenizer: Any = None  # a transformers tokenizer once set up
        self.last_unparsable = 0
        self.last_judge_tokens = 0

    @property
    def source(self) -> ModelSource:
        """The judge checkpoint (loaded in float32)."""
        return ModelSource(self.path, torch.float32, self.trust_remote_code)

    def setup(self, device) -> None:  # noqa: ANN001
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.engine.setup(self.source, device)

    def judges(self) -> list[Judge]:
        """This reward's judge: a placement policy may run it on engine workers of its own."""
        return [Judge(self.engine, self.source, self._use_engine)]

    def _use_engine(self, engine: Engine) -> None:
        self.engine = engine

    def judge_prompt(self, sample: Sample) -> str:
        return self.template.format(prompt=sample.prompt.text, response=sample.response_text,
                                    answer=sample.prompt.answer or "")

    def _judge(self, prompts: list[list[int]]) -> list[str]:
        """One judge call with retries; raises ``RewardError`` when every attempt failed."""
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            started = time.perf_counter()
            try:
                outs = self.engine.generate(prompts, self.params)
            except Exception as err:  # noqa: BLE001  the judge engine may fail in any way; retry then report
                last = err
                log.warning("judge call failed (attempt %d/%d): %s", attempt + 1, self.retries + 1, err)
                continue
            elapsed = time.perf_counter() - started
            if self.timeout_s and elapsed > self.timeout_s:
                last = TimeoutError(f"judge call took {elapsed:.1f}s > timeout_s {self.timeout_s}s")
                log.warning("judge call timed out (attempt %d/%d)", attempt + 1, self.retries + 1)
                continue
            if len(outs) != len(prompts):
                raise RewardError(f"judge engine returned {len(outs)} verdicts for {len(prompts)} samples")
            self.last_judge_tokens += sum(len(o[0].token_ids) for o in outs)
            return [self.tokenizer.decode(o[0].token_ids, skip_special_tokens=True) for o in outs]
        raise RewardError(
            f"the generative judge failed {self.retries + 1} times on a batch of {len(prompts)} samples: "
            f"{type(last).__name__}: {last}; no reward was given to them"
        )

    def score(self, samples: Sequence[Sample]) -> list[float]:
        if self.tokenizer is None:
            self.setup(None)
        self.last_errors = self.last_unparsable = self.last_judge_tokens = 0
        self.last_error = None
        scores: list[float] = []
        for start in range(0, len(samples), self.batch_size):
            chunk = samples[start : start + self.batch_size]
            prompts = [self.tokenizer(self.judge_prompt(s))["input_ids"] for s in chunk]
            for sample, text in zip(chunk, self._judge(prompts), strict=False):
                value = parse_verdict(text, self.verdict, self.max_score)
                if value is None:
                    self.last_unparsable += 1
                    if self.unparsable_score is None:
                        raise RewardError(
                            f"unparsable judge verdict {text!r} for prompt "
                            f"{sample.prompt.source or sample.prompt.index}; "
                            "set --reward.unparsable_score to score such samples and go on"
                        )
                    if self.last_error is None:  # no log line per sample: reward/errors counts them
                        where, score = sample.prompt.source or sample.prompt.index, self.unparsable_score
                        self.last_error = f"unparsable judge verdict {text!r} for prompt {where}, scored {score}"
                    value = self.unparsable_score
                    sample.reward_info["judge_unparsable"] = 1.0
                scores.append(float(value))
        self.last_errors = self.last_unparsable
        return scores
