"""``reveal``: the embedded multi-turn task's environment, small enough for the tiny default model.

The prompt (``--data.task reveal``) hides the digit: it reads ``?=``. After the model's first turn,
the environment reveals it (observation ``|7=``); the model's second turn is scored by the reward
model (``target_char``: the share of its characters equal to the digit). Only the observation
carries the digit, so a policy that scores has learnt to use what the environment told it.
"""

from __future__ import annotations

from typing import Any

from gcore.envs.base import Environment, Turn
from gcore.errors import DataError
from gcore.types import Prompt


class RevealEnvironment(Environment):
    """Reveals each prompt's answer after the model's first turn; the episode ends after the second.

    Args:
        max_turns: model turns per episode (2: the first, the observation, the answer).
        max_tokens: tokens per trajectory after the prompt (0: no total, only ``max_turns`` turns).
        workers, timeout_s, overlap: as for every environment (``gcore fit --env.help reveal``).
    """

    def __init__(self, max_turns: int = 2, max_tokens: int = 0, workers: int = 4, timeout_s: float = 60.0,
                 overlap: bool = True) -> None:
        super().__init__(max_turns, max_tokens, workers, timeout_s, overlap)

    def reset(self, prompt: Prompt) -> dict[str, Any]:
        if not prompt.answer:
            raise DataError(f"{prompt.source or 'a prompt'}: --env reveal needs an answer (the digit to reveal)")
        return {"answer": prompt.answer, "shown": False}

    def step(self, state: dict[str, Any], response: str) -> Turn:
        if state["shown"]:
            return Turn(done=True)
        state["shown"] = True
        return Turn(observation=f"|{state['answer']}=")
