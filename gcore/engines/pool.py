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

One pool serves every controller of a machine (``Peers``): the first controller there (its *owner*)
starts the workers, and every controller, the owner too, connects to each worker and sends it
requests itself; there is no process in between. Requests travel over ``multiprocessing.connection``
(a socket per controller and worker on the loopback interface, authenticated with a key the owner
draws and shares through ``torch.distributed``), a transport that runs across machines as it is (a
worker would listen on a routable address); today each machine's pool serves that machine's
controllers, since the weights reach the workers through the machine's shared memory. A worker serves
its controllers' requests one at a time, in the order they come. Policy weights go from the owner to
the workers through one shared-memory file in ``/dev/shm`` (no disk): the owner copies its tensors in
once (every controller holds the same weights after a step), every worker copies them into its engine.

Faults: a worker that dies, answers with an error, or does not answer within ``job_timeout_s`` (it
is then killed) has its request sent again to another worker of the same role, or to a respawned
one; after ``retries`` further attempts the request fails with a ``GcoreError`` and no result of it
is used.
"""

# the role names and request kinds are Literal types: comparing one with another spelling is an error
# mypy: strict-equality

from __future__ import annotations

import atexit
import itertools
import logging
import math
import os
import pickle
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, Protocol, SupportsInt, TypeAlias, assert_never, cast

import torch

from gcore.engines.base import JUDGE, POLICY, REWARD, Engine, EngineCapabilities, Role
from gcore.errors import GcoreError
from gcore.model import ModelSource
from gcore.threads import spawning, worker_threads
from gcore.types import Generation, Sample, SamplingParams, VisualInputs

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

log = logging.getLogger(__name__)

__all__ = ["JUDGE", "POLICY", "REWARD", "Job", "JobKind", "Peers", "PoolEngine", "Reply", "Role", "RoleSpec",
           "Scorer", "SharedWeights", "WorkerPool", "worker_devices"]

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


@dataclass
class Peers:
    """The controllers that share one pool: those of this machine, found through ``torch.distributed``.

    ``owner``: this controller starts and stops the workers and sends them the weights (the first
    controller of the machine). ``clients``: how many controllers connect to each worker.
    ``gather(value)``: every controller of the machine's ``value``, the owner's first (a collective of all
    controllers). ``barrier()``: every controller has reached it. ``machines``: how many machines run
    controllers (each with a pool of its own). ``index``: this controller's place among the machine's.
    """

    owner: bool
    clients: int
    gather: Callable[[object], list[object]]
    barrier: Callable[[], None]
    machines: int = 1
    index: int = 0  # this controller's place among the machine's (the owner's is 0)

    def share(self, value: object) -> object:
        """The owner's ``value``, on every controller of the machine (a collective)."""
        return self.gather(value if self.owner else None)[0]

    @classmethod
    def of_this_machine(cls) -> Peers | None:
        """The controllers of this machine, or ``None`` when this process is the only controller."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        rank, world = dist.get_rank(), dist.get_world_size()
        node = os.environ.get("NODE_RANK") or os.environ.get("GROUP_RANK") or "0"
        nodes: list[object] = [None] * world
        dist.all_gather_object(nodes, node)
        mine = [r for r, n in enumerate(nodes) if n == node]

        def gather(value: object) -> list[object]:
            gathered: list[object] = [None] * world
            dist.all_gather_object(gathered, value)
            return [gathered[r] for r in mine]

        return cls(owner=rank == mine[0], clients=len(mine), gather=gather, barrier=dist.barrier,
                   machines=len(set(nodes)), index=mine.index(rank))


def worker_devices(device: str, size: int, visible: int) -> list[str]:
    """The device of each of ``size`` workers: on CUDA with several ``visible`` GPUs, worker ``i`` takes
    ``cuda:(i % visible)`` (the partition is then of GPUs); otherwise all run on ``device``."""
    if device.startswith("cuda") and visible > 1:
        return [f"cuda:{i % visible}" for i in range(size)]
    return [device] * size


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
                 release: bool, device: str, clients: int, authkey: bytes, startup: Connection) -> None:
    """The worker's life: build its engine, say on ``startup`` (the owner's pipe) that it is ready and
    where it listens, take its ``clients`` controllers' connections, then serve their requests one at a
    time until told to stop or every controller is gone. A request is ``(kind, job id, *args)``
    (``("stop", None)`` ends the worker); each is answered on the connection it came on."""
    from multiprocessing.connection import Listener, wait

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        runtime = _WorkerRuntime(pickle.loads(specs), release, torch.device(device))
        runtime.switch(role, weights)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
    except BaseException:  # noqa: BLE001  report why it could not start, whatever it was, then exit
        _send(startup, ("fatal", index, None, traceback.format_exc()))
        return
    try:  # the engines are shut down however the worker ends: an engine's own processes (SGLang's) would
        # otherwise keep it alive (multiprocessing joins them at exit)
        _send(startup, ("ready", index, None, listener.address))
        controllers = [listener.accept() for _ in range(clients)]
        listener.close()
        while controllers:
            for conn in cast("list[Connection]", wait(controllers)):
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # that controller is gone
                    controllers.remove(conn)
                    continue
                if message[0] == "stop":
                    return
                kind: JobKind = message[0]
                job_id: int = message[1]

                def take_sync(conn: Connection = conn) -> None:
                    """A partial rollout's weight update, sent while its generation ran: load it and answer it."""
                    update = conn.recv()
                    if update[0] != "sync":
                        raise GcoreError(f"engine worker {index}: a {update[0]!r} request came during a partial "
                                         "rollout (only a weight sync may)")
                    started = time.perf_counter()
                    try:
                        loaded = runtime.sync(*update[2:])
                    except Exception:  # answered, or the controller waits for this sync forever; the generate fails
                        _send(conn, ("error", index, update[1], traceback.format_exc()))
                        raise
                    _send(conn, ("result", index, update[1], (loaded, time.perf_counter() - started)))

                try:
                    started = time.perf_counter()
                    result = _serve(runtime, kind, message[2:], conn.poll, take_sync)
                    reply: Reply = ("result", index, job_id, (result, time.perf_counter() - started))
                except Exception:  # noqa: BLE001  an engine may fail in any way: the pool retries or reports it
                    reply = ("error", index, job_id, traceback.format_exc())
                try:
                    _send(conn, reply)
                except OSError:  # that controller is gone
                    controllers.remove(conn)
    finally:
        runtime.shutdown()


