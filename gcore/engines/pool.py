"""Engine worker processes: the "devices" that placement policies assign roles to (CPU cores, or shares of a GPU).

An engine runtime: ``PoolEngine`` is an ``Engine`` whose ``generate`` runs on worker processes.
Which worker holds which role, and when, is decided by a placement policy; the policies start a
pool through ``gcore/placement/launch.py``.

A ``WorkerPool`` owns ``size`` worker processes (``torch.multiprocessing`` spawn, each with its own
``torch.set_num_threads`` budget, started with ``OMP_NUM_THREADS`` and a passive OpenMP wait policy unless the
user set them: ``gcore/threads.py``). Their engines run on the pool's ``device``: the CPU, or the controller's
GPU, which the workers then share (each holds its own copy of its role's model there).
Every worker holds one awake *role* at a time: the policy engine (``policy``), the judge engine
(``judge``), both built from the configured, not yet set-up ``Engine`` objects the trainer was
given, or a rule-based reward (``reward``, any ``Scorer``) that scores samples.
Changing a worker's role is a real swap: the old engine is
put to sleep and, with ``release=True`` (the CPU default), shut down so its memory is freed; the new
one wakes up, or is loaded again from its checkpoint (the policy then takes the latest weights from
shared memory).

Requests travel over local ``multiprocessing`` queues (OS pipes, no sockets). Policy weights go
from the trainer to the workers through one shared-memory file in ``/dev/shm`` (no disk): the
trainer copies its tensors in once, every worker copies them into its engine.

Faults: a worker that dies, answers with an error, or does not answer within ``job_timeout_s`` (it
is then killed) has its request sent again to another worker of the same role, or to a respawned
one; after ``retries`` further attempts the request fails with a ``GcoreError`` and no result of it
is used.
"""

# the role names and request kinds are Literal types: comparing one with another spelling is an error
# mypy: strict-equality

from __future__ import annotations

import itertools
import logging
import math
import os
import pickle
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, SupportsInt, TypeAlias, assert_never, cast

import torch

from gcore.engines.base import JUDGE, POLICY, REWARD, Engine, Role
from gcore.errors import GcoreError
from gcore.model import ModelSource
from gcore.threads import spawning, worker_threads
from gcore.types import Generation, Sample, SamplingParams

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.queues import Queue

log = logging.getLogger(__name__)

__all__ = ["JUDGE", "POLICY", "REWARD", "Job", "JobKind", "PoolEngine", "Reply", "Role", "RoleSpec", "Scorer",
           "SharedWeights", "WorkerPool"]

#: what a request asks of a worker (``_worker_main``): sample with its engine, read next-token log-probabilities
#: from it, score with its reward, take a role, load the shared weights; ``stop`` (no ``Job``) ends the worker
JobKind: TypeAlias = Literal["generate", "logprobs", "score", "role", "sync"]
#: what a worker answers: it started, it could not start, a request's result, a request's error
ReplyKind: TypeAlias = Literal["ready", "fatal", "result", "error"]
#: a worker's answer: (kind, worker index, job id or ``None``, payload: (result, busy seconds) or a traceback)
Reply: TypeAlias = tuple[ReplyKind, int, int | None, object]


class Scorer(Protocol):
    """What a worker needs of a rule-based reward (a ``gcore.rewards.RewardModel`` is one)."""

    last_errors: int

    def setup(self, device: torch.device) -> None: ...

    def score(self, samples: Sequence[Sample]) -> list[float]: ...


@dataclass
class RoleSpec:
    """How a worker builds the engine of one role (or, with ``reward``, the reward it scores with)."""

    engine: Engine | None  # configured but not set up: it is pickled into every worker
    source: ModelSource | None = None  # what the engine loads
    reward: Scorer | None = None  # a rule-based reward: the role scores samples instead of generating


