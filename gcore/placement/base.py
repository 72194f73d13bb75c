"""The ``PlacementPolicy`` contract: where each role runs, and when it holds device memory."""

from __future__ import annotations

import functools
import time
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from gcore.engines.base import POLICY, Engine, generate_prompts
from gcore.errors import ConfigError
from gcore.model import ModelSource
from gcore.rewards.base import RewardModel
from gcore.rollout import RolloutJob, StageTimer
from gcore.types import Generation, Sample, SamplingParams

if TYPE_CHECKING:
    from gcore.engines.pool import WorkerPool
    from gcore.envs.episodes import Generate


@dataclass
class Telemetry:
    """Per-stage busy seconds of one step, gathered from every controller (rank -> stage -> s), and how much
    judging the next rollout has against this step's: ``judge_scale``, the judged prompts of the rollout that
    starts next over this step's (``RewardModel.judged``, counted over the global batches, so the same on every
    controller; 1 when unknown), so that a split can follow a shift in the work at the step it happens."""

    step: int
    stage_seconds: list[dict[str, float]] = field(default_factory=list)
    judge_scale: float = 1.0

    def busiest(self, stage: str) -> float:
        return max((s.get(stage, 0.0) for s in self.stage_seconds), default=0.0)


@dataclass
class InFlight:
    """A rollout started ahead of its step (``PlacementPolicy.start_rollout``): calling it waits for the rollout
    and returns its samples (``collect``).

    What a checkpoint can hold of it, so that a resumed run collects the same samples
    (``Controller.in_flight_state``): ``generations``, where the policy gives it, waits for the generation alone
    and returns the engine's outputs, one list per prompt (the policy finishes the rollout from them after a
    resume: ``resume_rollout``); ``deferred``: nothing of the rollout has run yet (it runs when collected), so
    starting it again after a resume reproduces it. A rollout with neither (one that runs whole in a thread, or a
    policy's own callable) is generated again, for the same prompts, with the weights resumed.
    """

    collect: Callable[[], list[Sample]]
    generations: Callable[[], list[list[Generation]]] | None = None
    deferred: bool = False

    def __call__(self) -> list[Sample]:
        return self.collect()


def _returns_in_flight(method: Callable[..., object]) -> Callable[..., InFlight]:
    """A policy's own ``start_rollout`` or ``resume_rollout``, refusing in one line a result that is not an
    ``InFlight`` (a plain function, as the contract once allowed): the controller reads from it what a checkpoint
    can record of the rollout, and would otherwise fail only at the first checkpoint."""

    @functools.wraps(method)
    def checked(self: PlacementPolicy, *args: object, **kwargs: object) -> InFlight:
        result = method(self, *args, **kwargs)
        if not isinstance(result, InFlight):
            raise ConfigError(f"placement {type(self).__name__}.{method.__name__} returned a {type(result).__name__}, "
                              "not an InFlight (gcore.placement.base): return InFlight(collect), collect being the "
                              "function that waits for the samples")
        return result

    return checked


