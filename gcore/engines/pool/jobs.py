"""What the pool and its workers say to each other: the requests (``Job``), the answers (``Reply``), how a worker
builds a role (``RoleSpec``), and the controllers that share a pool (``Peers``)."""

# the role names and request kinds are Literal types: comparing one with another spelling is an error
# mypy: strict-equality

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeAlias

import torch

from gcore.engines.base import Engine, Role
from gcore.model import ModelSource
from gcore.types import Sample

#: what a request asks of a worker (``worker.worker_main``): sample with its engine, read next-token log-probabilities
#: from it, score with its reward, take a role, load the shared weights; ``stop`` (no ``Job``) ends the worker
JobKind: TypeAlias = Literal["generate", "logprobs", "token_logprobs", "score", "role", "sync"]
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
class Peers:
    """The controllers that share one pool: those of this machine, found through ``torch.distributed``.

    ``owner``: this controller starts and stops the workers and sends them the weights (the first
    controller of the machine). ``clients``: how many controllers connect to each worker.
    ``gather(value)``: every controller of the machine's ``value``, the owner's first (a collective of all
    controllers). ``barrier()``: every controller has reached it. ``machines``: how many pools the job's
    controllers form (one per machine, or one on a Ray cluster). ``index``: this controller's place among the
    pool's.
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

    @classmethod
    def of_the_job(cls) -> Peers | None:
        """Every controller of the job, on every machine, sharing one pool (a pool on a Ray cluster): the first
        controller (rank 0) owns it. ``None`` when this process is the only controller."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        rank, world = dist.get_rank(), dist.get_world_size()

        def gather(value: object) -> list[object]:
            gathered: list[object] = [None] * world
            dist.all_gather_object(gathered, value)
            return gathered

        return cls(owner=rank == 0, clients=world, gather=gather, barrier=dist.barrier, machines=1, index=rank)


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
    #: the pool's weight version (``WorkerPool.version``): a sync's or role change's, the one it loads; a generate
    #: request's, the one its worker held when it was sent (``-1``: not known yet)
    version: int = -1
    #: a generate request's rollout started at this weight version: with partial rollouts its results' token versions
    #: are counted from there (``WorkerPool._rebase``); ``None``: from the request's own start
    base: int | None = None

