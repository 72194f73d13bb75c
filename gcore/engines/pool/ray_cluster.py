"""Engine workers as Ray actors: one pool over the machines of a Ray cluster (``--placement.cluster ray``).

What Ray does here, and what it does not:

- **Ray places and supervises the workers.** Each worker is a Ray actor in a placement group of one bundle per
  worker (``{"CPU": threads}`` on CPU, ``{"GPU": 1}`` on GPU) spread over the cluster's nodes (``SPREAD``). A worker
  whose node is lost is placed again by the owner controller (``WorkerPool.revive``) in its bundle, which Ray
  re-reserves on the nodes left.
- **Requests do not go through Ray.** A worker actor runs the same loop as a local worker process
  (``worker.start_worker`` and ``worker.serve_worker``), listening on its node's address; every controller connects
  to every worker over the pool's authenticated sockets (``transport.py``) and sends its own requests, as on one
  machine. No process sits between a controller and a worker; Ray's driver API is used to start, stage weights
  and stop.
- **Weights go through Ray's object store**, not ``/dev/shm``: the owner puts the policy's tensors in buckets of at
  most ``BUCKET_BYTES`` (``ray.put``, each tensor as a numpy array of its bytes, which Ray stores and reads
  without a copy), hands the bucket references to every worker actor (``stage``, a Ray call: the
  references are counted, and freed when the next version replaces them), and then sends each policy worker its
  ``sync`` request on its socket, in order behind its earlier requests; the worker reads the buckets
  (``ray.get``, from whichever node holds them) and copies them into its engine. No shared file system or disk.

Each controller is a Ray driver of its own (``connect``); the owner (the job's first controller) starts the
workers and shares their addresses with the others through the controllers' collective (``Peers.of_the_job``),
where the split of the pool is also decided, identically on every controller.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from gcore.engines.pool.ray_weights import stage
from gcore.engines.pool.transport import first_line
from gcore.errors import ConfigError, GcoreError
from gcore.threads import thread_env

log = logging.getLogger(__name__)

#: the most bytes of one object of a weight hand-off in Ray's object store
BUCKET_BYTES = 256 << 20
#: how often the owner asks Ray whether a worker's actor still runs (``RayWorkers.exited``)
CHECK_S = 1.0
#: the Ray namespace of gcore's actors
NAMESPACE = "gcore"


def _ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise ConfigError("--placement.cluster ray needs the ray package: pip install 'gcore[cluster]'") from None
    return ray


def connect(address: str) -> bool:
    """Connect this process to the Ray cluster at ``address`` (``auto``: the one ``ray start`` left on this machine,
    or ``RAY_ADDRESS``), unless it is connected already; returns whether it connected now. A cluster that cannot
    be reached is a one-line ``ConfigError`` naming the address: gcore never starts a cluster of its own here."""
    ray = _ray()
    if ray.is_initialized():
        return False
    if not address:
        raise ConfigError("--placement.address is empty: give the Ray cluster's address (host:port of its head, or "
                          "auto for the one started on this machine with `ray start`)")
    _probe(address)
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    except Exception as err:  # noqa: BLE001  ConnectionError, ValueError, a timeout: said in one line
        raise ConfigError(f"--placement.address {address!r}: cannot reach a Ray cluster there ({first_line(err)}); "
                          "start one with `ray start --head` (docs/cluster.md)") from None
    return True


#: how long ``connect`` tries to open a TCP connection to a ``host:port`` address before it says it cannot
PROBE_S = 10.0


def _probe(address: str) -> None:
    """A ``host:port`` address that nothing answers on is refused at once: ``ray.init`` would retry it for
    minutes. ``auto`` and ``ray://`` addresses are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_S).close()
    except OSError as err:
        raise ConfigError(f"--placement.address {address!r}: cannot reach a Ray cluster there (nothing answers: "
                          f"{first_line(err)}); start one with `ray start --head` (docs/cluster.md)") from None


