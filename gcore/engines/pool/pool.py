"""``WorkerPool``: this controller's side of the engine-worker pool (processes, connections, the dispatcher)."""

# the role names and request kinds are Literal types: comparing one with another spelling is an error
# mypy: strict-equality

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import math
import os
import pickle
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Literal, SupportsInt, cast

import torch

from gcore.engines.base import POLICY, Role
from gcore.engines.pool.environment import clean_environment, describe_exit
from gcore.engines.pool.jobs import Job, JobKind, Peers, Reply, RoleSpec
from gcore.engines.pool.transport import Address, connect
from gcore.engines.pool.weights import SharedWeights, create_shared, remove
from gcore.engines.pool.worker import HOLD_ENV, HOLD_GUARD_S, worker_main
from gcore.environ import children_import_this_gcore
from gcore.errors import GcoreError
from gcore.threads import spawning, worker_threads
from gcore.types import Generation, SamplingParams, VisualInputs

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from gcore.engines.pool.ray_cluster import RayWorkers

log = logging.getLogger(__name__)


def worker_devices(device: str, size: int, visible: int) -> list[str]:
    """The device of each of ``size`` workers: on CUDA with several ``visible`` GPUs, worker ``i`` takes
    ``cuda:(i % visible)`` (the partition is then of GPUs); otherwise all run on ``device``."""
    if device.startswith("cuda") and visible > 1:
        return [f"cuda:{i % visible}" for i in range(size)]
    return [device] * size


#: how long a lost worker's process is given to end before its loss is described (its exit status says why: a
#: worker killed by a signal closes its connection a moment before the kernel has it reaped)
REAP_S = 5.0


