"""The episode loop: many multi-turn episodes at once, kept as token ids (docs/agents.md).

``run_episodes`` takes the engine's ``generate`` and an ``Environment``. The first turn samples ``n``
responses per prompt; from then on each episode continues from its own ids (the prompt, then every
turn's generated ids and every observation's ids, in order) with one sample. The token rule: what
the model generated is kept as the engine returned it (ids and log-probabilities), never decoded and
re-encoded; an observation is tokenized once, when it is appended. So the trainer trains on exactly
the ids and behaviour log-probabilities the engine produced, and ``Sample.response_mask`` tells the
model's tokens (trained) from the observations' (context).

The environment's ``step`` runs in a thread pool. With ``Environment.overlap`` the loop generates for
the episodes whose observation is back while the others' ``step`` is still running, so the engine is
not idle behind one slow tool; ``time/env`` is the time it waited with nothing to generate.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from gcore.envs.base import Environment, Turn
from gcore.errors import ConfigError
from gcore.types import Generation, Prompt, Sample, SamplingParams
from gcore.user_code import describe, ending_as

log = logging.getLogger(__name__)

Generate = Callable[[Sequence[Sequence[int]], SamplingParams], list[list[Generation]]]


class Tokenizer(Protocol):
    """What the loop needs of a tokenizer (a ``transformers`` tokenizer is one)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass
class Episode:
    """One trajectory in the making."""

    prompt: Prompt  # its ``token_ids`` are what the episode started from (``Environment.prompt_ids``)
    group: int
    state: Any
    ids: list[int] = field(default_factory=list)  # after the prompt: model and observation tokens
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0 at observation tokens
    mask: list[int] = field(default_factory=list)  # 1: the model's token, 0: an observation's
    turns: int = 0
    reward: float = 0.0
    last_text: str = ""
    done: bool = False  # the environment ended it
    failed: bool = False  # its environment step raised or timed out
    over: bool = False  # no more turns: done, truncated or failed

    def sample(self, policy_version: int) -> Sample:
        return Sample(prompt=self.prompt, group=self.group, response_ids=self.ids, response_logprobs=self.logprobs,
                      response_text=self.last_text, finished=self.done, policy_version=policy_version,
                      response_mask=self.mask, turns=self.turns, env_reward=self.reward)


@dataclass
class EpisodeStats:
    """What the loop measured, for the step's metrics (summed over the step's rollouts)."""

    generate_s: float = 0.0  # in ``generate`` calls
    env_wait_s: float = 0.0  # waiting for observations with nothing to generate (the engine idle)
    env_busy_s: float = 0.0  # summed ``step`` seconds over episodes (they overlap one another)
    generate_calls: int = 0
    counts: dict[str, float] = field(default_factory=dict)  # env/<name>: turns, errors, truncated, Turn.metrics
    first_error: str | None = None  # the first environment error (logged once per rollout)

    def add(self, name: str, value: float = 1.0) -> None:
        self.counts[name] = self.counts.get(name, 0.0) + value


def run_episodes(env: Environment, generate: Generate, prompts: Sequence[Prompt], sampling: SamplingParams,
                 tokenizer: Tokenizer, first_group: int = 0, policy_version: int = 0,
                 stats: EpisodeStats | None = None) -> list[Sample]:
    """Run ``sampling.n`` episodes per prompt to their end; one ``Sample`` each, in the order of the
    prompts (the ``n`` samples of ``prompts[i]`` form group ``first_group + i``)."""
    stats = stats if stats is not None else EpisodeStats()
    budget = env.max_tokens or sys.maxsize  # 0: turns of at most max_new_tokens, max_turns of them
    starts = [replace(p, token_ids=list(env.prompt_ids(p))) for p in prompts]
    episodes = [Episode(p, first_group + g, env.reset(p)) for g, p in enumerate(starts) for _ in range(sampling.n)]
    if not episodes:
        return []
    pending: dict[Future[tuple[Turn, float]], Episode] = {}
    deadline: dict[Future[tuple[Turn, float]], float] = {}
    pool = ThreadPoolExecutor(max_workers=env.workers, thread_name_prefix="gcore-env")
    try:
        first = _generate(generate, [p.token_ids for p in starts],
                          replace(sampling, max_new_tokens=min(sampling.max_new_tokens, budget)), stats)
        ready: list[Episode] = []
        for episode, generation in zip(episodes, (g for group in first for g in group), strict=True):
            _take_turn(episode, generation, tokenizer)
            _ask(pool, env, episode, pending, deadline)
        while pending or ready:
            if pending:  # take the observations that are back; wait when there is nothing to generate
                waited = time.perf_counter()
                done = _wait(pending, deadline, block=not ready or not env.overlap, everyone=not env.overlap)
                stats.env_wait_s += time.perf_counter() - waited
                for future in done:
                    episode = pending.pop(future)
                    deadline.pop(future, None)
                    if _observe(env, episode, future, tokenizer, budget, stats):
                        ready.append(episode)
                if pending and not env.overlap:
                    continue  # one batch per turn: every episode's observation first
            batch, ready = ready, []
            for tokens, members in _by_budget(batch, sampling.max_new_tokens, budget).items():
                params = replace(sampling, n=1, max_new_tokens=tokens)
                outputs = _generate(generate, [e.prompt.token_ids + e.ids for e in members], params, stats)
                for episode, group in zip(members, outputs, strict=True):
                    _take_turn(episode, group[0], tokenizer)
                    _ask(pool, env, episode, pending, deadline)
    finally:  # a step past its deadline keeps its thread; nobody waits for it
        pool.shutdown(wait=False, cancel_futures=True)
    samples = [e.sample(policy_version) for e in episodes]
    stats.add("episodes", len(episodes))
    stats.add("turns", sum(e.turns for e in episodes))
    stats.add("truncated", sum(not e.done and not e.failed for e in episodes))  # cut by max_turns or max_tokens
    if stats.first_error:  # one line per rollout, however many episodes failed
        log.warning("%d episode(s) ended on an environment error, their turns so far kept (env/errors); the "
                    "first: %s", sum(e.failed for e in episodes), stats.first_error)
    return samples