def _send(replies: Connection, reply: Reply) -> None:
    """Answer the pool (a ``Reply``: its kind is checked where it is written)."""
    replies.send(reply)


def _serve(runtime: _WorkerRuntime, kind: JobKind, args: tuple, pending: Callable[[], bool] = lambda: False,
           take_sync: Callable[[], None] = lambda: None) -> object:
    """One request in the worker: its result, which the pool reads as ``kind`` says. ``pending``: whether another
    request came meanwhile; ``take_sync``: serve it, a weight update (partial rollouts: ``generate`` with
    ``partial``)."""
    if kind == "generate":  # (role, prompts, params[, seed or None[, each prompt's visual inputs or None[, partial]]])
        role, prompts, params, *extra = args
        seed, visual, partial = (*extra, None, None, False)[:3]
        if partial:
            return runtime.generate_partial(role, prompts, params, seed, visual, pending, take_sync)
        return runtime.generate(role, prompts, params, seed, visual)
    if kind == "logprobs":  # (role, prompts, candidates[, each prompt's visual inputs or None])
        role, prompts, candidates, *extra = args
        visual = extra[0] if extra else None
        return runtime.next_token_logprobs(role, prompts, candidates, visual)
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
        self.weights: tuple | None = None  # the latest policy weights sent (a ``SharedWeights.ref()``)

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
        """Make ``role`` the awake engine (sleep/release the other one); returns the engines held.
        ``weights``: the latest policy weights (``None``: the latest this worker was sent)."""
        self.weights = weights or self.weights
        weights = self.weights
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

    def _take(self, role: Role) -> None:
        """A request for another role than the awake one swaps first. The controllers change roles with ``role``
        requests where none of them has requests in flight; a request still on its way when another controller
        changed the split (rollouts that overlap training) is served, not refused."""
        if role != self.role:
            log.info("engine worker holds the %s role, swapping to serve a %s request", self.role, role)
            self.switch(role, None)

    def generate(self, role: Role, prompts: list[list[int]], params: SamplingParams,
                 seed: int | None = None, visual: list[VisualInputs | None] | None = None) -> list[list[Generation]]:
        """Sample with the ``role`` engine; with a ``seed``, from a random state drawn from it alone (not from
        what this worker sampled before), so that a request samples the same wherever and whenever it runs.
        ``visual``: each prompt's images (image prompts)."""
        self._take(role)
        if seed is not None:
            torch.manual_seed(seed)
        if visual is None:
            return self._engine(role).generate(prompts, params)
        return self._engine(role).generate(prompts, params, visual=visual)

    def generate_partial(self, role: Role, prompts: list[list[int]], params: SamplingParams, seed: int | None,
                         visual: list[VisualInputs | None] | None, pending: Callable[[], bool],
                         take_sync: Callable[[], None]) -> list[list[Generation]]:
        """``generate`` as a partial rollout: when a weight update comes during it (``pending``), the engine stops
        between tokens, the update is loaded (``take_sync``), and every unfinished generation continues from its
        tokens with the new weights (its prompt and tokens prefilled again: the KV cache of the old weights is not
        kept), one more version per update (``Generation.versions``). No token is thrown away."""
        self._take(role)
        engine = self._engine(role)
        if not engine.capabilities.interrupt:
            return self.generate(role, prompts, params, seed, visual)
        engine.interrupt = pending
        try:
            out = self.generate(role, prompts, params, seed, visual)
            budget, loads = params.max_new_tokens, 0

            def cut_short(g: Generation) -> bool:  # stopped by an update: neither finished nor at the budget
                return not g.finished and len(g.token_ids) < budget

            cut = [(i, j) for i, row in enumerate(out) for j, g in enumerate(row) if cut_short(g)]
            while cut:
                take_sync()  # the update is there: it is what stopped the engine
                loads += 1
                for left in sorted({budget - len(out[i][j].token_ids) for i, j in cut}):
                    group = [(i, j) for i, j in cut if budget - len(out[i][j].token_ids) == left]
                    more = self.generate(role, [prompts[i] + out[i][j].token_ids for i, j in group],
                                         replace(params, n=1, max_new_tokens=left), None,
                                         None if visual is None else [visual[i] for i, _ in group])
                    for (i, j), (extra,) in zip(group, more, strict=True):
                        g = out[i][j]
                        versions = (g.versions or [0] * len(g.token_ids)) + [loads] * len(extra.token_ids)
                        out[i][j] = Generation(g.token_ids + extra.token_ids, g.logprobs + extra.logprobs,
                                               extra.finished, versions)
                cut = [(i, j) for i, j in cut if cut_short(out[i][j])]
            return out
        finally:
            engine.interrupt = None

    def next_token_logprobs(self, role: Role, prompts: list[list[int]], candidates: list[int],
                            visual: list[VisualInputs | None] | None = None) -> list[list[float]]:
        """The ``role`` engine's next-token log-probabilities of ``candidates``; ``visual``: each prompt's images
        (a VLM judge's ``probability`` verdict on image prompts), passed only when given, as ``generate`` does."""
        self._take(role)
        if visual is None:
            return self._engine(role).next_token_logprobs(prompts, candidates)
        return self._engine(role).next_token_logprobs(prompts, candidates, visual=visual)

    def score(self, role: Role, samples: list[Sample]) -> tuple[list[float], int]:
        """The reward of each sample, and how many failed (``Scorer.last_errors``)."""
        self._take(role)
        reward = self.engines[role]
        if isinstance(reward, Engine):
            raise RuntimeError(f"the {role} role holds an engine, not a rule-based reward")
        return reward.score(samples), reward.last_errors

    def shutdown(self) -> None:
        """Shut down every engine held (the worker ends)."""
        for held in self.engines.values():
            if isinstance(held, Engine):
                held.shutdown()

    def sync(self, weights: tuple) -> int:
        self.weights = weights
        if POLICY not in self.engines:  # released: it loads the latest weights when it wakes up
            return 0
        return self._engine(POLICY).update_weights(SharedWeights(*weights).views())