class PlacementPolicy(ABC):
    """Decides how roles (policy generation, judge, training) share the devices.

    ``launch`` starts the engines where the policy places them and returns the rollout engine the
    controller calls; ``rollout(job)`` runs the GENERATE and REWARD stages the controller asks for
    in a ``RolloutJob`` (the default: generate everything, then score it), with
    ``before_generate``/``after_generate`` around them;
    ``update`` gets the step's gathered telemetry and returns what to log. Decisions must be
    computed identically on every rank from the same telemetry: there is no master.
    """

    #: seconds an engine worker may leave a connect, handshake or started read unanswered before it is reported
    #: dead: the trainer sets it from ``--trainer.heartbeat_timeout`` before ``launch``.
    heartbeat_timeout: float = 30.0

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for name in ("start_rollout", "resume_rollout"):  # typed to return an InFlight; checked for plugins
            method = cls.__dict__.get(name)
            if isinstance(method, types.FunctionType):
                setattr(cls, name, _returns_in_flight(method))

    @property
    def telemetry_keys(self) -> tuple[str, ...]:
        """Extra per-rank numbers this policy writes into the step's timer; gathered and logged as
        ``time/<key>``. Default: none."""
        return ()

    @property
    def supports_overlap(self) -> bool:
        """Whether ``start_rollout`` returns while generation goes on in processes of their own, so that
        a rollout can run while the controller trains (``--trainer.max_staleness`` >= 1). Default: no."""
        return False

    @property
    def reproducible(self) -> bool:
        """Whether a seeded run samples the same on every run, so that a run resumed from a checkpoint continues
        exactly as the uninterrupted one (with ``--trainer.max_staleness`` too: ``Controller.in_flight_state``).
        Default: yes; a policy whose decisions follow measured times says no (the trainer notes it on resume)."""
        return True

    @property
    def supports_images(self) -> bool:
        """Whether the rollouts can generate from image prompts (each prompt's visual inputs handed to the engine:
        ``generate_prompts`` in the controller's process, ``RolloutJob.visual`` to engine worker processes). The
        built-in policies do; default no, so that a policy that hands its engines token ids only is refused in one
        line instead of generating without the images."""
        return False

    @abstractmethod
    def setup(self, world_size: int, device_type: str, reward: RewardModel | None = None) -> None:
        """Check that the roles fit the devices and the reward; raise a ``GcoreError`` if not.

        The trainer calls it before it launches any controller process or engine.
        """

    def validate(self, world_size: int, single_controller: bool) -> None:
        """Raise a one-line ``ConfigError`` (naming the flag and what works) when this policy cannot run
        with the trainer's controllers; the trainer calls it before anything is launched.

        ``single_controller``: one controller drives all ``world_size`` processes
        (``--trainer.controllers 1``). Default: every policy that keeps its engines in the
        controller's process runs either way.
        """

    def describe(self) -> str:
        """One line on what this policy does on this machine, printed when a run starts ("": nothing)."""
        return ""

    def launch(self, engine: Engine, reward: RewardModel, source: ModelSource, device: torch.device,
               seed: int) -> Engine:
        """Set up the engines (the policy's from ``source``) and the reward; returns the rollout engine.
        Default: both in this process."""
        engine.setup(source, device)
        reward.setup(device)
        return engine

    def rollout(self, job: RolloutJob) -> list[Sample]:
        """Generate ``job.sampling.n`` samples per prompt of ``job`` and score them (``job.samples``,
        ``job.score``), timing the stages in ``job.timer``. Default: on ``job.engine``, in this process."""
        if job.multi_turn:
            self.before_generate(job.engine)
            samples = job.timed_episodes(job.engine.generate)
        else:
            with job.timer("generate"):
                self.before_generate(job.engine)
                outputs = generate_prompts(job.engine, job.prompts, job.sampling)
            samples = job.samples(outputs)
        with job.timer("reward"):
            job.score(samples)
        with job.timer("swap"):
            self.after_generate(job.engine)
        return samples

    def allow_overlap(self, partial: bool = False) -> None:
        """Called once by the controller when rollouts will run while it trains (``--trainer.max_staleness``
        >= 1, only where ``supports_overlap``): from then on a weight update is queued behind the
        generation in flight instead of waiting for it. ``partial`` (``--trainer.partial_rollouts``): instead,
        the generation in flight stops between tokens, takes the update and continues with it."""

    def start_rollout(self, job: RolloutJob) -> InFlight:
        """Start ``job``; returns it in flight: calling that waits for it and returns its samples (timed in
        ``job.timer`` as it is then). A policy that ``supports_overlap`` sends the generation requests
        here and returns at once; weight updates sent meanwhile are applied after them. Default: the
        whole ``rollout`` runs when the result is asked for (``InFlight.deferred``)."""
        return InFlight(lambda: self.rollout(job), deferred=True)

    def resume_rollout(self, job: RolloutJob, generations: list[list[Generation]]) -> InFlight:
        """After a resume: the rest of a rollout whose generation a checkpoint recorded (``InFlight.generations``,
        ``generations[i]``: the completions of ``job.prompts[i]``); returns it in flight: calling that scores them
        and returns the samples, as the rollout started ahead would have. Default: scored in this process."""

        def finish() -> list[Sample]:
            samples = job.samples(generations)
            with job.timer("reward"):
                job.score(samples)
            return samples

        return InFlight(finish)

    def join_rollouts(self) -> float:
        """Wait for the rollouts that run in a thread of this process while the controller trains (a
        rollout whose judging or episode loop is in the pipeline: ``Background``); returns the seconds
        waited. The controller calls it before the weight sync, so that nothing uses the engine workers
        from its own thread meanwhile. Default: nothing runs in a thread."""
        return 0.0

    def shutdown(self) -> None:
        """Stop whatever ``launch`` started."""

    def before_generate(self, engine: Engine) -> None:
        """Called right before generation."""

    def after_generate(self, engine: Engine) -> None:
        """Called right after generation (and reward)."""

    def before_sync(self, engine: Engine) -> None:
        """Called right before the trainer's new weights are sent to the engine."""

    def update(self, telemetry: Telemetry) -> dict[str, float]:
        """Re-decide placement from measured utilization; returns metrics to log."""
        return {}

    def state_dict(self) -> dict:
        """The current placement decision, saved in every checkpoint as JSON (after ``setup``)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned, when a run resumes (after ``setup``, which may have
        seen a different number of devices)."""