def _generate(generate: Generate, prompts: list[list[int]], params: SamplingParams,
              stats: EpisodeStats) -> list[list[Generation]]:
    started = time.perf_counter()
    outputs = generate(prompts, params)
    stats.generate_s += time.perf_counter() - started
    stats.generate_calls += 1
    return outputs


def _take_turn(episode: Episode, generation: Generation, tokenizer: Tokenizer) -> None:
    """Append the model's turn exactly as the engine produced it."""
    episode.ids += generation.token_ids
    episode.logprobs += generation.logprobs
    episode.mask += [1] * len(generation.token_ids)
    episode.turns += 1
    episode.last_text = str(tokenizer.decode(generation.token_ids, skip_special_tokens=True))


def _ask(pool: ThreadPoolExecutor, env: Environment, episode: Episode,
         pending: dict[Future[tuple[Turn, float]], Episode], deadline: dict[Future[tuple[Turn, float]], float]) -> None:
    """Send the episode's last turn to the environment (in the pool), unless the episode is over."""
    if episode.over:
        return
    future = pool.submit(_step, env, episode.state, episode.last_text)
    pending[future] = episode
    deadline[future] = time.monotonic() + env.timeout_s


class StepError(Exception):
    """An environment's ``step`` ended with a ``BaseException`` (``SystemExit``, ``KeyboardInterrupt`` raised by
    its own code: signals reach the main thread, not this one); an error of that episode, not of the run."""


def _step(env: Environment, state: Any, text: str) -> tuple[Turn, float]:  # noqa: ANN401  the episode's state
    started = time.perf_counter()
    with ending_as(lambda cause: StepError(describe(cause))):  # its episode's error, counted
        turn = env.step(state, text)
        if inspect.isawaitable(turn):
            turn = asyncio.run(_await(turn))
    return turn, time.perf_counter() - started


async def _await(awaitable: Any) -> Any:  # noqa: ANN401  whatever the environment's coroutine returns
    return await awaitable


def _wait(pending: dict[Future[tuple[Turn, float]], Episode], deadline: dict[Future[tuple[Turn, float]], float],
          block: bool, everyone: bool) -> list[Future[tuple[Turn, float]]]:
    """The environment steps that are done (or past their deadline): at once when ``block`` is
    false; else at least one, or all of them when ``everyone``."""
    if not block:
        return [f for f in pending if f.done()]
    timeout = max(min(deadline.values()) - time.monotonic(), 0.0) if deadline else None
    done, _ = wait(list(pending), timeout=timeout, return_when="ALL_COMPLETED" if everyone else FIRST_COMPLETED)
    now = time.monotonic()
    late = [f for f in pending if f not in done and deadline.get(f, now + 1) <= now]
    return [*done, *late]


def _observe(env: Environment, episode: Episode, future: Future[tuple[Turn, float]], tokenizer: Tokenizer,
             budget: int, stats: EpisodeStats) -> bool:
    """Take the environment's answer to the episode's turn; True when the episode goes on."""
    name = type(env).__name__
    if not future.done():
        stats.add("errors")
        stats.add("timeouts")
        late = f"{name}.step did not return within --env.timeout_s {env.timeout_s:g} s"
        stats.first_error = stats.first_error or late
        episode.over = episode.failed = True
        return False
    try:
        turn, seconds = future.result()
    except Exception as err:  # noqa: BLE001  an environment's error ends its episode, counted, not the run
        stats.add("errors")
        stats.first_error = stats.first_error or f"{name}.step raised {type(err).__name__}: {err}"
        episode.over = episode.failed = True
        return False
    if not isinstance(turn, Turn):
        raise ConfigError(f"--env {type(env).__module__}.{name}: step returned {type(turn).__name__}, not a "
                          "gcore.envs.Turn")
    stats.env_busy_s += seconds
    stats.add("steps")
    for key, value in turn.metrics.items():
        stats.add(key, float(value))
    episode.reward += float(turn.reward)
    if turn.done:
        episode.done = episode.over = True
        return False
    observation = _observation_ids(env, turn.observation, tokenizer)
    if episode.turns >= env.max_turns or len(episode.ids) + len(observation) >= budget:
        episode.over = True  # truncated: no room for another turn
        return False
    episode.ids += observation
    episode.logprobs += [0.0] * len(observation)
    episode.mask += [0] * len(observation)
    return True


def _observation_ids(env: Environment, observation: object, tokenizer: Tokenizer) -> list[int]:
    if isinstance(observation, str):
        return list(tokenizer.encode(observation, add_special_tokens=False))
    if isinstance(observation, list) and all(isinstance(t, int) for t in observation):
        return observation
    raise ConfigError(f"--env {type(env).__module__}.{type(env).__name__}: a Turn's observation must be a str or a "
                      f"list of token ids, got {type(observation).__name__}")


def _by_budget(episodes: list[Episode], max_new_tokens: int, budget: int) -> dict[int, list[Episode]]:
    """The episodes ready for a turn, grouped by the tokens their turn may generate."""
    groups: dict[int, list[Episode]] = {}
    for episode in episodes:
        groups.setdefault(min(max_new_tokens, budget - len(episode.ids)), []).append(episode)
    return groups
