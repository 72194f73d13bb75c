"""The episode loop: many multi-turn episodes at once, kept as token ids (docs/agents.md).

``run_episodes`` takes the engine's ``generate`` and an ``Environment``. The first turn samples ``n``
responses per prompt; from then on each episode continues from its own ids (the prompt, then every
turn's generated ids and every observation's ids, in order) with one sample. The token rule: what
the model generated is kept as the engine returned it (ids and log-probabilities), never decoded and
re-encoded; an observation is tokenized once, when it is appended. So the trainer trains on exactly
the ids and behaviour log-probabilities the engine produced, and ``Sample.response_mask`` tells the
model's tokens (trained) from the observations' (context). A turn cut at the token budget (the engine's
generation unfinished) is closed before its observation with the tokens that close an assistant turn
(``turn_end_ids``: the chat template's end-of-turn token, or the EOS), as context (mask 0): the
observation follows a closed turn whether the model ended it or the budget did.

The environment's ``reset`` and ``step`` run on ``workers`` threads, each call in a child process of
its own by default (``--env.isolation process``, ``gcore/envs/isolation.py``: a call past
``--env.timeout_s`` is killed with its process). With ``Environment.overlap`` the loop generates for
the episodes whose observation is back while the others' ``step`` is still running, so the engine is
not idle behind one slow tool; ``time/env`` is the time it waited with nothing to generate.

What an environment returns is checked before it reaches the engine or the reward: a turn's reward
as a reward model's is (a finite number within float32's range; else the run stops in one line
naming the environment and the episode), observation token ids against the vocabulary (the run
stops), and an observation's size (``--env.max_observation_chars`` per observation,
``--env.max_observation_tokens`` per episode; over either, the episode ends as an error, counted in
``env/errors`` and ``env/oversized``, and the run goes on).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from gcore.envs.base import Environment, Turn
from gcore.envs.isolation import CallFailed, CallPool, CallTimeout, ProcessRunner, run_call
from gcore.errors import ConfigError, GcoreError, RewardError
from gcore.rewards.base import as_reward
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
    number: int = 0  # which of its prompt's ``n`` episodes (from 0), for messages
    of: int = 1  # its prompt's episodes
    ids: list[int] = field(default_factory=list)  # after the prompt: model and observation tokens
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0 at observation tokens
    mask: list[int] = field(default_factory=list)  # 1: the model's token, 0: an observation's
    #: partial rollouts: the weight updates the engine had loaded since the rollout started when it sampled each
    #: token (``Generation.versions``, counted from the rollout's start); an observation's tokens take the version
    #: of the turn before them (they are context, mask 0)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    last_text: str = ""
    done: bool = False  # the environment ended it
    failed: bool = False  # its environment step raised or timed out
    over: bool = False  # no more turns: done, truncated or failed
    observed: int = 0  # observation tokens appended so far (``--env.max_observation_tokens``)
    closing: list[int] = field(default_factory=list)  # ``turn_end_ids``: what closes a turn cut at the budget
    cut: bool = False  # its last turn was cut at the token budget (unfinished): closed before the observation
    metrics: dict[str, float] = field(default_factory=dict)  # its turns' ``Turn.metrics``, summed

    def where(self) -> str:
        return where(self.prompt, self.number, self.of)

    def sample(self, policy_version: int) -> Sample:
        # partial rollouts: a token sampled after the engine loaded k updates is k versions newer, across turns
        newer = any(self.versions)
        return Sample(prompt=self.prompt, group=self.group, response_ids=self.ids, response_logprobs=self.logprobs,
                      response_text=self.last_text, finished=self.done, policy_version=policy_version,
                      response_mask=self.mask, turns=self.turns, env_reward=self.reward, env_metrics=dict(self.metrics),
                      token_versions=[policy_version + v for v in self.versions] if newer else None)


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

    def error(self, message: str, timeout: bool = False, kind: str = "") -> None:
        """An episode ended as an error: counted in ``env/errors`` (and ``env/timeouts``, ``env/<kind>``)."""
        self.add("errors")
        if timeout:
            self.add("timeouts")
        if kind:
            self.add(kind)
        self.first_error = self.first_error or message


def run_episodes(env: Environment, generate: Generate, prompts: Sequence[Prompt], sampling: SamplingParams,
                 tokenizer: Tokenizer, first_group: int = 0, policy_version: int = 0,
                 stats: EpisodeStats | None = None) -> list[Sample]:
    """Run ``sampling.n`` episodes per prompt to their end; one ``Sample`` each, in the order of the
    prompts (the ``n`` samples of ``prompts[i]`` form group ``first_group + i``)."""
    stats = stats if stats is not None else EpisodeStats()
    own = getattr(env, "run_episodes", None)
    if own is not None:  # an environment that drives its episodes itself (openai_agent: the agent calls the policy)
        return list(own(generate, prompts, sampling, tokenizer, first_group, policy_version, stats))
    budget = env.max_tokens or sys.maxsize  # 0: turns of at most max_new_tokens, max_turns of them
    starts = [replace(p, token_ids=list(env.prompt_ids(p))) for p in prompts]
    closing = turn_end_ids(tokenizer)
    episodes = [Episode(p, first_group + g, None, number=k, of=sampling.n, closing=closing)
                for g, p in enumerate(starts) for k in range(sampling.n)]
    if not episodes:
        return []
    runner = env_runner(env)
    pending: dict[Future[tuple[Any, float]], Episode] = {}
    deadline: dict[Future[tuple[Any, float]], float] = {}
    pool = CallPool(env.workers)
    try:
        _reset(pool, env, runner, episodes, stats)
        first = _generate(generate, [p.token_ids for p in starts],
                          replace(sampling, max_new_tokens=min(sampling.max_new_tokens, budget)), stats)
        ready: list[Episode] = []
        for episode, generation in zip(episodes, (g for group in first for g in group), strict=True):
            _take_turn(episode, generation, tokenizer)
            _ask(pool, env, runner, episode, pending, deadline)
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
                    _ask(pool, env, runner, episode, pending, deadline)
    finally:  # a thread-mode step past its deadline keeps its (daemon) thread; nobody waits for it
        pool.shutdown()
    samples = [e.sample(policy_version) for e in episodes]
    stats.add("episodes", len(episodes))
    stats.add("turns", sum(e.turns for e in episodes))
    stats.add("truncated", sum(not e.done and not e.failed for e in episodes))  # cut by max_turns or max_tokens
    if stats.first_error:  # one line per rollout, however many episodes failed
        log.warning("%d episode(s) ended on an environment error, their turns so far kept (env/errors); the "
                    "first: %s", sum(e.failed for e in episodes), stats.first_error)
    return samples


_RUNNER_LOCK = threading.Lock()


def env_runner(env: Environment) -> ProcessRunner | None:
    """The child processes that run ``env``'s calls (``--env.isolation process``), started on first use and
    kept on the environment for the run; ``None`` where its calls run in threads (``thread``, or an environment
    class defined in ``__main__``, which a child process cannot import: a warning says so, once)."""
    if getattr(env, "isolation", "process") != "process":
        return None
    with _RUNNER_LOCK:
        runner = env.__dict__.get("_runner")
        if runner is None:
            if type(env).__module__ in ("__main__", "__mp_main__"):
                if not env.__dict__.get("_warned_main"):
                    log.warning("--env %s is defined in __main__, which the environment's own process cannot "
                                "import: its calls run in threads of the controller (a step past --env.timeout_s "
                                "cannot be killed); define it in a module for --env.isolation process",
                                type(env).__name__)
                    env.__dict__["_warned_main"] = True
                return None
            runner = env.__dict__["_runner"] = ProcessRunner(env)
        return runner


def close_runner(env: Environment) -> None:
    """Stop ``env``'s child processes now (they are stopped at exit anyway); the next episode starts new ones."""
    with _RUNNER_LOCK:
        runner = env.__dict__.pop("_runner", None)
    if runner is not None:
        runner.close()


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
    episode.versions += generation.versions or [0] * len(generation.token_ids)  # None: the rollout's first version
    episode.turns += 1
    episode.cut = not generation.finished  # at the budget: the loop's engines finish a turn or run to its budget
    episode.last_text = str(tokenizer.decode(generation.token_ids, skip_special_tokens=True))