def turns(pool: WorkerPool, workers: Callable[[], list[int]], base: int, ahead: bool) -> Generate:
    """The episode loop's ``generate`` on the policy workers of ``pool`` (``workers()`` when each turn batch goes
    out). With partial rollouts each turn's tokens carry their versions counted from ``base``, the pool's weight
    version the rollout started with (``WorkerPool._rebase``): a turn cut by a weight sync continues with the new
    weights and the later turns are of the new version, which the episode loop keeps token by token
    (``Sample.token_versions``). ``ahead``: the rollout was started ahead of its step, so that a weight sync comes
    during it; only a test's ``worker.HOLD_ENV`` reads it (its first turn batch is held for that sync, the others
    not: the sync after them waits for this rollout)."""
    first = [ahead]

    def generate(prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        hold, first[0] = first[0], False
        return pool.generate(POLICY, prompts, params, workers(), base=base, hold=hold)

    return generate


class Background:
    """Rollouts that run in a thread while the controller trains (``--trainer.max_staleness``): with
    multi-turn episodes (the episode loop calls the engine once per turn, so it cannot be sent ahead
    as one request) and with a generative judge (its requests go out as the generation requests
    finish, so someone must take the results and send them while the controller trains). The
    rollouts run one after another, in the order they were started. Without partial rollouts a policy
    ``join``s them before the weight sync (``join_rollouts``, ``before_sync``), so the update waits for
    the rollouts in flight and every sample of them is sampled by the weights they were started with.
    With partial rollouts it does not: the pool takes requests from both threads (``WorkerPool._lock``),
    and the sync reaches the generation in flight, which continues with the new weights."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._running: list[Future[list[Sample]]] = []

    def start(self, job: RolloutJob, run: Callable[[RolloutJob], list[Sample]]) -> InFlight:
        """Run ``run(job)`` in the thread; returns it in flight: calling that waits for its samples and adds what
        it timed and counted to ``job`` (whose ``timer`` is the collecting step's by then)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gcore-rollout")
        own = replace(job, timer=StageTimer())
        future = self._executor.submit(run, own)
        self._running.append(future)

        def result() -> list[Sample]:
            samples = future.result()
            for stage, seconds in own.timer.seconds.items():
                job.timer.add(stage, seconds)
            job.reward_errors += own.reward_errors
            job.first_reward_error = job.first_reward_error or own.first_reward_error
            job.env_stats = own.env_stats
            return samples

        return InFlight(result)

    def join(self) -> float:
        """Wait for the rollouts in flight (their errors are raised when their samples are asked for);
        returns the seconds waited."""
        started = time.perf_counter()
        wait(self._running)
        self._running.clear()
        return time.perf_counter() - started

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
