"""What a controller asks of its placement policy: one ``RolloutJob`` per GENERATE + REWARD.

The controller (``gcore/controller.py``) owns the step; the placement policy (``gcore/placement/``)
decides where and when the engines run. Between them travels a ``RolloutJob``: the prompts, the
sampling parameters, the engine to call, and how a completion becomes a scored ``Sample``
(``job.samples``, ``job.score``). A policy never sees the controller, so nothing in placement calls
back up into it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from gcore.algorithms.base import Algorithm
from gcore.engines.base import Engine
from gcore.envs.base import Environment
from gcore.envs.episodes import EpisodeStats, Generate, Tokenizer, run_episodes
from gcore.errors import RewardError
from gcore.rewards.base import RewardModel, as_reward, describe_sample
from gcore.types import Generation, Prompt, Sample, SamplingParams, VisualInputs

#: ``env``: a multi-turn rollout's wait for its environment's observations with nothing to generate
STAGES = ("generate", "env", "reward", "swap", "prepare", "train", "sync")
LOCAL_STAGES = ("generate", "env", "reward", "swap", "prepare")  # no collective inside: a controller's own work


class StageTimer:
    """Wall-clock seconds per stage of one step."""

    def __init__(self, on_stage: Callable[[str], None] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.on_stage = on_stage

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        if self.on_stage:
            self.on_stage(stage)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - start)

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds


@dataclass
class RolloutJob:
    """One GENERATE + REWARD request: ``n`` samples per prompt, scored and shaped.

    A placement policy's ``rollout(job)`` generates ``prompts`` with ``sampling`` (on ``engine``, or
    on engines it launched itself), turns the completions into samples with ``job.samples`` and
    scores them with ``job.score``, timing its stages in ``timer``. With a multi-turn environment
    (``job.multi_turn``) a policy runs ``job.episodes(generate)`` instead of one ``generate`` and
    ``job.samples``: the episode loop calls ``generate`` once per turn batch. The job counts the samples
    whose scoring failed (``reward_errors``), for the controller's ``reward/errors``. A job started
    ahead of its step (``PlacementPolicy.start_rollout``) is given that step's ``timer`` before its
    result is collected. ``seed`` makes a rollout on engine workers sample the same wherever and whenever it
    runs (a resumed run samples what the uninterrupted one did).
    """

    prompts: list[Prompt]
    sampling: SamplingParams
    engine: Engine  # the rollout engine ``PlacementPolicy.launch`` returned
    reward: RewardModel
    algorithm: Algorithm  # shapes the raw reward (``Algorithm.shape_reward``)
    tokenizer: Tokenizer  # decodes the responses (and encodes an environment's observations)
    timer: StageTimer
    first_group: int = 0  # the groups of ``prompts`` are numbered from here
    policy_version: int = 0  # the training steps the engine's weights have had (``Sample.policy_version``)
    env: Environment | None = None  # ``--env``; ``None`` or ``SingleTurn``: one generation per sample
    #: what engine workers sample this job's generation requests from (``WorkerPool.submit_generate``), drawn by
    #: the controller from the run's seed, its rank, the step and the step's rollout count; ``None``: the workers'
    #: own random state. An engine in the controller's process samples from the controller's generator.
    seed: int | None = None
    reward_errors: int = 0
    first_reward_error: str | None = None
    env_stats: EpisodeStats | None = None  # what the episode loop measured (multi-turn only)

    def visual(self) -> list[VisualInputs | None] | None:
        """Each prompt's images (``Prompt.visual``), or ``None`` when no prompt has any (text prompts)."""
        visual = [p.visual for p in self.prompts]
        return None if all(v is None for v in visual) else visual

    @property
    def multi_turn(self) -> bool:
        """Whether the samples are multi-turn episodes (``episodes``) rather than single generations."""
        return self.env is not None and self.env.multi_turn

    def episodes(self, generate: Generate) -> list[Sample]:
        """Run the multi-turn episodes of ``prompts`` (``n`` each) on ``generate`` (an engine's, or one
        that splits over workers); their stage times and counts go to ``env_stats`` (the caller adds
        the times to ``timer``: ``env_stats.generate_s`` and ``env_stats.env_wait_s``)."""
        assert self.env is not None, "episodes needs an environment (job.multi_turn)"
        stats = EpisodeStats()
        samples = run_episodes(self.env, generate, self.prompts, self.sampling, self.tokenizer, self.first_group,
                               self.policy_version, stats)
        self.env_stats = stats
        return samples

    def timed_episodes(self, generate: Generate, generate_stage: bool = True) -> list[Sample]:
        """``episodes(generate)`` with its stage times added to ``timer``: every placement's multi-turn rollout
        runs through here. ``env``: the wait for the environment; ``generate`` (unless ``generate_stage`` is
        false, for a policy that times its generation its own way): the episode loop's generation time."""
        samples = self.episodes(generate)
        assert self.env_stats is not None  # set by episodes
        if generate_stage:
            self.timer.add("generate", self.env_stats.generate_s)
        self.timer.add("env", self.env_stats.env_wait_s)
        return samples

    def samples(self, outputs: list[list[Generation]], start: int = 0) -> list[Sample]:
        """One ``Sample`` per generation of ``prompts[start:]`` (``outputs[i]`` are the completions
        of ``prompts[start + i]``), in the groups of those prompts."""
        first = self.first_group + start
        return [
            Sample(
                prompt=prompt,
                group=first + group,
                response_ids=g.token_ids,
                response_logprobs=g.logprobs,
                response_text=str(self.tokenizer.decode(g.token_ids, skip_special_tokens=True)),  # ids -> one str
                finished=g.finished,
                policy_version=self.policy_version,
                # partial rollouts: a token sampled after the engine loaded k updates is k versions newer
                token_versions=None if g.versions is None else [self.policy_version + v for v in g.versions],
                routed_experts=g.routed_experts,
            )
            for group, (prompt, generations) in enumerate(zip(self.prompts[start:], outputs, strict=False))
            for g in generations
        ]

    def score(self, samples: list[Sample], reward: RewardModel | None = None) -> None:
        """Reward the samples (with ``reward``, e.g. one scored in worker processes, instead of the
        job's): the raw score is kept in ``reward_info["raw"]``, the algorithm shapes it."""
        reward = reward or self.reward
        raw = reward.score(samples)
        if len(raw) != len(samples):
            raise RewardError(f"{type(reward).__name__} returned {len(raw)} rewards for {len(samples)} samples")
        self.reward_errors += reward.last_errors
        self.first_reward_error = self.first_reward_error or reward.last_error
        for sample, value in zip(samples, raw, strict=False):
            try:  # any reward model, not only the rule-based ones (which check their own values)
                value = as_reward(value)
            except (TypeError, ValueError) as err:
                name = type(reward).__name__
                raise RewardError(f"{name} gave {err} on sample ({describe_sample(sample)})") from None
            if sample.env_reward:  # a multi-turn episode's environment rewards, summed over its turns
                sample.reward_info["env"] = sample.env_reward
                value = as_reward(value + sample.env_reward)
            sample.reward_info["raw"] = value
            sample.reward = value
            sample.reward = float(self.algorithm.shape_reward(sample))