def _reset(pool: CallPool, env: Environment, runner: ProcessRunner | None, episodes: list[Episode],
           stats: EpisodeStats) -> None:
    """Each episode's ``reset``, on the pool; one that raises or times out ends its episode as an error (its first
    turn is still generated, with its prompt's others), a ``GcoreError`` (a prompt the environment cannot take)
    ends the run as before."""
    futures = {pool.submit(_call, env, runner, "reset", (e.prompt,)): e for e in episodes}
    # a process-mode call ends by its own deadline; in threads, the queue could take every call's full timeout
    rounds = -(-len(episodes) // env.workers)
    done, late = wait(list(futures), timeout=None if runner is not None else env.timeout_s * rounds)
    name = type(env).__name__
    for future, episode in futures.items():
        if future in late:
            _fail(episode, stats, f"{name}.reset did not return within --env.timeout_s {env.timeout_s:g} s on "
                                  f"{episode.where()}", timeout=True)
            continue
        try:
            episode.state, _ = future.result()
        except GcoreError:
            raise
        except CallTimeout as err:
            _fail(episode, stats, f"{name}.reset did not return within --env.timeout_s {env.timeout_s:g} s on "
                                  f"{episode.where()}; {err}", timeout=True)
        except Exception as err:  # noqa: BLE001  an environment's error ends its episode, counted, not the run
            _fail(episode, stats, f"{name}.reset {_raised(err)} on {episode.where()}")


def _ask(pool: CallPool, env: Environment, runner: ProcessRunner | None, episode: Episode,
         pending: dict[Future[tuple[Any, float]], Episode], deadline: dict[Future[tuple[Any, float]], float]) -> None:
    """Send the episode's last turn to the environment (on the pool), unless the episode is over."""
    if episode.over:
        return
    future = pool.submit(_call, env, runner, "step", (episode.state, episode.last_text))
    pending[future] = episode
    if runner is None:  # a process-mode call ends by its deadline itself (its process killed)
        deadline[future] = time.monotonic() + env.timeout_s


class StepError(Exception):
    """An environment's ``step`` ended with a ``BaseException`` (``SystemExit``, ``KeyboardInterrupt`` raised by
    its own code: signals reach the main thread, not this one); an error of that episode, not of the run."""


def _call(env: Environment, runner: ProcessRunner | None, method: str,
          args: tuple[Any, ...]) -> tuple[Any, float]:
    """``env.<method>(*args)`` in this thread or in the runner's child; its result and seconds."""
    started = time.perf_counter()
    if runner is None:
        with ending_as(lambda cause: StepError(describe(cause))):  # its episode's error, counted
            result = run_call(env, method, args)
    else:
        result = runner.call(method, args, env.timeout_s)
    return result, time.perf_counter() - started


def _wait(pending: dict[Future[tuple[Any, float]], Episode], deadline: dict[Future[tuple[Any, float]], float],
          block: bool, everyone: bool) -> list[Future[tuple[Any, float]]]:
    """The environment steps that are done (or past their deadline): at once when ``block`` is
    false; else at least one, or all of them when ``everyone``."""
    if not block:
        return [f for f in pending if f.done()]
    timeout = max(min(deadline.values()) - time.monotonic(), 0.0) if deadline else None
    done, _ = wait(list(pending), timeout=timeout, return_when="ALL_COMPLETED" if everyone else FIRST_COMPLETED)
    now = time.monotonic()
    late = [f for f in pending if f not in done and deadline.get(f, now + 1) <= now]
    return [*done, *late]


def _fail(episode: Episode, stats: EpisodeStats, message: str, timeout: bool = False, kind: str = "") -> None:
    stats.error(message, timeout, kind)
    episode.over = episode.failed = True


def _raised(err: BaseException) -> str:
    if isinstance(err, CallFailed):
        text = str(err)
        return text if text.startswith("its process") else f"raised {text}"
    return f"raised {type(err).__name__}: {err}"


def _observe(env: Environment, episode: Episode, future: Future[tuple[Any, float]], tokenizer: Tokenizer,
             budget: int, stats: EpisodeStats) -> bool:
    """Take the environment's answer to the episode's turn; True when the episode goes on."""
    name = type(env).__name__
    if not future.done():
        _fail(episode, stats, f"{name}.step did not return within --env.timeout_s {env.timeout_s:g} s on "
                              f"{episode.where()} (left running in its thread: --env.isolation thread)", timeout=True)
        return False
    try:
        (turn, state), seconds = future.result()
    except CallTimeout as err:
        _fail(episode, stats, f"{name}.step did not return within --env.timeout_s {env.timeout_s:g} s on "
                              f"{episode.where()}; {err}", timeout=True)
        return False
    except Exception as err:  # noqa: BLE001  an environment's error ends its episode, counted, not the run
        _fail(episode, stats, f"{name}.step {_raised(err)} on {episode.where()}")
        return False
    qualified = f"{type(env).__module__}.{name}"
    if not isinstance(turn, Turn):
        raise ConfigError(f"--env {qualified}: step returned {type(turn).__name__}, not a gcore.envs.Turn")
    episode.state = state
    stats.env_busy_s += seconds
    stats.add("steps")
    for key, value in turn.metrics.items():
        stats.add(key, float(value))
        episode.metrics[key] = episode.metrics.get(key, 0.0) + float(value)
    try:  # the checks a reward model's score goes through, for this turn's and the episode's sum
        reward = as_reward(turn.reward)
        episode.reward = as_reward(episode.reward + reward)
    except (TypeError, ValueError) as err:
        raise RewardError(f"--env {qualified}: turn {episode.turns}'s reward: {err}, on {episode.where()}") from None
    if turn.done:
        episode.done = episode.over = True
        return False
    observation = turn.observation
    limit = env.max_observation_chars
    if isinstance(observation, str) and limit and len(observation) > limit:
        _fail(episode, stats, f"{name}.step gave an observation of {len(observation)} characters, more than "
                              f"--env.max_observation_chars {limit}, on {episode.where()}: the episode ended",
              kind="oversized")
        return False
    ids = _observation_ids(env, observation, tokenizer, episode)
    limit = env.max_observation_tokens
    if limit and episode.observed + len(ids) > limit:
        _fail(episode, stats, f"{name}.step gave an observation of {len(ids)} tokens, after {episode.observed} "
                              f"observation tokens in the episode: more than --env.max_observation_tokens {limit} "
                              f"per episode, on {episode.where()}: the episode ended", kind="oversized")
        return False
    closing = episode.closing if episode.cut else []  # the cut turn closed as the template closes a turn
    if episode.turns >= env.max_turns or len(episode.ids) + len(closing) + len(ids) >= budget:
        episode.over = True  # truncated: no room for another turn
        return False
    episode.ids += closing + ids
    episode.logprobs += [0.0] * (len(closing) + len(ids))
    episode.mask += [0] * (len(closing) + len(ids))
    episode.versions += [episode.versions[-1] if episode.versions else 0] * (len(closing) + len(ids))
    episode.observed += len(ids)
    return True


#: the text an assistant message's content is rendered with to find what the chat template writes after it
_CONTENT = "gcore-turn-end-probe"


def turn_end_ids(tokenizer: Tokenizer) -> list[int]:
    """The tokens that close an assistant turn, as the model writes them when it ends a turn itself: with a chat
    template, what the template writes after an assistant message's content, up to and including its first special
    token (ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``; what follows it, a newline,
    belongs to the next message, which ``ToolEnvironment`` renders in its observations); without a chat template,
    or one that writes no special token there, the EOS token; ``[]`` when the tokenizer has neither."""
    eos = getattr(tokenizer, "eos_token_id", None)
    fallback = [eos] if isinstance(eos, int) else []
    template = getattr(tokenizer, "chat_template", None)
    apply = getattr(tokenizer, "apply_chat_template", None)
    if not template or apply is None:
        return fallback
    messages = [{"role": "user", "content": "U"}, {"role": "assistant", "content": _CONTENT}]
    try:
        text = str(apply(messages, tokenize=False, add_generation_prompt=False))
    except Exception:  # noqa: BLE001  a template that cannot render this conversation: the EOS
        return fallback
    if _CONTENT not in text:
        return fallback
    after = text[text.rindex(_CONTENT) + len(_CONTENT):]
    ids = list(tokenizer.encode(after, add_special_tokens=False)) if after else []
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special |= {i for i, token in added.items() if getattr(token, "special", False)}
    special.discard(getattr(tokenizer, "unk_token_id", None))  # a character the vocabulary lacks is no turn's end
    for index, token in enumerate(ids):
        if token in special:
            return ids[: index + 1]
    return fallback


def _observation_ids(env: Environment, observation: object, tokenizer: Tokenizer, episode: Episode) -> list[int]:
    qualified = f"--env {type(env).__module__}.{type(env).__name__}"
    if isinstance(observation, str):
        return list(tokenizer.encode(observation, add_special_tokens=False))
    if not (isinstance(observation, list) and all(isinstance(t, int) for t in observation)):
        raise ConfigError(f"{qualified}: a Turn's observation must be a str or a list of token ids, got "
                          f"{type(observation).__name__}")
    vocab = vocab_size(tokenizer)
    bad = next((t for t in observation if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        valid = f"0..{vocab - 1}" if vocab is not None else ">= 0"
        raise ConfigError(f"{qualified}: a Turn's observation holds token id {_short(bad)}, outside the tokenizer's "
                          f"vocabulary ({valid}), on {episode.where()}; give text, or ids of the policy's tokenizer "
                          "(Environment.setup receives it)")
    return observation


def vocab_size(tokenizer: Tokenizer) -> int | None:
    """The ids a tokenizer has (``len(tokenizer)``: its vocabulary and added tokens), or ``None`` if it cannot say."""
    size: object
    try:
        size = len(tokenizer)  # type: ignore[arg-type]
    except TypeError:
        size = getattr(tokenizer, "vocab_size", None)
    return int(size) if isinstance(size, int) and size > 0 else None


def _short(value: int) -> str:
    return str(value) if value.bit_length() < 128 else f"an int of {value.bit_length()} bits"


def where(prompt: Prompt, number: int, of: int) -> str:
    """``episode 2 of 4 of prompt data.jsonl:3: '7='``: which sample a message is about."""
    return f"episode {number + 1} of {of} of prompt {prompt.source or prompt.index}: {_clip(prompt.text)!r}"


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _by_budget(episodes: list[Episode], max_new_tokens: int, budget: int) -> dict[int, list[Episode]]:
    """The episodes ready for a turn, grouped by the tokens their turn may generate."""
    groups: dict[int, list[Episode]] = {}
    for episode in episodes:
        groups.setdefault(min(max_new_tokens, budget - len(episode.ids)), []).append(episode)
    return groups