@dataclass
class SharedWeights:
    """Policy weights in one shared-memory file: ``layout`` is (name, dtype, shape, byte offset)."""

    path: str
    nbytes: int
    layout: list[tuple[str, torch.dtype, tuple[int, ...], int]]
    version: int = 0

    def views(self) -> list[tuple[str, torch.Tensor]]:
        storage = torch.UntypedStorage.from_file(self.path, shared=True, nbytes=self.nbytes)
        out = []
        for name, dtype, shape, offset in self.layout:
            item = torch.empty((), dtype=dtype).element_size()
            # torch's stub lists set_(storage, offset, size) only with a stride; without one torch takes the
            # contiguous strides
            view = torch.empty(0, dtype=dtype).set_(storage, offset // item, shape)  # type: ignore[call-overload]
            out.append((name, view))
        return out

    def ref(self) -> tuple[str, int, list, int]:
        return (self.path, self.nbytes, self.layout, self.version)


@dataclass(eq=False)
class Job:
    """One request to a worker; ``workers`` are the ones allowed to serve it."""

    id: int
    kind: JobKind
    args: tuple
    workers: tuple[int, ...]
    role: Role | Literal[""] = ""  # "": a request that serves no role (a weight sync)
    worker: int | None = None
    sent: float = 0.0
    attempts: int = 0
    done: bool = False
    ok: bool = False
    result: object = None
    busy_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    failed_on: set[int] = field(default_factory=set)


def _worker_main(index: int, threads: int, seed: int, specs: bytes, role: Role, weights: tuple | None,
                 release: bool, device: str, requests: Queue[tuple], replies: Connection) -> None:
    """The worker's loop: build its engine, then serve requests until told to stop. A request is
    ``(kind, job id, *args)`` (``("stop", None)`` ends the loop); ``replies`` is this worker's own pipe."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        runtime = _WorkerRuntime(pickle.loads(specs), release, torch.device(device))
        runtime.switch(role, weights)
    except BaseException:  # noqa: BLE001  report why it could not start, whatever it was, then exit
        _send(replies, ("fatal", index, None, traceback.format_exc()))
        return
    _send(replies, ("ready", index, None, None))
    while True:
        message = requests.get()
        if message[0] == "stop":
            return
        kind: JobKind = message[0]
        job_id: int = message[1]
        try:
            started = time.perf_counter()
            result = _serve(runtime, kind, message[2:])
            _send(replies, ("result", index, job_id, (result, time.perf_counter() - started)))
        except Exception:  # noqa: BLE001  an engine may fail in any way: the pool retries elsewhere or reports it
            _send(replies, ("error", index, job_id, traceback.format_exc()))


def _send(replies: Connection, reply: Reply) -> None:
    """Answer the pool (a ``Reply``: its kind is checked where it is written)."""
    replies.send(reply)


def _serve(runtime: _WorkerRuntime, kind: JobKind, args: tuple) -> object:
    """One request in the worker: its result, which the pool reads as ``kind`` says."""
    if kind == "generate":
        role, prompts, params = args
        return runtime.generate(role, prompts, params)
    if kind == "logprobs":
        role, prompts, candidates = args
        return runtime.next_token_logprobs(role, prompts, candidates)
    if kind == "score":
        return runtime.score(*args)
    if kind == "role":
        return runtime.switch(*args)
    if kind == "sync":
        (weights,) = args
        return runtime.sync(weights)
    assert_never(kind)


class _WorkerRuntime:
    """Inside a worker: its engines, which one is awake, and how roles are swapped."""

    def __init__(self, specs: dict[Role, RoleSpec], release: bool, device: torch.device) -> None:
        self.specs, self.release, self.device = specs, release, device
        self.engines: dict[Role, Engine | Scorer] = {}
        self.role: Role | None = None

    def _engine(self, role: Role) -> Engine:
        """The engine ``role`` holds (not a rule-based reward's)."""
        held = self.engines[role]
        if not isinstance(held, Engine):
            raise RuntimeError(f"the {role} role holds a rule-based reward, not an engine")
        return held

    def _load(self, role: Role, weights: tuple | None) -> Engine | Scorer:
        spec = self.specs[role]
        if spec.reward is not None:
            reward = pickle.loads(pickle.dumps(spec.reward))
            reward.setup(torch.device("cpu"))  # rule-based: Python on the CPU
            return reward
        engine = pickle.loads(pickle.dumps(spec.engine))  # a fresh copy of the configured engine
        assert spec.source is not None, f"the {role} role has an engine but no ModelSource"
        engine.setup(spec.source, self.device)
        if role == POLICY and weights is not None:
            engine.update_weights(SharedWeights(*weights).views())
        return engine

    def switch(self, role: Role, weights: tuple | None) -> tuple[Role, ...]:
        """Make ``role`` the awake engine (sleep/release the other one); returns the engines held."""
        if role == self.role:
            return tuple(sorted(self.engines))
        if self.role is not None:
            old = self.engines[self.role]
            if isinstance(old, Engine):
                old.sleep()
            if self.release:
                if isinstance(old, Engine):
                    old.shutdown()
                del self.engines[self.role]
        if role in self.engines:
            held = self.engines[role]
            if isinstance(held, Engine):
                held.wake_up()
            if role == POLICY and weights is not None:
                self._engine(role).update_weights(SharedWeights(*weights).views())
        else:
            self.engines[role] = self._load(role, weights)
        self.role = role
        return tuple(sorted(self.engines))

    def generate(self, role: Role, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        if role != self.role:
            raise RuntimeError(f"worker holds the {self.role} engine, asked to run the {role} engine")
        return self._engine(role).generate(prompts, params)

    def next_token_logprobs(self, role: Role, prompts: list[list[int]], candidates: list[int]) -> list[list[float]]:
        if role != self.role:
            raise RuntimeError(f"worker holds the {self.role} engine, asked to run the {role} engine")
        return self._engine(role).next_token_logprobs(prompts, candidates)

    def score(self, role: Role, samples: list[Sample]) -> tuple[list[float], int]:
        """The reward of each sample, and how many failed (``Scorer.last_errors``)."""
        if role != self.role:
            raise RuntimeError(f"worker holds the {self.role} role, asked to score as {role}")
        reward = self.engines[role]
        if isinstance(reward, Engine):
            raise RuntimeError(f"the {role} role holds an engine, not a rule-based reward")
        return reward.score(samples), reward.last_errors

    def sync(self, weights: tuple) -> int:
        if POLICY not in self.engines:  # released: it loads the latest weights when it wakes up
            return 0
        return self._engine(POLICY).update_weights(SharedWeights(*weights).views())


class WorkerPool:
    """``size`` engine worker processes and a dispatcher for their requests.

    Args:
        size: worker processes.
        specs: role name -> how to build its engine.
        roles: the awake role of each worker at start.
        threads: ``torch.set_num_threads`` of each worker; 0: each worker's share of this process's threads, or
            the user's ``OMP_NUM_THREADS`` (``gcore.threads.worker_threads``).
        seed: workers are seeded ``seed + index``.
        release: free a sleeping engine's memory (reload it on wake-up) instead of ``Engine.sleep`` only.
        job_timeout_s: a request not answered in this time kills its worker and is sent elsewhere.
        retries: further attempts for a failed request before the step fails.
        startup_timeout_s: how long a worker may take to load its engine.
        device: where the workers' engines run: ``cpu``, or one GPU (``cuda:0``) that they share.
    """

    def __init__(self, size: int, specs: dict[Role, RoleSpec], roles: Sequence[Role], threads: int = 0, seed: int = 0,
                 release: bool = True, job_timeout_s: float = 600.0, retries: int = 2,
                 startup_timeout_s: float = 900.0, device: str = "cpu") -> None:
        if size < 1 or len(roles) != size:
            raise GcoreError(f"a worker pool needs >= 1 worker and one role per worker, got {size} and {list(roles)}")
        for role in roles:
            if role not in specs:
                raise GcoreError(f"worker role {role!r} has no engine; roles with one: {', '.join(specs)}")
        import torch.multiprocessing as mp

        self.size, self.threads, self.seed, self.release = size, threads or worker_threads(size), seed, release
        self.job_timeout_s, self.retries, self.startup_timeout_s = job_timeout_s, retries, startup_timeout_s
        self.device = device
        self._specs = pickle.dumps(specs)
        self._ctx = mp.get_context("spawn")
        # one pipe per worker: a worker killed mid-reply blocks no other
        self._replies: list[Connection | None] = [None] * size
        self.roles: list[Role] = list(roles)
        self.processes: list = [None] * size
        self._requests: list = [None] * size
        self._ready = [False] * size
        self._busy_with: list[Job | None] = [None] * size
        self._jobs: dict[int, Job] = {}
        self._pending: list[Job] = []
        self._ids = itertools.count()
        self.weights: SharedWeights | None = None
        #: weight syncs return once queued, without waiting for the generation in flight (``sync_weights``)
        self.queue_syncs = False
        self._syncs: list[Job] = []  # the last queued sync's requests
        self.busy: dict[str, float] = {}
        self.retried = 0
        self.respawned = 0
        self.swaps = 0  # role changes done by workers
        self.held: list[tuple[Role, ...]] = [(role,) for role in roles]  # engines resident in each worker
        self._fatal: dict[int, str] = {}  # why a worker could not start
        self.closed = False
        self._spawn(range(size))
        self._wait_ready(range(size))

    # -- processes ---------------------------------------------------------------------------
    def _spawn(self, indices: Iterable[int]) -> None:
        for i in indices:
            dead = self._replies[i]
            if dead is not None:  # a dead worker's pipe
                dead.close()
            self._requests[i] = self._ctx.Queue()
            self._replies[i], writer = self._ctx.Pipe(duplex=False)
            self._ready[i] = False
            self.held[i] = (self.roles[i],)
            weights = self.weights.ref() if self.weights is not None else None
            process = self._ctx.Process(
                target=_worker_main, name=f"gcore-engine-worker-{i}", daemon=True,
                args=(i, self.threads, self.seed + i, self._specs, self.roles[i], weights, self.release,
                      self.device, self._requests[i], writer),
            )
            with spawning(self.threads):  # its OpenMP reads these when it imports torch
                process.start()
            writer.close()  # the worker holds the only writing end: its death reads as end of file
            self.processes[i] = process

    def _wait_ready(self, indices: Iterable[int]) -> None:
        waiting = set(indices)
        deadline = time.monotonic() + self.startup_timeout_s
        while waiting:
            if time.monotonic() > deadline:
                raise GcoreError(f"engine workers {sorted(waiting)} did not start within {self.startup_timeout_s:.0f}s")
            self._pump(0.5)
            for i in list(waiting):
                if self._ready[i]:
                    waiting.discard(i)
                elif not self.processes[i].is_alive() and not self._ready[i]:
                    self._receive(0)
                    if not self._ready[i]:
                        why = self._fatal.get(i, "").strip().splitlines()[-1:] or ["no error reported"]
                        raise GcoreError(f"engine worker {i} exited while starting (exit code "
                                         f"{self.processes[i].exitcode}): {why[0]}")

    def alive(self, i: int) -> bool:
        return self.processes[i] is not None and self.processes[i].is_alive()

    def revive(self) -> int:
        """Respawn dead workers (with their roles and the latest weights); returns how many."""
        dead = [i for i in range(self.size) if not self.alive(i)]
        for i in dead:
            self._fail_worker(i, "it died")
        if dead:
            log.warning("respawning engine workers %s", dead)
            self._spawn(dead)
            self._wait_ready(dead)
            self.respawned += len(dead)
        return len(dead)

    def close(self) -> None:
        """Stop the workers and remove the shared weights."""
        if self.closed:
            return
        self.closed = True
        for i, process in enumerate(self.processes):
            if process is not None and process.is_alive():
                self._requests[i].put(("stop", None))
        for process in self.processes:
            if process is not None:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
                    process.join(timeout=5)
        for conn in self._replies:
            if conn is not None:
                conn.close()
        if self.weights is not None and os.path.exists(self.weights.path):
            os.unlink(self.weights.path)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  interpreter shutdown: best effort
            pass

    # -- requests ----------------------------------------------------------------------------
    def submit(self, kind: JobKind, args: tuple, workers: Sequence[int], role: Role | Literal[""] = "") -> Job:
        """Queue a request for any of ``workers``; it is sent as soon as one of them is free."""
        if not workers:
            raise GcoreError(f"no engine worker to run a {kind} request for role {role!r}")
        job = Job(next(self._ids), kind, args, tuple(workers), role)
        self._jobs[job.id] = job
        self._pending.append(job)
        self._dispatch()
        return job

    def wait(self, jobs: Iterable[Job], first: bool = False) -> list[Job]:
        """Wait until every job (or, with ``first``, at least one) is done; returns the done ones."""
        jobs = list(jobs)
        while True:
            done = [j for j in jobs if j.done]
            if len(done) == len(jobs) or (first and done):
                for j in done:
                    if not j.ok:
                        raise GcoreError(j.errors[-1] if j.errors else f"{j.kind} request failed")
                return done
            self._pump(0.2)

    def generate(self, role: Role, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 workers: Sequence[int]) -> list[list[Generation]]:
        """``prompts`` split into one request per worker; the results in the order of ``prompts``."""
        return self.collect_generate(self.submit_generate(role, prompts, params, workers))

    def submit_generate(self, role: Role, prompts: Sequence[Sequence[int]], params: SamplingParams,
                        workers: Sequence[int]) -> list[Job]:
        """Send ``generate``'s requests and return at once; ``collect_generate`` waits for them."""
        if not prompts:
            return []
        chunk = math.ceil(len(prompts) / len(workers))
        return [self.submit("generate", (role, [list(p) for p in prompts[s : s + chunk]], params), workers, role)
                for s in range(0, len(prompts), chunk)]

    def collect_generate(self, jobs: list[Job]) -> list[list[Generation]]:
        """Wait for requests of ``submit_generate``; their results in the order of its prompts."""
        self.wait(jobs)
        return [out for job in jobs for out in cast("list[list[Generation]]", job.result)]

    def assign(self, roles: Sequence[Role]) -> float:
        """Give worker ``i`` the role ``roles[i]`` (a real swap where it changes); returns seconds."""
        started = time.perf_counter()
        weights = self.weights.ref() if self.weights is not None else None
        jobs = []
        for i, role in enumerate(roles):
            if role != self.roles[i]:
                self.roles[i] = role  # a respawned worker starts in its new role
                jobs.append(self.submit("role", (role, weights), [i], role))
        self.wait(jobs)
        return time.perf_counter() - started

    def sync_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Copy the trainer's weights into shared memory, and from there into every policy engine.

        A worker takes requests in order, so the update reaches each engine after the generation it
        was sent before. With ``queue_syncs`` (rollouts that run while the controller trains) this
        returns once the update is queued, without waiting for the generation in flight; it waits only
        for the previous update to be loaded, so that the shared memory is never rewritten while a
        worker copies from it. ``bytes`` is then what was queued (the shared size per policy worker).
        """
        started = time.perf_counter()
        named = [(name, tensor.detach()) for name, tensor in named]
        if self.weights is None:
            self.weights = _create_shared(named)
        self.wait(self._syncs)
        views = dict(self.weights.views())
        if set(views) != {name for name, _ in named}:
            raise GcoreError("weight sync: the trainer's parameter names changed since the first sync")
        for name, tensor in named:
            views[name].copy_(tensor)
        self.weights.version += 1
        copied = time.perf_counter()
        jobs = [self.submit("sync", (self.weights.ref(),), [i]) for i in range(self.size)
                if self.roles[i] == POLICY]
        if self.queue_syncs:
            self._syncs = jobs
            loaded = self.weights.nbytes * len(jobs)
        else:
            self.wait(jobs)
            loaded = sum(int(cast(SupportsInt, j.result)) for j in jobs)  # the bytes each worker loaded
        end = time.perf_counter()
        return {"bytes": float(loaded), "shm_bytes": float(self.weights.nbytes), "copy_s": copied - started,
                "load_s": end - copied, "s": end - started}

    # -- dispatcher --------------------------------------------------------------------------
    def _dispatch(self) -> None:
        for job in list(self._pending):
            free = [i for i in job.workers if self._ready[i] and self._busy_with[i] is None and self.alive(i)]
            if not free:
                continue
            i = min(free, key=lambda w: (w in job.failed_on, w))  # a retry goes to another worker first
            job.worker, job.sent, job.attempts = i, time.monotonic(), job.attempts + 1
            self._busy_with[i] = job
            self._pending.remove(job)
            self._requests[i].put((job.kind, job.id, *job.args))

    def _pump(self, timeout: float) -> None:
        """Take replies, notice dead or hung workers, and send what waits."""
        self._receive(timeout)
        now = time.monotonic()
        for i, job in enumerate(self._busy_with):
            if job is None:
                continue
            if not self.alive(i):
                self._receive(0)  # its last reply may still be in its pipe
                if self._busy_with[i] is job:
                    self._fail_worker(i, f"it died (exit code {self.processes[i].exitcode})")
            elif self.job_timeout_s and now - job.sent > self.job_timeout_s:
                log.warning("engine worker %d did not answer in %.0fs: killing it", i, self.job_timeout_s)
                self.processes[i].kill()
                self.processes[i].join(timeout=10)
                self._fail_worker(i, f"it did not answer within job_timeout_s {self.job_timeout_s:.0f}s")
        self._revive_if_stuck()
        self._dispatch()

    def _receive(self, timeout: float) -> None:
        """Handle every reply that is in (waiting up to ``timeout`` for the first)."""
        from multiprocessing.connection import wait

        while True:
            readers = {conn: i for i, conn in enumerate(self._replies) if conn is not None}
            # the connections it was given, those with something to read
            ready = cast("list[Connection]", wait(list(readers), timeout)) if readers else []
            if not ready:
                return
            for conn in ready:
                try:
                    reply = conn.recv()
                except (EOFError, OSError):  # the worker is gone (a cut reply counts as none)
                    conn.close()
                    self._replies[readers[conn]] = None
                    continue
                self._handle(reply)
            timeout = 0

    def _handle(self, reply: Reply) -> None:
        kind, i, job_id, payload = reply
        if kind == "ready":
            self._ready[i] = True
            return
        if kind == "fatal":
            log.error("engine worker %d failed to start:\n%s", i, payload)
            self._fatal[i] = cast(str, payload)  # the traceback
            self._ready[i] = False
            return
        job = self._jobs.get(job_id) if job_id is not None else None
        if job is None or job.done or job.worker != i:
            return  # a late answer to a request that was already sent elsewhere
        self._busy_with[i] = None
        if kind == "result":
            job.result, job.busy_s = cast("tuple[object, float]", payload)
            job.done = job.ok = True
            if job.kind in ("generate", "logprobs", "score"):
                self.busy[job.role] = self.busy.get(job.role, 0.0) + job.busy_s
            elif job.kind == "role":
                self.swaps += 1
                self.held[i] = cast("tuple[Role, ...]", job.result)  # ``_WorkerRuntime.switch``'s
            del self._jobs[job.id]
        else:
            self._retry(job, i, f"engine worker {i} raised:\n{payload}")

    def _fail_worker(self, i: int, why: str) -> None:
        job, self._busy_with[i] = self._busy_with[i], None
        self._ready[i] = False
        if job is not None:
            self._retry(job, i, f"engine worker {i} failed on a {job.kind} request ({why})")

    def _retry(self, job: Job, worker: int, error: str) -> None:
        job.errors.append(error)
        job.failed_on.add(worker)
        job.worker = None
        if job.kind not in ("generate", "logprobs", "score"):  # a role change or sync of a worker that died: it is respawned later
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
        """A request whose every allowed worker is dead gets those workers respawned."""
        for job in self._pending:
            if not any(self.alive(i) for i in job.workers):
                self.revive()
                return


def _create_shared(named: list[tuple[str, torch.Tensor]]) -> SharedWeights:
    layout, offset = [], 0
    for name, tensor in named:
        offset = (offset + 63) // 64 * 64
        layout.append((name, tensor.dtype, tuple(tensor.shape), offset))
        offset += tensor.numel() * tensor.element_size()
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if root is None:
        raise GcoreError("weight sync to engine workers needs /dev/shm (shared memory) on this machine")
    path = os.path.join(root, f"gcore-weights-{os.getpid()}-{id(named):x}")
    with open(path, "wb") as f:
        f.truncate(max(offset, 1))
    return SharedWeights(path, max(offset, 1), layout)


class PoolEngine(Engine):
    """The ``Engine`` a controller (or a generative reward) calls: one role on a set of pool workers.

    ``workers`` is the current partition of that role (a placement policy changes it between
    steps). ``generate`` splits the prompts over them; ``update_weights`` syncs the policy through
    shared memory to every worker that holds it.
    """

    def __init__(self, pool: WorkerPool, role: Role, workers: Sequence[int]) -> None:
        self.pool, self.role, self.workers = pool, role, list(workers)
        self.last_sync: dict[str, float] = {}

    def setup(self, source: ModelSource, device: torch.device) -> None:
        """The workers loaded the engine already."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        return self.pool.generate(self.role, prompts, params, self.workers)

    def next_token_logprobs(self, prompts: Sequence[Sequence[int]], candidates: Sequence[int]) -> list[list[float]]:
        """Split over the role's workers like ``generate``; the results in the order of ``prompts``."""
        if not prompts:
            return []
        chunk = math.ceil(len(prompts) / len(self.workers))
        jobs = [self.pool.submit("logprobs", (self.role, [list(p) for p in prompts[s : s + chunk]], list(candidates)),
                                 self.workers, self.role) for s in range(0, len(prompts), chunk)]
        self.pool.wait(jobs)
        return [row for job in jobs for row in cast("list[list[float]]", job.result)]

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        if self.role != POLICY:
            raise GcoreError(f"weight sync goes to the policy engine, not the {self.role} engine")
        self.last_sync = self.pool.sync_weights(weights)
        return int(self.last_sync["bytes"])

    def shutdown(self) -> None:
        self.pool.close()
