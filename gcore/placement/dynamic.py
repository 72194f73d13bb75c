"""``dynamic`` placement: generation and the reward on two partitions sized from utilization."""

# the role names and request kinds are Literal types: comparing one with another spelling is an error
# mypy: strict-equality

from __future__ import annotations

import math
import pickle
import time
from typing import TYPE_CHECKING, Literal, cast

import torch

from gcore.engines.base import JUDGE, POLICY, REWARD, Engine, Role
from gcore.errors import ConfigError
from gcore.model import ModelSource
from gcore.placement.base import Background, InFlight, PlacementPolicy, Telemetry, turns
from gcore.rewards.base import RewardModel
from gcore.rollout import RolloutJob, StageTimer
from gcore.threads import usable_cores, worker_threads
from gcore.types import Generation, Sample

if TYPE_CHECKING:
    from gcore.engines.pool import Job, PoolEngine, WorkerPool
    from gcore.placement.launch import PoolReward

#: the rollout stages (``gcore.rollout.STAGES``) whose busy seconds ``update`` balances
GENERATE_STAGE, REWARD_STAGE = "generate", "reward"


class DynamicPlacement(PlacementPolicy):
    """Splits ``devices`` into a policy-generation partition and a reward partition that run at once.

    After each step ``update`` reads the busy seconds per role (the slowest rank's, from telemetry
    gathered on every rank, so every rank decides the same) and moves devices towards the split with
    the shortest predicted rollout: without a reported generation floor, the split that balances the
    measured work; with one (a long tail that more devices cannot shorten), more judge devices.

    In the trainer a device is an engine worker process, and the ``workers`` workers of a machine form
    one pool that all its controllers share (``gcore.engines.pool.Peers``): every controller sends its
    own requests to the partition serving the role, and the split, computed identically on every
    controller from all controllers' stage times, is one split of that pool. On CPU a worker has
    ``threads`` threads; by default there is one worker per core this process may use
    (``os.sched_getaffinity``), and more workers than cores may be asked for (each then gets one
    thread), so that a 4-worker pool on 2 cores can be split 1/3, 2/2 or 3/1. On CUDA the workers
    spread over the visible GPUs (worker ``i`` on ``cuda:(i % GPUs)``), or share the one GPU (two
    workers by default), each with its own copy of its role's model; the controllers train on their
    GPUs between rollouts. Generation
    requests (``stream_groups`` prompt groups each) go to the generation partition; each finished
    group is scored on the reward partition while the rest is still generating. A worker that changes
    partition swaps engines (``time/swap``). Training runs in the controller, on every core, between
    rollouts (the workers wait meanwhile).

    The reward partition holds the generative judge (at least one device), or, with a rule-based
    reward, worker processes that run the reward: there it may be empty, and the controller scores
    each finished group itself, which holds up sending the next generation requests. It gets workers
    when the scoring costs more than the generation they would have done. ``placement/judge_devices``
    in the metrics is the reward partition's size, whichever reward it holds.

    Args:
        workers: engine workers to split, one pool per machine shared by its controllers (0: on CPU one per
            usable core, on CUDA one per visible GPU and at least 2; in ``gcore simulate``, the devices simulated).
        judge_fraction: the judge partition's share at the start (a rule-based reward starts in the
            controller).
        min_fraction: smallest share of devices either partition may get (at least one device; the
            reward partition of a rule-based reward may be empty).
        hysteresis: move only when the two roles' idle times differ by more than this share of the
            rollout phase.
        max_move_fraction: move at most this share of the devices in one step (at least one).
        threads: torch threads of each engine worker (trainer only; 0: the user's ``OMP_NUM_THREADS``, else each
            worker's share of the controller's cores; with ``cluster ray``, its share of the cluster's CPUs;
            docs/threads.md).
        stream_groups: prompt groups per generation request: the unit that streams to the judge.
        worker_timeout_s: a worker that does not answer a request in this time is killed and the
            request sent to another worker.
        retries: further attempts for a failed worker request before the step fails.
        cluster: ``local``: each machine's workers are processes of that machine, split among its controllers;
            ``ray``: the workers are actors of a Ray cluster (``address``), spread over its nodes, one pool and one
            split for every controller of the job (docs/cluster.md).
        address: the Ray cluster's address (``host:port`` of its head, or ``auto``: the one ``ray start`` runs on
            this machine, or ``RAY_ADDRESS``); with ``cluster ray`` only.
    """

    def __init__(
        self,
        workers: int = 0,
        judge_fraction: float = 0.25,
        min_fraction: float = 0.125,
        hysteresis: float = 0.1,
        max_move_fraction: float = 0.125,
        threads: int = 0,
        stream_groups: int = 1,
        worker_timeout_s: float = 600.0,
        retries: int = 2,
        cluster: Literal["local", "ray"] = "local",
        address: str = "auto",
    ) -> None:
        for name, value in (("judge_fraction", judge_fraction), ("min_fraction", min_fraction)):
            if not 0 < value < 1:
                raise ConfigError(f"--placement.{name} must be in (0, 1), got {value}")
        if hysteresis < 0 or not 0 < max_move_fraction <= 1:
            raise ConfigError("--placement.hysteresis must be >= 0 and max_move_fraction in (0, 1]")
        if workers < 0:
            raise ConfigError(f"--placement.workers must be >= 0 (0: one per core), got {workers}")
        self.workers, self.judge_fraction, self.min_fraction = workers, judge_fraction, min_fraction
        self.hysteresis, self.max_move_fraction = hysteresis, max_move_fraction
        if threads < 0 or stream_groups < 1 or retries < 0:
            raise ConfigError(f"--placement.threads and retries must be >= 0, stream_groups >= 1, got "
                              f"{threads}, {stream_groups}, {retries}")
        self.threads, self.stream_groups = threads, stream_groups
        self.worker_timeout_s, self.retries = worker_timeout_s, retries
        if cluster not in CLUSTERS:
            raise ConfigError(f"--placement.cluster {cluster!r} is not a cluster gcore runs on; valid choices: "
                              f"{', '.join(CLUSTERS)}")
        self.cluster, self.address = cluster, address
        self._nodes: dict[str, int] = {}  # a Ray node -> its number in the metrics (``placement/node<k>_requests``)
        self.total = 0
        self.device_type = "cpu"
        self.judge_devices = 0
        self.reward_role: Role = JUDGE  # or REWARD: worker processes running a rule-based reward
        self.min_reward_devices = self.max_reward_devices = 0
        self.world_size = 1
        self.controllers = 1  # controllers sharing each pool (set by ``launch``)
        self.machines = 1
        self.pool: WorkerPool | None = None
        self._background = Background()  # multi-turn rollouts that overlap training
        self.policy_engine: PoolEngine | None = None
        self.judge_engine: PoolEngine | None = None
        self.reward_pool: PoolReward | None = None

    @property
    def telemetry_keys(self) -> tuple[str, ...]:
        return ("rollout", "idle_generate", "idle_reward")

    @property
    def generate_devices(self) -> int:
        return self.total - self.judge_devices

    @property
    def min_devices(self) -> int:
        return max(1, math.ceil(self.min_fraction * self.total))

    def validate(self, world_size: int, single_controller: bool) -> None:
        if single_controller:
            raise ConfigError("--trainer.controllers 1 runs with --placement static and no --placement.workers "
                              "(the engine worker pools are per controller)")

    def setup(self, world_size: int, device_type: str, reward: RewardModel | None = None) -> None:
        """``reward`` ``None`` (``gcore simulate``) or one with a generative judge: a judge partition."""
        if device_type not in ("simulated", "cpu", "cuda"):
            raise ConfigError(f"--placement dynamic runs on the CPU, a CUDA GPU or in `gcore simulate`, not on "
                              f"{device_type}: use --placement static")
        judged = reward is None or bool(reward.judges())
        self.reward_role = JUDGE if judged else REWARD
        self.device_type = device_type
        self.world_size = world_size
        defaults = {"simulated": world_size, "cuda": max(2, torch.cuda.device_count()), "cpu": usable_cores()}
        self.total = self.workers or defaults[device_type]
        if judged and self.total < 2:
            raise ConfigError(
                f"--placement dynamic with a generative judge needs at least 2 devices (one for generation, one "
                f"for the judge), got {self.total}; give --placement.workers 2 or use --placement static"
            )
        if self.total - self.min_devices < (self.min_devices if judged else 0):
            raise ConfigError(
                f"--placement.min_fraction {self.min_fraction} leaves no room to split {self.total} devices"
            )
        self.min_reward_devices = self.min_devices if judged else 0
        self.max_reward_devices = self.total - self.min_devices if judged or _picklable(reward) else 0
        wanted = round(self.judge_fraction * self.total) if judged else 0
        self.judge_devices = min(max(wanted, self.min_reward_devices), self.max_reward_devices)

    def describe(self) -> str:
        gpu = self.device_type == "cuda"
        shared = " shared by the machine's controllers" if self.world_size > 1 else ""
        workers = f"{self.total} engine worker process{'es' if self.total != 1 else ''}{shared}"
        if self.cluster == "ray":
            shared = " shared by every controller of the job" if self.world_size > 1 else ""
            workers = (f"{self.total} engine workers as actors of the Ray cluster at {self.address}, spread over its "
                       f"nodes{shared}")
        elif gpu:
            gpus = torch.cuda.device_count()
            workers += f" spread over {min(self.total, gpus)} GPUs" if gpus > 1 else " sharing one GPU"
        if self.reward_role == JUDGE:
            return (f"dynamic placement: {workers}, {self.generate_devices} generating and {self.judge_devices} "
                    "judging at once; the split is re-sized every step from the measured stage times "
                    "(placement/* in metrics.csv)")
        where = (f"in {self.judge_devices} reward worker(s)" if self.judge_devices else
                 "in the controller as each group finishes")
        moves = ("it moves workers between generation and reward scoring from the measured stage times every step; "
                 "a rule-based reward usually costs a few percent of generation's CPU time or less, and then nothing "
                 "moves "
                 "(a generative judge, --reward generative, is the work it moves to)"
                 if self.max_reward_devices else "the reward cannot be sent to a worker process, so it stays there "
                 "and nothing moves")
        threads = "" if gpu else (f" ({self.threads or worker_threads(self.total)} thread(s) each, from "
                                  f"{usable_cores()} usable cores)")
        if self.cluster == "ray" and not gpu:
            threads = (f" ({self.threads} thread(s) each)" if self.threads else
                       " (each with its share of the cluster's CPUs as threads)")
        trains = "the controller trains on the GPU" if gpu else "training uses the controller's cores"
        return (f"dynamic placement: {workers}{threads} generate; the reward scores {where}; {trains} between "
                f"rollouts; {moves} (placement/* in metrics.csv)")

    def launch(self, engine: Engine, reward: RewardModel, source: ModelSource, device: torch.device,
               seed: int) -> Engine:
        """Start the machine's ``workers`` engine workers (the first controller there starts them, every
        controller connects): the first ``generate_devices`` hold the policy, the rest the judge."""
        from gcore.engines.pool import Peers
        from gcore.placement.launch import PoolReward, launch_workers

        if self.total == 0:
            raise RuntimeError("DynamicPlacement.launch called before setup")
        ray = self.cluster == "ray"
        peers = Peers.of_the_job() if ray else Peers.of_this_machine()
        if peers is not None:
            self.controllers, self.machines = peers.clients, peers.machines
        self.pool, self.policy_engine, self.judge_engine = launch_workers(
            "--placement dynamic", engine, reward, source=source, device=device, roles=self._roles(),
            threads=self.threads, seed=seed, release=True, job_timeout_s=self.worker_timeout_s, retries=self.retries,
            reward_workers=self.reward_role == REWARD and self.max_reward_devices > 0, peers=peers,
            liveness_timeout_s=self.heartbeat_timeout, ray_address=self.address if ray else "")
        if self.reward_role == REWARD:
            self.reward_pool = PoolReward(self.pool, [])
        return self.policy_engine

    def _roles(self) -> list[Role]:
        generating: list[Role] = [POLICY] * self.generate_devices
        return generating + [self.reward_role] * self.judge_devices

    @property
    def supports_images(self) -> bool:
        return True

    @property
    def supports_overlap(self) -> bool:
        return True

    @property
    def reproducible(self) -> bool:
        """No: the split of the workers between generation and scoring follows measured times, and the split
        decides how a rollout's prompts are dealt out to requests (each sampling from its own seed)."""
        return False

    def allow_overlap(self, partial: bool = False) -> None:
        if self.pool is None:
            raise RuntimeError("DynamicPlacement.allow_overlap called before launch")
        self.pool.queue_syncs = True
        self.pool.partial_rollouts = partial

    def rollout(self, job: RolloutJob) -> list[Sample]:
        """Generate on one partition and judge on the other at once: each finished request is judged
        while the rest is still generating. Writes per-device busy seconds for ``update``."""
        if self._pipelined(job):  # in the controller's thread, which waits for the samples anyway
            return self._send(job, streamed=True)()
        return self.start_rollout(job)()

    def _pipelined(self, job: RolloutJob) -> bool:
        """Whether ``start_rollout`` runs ``job`` whole in the ``Background`` thread: while rollouts overlap
        training, one with a generative judge or multi-turn episodes (someone must drive it meanwhile)."""
        pool = self.pool
        return pool is not None and pool.queue_syncs and (job.multi_turn or self.reward_role == JUDGE)

    def start_rollout(self, job: RolloutJob) -> InFlight:
        """Swap the workers that changed partition and send the generation requests; the judging runs
        when the result is asked for. While rollouts overlap training (``allow_overlap``), a rollout
        with a generative judge or multi-turn episodes runs whole in a thread (``Background``): each
        finished request is judged on the judge partition while the rest generates and the controller
        trains, and the weight sync waits for it (``join_rollouts``). A rollout with a rule-based reward
        sends one request per generation worker, so that every worker is busy while no one dispatches
        requests, and is scored when it is collected."""
        if self.pool is None:
            raise RuntimeError("DynamicPlacement.rollout called before launch")
        if self._pipelined(job):
            base = self.pool.version  # the weights the job is started with (its ``policy_version``)
            if job.multi_turn:  # its turns say whether the test hook holds them (``turns``)
                self.pool.expect_rollout()
            return self._background.start(job, lambda own: self._send(own, streamed=True, base=base, ahead=True)())
        return self._send(job, streamed=not self.pool.queue_syncs)

    def _partial(self) -> bool:
        """Partial rollouts: a rollout in the ``Background`` thread is not joined before a weight sync (as
        ``StaticPlacement._partial``)."""
        return self.pool is not None and self.pool.partial_rollouts

    def _send(self, job: RolloutJob, streamed: bool, base: int | None = None, ahead: bool = False) -> InFlight:
        """Swap the workers that changed partition and send the generation requests (``stream_groups``
        prompt groups each when ``streamed``, else one per generation worker); returns what collects and
        scores them (multi-turn: what runs the episode loop)."""
        pool, prompts = self.pool, job.prompts
        assert pool is not None  # checked by start_rollout
        generators, scorers = self._partition(job)
        started = time.perf_counter()
        base = pool.version if base is None else base
        if job.multi_turn:
            return InFlight(lambda: self._episode_rollout(job, scorers, started, base, ahead))
        size = self.stream_groups
        if not streamed:
            size = max(size, math.ceil(len(prompts) / len(generators)))
        chunks = {start: prompts[start : start + size] for start in range(0, len(prompts), size)}
        visual = job.visual()  # each prompt's images (image prompts), else None
        requests = {start: pool.submit("generate", (POLICY, [p.token_ids for p in chunk], job.sampling,
                                                    # each request samples from the job's seed + its first prompt
                                                    None if job.seed is None else job.seed + start,
                                                    None if visual is None else visual[start : start + size],
                                                    pool.partial_rollouts),
                                       generators, POLICY, base) for start, chunk in chunks.items()}

        def generations() -> list[list[Generation]]:
            pool.wait(list(requests.values()))
            return [out for start in sorted(requests) for out in cast("list[list[Generation]]", requests[start].result)]

        return InFlight(lambda: self._finish_rollout(job, requests, scorers, started), generations=generations)

    def _partition(self, job: RolloutJob) -> tuple[list[int], list[int]]:
        """Swap the workers that changed partition since the last rollout and point the role engines at their
        partitions; returns (generation workers, scoring workers)."""
        pool = self.pool
        assert pool is not None and self.policy_engine is not None  # set by launch
        if pool.peers is None:  # a shared pool restarts lost workers in ``update``, which every controller passes
            pool.revive()
        with job.timer("swap"):  # the workers that changed partition since the last step swap engines
            pool.assign(self._roles())
        generators, scorers = list(range(self.generate_devices)), list(range(self.generate_devices, self.total))
        self.policy_engine.workers = generators
        for role_engine in (self.judge_engine, self.reward_pool):
            if role_engine is not None:
                role_engine.workers = scorers
        pool.busy.clear()
        return generators, scorers

    def resume_rollout(self, job: RolloutJob, generations: list[list[Generation]]) -> InFlight:
        """The recorded generations scored on the reward partition, as ``start_rollout``'s would have been."""

        def finish() -> list[Sample]:
            _, scorers = self._partition(job)
            started = time.perf_counter()
            samples = job.samples(generations)
            reward = self.reward_pool if scorers and self.reward_pool is not None else None  # None: in the controller
            job.score(samples, reward)
            self._rollout_telemetry(job.timer, scorers, time.perf_counter() - started, time.perf_counter() - started)
            return samples

        return InFlight(finish)

    def _episode_rollout(self, job: RolloutJob, scorers: list[int], started: float, base: int,
                         ahead: bool = False) -> list[Sample]:
        """Multi-turn: the episode loop on the generation partition (each turn batch split over it), then
        the episodes judged on the reward partition. The wait for the environment is timed as ``env``:
        ``update`` does not count it as the generation partition's idle time (no split shortens it)."""
        pool, timer = self.pool, job.timer
        assert pool is not None and self.policy_engine is not None  # set by launch
        # its generation is timed by the partition's telemetry (``_rollout_telemetry``), not as ``generate``
        engine = self.policy_engine
        samples = job.timed_episodes(turns(pool, lambda: engine.workers, base, ahead), generate_stage=False)
        reward = self.reward_pool if scorers and self.reward_pool is not None else None  # None: in the controller
        scored = time.process_time()
        job.score(samples, reward)
        in_controller = time.process_time() - scored
        self._rollout_telemetry(timer, scorers, in_controller, time.perf_counter() - started)
        return samples

    def _finish_rollout(self, job: RolloutJob, requests: dict[int, Job], scorers: list[int],
                        started: float) -> list[Sample]:
        pool, timer = self.pool, job.timer
        assert pool is not None  # set by launch
        reward = self.reward_pool if scorers and self.reward_pool is not None else None  # None: in the controller
        in_controller = 0.0
        by_chunk: dict[int, list[Sample]] = {}
        while len(by_chunk) < len(requests):
            pool.wait([request for start, request in requests.items() if start not in by_chunk], first=True)
            finished = []
            for start, request in requests.items():
                if request.done and start not in by_chunk:
                    generations = cast("list[list[Generation]]", request.result)
                    by_chunk[start] = job.samples(generations, start)
                    finished += by_chunk[start]
            scored = time.process_time()
            job.score(finished, reward)  # on the reward partition, while generation goes on
            in_controller += time.process_time() - scored
        self._rollout_telemetry(timer, scorers, in_controller, time.perf_counter() - started)
        return [sample for start in sorted(by_chunk) for sample in by_chunk[start]]

    def _rollout_telemetry(self, timer: StageTimer, scorers: list[int], in_controller: float, wall: float) -> None:
        """The rollout's busy seconds per device of each partition (what ``update`` balances) and idle.
        ``in_controller``: the CPU seconds the controller spent scoring (no reward workers): the work a worker
        would take over; its wall time would add the waits for a core that a busy machine makes."""
        assert self.pool is not None  # set by launch
        pool = self.pool
        busy_generate = pool.busy.get(POLICY, 0.0)
        busy_judge = pool.busy.get(self.reward_role, 0.0) if scorers else in_controller
        generate_devices = self.total - len(scorers)  # the split when the rollout started
        timer.add(GENERATE_STAGE, busy_generate / generate_devices)
        timer.add(REWARD_STAGE, busy_judge / max(len(scorers), 1))
        timer.add("rollout", wall)
        timer.add("idle_generate", generate_devices * wall - busy_generate)
        timer.add("idle_reward", len(scorers) * wall - busy_judge if scorers else 0.0)

    def shutdown(self) -> None:
        self._background.shutdown()
        if self.pool is not None:
            self.pool.close()

    def join_rollouts(self) -> float:
        return 0.0 if self._partial() else self._background.join()

    def before_sync(self, engine: Engine) -> None:
        if not self._partial():
            self._background.join()

    def state_dict(self) -> dict:
        return {"total": self.total, "judge_devices": self.judge_devices}

    def load_state_dict(self, state: dict) -> None:
        """The saved split; on a different device count, the same judge share, within the bounds."""
        share = state["judge_devices"] / state["total"] if state.get("total") else self.judge_fraction
        wanted = state["judge_devices"] if state.get("total") == self.total else round(share * self.total)
        self.judge_devices = min(max(wanted, self.min_reward_devices), self.max_reward_devices)

    def predicted_rollout(self, judge_devices: int, busy: tuple[float, float], floors: tuple[float, float]) -> float:
        """Rollout seconds predicted for a judge partition of ``judge_devices`` from this step's measurements.

        Generation takes its latency floor (the longest response decoded alone, which more devices
        cannot shorten) plus a throughput part that scales with 1/devices; the judge's work scales
        with 1/devices, and its last verdict comes at least ``judge floor`` after the last sample.
        With no reward devices (a rule-based reward in the controller, counted as one device when
        measured there), scoring holds up generation requests: the two add up.
        """
        generate_busy, judge_busy = busy
        generate_floor, judge_floor = floors
        floor = min(generate_floor, generate_busy)
        generate = floor + (generate_busy - floor) * self.generate_devices / (self.total - judge_devices)
        reward_work = judge_busy * max(self.judge_devices, 1)  # device-seconds
        if judge_devices == 0:
            return generate + reward_work
        return max(generate + judge_floor, reward_work / judge_devices)

    def target_judge_devices(
        self, generate_busy: float, judge_busy: float, generate_floor: float = 0.0, judge_floor: float = 0.0
    ) -> int:
        """The judge partition (within the bounds) with the shortest predicted rollout.

        Without floors this is the split that balances the measured work (device-seconds) of both
        roles; with a generation floor (a long tail) the judge gets more, since extra generation
        devices do not shorten the tail.
        """
        if generate_busy + judge_busy <= 0:
            return self.judge_devices
        low, high = self.min_reward_devices, self.max_reward_devices
        busy, floors = (generate_busy, judge_busy), (generate_floor, judge_floor)
        return min(
            range(low, high + 1),
            key=lambda j: (round(self.predicted_rollout(j, busy, floors), 9), abs(j - self.judge_devices)),
        )

    def _pool_busy(self, telemetry: Telemetry, stage: str) -> float:
        """A role's busy seconds per device of the pool: the sum of what the controllers sharing the pool
        measured (their mean per machine), or with a pool of its own the slowest controller's."""
        if self.controllers <= 1:
            return telemetry.busiest(stage)
        return sum(s.get(stage, 0.0) for s in telemetry.stage_seconds) / self.machines

    def update(self, telemetry: Telemetry) -> dict[str, float]:
        """Moves devices between the partitions from this step's per-role busy seconds.

        Reads ``generate`` and ``reward`` busy seconds per device, and optionally ``rollout`` (the
        phase's wall time), ``generate_floor`` (the longest response's decode time at batch 1) and
        ``reward_floor`` (one verdict's latency); the slowest rank's value of each, except the busy
        seconds on a pool that several controllers share: there each controller measured its own
        requests, and their sum is the pool's (per machine). The split is for the rollout that starts
        next: the judge's busy seconds are scaled by ``telemetry.judge_scale`` (that rollout's judged
        prompts over this step's), so that when the prompts' mix shifts the split moves with it, not a
        step later. A shared pool restarts its lost workers here: every controller passes ``update``
        once per step (it may run several rollouts).
        """
        if self.total == 0:
            raise RuntimeError("DynamicPlacement.update called before setup")
        generate_busy = self._pool_busy(telemetry, GENERATE_STAGE)
        judge_busy = self._pool_busy(telemetry, REWARD_STAGE) if self.judge_devices else telemetry.busiest(REWARD_STAGE)
        floors = (telemetry.busiest("generate_floor"), telemetry.busiest("reward_floor"))
        rollout = max(telemetry.busiest("rollout"), generate_busy, judge_busy)
        # waiting for a multi-turn environment's observations idles the generators whatever the split
        env = telemetry.busiest("env")
        idle_generate = max(rollout - env - generate_busy, 0.0)
        idle_judge = rollout - judge_busy
        # the split is for the next rollout: its judging is this step's scaled by its share of judged prompts
        judge_next = judge_busy * telemetry.judge_scale
        rollout_next = max(rollout, judge_next)
        idle_generate_next = max(rollout_next - env - generate_busy, 0.0)
        moved = 0
        if rollout_next > 0 and abs(idle_generate_next - (rollout_next - judge_next)) > self.hysteresis * rollout_next:
            target = self.target_judge_devices(generate_busy, judge_next, *floors)
            limit = max(1, int(self.max_move_fraction * self.total))
            moved = max(-limit, min(limit, target - self.judge_devices))
            busy = (generate_busy, judge_next)
            now = self.predicted_rollout(self.judge_devices, busy, floors)
            # move only when the prediction improves by a margin: noise in the measurements never undoes a split
            if moved and self.predicted_rollout(self.judge_devices + moved, busy, floors) > now * (1 - MIN_GAIN):
                moved = 0
            self.judge_devices += moved
        if self.pool is not None and self.pool.peers is not None:
            self.pool.revive()
        return {
            "placement/judge_devices": float(self.judge_devices),
            "placement/generate_devices": float(self.generate_devices),
            "placement/moved": float(moved),
            "placement/idle_generate_s": idle_generate,
            "placement/idle_judge_s": idle_judge,
            **self._node_metrics(),
        }

    def _node_metrics(self) -> dict[str, float]:
        """On a Ray cluster: the workers on each node now (``placement/node<k>_workers``), this controller's
        requests each node has served so far (``placement/node<k>_requests``; nodes numbered as first seen), and the
        workers started again after a loss (``placement/respawned``)."""
        pool = self.pool
        if pool is None or self.cluster != "ray":
            return {}
        for node in sorted(set(pool.nodes) | set(pool.served)):
            self._nodes.setdefault(node, len(self._nodes))
        out = {"placement/respawned": float(pool.respawned)}
        for node, k in self._nodes.items():
            out[f"placement/node{k}_workers"] = float(pool.nodes.count(node))
            out[f"placement/node{k}_requests"] = float(pool.served.get(node, 0))
        return out


#: the least share of the predicted rollout a move must save: below it, the measurements' own noise could decide the
#: split (a generation latency floor measured near its whole busy time makes a generation worker look free to give
#: away for any saving at all)
MIN_GAIN = 0.01
#: where the engine workers run (``--placement.cluster``)
CLUSTERS = ("local", "ray")


def _picklable(reward: RewardModel | None) -> bool:
    """Whether a rule-based reward can be sent to a worker process (a reward holding a lambda cannot)."""
    try:
        pickle.dumps(reward)
    except (pickle.PicklingError, TypeError, AttributeError):  # a local class or lambda, a lock, an open file
        return False
    return True