class WorkerPool:
    """``size`` engine worker processes and this controller's dispatcher for their requests.

    Args:
        size: worker processes.
        specs: role name -> how to build its engine.
        roles: the awake role of each worker at start.
        threads: ``torch.set_num_threads`` of each worker; 0: each worker's share of this process's threads, or
            the user's ``OMP_NUM_THREADS`` (``gcore.threads.worker_threads``).
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
    """

    def __init__(self, size: int, specs: dict[Role, RoleSpec], roles: Sequence[Role], threads: int = 0, seed: int = 0,
                 release: bool = True, job_timeout_s: float = 600.0, retries: int = 2,
                 startup_timeout_s: float = 900.0, device: str = "cpu", peers: Peers | None = None) -> None:
        if size < 1 or len(roles) != size:
            raise GcoreError(f"a worker pool needs >= 1 worker and one role per worker, got {size} and {list(roles)}")
        for role in roles:
            if role not in specs:
                raise GcoreError(f"worker role {role!r} has no engine; roles with one: {', '.join(specs)}")
        import torch.multiprocessing as mp

        self.size, self.threads, self.seed, self.release = size, threads or worker_threads(size), seed, release
        self.job_timeout_s, self.retries, self.startup_timeout_s = job_timeout_s, retries, startup_timeout_s
        self.peers = peers
        self.owner = peers is None or peers.owner
        self._first = peers.index * size // peers.clients if peers is not None else 0  # where ``_dispatch`` looks first
        visible = torch.cuda.device_count() if device.startswith("cuda") else 0
        self.device, self.devices = device, worker_devices(device, size, visible)
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
        self.busy: dict[str, float] = {}
        self.retried = 0
        self.respawned = 0
        self.swaps = 0  # role changes done by workers
        self.held: list[tuple[Role, ...]] = [(role,) for role in roles]  # engines resident in each worker
        self.closed = False
        if not self._daemon:  # multiprocessing joins a non-daemonic child at exit: the workers are stopped before
            atexit.register(self.close)
        self._start(list(range(size)))

    # -- processes ---------------------------------------------------------------------------
    def _start(self, indices: list[int]) -> None:
        """The owner starts workers ``indices``; then every controller connects to them."""
        if self.owner:
            self._spawn(indices)
            self._wait_ready(indices)
        share = self.peers.share if self.peers is not None else (lambda value: value)
        self._authkey, addresses = cast("tuple[bytes, list[object]]",
                                        share((self._authkey, [self._addresses[i] for i in indices])))
        from multiprocessing.connection import Client

        for i, address in zip(indices, addresses, strict=True):
            old = self._conns[i]
            if old is not None:
                old.close()
            self._conns[i] = Client(address, authkey=self._authkey)  # type: ignore[arg-type]  # an (host, port)
            self._ready[i] = True
            self.held[i] = (self.roles[i],)

    def _spawn(self, indices: Iterable[int]) -> None:
        clients = self.peers.clients if self.peers is not None else 1
        for i in indices:
            self._ready[i] = False
            startup, writer = self._ctx.Pipe(duplex=False)
            self._startup[i] = startup
            weights = self.weights.ref() if self.weights is not None else None
            process = self._ctx.Process(
                target=_worker_main, name=f"gcore-engine-worker-{i}", daemon=self._daemon,
                args=(i, self.threads, self.seed + i, self._specs, self.roles[i], weights, self.release,
                      self.devices[i], clients, self._authkey, writer),
            )
            with spawning(self.threads):  # its OpenMP reads these when it imports torch
                process.start()
            writer.close()  # the worker holds the only writing end: its death reads as end of file
            self.processes[i] = process

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
                    raise GcoreError(f"engine worker {i} exited while starting (exit code "
                                     f"{self.processes[i].exitcode}): {why[0]}")
                self._addresses[i] = payload
                waiting.discard(i)

    def alive(self, i: int) -> bool:
        """Whether worker ``i`` is connected (and, for the owner, its process runs)."""
        if self._conns[i] is None:
            return False
        return not self.owner or (self.processes[i] is not None and self.processes[i].is_alive())

    def revive(self) -> int:
        """Respawn dead or lost workers (with their roles and the latest weights); returns how many.
        With ``peers`` a collective: every controller of the machine calls it at the same point."""
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
                    if self.processes[i] is not None and self.processes[i].is_alive():
                        self.processes[i].kill()
                        self.processes[i].join(timeout=10)
            self._start(lost)
            self.respawned += len(lost)
        return len(lost)

    def close(self) -> None:
        """Stop the workers (the owner) or leave them (another controller), and remove the shared weights."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        # first: a worker that maps the file keeps its pages, and a close cut short (a second Ctrl-C during the joins
        # below, an engine slow to stop) must not leave the file in /dev/shm
        if self.weights is not None and os.path.exists(self.weights.path):
            os.unlink(self.weights.path)
        for i, conn in enumerate(self._conns):
            if conn is not None and self.owner and self.alive(i):
                try:
                    conn.send(("stop", None))
                except OSError:
                    pass
        for conn in self._conns:
            if conn is not None:
                conn.close()
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
                 workers: Sequence[int], visual: Sequence[VisualInputs | None] | None = None) -> list[list[Generation]]:
        """``prompts`` split into one request per worker; the results in the order of ``prompts``. ``visual``: each
        prompt's images (image prompts)."""
        return self.collect_generate(self.submit_generate(role, prompts, params, workers, visual))

    def submit_generate(self, role: Role, prompts: Sequence[Sequence[int]], params: SamplingParams,
                        workers: Sequence[int], visual: Sequence[VisualInputs | None] | None = None,
                        seed: int | None = None) -> list[Job]:
        """Send ``generate``'s requests and return at once; ``collect_generate`` waits for them. With a ``seed``,
        request ``i`` samples from ``seed + i`` whichever worker serves it (``_WorkerRuntime.generate``): the
        samples depend on the prompts and the seed, not on the worker or on what it ran before. ``visual``: each
        prompt's images (image prompts)."""
        return self.submit_split("generate", role, prompts, params, workers, seed, visual)

    def collect_generate(self, jobs: list[Job]) -> list[list[Generation]]:
        """Wait for requests of ``submit_generate``; their results in the order of its prompts."""
        return cast("list[list[Generation]]", self.collect(jobs))

    def submit_split(self, kind: Literal["generate", "logprobs"], role: Role, prompts: Sequence[Sequence[int]],
                     option: object, workers: Sequence[int], seed: int | None = None,
                     visual: Sequence[VisualInputs | None] | None = None) -> list[Job]:
        """``prompts`` split into one ``kind`` request per worker, each ``(role, its prompts, option)``; a
        ``generate`` request also carries its seed (``seed + i`` for request ``i``, or ``None``) and its prompts'
        ``visual`` inputs (or ``None``); a ``logprobs`` request its prompts' ``visual`` inputs where there are
        any (text prompts keep the three-item request). Returns at once (``collect`` waits)."""
        if not prompts:
            return []
        chunk = math.ceil(len(prompts) / len(workers))

        def extra(i: int, start: int) -> tuple:
            images = None if visual is None else list(visual[start : start + chunk])
            if kind == "logprobs":
                return () if images is None else (images,)
            return (None if seed is None else seed + i, images, self.partial_rollouts and role == POLICY)

        return [self.submit(kind, (role, [list(p) for p in prompts[s : s + chunk]], option, *extra(i, s)), workers,
                            role) for i, s in enumerate(range(0, len(prompts), chunk))]

    def collect(self, jobs: list[Job]) -> list[object]:
        """Wait for requests of ``submit_split``; their results (one per prompt) in the order of its prompts."""
        self.wait(jobs)
        return [out for job in jobs for out in cast("list[object]", job.result)]

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
        In a pool shared by several controllers the owner sends the update and waits for it; every
        controller calls this at the same point and returns when the workers have it.
        """
        started = time.perf_counter()
        if not self.owner:  # the owner sends the weights every controller holds; wait until the workers have them
            assert self.peers is not None  # only a shared pool has other controllers
            self.peers.barrier()
            return {"bytes": 0.0, "shm_bytes": 0.0, "copy_s": 0.0, "load_s": 0.0, "s": time.perf_counter() - started}
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
        jobs = [self._send_sync(i) for i in range(self.size) if self.roles[i] == POLICY]
        if self.queue_syncs and self.peers is None:
            self._syncs = jobs
            loaded = self.weights.nbytes * len(jobs)
        else:  # a shared pool waits: another controller's next request must find the new weights
            self.wait(jobs)
            loaded = sum(int(cast(SupportsInt, j.result)) for j in jobs)  # the bytes each worker loaded
            if self.peers is not None:
                self.peers.barrier()
        end = time.perf_counter()
        return {"bytes": float(loaded), "shm_bytes": float(self.weights.nbytes), "copy_s": copied - started,
                "load_s": end - copied, "s": end - started}

    def _send_sync(self, i: int) -> Job:
        """Worker ``i``'s weight sync: queued behind its requests, or, during a partial rollout's generation (a
        ``generate`` request that says ``partial``), sent at once: the worker takes it between two tokens."""
        assert self.weights is not None  # set by sync_weights
        running = self._busy_with[i]
        conn = self._conns[i]
        # with ``partial_rollouts`` every policy generate request says ``partial`` (``submit_split``, dynamic placement)
        generating = running is not None and running.kind == "generate" and running.role == POLICY
        if not (self.partial_rollouts and generating and conn is not None and i not in self._side):
            return self.submit("sync", (self.weights.ref(),), [i])
        job = Job(next(self._ids), "sync", (self.weights.ref(),), (i,), worker=i, sent=time.monotonic(), attempts=1)
        self._jobs[job.id] = job
        self._side[i] = job
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
                if self._busy_with[i] is job:
                    code = self.processes[i].exitcode if self.owner and self.processes[i] is not None else None
                    self._fail_worker(i, "it died" + (f" (exit code {code})" if code is not None else ""))
            elif self.job_timeout_s and now - job.sent > self.job_timeout_s:
                log.warning("engine worker %d did not answer in %.0fs: dropping it", i, self.job_timeout_s)
                if self.owner:
                    self.processes[i].kill()
                    self.processes[i].join(timeout=10)
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
        if job.kind not in ("generate", "logprobs", "score"):  # a role change or sync of a dead worker: respawned later
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
                if self.peers is not None:
                    self._pending.remove(job)
                    job.done, job.ok = True, False
                    job.errors.append(f"every engine worker that may serve this {job.role or job.kind} request "
                                      f"({list(job.workers)}) is lost; they are restarted when the next step starts")
                    return
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

    #: the workers' engines take image prompts where the configured engine does (the trainer checks that one)
    capabilities = EngineCapabilities(images=True)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 visual: Sequence[VisualInputs | None] | None = None) -> list[list[Generation]]:
        return self.pool.generate(self.role, prompts, params, self.workers, visual)

    def next_token_logprobs(self, prompts: Sequence[Sequence[int]], candidates: Sequence[int],
                            visual: Sequence[VisualInputs | None] | None = None) -> list[list[float]]:
        """Split over the role's workers like ``generate``; the results in the order of ``prompts``. ``visual``: each
        prompt's images, which go with its request to the workers' engines (an engine there whose
        ``next_token_logprobs`` takes none fails the request: ``GenerativeReward`` refuses that before)."""
        jobs = self.pool.submit_split("logprobs", self.role, prompts, list(candidates), self.workers, visual=visual)
        return cast("list[list[float]]", self.pool.collect(jobs))

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        if self.role != POLICY:
            raise GcoreError(f"weight sync goes to the policy engine, not the {self.role} engine")
        self.last_sync = self.pool.sync_weights(weights)
        return int(self.last_sync["bytes"])

    def shutdown(self) -> None:
        self.pool.close()
