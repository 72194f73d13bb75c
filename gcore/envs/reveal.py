"""``reveal``: the embedded multi-turn task's environment, small enough for the tiny default model.

The prompt hides the digit: it reads ``?=`` (the ``reveal`` task's prompt as it is; any other task's
prompt with its answer replaced by ``?``, so ``gcore fit --env reveal`` on the default task starts from
``?=`` too). After the model's first turn, the environment reveals it (observation ``|777...7=``, the digit
``repeat`` times); the model's second turn is scored by the reward model (``target_char``: the share of its
characters equal to the digit). Only the observation carries the digit, so a policy that scores more than a
constant digit's 0.1 has learnt to use what the environment told it; ``--env.show false`` is that control.

The digit is written ``repeat`` times (default 32) so that the randomly initialised tiny model learns it
within the default 30 steps: with 8 copies, ``gcore fit --env reveal`` ended at a last-10 mean reward of
0.08-0.10, no better than the control, and only took off after step 40 (tests/envs/test_reveal_learning.py
has the measured spread of both).
"""

from __future__ import annotations

from typing import Any

from gcore.envs.base import Environment, Turn
from gcore.errors import ConfigError, DataError
from gcore.types import Prompt


class RevealEnvironment(Environment):
    """Reveals each prompt's answer after the model's first turn; the episode ends after the second.

    Args:
        max_turns: model turns per episode (2: the first, the observation, the answer).
        repeat: copies of the digit in the observation.
        show: ``false`` is the control: the observation shows ``?`` in place of the digit, so what a run
            scores then is what a policy that ignores the environment can score (a constant digit: 0.1).
        workers, timeout_s: as for every environment, with smaller defaults for the tiny task.
        options: ``Environment``'s other options, by keyword (``gcore fit --env.help reveal`` lists them all).
    """

    def __init__(self, *, max_turns: int = 2, repeat: int = 32, show: bool = True, workers: int = 4,
                 timeout_s: float = 60.0, **options: Any) -> None:  # noqa: ANN401  Environment's other arguments, checked there
        super().__init__(max_turns=max_turns, workers=workers, timeout_s=timeout_s, **options)
        if repeat < 1:
            raise ConfigError(f"--env.repeat must be >= 1, got {repeat}")
        self.repeat = repeat
        self.show = show

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt with its answer hidden: every occurrence of the answer's tokens becomes ``?``'s, so the
        embedded task's ``?=`` is kept as it is and another task's prompt (the default ``7=``) reads ``?=`` too:
        only the observation tells the model the digit."""
        ids = list(prompt.token_ids)
        if self.tokenizer is None or not prompt.answer:
            return ids
        answer = list(self.tokenizer.encode(prompt.answer, add_special_tokens=False))
        hidden = list(self.tokenizer.encode("?" * len(prompt.answer), add_special_tokens=False))
        out, i = [], 0
        while i < len(ids):
            if answer and ids[i:i + len(answer)] == answer:
                out += hidden
                i += len(answer)
            else:
                out.append(ids[i])
                i += 1
        return out

    def reset(self, prompt: Prompt) -> dict[str, Any]:
        if not prompt.answer:
            raise DataError(f"{prompt.source or 'a prompt'}: --env reveal needs an answer (the digit to reveal)")
        return {"answer": prompt.answer, "shown": False}

    def step(self, state: dict[str, Any], response: str) -> Turn:
        if state["shown"]:
            return Turn(done=True)
        state["shown"] = True
        shown = state["answer"] if self.show else "?" * len(state["answer"])
        return Turn(observation=f"|{shown * self.repeat}=")