class WorkerPool:
    """``size`` engine worker processes and this controller's dispatcher for their requests.

    Args:
        size: worker processes.
        specs: role name -> how to build its engine.
        roles: the awake role of each worker at start.
        threads: ``torch.set_num_threads`` of each worker; 0: the user's ``OMP_NUM_THREADS``, else each worker's
            share of this process's threads (``gcore.threads.worker_threads``); on Ray, each worker's share of the
            cluster's CPUs (``ray_cluster.cluster_threads``).
        seed: workers are seeded ``seed + index`` (what a generation request without a seed of its own samples
            from; one with a seed, ``submit_generate``'s, samples from that alone).
        release: free a sleeping engine's memory (reload it on wake-up) instead of ``Engine.sleep`` only.
        job_timeout_s: a request not answered in this time is sent elsewhere (and its worker killed).
        retries: further attempts for a failed request before the step fails.
        startup_timeout_s: how long a worker may take to load its engine.
        device: where the workers' engines run: ``cpu``, or a GPU (``cuda:0``); with several visible GPUs the
            workers spread over them (``worker_devices``), with one they share it.
        peers: the controllers that share this pool (``Peers.of_this_machine``); ``None``: this one alone.
            Every controller of the machine builds its ``WorkerPool`` with the same arguments at the same point.
        liveness_timeout_s: the deadline of every connect, authentication handshake and started read between a
            controller and a worker (``transport``); 30 s, as ``--trainer.heartbeat_timeout``'s default.
        ray_address: the workers are actors of the Ray cluster at this address (``ray_cluster.py``), spread over
            its nodes, and the weights go through its object store; ``peers`` are then every controller of the
            job (``Peers.of_the_job``). Empty: worker processes of this machine.
    """

    def __init__(self, size: int, specs: dict[Role, RoleSpec], roles: Sequence[Role], threads: int = 0, seed: int = 0,
                 release: bool = True, job_timeout_s: float = 600.0, retries: int = 2,
                 startup_timeout_s: float = 900.0, device: str = "cpu", peers: Peers | None = None,
                 liveness_timeout_s: float = 30.0, ray_address: str = "") -> None:
        if size < 1 or len(roles) != size:
            raise GcoreError(f"a worker pool needs >= 1 worker and one role per worker, got {size} and {list(roles)}")
        for role in roles:
            if role not in specs:
                raise GcoreError(f"worker role {role!r} has no engine; roles with one: {', '.join(specs)}")
        import torch.multiprocessing as mp

        self.size, self.threads, self.seed, self.release = size, threads, seed, release
        self.job_timeout_s, self.retries, self.startup_timeout_s = job_timeout_s, retries, startup_timeout_s
        if liveness_timeout_s <= 0:
            raise GcoreError(f"a worker pool's liveness_timeout_s must be > 0 seconds, got {liveness_timeout_s}")
        self.liveness_timeout_s = liveness_timeout_s
        self.peers = peers
        self.owner = peers is None or peers.owner
        self._first = peers.index * size // peers.clients if peers is not None else 0  # where ``_dispatch`` looks first
        visible = torch.cuda.device_count() if device.startswith("cuda") else 0
        self.device, self.devices = device, worker_devices(device, size, visible)
        self.ray: RayWorkers | None = None  # the owner's handles on the workers' Ray actors
        if ray_address:
            from gcore.engines.pool.ray_cluster import RayWorkers, connect

            if self.owner:
                self.ray = RayWorkers.connect(size, self.threads, device.startswith("cuda"), ray_address,
                                              startup_timeout_s)
                self.devices = [self.ray.device()] * size
                self.threads = self.ray.threads
            else:  # every controller is a Ray driver of its own
                connect(ray_address)
        else:
            self.threads = threads or worker_threads(size)
        #: the Ray node of each worker ("" on one machine), and this controller's requests served on each node
        self.nodes: list[str] = [""] * size
        self.served: dict[str, int] = {}
        self._specs = pickle.dumps(specs)
        # a worker whose engine starts processes of its own (SGLang) cannot be daemonic
        self._daemon = not any(spec.engine is not None and spec.engine.capabilities.starts_processes
                               for spec in specs.values())
        self._ctx = mp.get_context("spawn")
        self._authkey = os.urandom(32) if self.owner else b""
        # a connection per worker: a worker killed mid-reply blocks no other
        self._conns: list[Connection | None] = [None] * size
        self._startup: list[Connection | None] = [None] * size  # the owner's: each worker's ready/fatal message
        self._addresses: list[object] = [None] * size
        self.pids: list[int | None] = [None] * size  # each worker's process id (every controller knows them)
        self.roles: list[Role] = list(roles)
        self.processes: list = [None] * size
        self._ready = [False] * size
        self._busy_with: list[Job | None] = [None] * size
        self._jobs: dict[int, Job] = {}
        self._pending: list[Job] = []
        self._ids = itertools.count()
        self.weights: SharedWeights | None = None
        #: weight syncs return once queued, without waiting for the generation in flight (``sync_weights``)
        self.queue_syncs = False
        #: partial rollouts (``--trainer.partial_rollouts``, with ``queue_syncs``): a weight sync goes at once to a
        #: worker that is generating for the policy, which stops between tokens, loads it and continues the
        #: unfinished generations with it (``_WorkerRuntime.generate_partial``)
        self.partial_rollouts = False
        self._syncs: list[Job] = []  # the last queued sync's requests
        self._side: dict[int, Job] = {}  # worker -> the weight sync sent to it during its generation
        self._queued: dict[int, Job] = {}  # worker -> the request sent behind the weight sync it is loading
        #: the controller's main thread and a rollout's thread (``placement.base.Background``) may use the pool at
        #: once: every dispatcher operation (``submit``, a ``_pump`` round, a sync's or role change's sending,
        #: ``revive``) holds this lock, never a wait for a whole request (``wait`` pumps for everyone's requests)
        self._lock = threading.RLock()
        #: the weight syncs sent (each ``sync_weights``); each worker's latest sent to it, which it holds once it
        #: has served what came before (``_dispatch``): a generate request's ``Job.version``
        self.version = 0
        self._holds = [0] * size
        self._readers: list[Job] = []  # role changes that load the shared weights (``sync_weights`` waits for them)
        #: test only (``worker.HOLD_ENV``): set once the rollout started ahead in a thread has sent its first
        #: generation (``expect_rollout``); a weight sync waits for it, so that the held request is there to be cut
        self._rollout_out = threading.Event()
        self._rollout_out.set()
        self._hold_test = bool(int(os.environ.get(HOLD_ENV, "0") or 0))
        self.busy: dict[str, float] = {}
        self.retried = 0
        self.respawned = 0
        self.swaps = 0  # role changes done by workers
        self.held: list[tuple[Role, ...]] = [(role,) for role in roles]  # engines resident in each worker
        self.closed = False
        if not self._daemon or self.ray is not None:  # multiprocessing joins a non-daemonic child at exit (and Ray
            # actors outlive their driver): the workers are stopped before
            atexit.register(self.close)
        self._start(list(range(size)))

    # -- processes ---------------------------------------------------------------------------
    def _start(self, indices: list[int]) -> None:
        """The owner starts workers ``indices``; then every controller connects to them (``transport.connect``:
        each connect and handshake within ``liveness_timeout_s``; a worker that dies meanwhile is named at once)."""
        if self.owner and self.ray is not None:
            self._start_actors(indices)
        elif self.owner:
            self._spawn(indices)
            self._wait_ready(indices)
        share = self.peers.share if self.peers is not None else (lambda value: value)
        self._authkey, addresses, pids, nodes = cast(
            "tuple[bytes, list[Address], list[int | None], list[str]]",
            share((self._authkey, [self._addresses[i] for i in indices], [self.pids[i] for i in indices],
                   [self.nodes[i] for i in indices])))
        for i, address, pid, node in zip(indices, addresses, pids, nodes, strict=True):
            self.nodes[i] = node
            old = self._conns[i]
            if old is not None:
                old.close()
            self.pids[i] = pid
            self._conns[i] = connect(address, self._authkey, self.liveness_timeout_s, f"engine worker {i} (pid {pid})",
                                     gone=functools.partial(self._exited, i))
            self._ready[i] = True
            self.held[i] = (self.roles[i],)

    def _exited(self, i: int) -> str | None:
        """How worker ``i``'s process ended (``was killed by SIGKILL``), or ``None`` while it runs (or, on a
        controller other than the owner, which does not hold the process, when that is not known)."""
        if self.ray is not None:
            return self.ray.exited(i)
        process = self.processes[i] if self.owner else None
        if process is None or process.is_alive():
            return None
        return describe_exit(process.exitcode)

    def _death(self, i: int) -> str:
        """How worker ``i`` was lost: ``was killed by SIGKILL``, ``exited with status 1``; on a controller other than
        the owner (which alone holds the process) ``closed its connection``."""
        process = self.processes[i] if self.owner else None
        if process is not None and process.is_alive():
            process.join(REAP_S)  # a worker whose connection just closed is usually exiting: its status says why
        if self.ray is not None:
            deadline = time.monotonic() + REAP_S
            while self._exited(i) is None and time.monotonic() < deadline:
                time.sleep(0.1)
        exited = self._exited(i)
        if exited is not None:
            return exited
        return "stopped answering on its connection" if self.owner else "closed its connection (it is gone)"

    def _spawn(self, indices: Iterable[int]) -> None:
        clients = self.peers.clients if self.peers is not None else 1
        for i in indices:
            self._ready[i] = False
            startup, writer = self._ctx.Pipe(duplex=False)
            self._startup[i] = startup
            weights = self._latest_weights()
            self._holds[i] = self.version
            process = self._ctx.Process(
                target=worker_main, name=f"gcore-engine-worker-{i}", daemon=self._daemon,
                args=(i, self.threads, self.seed + i, self._specs, self.roles[i], weights, self.release,
                      self.devices[i], clients, self._authkey, writer, self.liveness_timeout_s),
            )
            # a clean environment (``environment.py``: no secret of the trainer's), with the thread settings its
            # OpenMP reads when it imports torch
            with clean_environment(), spawning(self.threads), children_import_this_gcore():
                process.start()
            writer.close()  # the worker holds the only writing end: its death reads as end of file
            self.processes[i] = process
            self.pids[i] = process.pid

    def _start_actors(self, indices: list[int]) -> None:
        """The owner starts workers ``indices`` as Ray actors (``ray_cluster.RayWorkers``) and waits for each one's
        address; a worker that fails to start ends the run in one line, as a local one does."""
        assert self.ray is not None
        clients = self.peers.clients if self.peers is not None else 1
        weights = self.ray.latest()
        for i in indices:
            self._ready[i] = False
            self._holds[i] = self.version
            self.ray.spawn(i, (i, self.threads, self.seed + i, self._specs, self.roles[i], weights, self.release,
                               self.devices[i], self._authkey, self.liveness_timeout_s), clients,
                           self.startup_timeout_s)
        for i, (kind, payload) in sorted(self.ray.ready(indices).items()):
            self.pids[i], self.nodes[i] = self.ray.pids[i], self.ray.nodes[i]
            if kind != "ready":
                why = str(payload).strip().splitlines()[-1:] or ["no error reported"]
                log.error("engine worker %d failed to start on Ray node %s:\n%s", i, self.nodes[i][:8], payload)
                raise GcoreError(f"engine worker {i} (pid {self.pids[i]}, Ray node {self.nodes[i][:8]}) failed while "
                                 f"starting: {why[0]}")
            self._addresses[i] = payload

    def _wait_ready(self, indices: Iterable[int]) -> None:
        """Wait for each worker's ``ready`` (with the address it listens on) on its startup pipe."""
        from multiprocessing.connection import wait

        waiting = set(indices)
        deadline = time.monotonic() + self.startup_timeout_s
        while waiting:
            if time.monotonic() > deadline:
                raise GcoreError(f"engine workers {sorted(waiting)} did not start within {self.startup_timeout_s:.0f}s")
            pipes = {pipe: i for i in waiting if (pipe := self._startup[i]) is not None}
            for pipe in cast("list[Connection]", wait(list(pipes), 0.5)):
                i = pipes[pipe]
                try:
                    kind, _, _, payload = pipe.recv()
                except (EOFError, OSError):
                    kind, payload = "fatal", ""
                pipe.close()
                self._startup[i] = None
                if kind != "ready":
                    self.processes[i].join(timeout=10)
                    why = str(payload).strip().splitlines()[-1:] or ["no error reported"]
                    log.error("engine worker %d failed to start:\n%s", i, payload)
                    code = self.processes[i].exitcode
                    raise GcoreError(f"engine worker {i} (pid {self.pids[i]}) "
                                     f"{describe_exit(code) if code is not None else 'failed'} while starting "
                                     f"(exit code {code}): {why[0]}")
                self._addresses[i] = payload
                waiting.discard(i)

    def alive(self, i: int) -> bool:
        """Whether worker ``i`` is connected (and, for the owner, its process runs)."""
        if self._conns[i] is None:
            return False
        if self.ray is not None:
            return self.ray.exited(i) is None
        return not self.owner or (self.processes[i] is not None and self.processes[i].is_alive())

    def revive(self) -> int:
        """Respawn dead or lost workers (with their roles and the latest weights); returns how many.
        With ``peers`` a collective: every controller of the machine calls it at the same point."""
        with self._lock:
            return self._revive()

    def _revive(self) -> int:
        lost = [i for i in range(self.size) if not self.alive(i)]
        if self.peers is not None:  # a worker one controller lost (it timed out there) is restarted for all
            every = cast("list[list[int]]", self.peers.gather(lost))
            lost = sorted(set(lost).union(*every))
        for i in lost:
            self._fail_worker(i, "it died")
        if lost:
            log.warning("respawning engine workers %s", lost)
            if self.owner:
                for i in lost:
                    self._kill(i)
            self._start(lost)
            self.respawned += len(lost)
        return len(lost)

    def _kill(self, i: int) -> None:
        """The owner ends worker ``i`` (hung, or lost by another controller) before it is started again."""
        if self.ray is not None:
            self.ray.kill(i)
        elif self.processes[i] is not None and self.processes[i].is_alive():
            self.processes[i].kill()
            self.processes[i].join(timeout=10)

    def close(self) -> None:
        """Stop the workers (the owner) or leave them (another controller), and remove the shared weights."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        # first: a worker that maps the file keeps its pages, and a close cut short (a second Ctrl-C during the joins
        # below, an engine slow to stop) must not leave the file in /dev/shm
        if self.weights is not None:
            remove(self.weights.path)
        for i, conn in enumerate(self._conns):
            if conn is not None and self.owner and self.alive(i):
                try:
                    conn.send(("stop", None))
                except OSError:
                    pass
        for conn in self._conns:
            if conn is not None:
                conn.close()
        if self.ray is not None:  # the workers' engines stop on ``stop``; their actors are killed after a moment
            deadline = time.monotonic() + 10
            while any(self.ray.exited(i) is None for i in range(self.size)) and time.monotonic() < deadline:
                time.sleep(0.1)
            self.ray.close()
        for process in self.processes if self.owner else []:
            if process is not None:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
                    process.join(timeout=5)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  interpreter shutdown: best effort
            pass

    # -- requests ----------------------------------------------------------------------------
    def submit(self, kind: JobKind, args: tuple, workers: Sequence[int], role: Role | Literal[""] = "",
               base: int | None = None) -> Job:
        """Queue a request for any of ``workers``; it is sent as soon as one of them is free. ``base``: a generate
        request's rollout started at this weight version (``Job.base``)."""
        if not workers:
            raise GcoreError(f"no engine worker to run a {kind} request for role {role!r}")
        with self._lock:
            job = Job(next(self._ids), kind, args, tuple(workers), role, base=base)
            if kind in ("sync", "role"):  # they load the latest weights
                job.version = self.version
            self._jobs[job.id] = job
            self._pending.append(job)
            self._dispatch()
            return job

    def wait(self, jobs: Iterable[Job], first: bool = False) -> list[Job]:
        """Wait until every job (or, with ``first``, at least one) is done; returns the done ones. Another thread
        may wait at the same time: whichever holds the lock pumps (a round of at most 0.2 s) and handles the replies
        of every request, the other looks at its jobs again meanwhile."""
        jobs = list(jobs)
        while True:
            done = [j for j in jobs if j.done]
            if len(done) == len(jobs) or (first and done):
                for j in done:
                    if not j.ok:
                        raise GcoreError(j.errors[-1] if j.errors else f"{j.kind} request failed")
                return done
            if self._lock.acquire(timeout=0.05):
                try:
                    self._pump(0.2)
                finally:
                    self._lock.release()

    def generate(self, role: Role, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 workers: Sequence[int], visual: Sequence[VisualInputs | None] | None = None,
                 base: int | None = None, hold: bool | None = None) -> list[list[Generation]]:
        """``prompts`` split into one request per worker; the results in the order of ``prompts``. ``visual``: each
        prompt's images (image prompts). ``base`` and ``hold``: as ``submit_split``'s."""
        return self.collect_generate(self.submit_split("generate", role, prompts, params, workers, None, visual,
                                                       base, hold))

    def submit_generate(self, role: Role, prompts: Sequence[Sequence[int]], params: SamplingParams,
                        workers: Sequence[int], visual: Sequence[VisualInputs | None] | None = None,
                        seed: int | None = None, base: int | None = None, hold: bool | None = None) -> list[Job]:
        """Send ``generate``'s requests and return at once; ``collect_generate`` waits for them. With a ``seed``,
        request ``i`` samples from ``seed + i`` whichever worker serves it (``_WorkerRuntime.generate``): the
        samples depend on the prompts and the seed, not on the worker or on what it ran before. ``visual``: each
        prompt's images (image prompts). ``base``, ``hold``: as ``submit_split``'s."""
        return self.submit_split("generate", role, prompts, params, workers, seed, visual, base, hold)

    def collect_generate(self, jobs: list[Job]) -> list[list[Generation]]:
        """Wait for requests of ``submit_generate``; their results in the order of its prompts."""
        return cast("list[list[Generation]]", self.collect(jobs))

    def submit_split(self, kind: Literal["generate", "logprobs", "token_logprobs"], role: Role,
                     prompts: Sequence[Sequence[int]], option: object, workers: Sequence[int], seed: int | None = None,
                     visual: Sequence[VisualInputs | None] | None = None, base: int | None = None,
                     hold: bool | None = None, starts: Sequence[int] | None = None) -> list[Job]:
        """``prompts`` split into one ``kind`` request per worker, each ``(role, its prompts, option)``; a
        ``generate`` request also carries its seed (``seed + i`` for request ``i``, or ``None``) and its prompts'
        ``visual`` inputs (or ``None``); a ``logprobs`` request its prompts' ``visual`` inputs where there are
        any (text prompts keep the three-item request); a ``token_logprobs`` request its sequences' ``starts``.
        Returns at once (``collect`` waits). With partial
        rollouts: ``base``, the weight version the rollout started at (``Job.base``); ``hold``, for a test's
        ``worker.HOLD_ENV`` only: whether the worker holds this request for an update (``None``: its own rule),
        never once an update came since ``base`` (none would come for it: the next waits for this rollout)."""
        if not prompts:
            return []
        chunk = math.ceil(len(prompts) / len(workers))

        def extra(i: int, start: int) -> tuple:
            images = None if visual is None else list(visual[start : start + chunk])
            if kind == "logprobs":
                return () if images is None else (images,)
            if kind == "token_logprobs":
                assert starts is not None  # ``PoolEngine.token_logprobs`` gives them
                return (list(starts[start : start + chunk]),)
            partial = self.partial_rollouts and role == POLICY
            return (None if seed is None else seed + i, images,
                    partial if not partial or hold is None else ("hold" if hold else "free"))

        with self._lock:  # the version read and the requests sent with no sync between them
            if hold is not None:
                self._rollout_out.set()
            if hold and base is not None and self.version != base:
                hold = False
            return [self.submit(kind, (role, [list(p) for p in prompts[s : s + chunk]], option, *extra(i, s)),
                                workers, role, base) for i, s in enumerate(range(0, len(prompts), chunk))]

    def expect_rollout(self) -> None:
        """Test only (``worker.HOLD_ENV``): a rollout started ahead in a thread will send a generation that says
        whether it is held (``submit_split``'s ``hold``); the next weight sync waits until it has gone out."""
        if self._hold_test and self.partial_rollouts:
            self._rollout_out.clear()

    def collect(self, jobs: list[Job]) -> list[object]:
        """Wait for requests of ``submit_split``; their results (one per prompt) in the order of its prompts."""
        self.wait(jobs)
        return [out for job in jobs for out in cast("list[object]", job.result)]

    def assign(self, roles: Sequence[Role]) -> float:
        """Give worker ``i`` the role ``roles[i]`` (a real swap where it changes); returns seconds. Each carries the
        latest weights: a worker swapped back to the policy loads them (a weight sync sent while it held another
        role went to the policy workers only)."""
        started = time.perf_counter()
        jobs = []
        with self._lock:
            weights = self._latest_weights()
            for i, role in enumerate(roles):
                if role != self.roles[i]:
                    self.roles[i] = role  # a respawned worker starts in its new role
                    jobs.append(self.submit("role", (role, weights), [i], role))
            self._readers = [j for j in self._readers if not j.done] + [j for j in jobs if j.role == POLICY]
        self.wait(jobs)
        return time.perf_counter() - started

    def sync_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Copy the trainer's weights into shared memory, and from there into every policy engine.

        A worker takes requests in order, so the update reaches each engine after the generation it
        was sent before. With ``queue_syncs`` (rollouts that run while the controller trains) this
        returns once the update is queued, without waiting for the generation in flight; it waits only
        for the previous update to be loaded, so that the shared memory is never rewritten while a
        worker copies from it. ``bytes`` is then what was queued (the shared size per policy worker).
        In a pool shared by several controllers the owner sends the update and waits for it; every
        controller calls this at the same point and returns when the workers have it.
        """
        started = time.perf_counter()
        if not self.owner:  # the owner sends the weights every controller holds; wait until the workers have them
            assert self.peers is not None  # only a shared pool has other controllers
            self.peers.barrier()
            return {"bytes": 0.0, "shm_bytes": 0.0, "copy_s": 0.0, "load_s": 0.0, "s": time.perf_counter() - started}
        named = [(name, tensor.detach()) for name, tensor in named]
        if self._hold_test and not self._rollout_out.wait(HOLD_GUARD_S):
            log.warning("weight sync: the rollout started ahead sent no generation within %.0f s (%s)",
                        HOLD_GUARD_S, HOLD_ENV)
        self.wait(self._syncs)
        while True:  # no role change that reads the shared weights may be under way (another thread's ``assign``)
            with self._lock:
                readers = self._readers = [j for j in self._readers if not j.done]
                if not readers:
                    # the lock is held to the last sync sent: no role change starts meanwhile, and every request
                    # sent after it finds the worker's sync ahead of it
                    self._lock.acquire()
                    break
            self.wait(readers)
        try:
            copied, nbytes, jobs = self._send_syncs(named)
        finally:
            self._lock.release()
        if self.queue_syncs and self.peers is None:
            self._syncs = jobs
            loaded = nbytes * len(jobs)
        else:  # a shared pool waits: another controller's next request must find the new weights
            self.wait(jobs)
            # the bytes each worker loaded (none by a lost one: it loads them when started again)
            loaded = sum(int(cast(SupportsInt, j.result or 0)) for j in jobs)
            if self.peers is not None:
                self.peers.barrier()
        end = time.perf_counter()
        return {"bytes": float(loaded), "shm_bytes": float(nbytes), "copy_s": copied - started,
                "load_s": end - copied, "s": end - started}

    def _send_syncs(self, named: list[tuple[str, torch.Tensor]]) -> tuple[float, int, list[Job]]:
        """The weights into shared memory (or Ray's object store), and a sync to every policy worker (the lock
        held); returns when the copy ended, the bytes of one copy, and the syncs."""
        if self.ray is not None:  # into Ray's object store, staged on every worker actor
            self.ray.put_weights(named)
            nbytes = self.ray.nbytes
        else:
            if self.weights is None:
                self.weights = create_shared(named)
            views = dict(self.weights.views())
            if set(views) != {name for name, _ in named}:
                raise GcoreError("weight sync: the trainer's parameter names changed since the first sync")
            for name, tensor in named:
                views[name].copy_(tensor)
            self.weights.version += 1
            nbytes = self.weights.nbytes
        self.version += 1
        copied = time.perf_counter()
        return copied, nbytes, [self._send_sync(i) for i in range(self.size) if self.roles[i] == POLICY]

    def _latest_weights(self) -> tuple | None:
        """What a worker is told to load the latest policy weights from: the shared-memory file's ``ref()``, or the
        version staged in Ray's object store; ``None`` before the first sync."""
        if self.ray is not None:
            return self.ray.latest()
        return self.weights.ref() if self.weights is not None else None

    def _send_sync(self, i: int) -> Job:
        """Worker ``i``'s weight sync: queued behind its requests, or, during a partial rollout's generation (a
        ``generate`` request that says ``partial``), sent at once: the worker takes it between two tokens."""
        weights = self._latest_weights()
        assert weights is not None  # set by sync_weights
        running = self._busy_with[i]
        conn = self._conns[i]
        # with ``partial_rollouts`` every policy generate request says ``partial`` (``submit_split``, dynamic placement)
        generating = running is not None and running.kind == "generate" and running.role == POLICY
        if not (self.partial_rollouts and generating and conn is not None and i not in self._side):
            return self.submit("sync", (weights,), [i])
        job = Job(next(self._ids), "sync", (weights,), (i,), worker=i, sent=time.monotonic(), attempts=1,
                  version=self.version)
        self._jobs[job.id] = job
        self._side[i] = job
        self._holds[i] = self.version  # its next request starts with these weights
        try:
            conn.send((job.kind, job.id, *job.args))
        except OSError:  # it died: noticed by the next ``_pump``
            self._drop(i)
        return job

    # -- dispatcher --------------------------------------------------------------------------
    def _takes(self, i: int) -> bool:
        """Whether worker ``i`` may be sent a request now: it is idle, or it loads a weight sync and has nothing
        queued behind it. A worker serves its requests in order, so a request sent behind a sync starts as soon as
        the weights are loaded, not at the controller's next call to the pool (which, with ``queue_syncs``, may be
        a whole training step later: the worker would idle through it)."""
        if not (self._ready[i] and self.alive(i)):
            return False
        running = self._busy_with[i]
        return running is None or (running.kind == "sync" and i not in self._queued)

    def _dispatch(self) -> None:
        for job in list(self._pending):
            free = [i for i in job.workers if self._takes(i)]
            if not free:
                continue
            # an idle worker first, and a retry to another worker; each controller sharing the pool starts its search
            # at its own place in it, so that their first requests do not all queue at worker 0
            i = min(free, key=lambda w: (w in job.failed_on, self._busy_with[w] is not None,
                                         (w - self._first) % self.size))
            job.worker, job.sent, job.attempts = i, time.monotonic(), job.attempts + 1
            if job.kind in ("sync", "role"):  # the worker serves them in order: what comes next finds these weights
                self._holds[i] = max(self._holds[i], job.version)
            elif job.kind == "generate":
                job.version = self._holds[i]
            if self._busy_with[i] is None:
                self._busy_with[i] = job
            else:  # behind the sync it loads; its job timeout counts from when it starts (``_handle``)
                self._queued[i] = job
            self._pending.remove(job)
            conn = self._conns[i]
            assert conn is not None  # alive
            try:
                conn.send((job.kind, job.id, *job.args))
            except OSError:  # it died: noticed by the next ``_pump``
                self._drop(i)

    def _pump(self, timeout: float) -> None:
        """Take replies, notice dead or hung workers, and send what waits."""
        self._receive(timeout)
        now = time.monotonic()
        for i, job in enumerate(self._busy_with):
            if job is None:
                continue
            if not self.alive(i):
                self._receive(0)  # its last reply may still be in its pipe
                if self._busy_with[i] is job:  # said in one line, the moment it is seen
                    what = self._death(i)
                    log.warning("engine worker %d (pid %s) %s while this controller waited on its %s request", i,
                                self.pids[i], what, job.kind)
                    self._fail_worker(i, f"pid {self.pids[i]} {what}")
            elif self.job_timeout_s and now - job.sent > self.job_timeout_s:
                log.warning("engine worker %d did not answer in %.0fs: dropping it", i, self.job_timeout_s)
                if self.owner:
                    self._kill(i)
                self._drop(i)  # the owner restarts it at the next ``revive``
                self._fail_worker(i, f"it did not answer within job_timeout_s {self.job_timeout_s:.0f}s")
        self._revive_if_stuck()
        self._dispatch()

    def _drop(self, i: int) -> None:
        """Stop using worker ``i`` (dead or hung): close this controller's connection to it."""
        conn, self._conns[i] = self._conns[i], None
        if conn is not None:
            conn.close()

    def _receive(self, timeout: float) -> None:
        """Handle every reply that is in (waiting up to ``timeout`` for the first)."""
        from multiprocessing.connection import wait

        while True:
            readers = {conn: i for i, conn in enumerate(self._conns) if conn is not None}
            # the connections it was given, those with something to read
            ready = cast("list[Connection]", wait(list(readers), timeout)) if readers else []
            if not ready:
                return
            for conn in ready:
                try:
                    reply = conn.recv()
                except (EOFError, OSError):  # the worker is gone (a cut reply counts as none)
                    self._drop(readers[conn])
                    continue
                self._handle(reply)
            timeout = 0

    def _handle(self, reply: Reply) -> None:
        kind, i, job_id, payload = reply  # "result" or "error" ("ready" and "fatal" come on the startup pipe)
        job = self._jobs.get(job_id) if job_id is not None else None
        if job is None or job.done or job.worker != i:
            return  # a late answer to a request that was already sent elsewhere
        if self._side.get(i) is job:  # a partial rollout's weight sync: the generation goes on
            del self._side[i]
        else:  # the request queued behind it, if any, is running now
            self._busy_with[i] = queued = self._queued.pop(i, None)
            if queued is not None:
                queued.sent = time.monotonic()
        if kind == "result":
            job.result, job.busy_s = cast("tuple[object, float]", payload)
            if job.kind == "generate" and job.base is not None and self.partial_rollouts:
                job.result = self._rebase(cast("list[list[Generation]]", job.result), job.version - job.base)
            job.done = job.ok = True
            if job.kind in ("generate", "logprobs", "token_logprobs", "score"):
                self.busy[job.role] = self.busy.get(job.role, 0.0) + job.busy_s
                self.served[self.nodes[i]] = self.served.get(self.nodes[i], 0) + 1
            elif job.kind == "role":
                self.swaps += 1
                self.held[i] = cast("tuple[Role, ...]", job.result)  # ``_WorkerRuntime.switch``'s
            del self._jobs[job.id]
        else:
            self._retry(job, i, f"engine worker {i} raised:\n{payload}")

    @staticmethod
    def _rebase(outputs: list[list[Generation]], shift: int) -> list[list[Generation]]:
        """A generate request's results with their token versions counted from its rollout's start instead of the
        request's: ``shift`` updates came between the two (a later turn of an episode, a request sent after a
        sync). ``versions`` stays ``None`` where every token is of the rollout's first version."""
        if not shift:
            return outputs
        return [[replace(g, versions=[shift + v for v in (g.versions or [0] * len(g.token_ids))]) for g in row]
                for row in outputs]

    def _fail_worker(self, i: int, why: str) -> None:
        job, self._busy_with[i] = self._busy_with[i], None
        self._ready[i] = False
        side = self._side.pop(i, None)
        if side is not None:  # a respawned worker loads the latest weights
            self._retry(side, i, f"engine worker {i} failed during a partial rollout ({why})")
        if job is not None:
            self._retry(job, i, f"engine worker {i} failed on a {job.kind} request ({why})")
        queued = self._queued.pop(i, None)
        if queued is not None:
            self._retry(queued, i, f"engine worker {i} failed before a {queued.kind} request queued behind a weight "
                                   f"sync started ({why})")

    def _retry(self, job: Job, worker: int, error: str) -> None:
        job.errors.append(error)
        job.failed_on.add(worker)
        job.worker = None
        if job.kind not in ("generate", "logprobs", "token_logprobs", "score"):  # a role change or sync of a dead
            # worker: respawned later
            job.done, job.ok = True, True
            del self._jobs[job.id]
            return
        if job.attempts > self.retries:
            job.done, job.ok = True, False
            job.errors.append(
                f"engine workers failed {job.attempts} times on a {job.role} request of {len(job.args[1])} "
                f"{'samples' if job.kind == 'score' else 'prompts'}; no result of it was used. Last failure: {error}"
            )
            del self._jobs[job.id]
            return
        self.retried += 1
        log.warning("retrying a %s request on another engine worker: %s", job.role, error.splitlines()[0])
        self._pending.insert(0, job)

    def _revive_if_stuck(self) -> None:
        """A request whose every allowed worker is dead gets those workers respawned (or, in a pool
        shared with other controllers, which restart workers together between steps, fails)."""
        for job in self._pending:
            if not any(self.alive(i) for i in job.workers):
                if self.peers is not None and job.kind in ("sync", "role"):  # started again with the latest
                    # weights and its role at the next step (``revive``, every controller at once)
                    self._pending.remove(job)
                    job.done = job.ok = True
                    del self._jobs[job.id]
                    return
                if self.peers is not None:
                    self._pending.remove(job)
                    job.done, job.ok = True, False
                    job.errors.append(f"every engine worker that may serve this {job.role or job.kind} request "
                                      f"({list(job.workers)}) is lost; they are restarted when the next step starts")
                    return
                self.revive()
                return