def cluster_threads(size: int) -> int:
    """Each of ``size`` CPU workers' share of the connected cluster's CPUs (at least 1): a Ray pool's threads per
    worker where the user gave no ``--placement.threads``. Neither the controller's cores nor its
    ``OMP_NUM_THREADS`` (which Lightning Fabric sets to each controller's share of its own machine) say anything
    about the cluster's nodes."""
    return max(1, int(_ray().cluster_resources().get("CPU", 0)) // size)


def check_resources(size: int, threads: int, gpu: bool, address: str) -> None:
    """Refuse in one line a cluster with fewer CPUs (or GPUs) than ``size`` workers need."""
    ray = _ray()
    have = ray.cluster_resources()
    kind, each = ("GPU", 1) if gpu else ("CPU", threads)
    need = size * each
    if have.get(kind, 0) < need:
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        raise ConfigError(f"--placement.address {address!r}: the Ray cluster has {have.get(kind, 0):g} {kind}s on "
                          f"{nodes} node(s); {size} engine workers x {each} {kind} need {need} "
                          "(give fewer --placement.workers or --placement.threads, or add nodes)")


# ---------------------------------------------------------------------------------------------------------------
# The worker actor (one process per worker, on whichever node Ray placed its bundle)
# ---------------------------------------------------------------------------------------------------------------

class WorkerActor:
    """The body of a worker actor: ``start`` builds the engine and the listener, ``serve`` runs the worker's loop
    (it returns when the worker is told to stop or every controller is gone), ``stage`` takes a weight version's
    bucket references while ``serve`` runs (the actor has two threads)."""

    def start(self, index: int, threads: int, seed: int, specs: bytes, role: str, weights: tuple | None,
              release: bool, device: str, authkey: bytes, timeout_s: float) -> tuple[str, object, str, int]:
        """``("ready", address, node id, pid)``, or ``("fatal", traceback, node id, pid)``."""
        from gcore.engines.pool.worker import start_worker

        ray = _ray()
        node, pid = ray.get_runtime_context().get_node_id(), os.getpid()
        self.index = index
        try:
            self.runtime, self.listener = start_worker(index, threads, seed, specs, role,  # type: ignore[arg-type]
                                                       weights, release, device, authkey, timeout_s,
                                                       host=ray.util.get_node_ip_address())
        except BaseException:  # noqa: BLE001  said to the owner, which names this worker and ends the run
            return ("fatal", traceback.format_exc(), node, pid)
        return ("ready", self.listener.address, node, pid)

    def serve(self, clients: int, accept_s: float) -> None:
        from gcore.engines.pool.worker import serve_worker

        deadline = time.monotonic() + accept_s
        serve_worker(self.index, self.runtime, self.listener, clients, keep_waiting=lambda: time.monotonic() < deadline)

    def stage(self, version: int, refs: list) -> None:
        stage(version, refs)


# ---------------------------------------------------------------------------------------------------------------
# The owner's side
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RayWorkers:
    """The owner's handles on a pool's worker actors: their placement group, the actors, each one's ``serve`` call
    (done: the worker ended) and node; ``weights``: the latest staged version (``put_weights``)."""

    size: int
    threads: int
    gpu: bool
    address: str
    startup_timeout_s: float
    connected_here: bool = False
    group: Any = None
    actors: list[Any] = field(default_factory=list)
    starting: list[Any] = field(default_factory=list)  # (``start`` call, clients, accept seconds) until it answers
    serving: list[Any] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    pids: list[int | None] = field(default_factory=list)
    version: int = 0
    refs: list = field(default_factory=list)
    checked: dict[int, float] = field(default_factory=dict)  # worker -> when Ray last said it runs
    nbytes: int = 0

    @classmethod
    def connect(cls, size: int, threads: int, gpu: bool, address: str, startup_timeout_s: float) -> RayWorkers:
        """Connect to the cluster, check it has the devices, and reserve one bundle per worker over its nodes."""
        connected = connect(address)
        ray = _ray()
        try:
            threads = threads or cluster_threads(size)
            check_resources(size, threads, gpu, address)
            from ray.util.placement_group import placement_group, remove_placement_group

            bundle = {"GPU": 1.0, "CPU": 1.0} if gpu else {"CPU": float(threads)}
            group = placement_group([bundle] * size, strategy="SPREAD", name=f"gcore-pool-{os.getpid()}")
            try:
                ray.get(group.ready(), timeout=startup_timeout_s)
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(group)
                raise GcoreError(f"--placement.address {address!r}: Ray could not reserve {size} x {bundle} within "
                                 f"{startup_timeout_s:.0f}s") from None
        except BaseException:
            if connected:  # a pool that could not start leaves no Ray driver behind
                ray.shutdown()
            raise
        return cls(size, threads, gpu, address, startup_timeout_s, connected, group, [None] * size, [None] * size,
                   [None] * size, [""] * size, [None] * size)

    def device(self) -> str:
        """Where a worker's engine runs in its actor: the GPU Ray gave it, or the CPU."""
        return "cuda:0" if self.gpu else "cpu"

    def spawn(self, i: int, args: tuple, clients: int, accept_s: float) -> None:
        """Start worker ``i`` in its bundle (``args``: ``WorkerActor.start``'s) and its loop; ``ready`` reads how
        it started."""
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = ray.remote(max_concurrency=2)(WorkerActor)
        actor = actor_class.options(
            num_cpus=0 if self.gpu else self.threads, num_gpus=1 if self.gpu else 0, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i),
            runtime_env={"env_vars": thread_env(self.threads)},
        ).remote()
        self.actors[i] = actor
        self.checked.pop(i, None)
        if self.refs:  # the latest weights are there before it is told to load them
            actor.stage.remote(self.version, self.refs)
        self.serving[i] = None
        self.starting[i] = (actor.start.remote(*args), clients, accept_s)

    def ready(self, indices: list[int]) -> dict[int, tuple[str, object]]:
        """Wait for workers ``indices`` to start; each one's ``(kind, address or traceback)``; a started one begins
        serving."""
        ray = _ray()
        started = {self.starting[i][0]: i for i in indices}
        deadline = time.monotonic() + self.startup_timeout_s
        out: dict[int, tuple[str, object]] = {}
        while started:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GcoreError(f"engine workers {sorted(started.values())} did not start on the Ray cluster within "
                                 f"{self.startup_timeout_s:.0f}s")
            done, _ = ray.wait(list(started), num_returns=1, timeout=min(left, 5.0))
            for ref in done:
                i = started.pop(ref)
                try:
                    kind, payload, node, pid = ray.get(ref)
                except ray.exceptions.RayError as err:
                    kind, payload, node, pid = "fatal", first_line(err), "", None
                self.nodes[i], self.pids[i] = node, pid
                _, clients, accept_s = self.starting[i]
                self.starting[i] = None
                if kind == "ready":
                    self.serving[i] = self.actors[i].serve.remote(clients, accept_s)
                out[i] = (kind, payload)
        return out

    def exited(self, i: int) -> str | None:
        """How worker ``i`` ended (its actor died, its node was lost), or ``None`` while it runs. Ray is asked at most
        every ``CHECK_S`` per worker: the pool asks at every dispatch, and a worker that dies closes its sockets,
        which the pool sees at once."""
        ray = _ray()
        serving = self.serving[i]
        if serving is None:
            return None
        now = time.monotonic()
        if now - self.checked.get(i, -CHECK_S) < CHECK_S:
            return None
        done, _ = ray.wait([serving], timeout=0)
        if not done:
            self.checked[i] = now
            return None
        try:
            ray.get(serving)
        except ray.exceptions.RayError as err:
            return f"died on Ray node {self.nodes[i][:8]} ({first_line(err)})"
        return "ended"

    def kill(self, i: int) -> None:
        ray = _ray()
        if self.actors[i] is not None:
            ray.kill(self.actors[i], no_restart=True)

    def put_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Put the policy's tensors in Ray's object store (buckets of at most ``BUCKET_BYTES``), stage them on every
        worker actor (``latest`` is then the reference the workers' ``sync`` requests carry)."""
        ray = _ray()
        buckets: list[list[tuple[str, str, tuple[int, ...], Any]]] = [[]]
        size = nbytes = 0
        for name, tensor in named:
            n = tensor.numel() * tensor.element_size()
            if buckets[-1] and size + n > BUCKET_BYTES:
                buckets.append([])
                size = 0
            # as bytes in a numpy array: Ray stores and reads those without a copy (a torch tensor is pickled)
            flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            buckets[-1].append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), flat))
            size += n
            nbytes += n
        self.version += 1
        self.refs = [ray.put(bucket) for bucket in buckets]
        self.nbytes = nbytes
        staged = [actor.stage.remote(self.version, self.refs) for actor in self.actors if actor is not None]
        try:
            ray.get(staged, timeout=self.startup_timeout_s)
        except ray.exceptions.RayError as err:  # a worker that died meanwhile is respawned with the latest weights
            log.warning("staging weight version %d on a Ray worker failed: %s", self.version, first_line(err))

    def latest(self) -> tuple | None:
        """The reference of the latest staged weights (``None`` before the first sync)."""
        return ("ray", self.version, self.nbytes) if self.refs else None

    def close(self) -> None:
        """Kill the actors, free the bundles, and leave the cluster if this pool connected to it."""
        ray = _ray()
        if not ray.is_initialized():
            return
        for i in range(self.size):
            try:
                self.kill(i)
            except Exception:  # noqa: BLE001  gone already
                pass
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.group)
            except Exception:  # noqa: BLE001  the cluster is gone
                pass
        self.refs = []
        if self.connected_here:
            ray.shutdown()

