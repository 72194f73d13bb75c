"""``reveal``: the embedded multi-turn task's environment, small enough for the tiny default model.

The prompt (``--data.task reveal``) hides the digit: it reads ``?=``. After the model's first turn,
the environment reveals it (observation ``|77777777=``); the model's second turn is scored by the
reward model (``target_char``: the share of its characters equal to the digit). Only the
observation carries the digit, so a policy that scores more than a constant digit's 0.1 has learnt
to use what the environment told it.

The digit is written ``repeat`` times: the randomly initialised tiny model does not learn, within a
test's 60 steps, to find one digit after its first turn's random characters (with the digit once:
mean reward 0.09 after 60 steps, the same as an observation without the digit), while with 8 copies
it reaches about 0.3 (tests/envs/test_reveal_learning.py has the measured spread).
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
        workers, timeout_s: as for every environment, with smaller defaults for the tiny task.
        options: ``Environment``'s other options, by keyword (``gcore fit --env.help reveal`` lists them all).
    """

    def __init__(self, *, max_turns: int = 2, repeat: int = 8, workers: int = 4, timeout_s: float = 60.0,
                 **options: Any) -> None:  # noqa: ANN401  Environment's other arguments, checked there
        super().__init__(max_turns=max_turns, workers=workers, timeout_s=timeout_s, **options)
        if repeat < 1:
            raise ConfigError(f"--env.repeat must be >= 1, got {repeat}")
        self.repeat = repeat

    def reset(self, prompt: Prompt) -> dict[str, Any]:
        if not prompt.answer:
            raise DataError(f"{prompt.source or 'a prompt'}: --env reveal needs an answer (the digit to reveal)")
        return {"answer": prompt.answer, "shown": False}

    def step(self, state: dict[str, Any], response: str) -> Turn:
        if state["shown"]:
            return Turn(done=True)
        state["shown"] = True
        return Turn(observation=f"|{state['answer'] * self.repeat}=")
