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
from typing import TYPE_CHECKING, Any, Literal

from gcore.errors import ConfigError
from gcore.types import Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


#: ``--env.max_observation_chars``: one observation's text at most (a tool's whole output, a page of text)
DEFAULT_MAX_OBSERVATION_CHARS = 100_000
#: ``--env.max_observation_tokens``: an episode's observation tokens at most (beyond most models' context)
DEFAULT_MAX_OBSERVATION_TOKENS = 32_768


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

    ``reset`` and ``step`` run ``workers`` at a time while the engine goes on generating the other
    episodes' turns, by default each in a child process (``isolation``); ``step`` may be ``async def``.

    The options below are every environment's, declared here only: a subclass takes its own options,
    re-declares one of these only where it gives it another default, and passes the rest on with
    ``**options``, by keyword, so an option added here reaches every environment's CLI (``--env.help``)
    with no other edit.

    Args:
        max_turns: model turns per episode at most; an episode still going after them is truncated.
        max_tokens: tokens per trajectory after the prompt at most (model and observation tokens;
            0: no total, only ``max_turns`` turns); a trajectory that reaches it is truncated. Each
            turn generates at most ``--sampling.max_new_tokens``.
        workers: episode calls (``reset``, ``step``) the environment runs at once.
        timeout_s: a ``reset`` or ``step`` that does not return in this time ends its episode as an
            error (counted in ``env/errors`` and ``env/timeouts``); with ``isolation process`` its
            process is killed.
        overlap: generate the turns of the episodes whose observation is ready while other episodes'
            ``step`` still runs (``false``: every turn waits for all episodes' observations, one
            batch per turn, as a synchronous loop does).
        isolation: where ``reset`` and ``step`` run: ``process`` (child processes of the controller,
            up to ``workers``; the environment and each episode's state are pickled to them, and a
            call past ``timeout_s`` is killed with its process) or ``thread`` (threads of the
            controller: no pickling, shared objects, but a call past ``timeout_s`` is only
            abandoned and keeps running). An environment class defined in ``__main__`` runs in
            threads.
        max_observation_chars: a text observation longer than this ends its episode as an error
            (``env/errors``, ``env/oversized``), before it is tokenized (0: no limit).
        max_observation_tokens: observation tokens per episode at most (text observations
            tokenized, token-id ones as given); the observation that would pass it ends its
            episode as an error (``env/errors``, ``env/oversized``) (0: no limit).
    """

    #: False for ``SingleTurn``: the rollout is one generation per sample, with no episode loop
    multi_turn: bool = True

    def __init__(self, max_turns: int = 4, max_tokens: int = 0, workers: int = 16, timeout_s: float = 120.0,
                 overlap: bool = True, isolation: Literal["process", "thread"] = "process",
                 max_observation_chars: int = DEFAULT_MAX_OBSERVATION_CHARS,
                 max_observation_tokens: int = DEFAULT_MAX_OBSERVATION_TOKENS) -> None:
        if max_turns < 1 or max_tokens < 0 or workers < 1 or timeout_s <= 0:
            raise ConfigError(f"--env: max_turns and workers must be >= 1, max_tokens >= 0 and timeout_s > 0, got "
                              f"{max_turns}, {workers}, {max_tokens}, {timeout_s}")
        if isolation not in ("process", "thread"):
            raise ConfigError(f"--env.isolation {isolation!r}: valid choices: process, thread")
        if max_observation_chars < 0 or max_observation_tokens < 0:
            raise ConfigError(f"--env.max_observation_chars and --env.max_observation_tokens must be >= 0 (0: no "
                              f"limit), got {max_observation_chars}, {max_observation_tokens}")
        self.max_turns, self.max_tokens, self.workers = max_turns, max_tokens, workers
        self.timeout_s, self.overlap, self.isolation = timeout_s, overlap, isolation
        self.max_observation_chars, self.max_observation_tokens = max_observation_chars, max_observation_tokens
        self.tokenizer: PreTrainedTokenizerBase | None = None

    def __getstate__(self) -> dict[str, Any]:
        """What is pickled to the environment's own processes: not the controller's handle on them."""
        state = dict(self.__dict__)
        state.pop("_runner", None)
        return state

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
