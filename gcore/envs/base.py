"""The ``Environment`` contract: what a multi-turn episode asks of the world the model acts in.

An episode starts from one prompt (a data row). The model takes a turn (it generates until its stop
token or the turn's token budget); the environment answers with a ``Turn``: the next observation,
an optional reward for the turn, and whether the episode is done. The episode loop
(``gcore/envs/episodes.py``) runs many episodes at once and keeps the trajectory as token ids: what
the model generated is never re-tokenized, and an observation is tokenized once, as it is appended.
docs/agents.md has the loop, the token rule and how to write an environment.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gcore.errors import ConfigError
from gcore.types import Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class Turn:
    """The environment's answer to one model turn.

    Args:
        observation: what the model sees before its next turn, appended to the trajectory as it
            is: text is tokenized once (no special tokens added, so a chat model's turn markers are
            part of the text), a list of ints is taken as token ids. Ignored when ``done``.
        reward: this turn's reward; an episode's rewards are summed into the trajectory's reward,
            on top of the reward model's score (``--reward none`` for the environment's alone).
        done: the episode ended (a terminal state). An episode cut by ``max_turns`` or
            ``max_tokens`` instead ends as truncated (``Sample.finished`` False).
        metrics: counts to log, summed over the step's episodes as ``env/<name>`` (for example
            ``tool_calls``, ``tool_errors``).
    """

    observation: str | list[int] = ""
    reward: float = 0.0
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


class Environment(ABC):
    """A multi-turn environment: ``reset`` starts an episode from a prompt, ``step`` answers each
    model turn. One object serves all of a controller's episodes at once, so per-episode state lives
    in what ``reset`` returns (handed back to ``step``), not on ``self``.

    ``step`` runs in a thread pool (``workers`` episodes' turns at a time) while the engine goes on
    generating the other episodes' turns; it may also be ``async def``.

    Args:
        max_turns: model turns per episode at most; an episode still going after them is truncated.
        max_tokens: tokens per trajectory after the prompt at most (model and observation tokens;
            0: no total, only ``max_turns`` turns); a trajectory that reaches it is truncated. Each
            turn generates at most ``--sampling.max_new_tokens``.
        workers: episode turns the environment runs at once (threads).
        timeout_s: a ``step`` that does not return in this time ends its episode as an error
            (counted in ``env/errors``; a thread cannot be killed, so it is left to finish).
        overlap: generate the turns of the episodes whose observation is ready while other episodes'
            ``step`` still runs (``false``: every turn waits for all episodes' observations, one
            batch per turn, as a synchronous loop does).
    """

    #: False for ``SingleTurn``: the rollout is one generation per sample, with no episode loop
    multi_turn: bool = True

    def __init__(self, max_turns: int = 4, max_tokens: int = 0, workers: int = 16, timeout_s: float = 120.0,
                 overlap: bool = True) -> None:
        if max_turns < 1 or max_tokens < 0 or workers < 1 or timeout_s <= 0:
            raise ConfigError(f"--env: max_turns and workers must be >= 1, max_tokens >= 0 and timeout_s > 0, got "
                              f"{max_turns}, {workers}, {max_tokens}, {timeout_s}")
        self.max_turns, self.max_tokens, self.workers = max_turns, max_tokens, workers
        self.timeout_s, self.overlap = timeout_s, overlap
        self.tokenizer: PreTrainedTokenizerBase | None = None

    def setup(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Called once per controller before the first episode, with the policy's tokenizer (for an
        environment that renders chat turns). Default: keep it as ``self.tokenizer``."""
        self.tokenizer = tokenizer

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The token ids the episode starts from. Default: the prompt's own (``Prompt.token_ids``);
        a tool environment puts its tools' descriptions before the question."""
        return prompt.token_ids

    def reset(self, prompt: Prompt) -> Any:  # noqa: ANN401  an environment's own episode state
        """Start an episode; returns its state (any object, handed to every ``step`` of the episode).
        Default: a dict with the prompt's answer and metadata."""
        return {"answer": prompt.answer, **prompt.metadata}

    @abstractmethod
    def step(self, state: Any, response: str) -> Turn | Awaitable[Turn]:  # noqa: ANN401  see ``reset``
        """Answer one model turn: ``response`` is its text (special tokens skipped). Returns a ``Turn``
        (or an awaitable of one). A raised exception ends the episode as an error (``env/errors``);
        the trajectory keeps the turns so far."""


class SingleTurn(Environment):
    """The default: no environment. The model answers each prompt once and the reward model scores
    the answer; the rollout is one ``Engine.generate`` per step, with no episode loop."""

    multi_turn = False

    def __init__(self) -> None:
        super().__init__(max_turns=1)

    def step(self, state: Any, response: str) -> Turn:  # noqa: ANN401  unused
        return Turn(done=True)
