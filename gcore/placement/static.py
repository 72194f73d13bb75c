"""``static`` placement: every role on every device, time-shared."""

# the role names and request kinds are Literal types: comparing one with another spelling is an error
# mypy: strict-equality

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from gcore.engines.base import JUDGE, POLICY, Engine
from gcore.errors import ConfigError
from gcore.model import ModelSource
from gcore.placement.base import Background, InFlight, PlacementPolicy, turns
from gcore.rewards.base import RewardModel
from gcore.rollout import RolloutJob
from gcore.types import Generation, Sample

if TYPE_CHECKING:
    from gcore.engines.pool import Job, PoolEngine, WorkerPool


class StaticPlacement(PlacementPolicy):
    """All roles co-located on all devices: generate, then put the engine to sleep and train.

    The engine wakes up before the weight sync, so new weights are copied device to device
    (measured on an H100: 175 GB/s into an awake engine versus 11 GB/s into a sleeping one).

    With ``workers`` > 0 (CPU), the engines run in that many worker processes per controller, all
    time-shared: generate on all of them, swap the policy engine out and the judge in (timed as
    ``time/swap``), judge on all, swap back, then prepare and train.

    Args:
        offload: put the rollout engine to sleep (release device memory) while training. ``auto``
            does so on GPUs only, where memory is shared with the trainer.
        workers: engine worker processes per controller (0: engines in the controller's process).
        threads: torch threads of each worker (0: each worker's share of the controller's cores, or the user's
            ``OMP_NUM_THREADS``; docs/threads.md).
        release: on a swap, free the sleeping engine's memory and reload it on wake-up (the policy
            then takes the latest weights from shared memory); ``false``: ``Engine.sleep`` only.
        worker_timeout_s: a worker that does not answer a request in this time is killed and the
            request sent to another worker.
        retries: further attempts for a failed worker request before the step fails.
    """

    def __init__(self, offload: bool | None = None, workers: int = 0, threads: int = 0, release: bool = True,
                 worker_timeout_s: float = 600.0, retries: int = 2) -> None:
        if workers < 0 or threads < 0 or retries < 0:
            raise ConfigError(f"--placement.workers, threads and retries must be >= 0, got "
                              f"{workers}, {threads}, {retries}")
        self.offload = offload
        self.workers, self.threads, self.release = workers, threads, release
        self.worker_timeout_s, self.retries = worker_timeout_s, retries
        self._offload = False
        self.pool: WorkerPool | None = None
        self.judge_engine: PoolEngine | None = None
        self._background = Background()  # multi-turn rollouts that overlap training

    @property
    def telemetry_keys(self) -> tuple[str, ...]:
        return ("rollout", "idle_generate", "idle_reward") if self.workers else ()

    def validate(self, world_size: int, single_controller: bool) -> None:
        if single_controller and self.workers:
            raise ConfigError("--trainer.controllers 1 runs with --placement static and no --placement.workers "
                              "(the engine worker pools are per controller)")

    def setup(self, world_size: int, device_type: str, reward: RewardModel | None = None) -> None:
        self._offload = self.offload if self.offload is not None else device_type == "cuda"

    def launch(self, engine: Engine, reward: RewardModel, source: ModelSource, device: torch.device,
               seed: int) -> Engine:
        if not self.workers:
            return super().launch(engine, reward, source, device, seed)
        from gcore.placement.launch import launch_workers

        self.pool, policy, self.judge_engine = launch_workers(
            "--placement.workers", engine, reward, source=source, device=device, roles=[POLICY] * self.workers,
            threads=self.threads, seed=seed, release=self.release, job_timeout_s=self.worker_timeout_s,
            retries=self.retries, liveness_timeout_s=self.heartbeat_timeout)
        return policy

    @property
    def supports_images(self) -> bool:
        return True

    @property
    def supports_overlap(self) -> bool:
        return self.workers > 0


    def allow_overlap(self, partial: bool = False) -> None:
        if self.pool is not None:
            self.pool.queue_syncs = True
            self.pool.partial_rollouts = partial

    def rollout(self, job: RolloutJob) -> list[Sample]:
        if self.pool is None:
            return super().rollout(job)
        return self._rollout_now(job)  # in the controller's thread: it waits for the samples anyway

    def start_rollout(self, job: RolloutJob) -> InFlight:
        """With workers: the generation requests go out now (one per worker); the rest of the rollout
        (the judge swap and the scoring) runs when the result is asked for. While rollouts overlap
        training (``allow_overlap``) a rollout with a generative judge or multi-turn episodes runs whole
        in a thread (``Background``): generation, the swap to the judge, the judging and the swap back
        run while the controller trains, and the weight sync waits for them (``join_rollouts``), unless
        rollouts are partial: the sync then reaches its generation in flight (``_partial``)."""
        if self.pool is None:
            return super().start_rollout(job)
        if self._pipelined(job):
            base = self.pool.version  # the weights the job is started with (its ``policy_version``)
            self.pool.expect_rollout()
            return self._background.start(job, lambda own: self._rollout_now(own, base, ahead=True))
        if job.multi_turn:
            return InFlight(lambda: self._episode_rollout(job))
        return self._send_generate(job)

    def resume_rollout(self, job: RolloutJob, generations: list[list[Generation]]) -> InFlight:
        """With workers: the recorded generations judged (or scored) as ``start_rollout``'s would have been."""
        if self.pool is None:
            return super().resume_rollout(job, generations)
        return InFlight(lambda: self._judge(job, job.samples(generations), 0.0))

    def _pipelined(self, job: RolloutJob) -> bool:
        """Whether ``start_rollout`` runs ``job`` whole in the ``Background`` thread: while rollouts overlap
        training, one with a generative judge or multi-turn episodes (someone must drive it meanwhile)."""
        return self.pool is not None and self.pool.queue_syncs and (job.multi_turn or self.judge_engine is not None)

    def _partial(self) -> bool:
        """Partial rollouts (``allow_overlap(partial=True)``): a rollout in the ``Background`` thread is not joined
        before a weight sync; the sync reaches its generation in flight, from the controller's thread (the pool
        takes both threads' requests: ``WorkerPool._lock``)."""
        return self.pool is not None and self.pool.partial_rollouts

    def _rollout_now(self, job: RolloutJob, base: int | None = None, ahead: bool = False) -> list[Sample]:
        """The whole rollout, generation to the last verdict (in the ``Background`` thread). ``base``: the pool's
        weight version the job was started with (partial rollouts count its tokens' versions from it);
        ``ahead``: started ahead of its step (a weight sync comes during it)."""
        if job.multi_turn:
            return self._episode_rollout(job, base, ahead)
        return self._send_generate(job, base, ahead)()

    def _send_generate(self, job: RolloutJob, base: int | None = None, ahead: bool = False) -> InFlight:
        """Send the generation requests (one per worker); returns what collects and judges them."""
        assert self.pool is not None  # set by launch
        pool = self.pool
        pool.revive()
        pool.busy.clear()
        started = time.perf_counter()
        requests = pool.submit_generate(POLICY, [p.token_ids for p in job.prompts], job.sampling,
                                        list(range(pool.size)), job.visual(), seed=job.seed,
                                        base=pool.version if base is None else base,
                                        hold=True if ahead and pool.partial_rollouts else None)
        return InFlight(lambda: self._finish_rollout(job, requests, started),
                        generations=lambda: pool.collect_generate(requests))

    def _episode_rollout(self, job: RolloutJob, base: int | None = None, ahead: bool = False) -> list[Sample]:
        """Multi-turn: the episode loop on every worker (each turn batch split over them), then judged."""
        assert self.pool is not None  # set by launch
        self.pool.revive()
        self.pool.busy.clear()
        started = time.perf_counter()
        generate = turns(self.pool, lambda: list(range(self.pool.size)) if self.pool else [],
                         self.pool.version if base is None else base, ahead)
        samples = job.timed_episodes(generate)
        return self._judge(job, samples, time.perf_counter() - started)

    def _finish_rollout(self, job: RolloutJob, requests: list[Job], started: float) -> list[Sample]:
        assert self.pool is not None  # set by launch
        with job.timer("generate"):
            outputs = self.pool.collect_generate(requests)
            generate_s = time.perf_counter() - started
        return self._judge(job, job.samples(outputs), generate_s)

    def _judge(self, job: RolloutJob, samples: list[Sample], generate_s: float) -> list[Sample]:
        """Swap every worker to the judge (if any), score, swap back; the rollout's idle telemetry."""
        assert self.pool is not None  # set by launch
        pool, everyone, timer = self.pool, list(range(self.pool.size)), job.timer
        if self.judge_engine is not None:
            with timer("swap"):
                pool.assign([JUDGE] * pool.size)
            self.judge_engine.workers = everyone
        with timer("reward"):
            started = time.perf_counter()
            job.score(samples)
            reward_s = time.perf_counter() - started
        if self.judge_engine is not None:
            with timer("swap"):
                pool.assign([POLICY] * pool.size)
        timer.add("rollout", generate_s + reward_s)
        timer.add("idle_generate", pool.size * generate_s - pool.busy.get(POLICY, 0.0))
        if self.judge_engine is not None:
            timer.add("idle_reward", pool.size * reward_s - pool.busy.get(JUDGE, 0.0))
        return samples

    def shutdown(self) -> None:
        self._background.shutdown()
        if self.pool is not None:
            self.pool.close()

    def before_generate(self, engine: Engine) -> None:
        if self._offload:
            engine.wake_up()

    def after_generate(self, engine: Engine) -> None:
        if self._offload:
            engine.sleep()

    def join_rollouts(self) -> float:
        return 0.0 if self._partial() else self._background.join()

    def before_sync(self, engine: Engine) -> None:
        if not self._partial():
            self._background.join()
        if self._offload:
            engine.wake_up()
