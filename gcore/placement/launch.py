"""How the placement policies start engine worker pools (``gcore/engines/pool/``) for their roles.

``launch_workers`` builds a pool whose workers hold the policy engine, the reward's generative
judge (found through ``RewardModel.judges``) or a rule-based reward, and points the reward at the
judge workers; ``PoolReward`` scores a rule-based reward on the ``reward`` workers.
"""

# the role names and request kinds are Literal types: comparing one with another spelling is an error
# mypy: strict-equality

from __future__ import annotations

import logging
import math
import pickle
from collections.abc import Sequence
from typing import cast

import torch

from gcore.engines.base import JUDGE, POLICY, REWARD, Engine, Role
from gcore.engines.pool import Peers, PoolEngine, RoleSpec, WorkerPool
from gcore.errors import ConfigError
from gcore.model import ModelSource
from gcore.rewards.base import RewardModel
from gcore.threads import usable_cores
from gcore.types import Sample

log = logging.getLogger(__name__)


class PoolReward(RewardModel):
    """A rule-based reward scored on a set of pool workers (the ``reward`` role), split like generation."""

    def __init__(self, pool: WorkerPool, workers: Sequence[int]) -> None:
        self.pool, self.workers = pool, list(workers)

    def score(self, samples: Sequence[Sample]) -> list[float]:
        if not samples:
            return []
        chunk = math.ceil(len(samples) / len(self.workers))
        jobs = [self.pool.submit("score", (REWARD, list(samples[s : s + chunk])), self.workers, REWARD)
                for s in range(0, len(samples), chunk)]
        self.pool.wait(jobs)
        results = [cast("tuple[list[float], int]", job.result) for job in jobs]  # (scores, errors) per request
        self.last_errors = sum(errors for _, errors in results)
        return [value for scores, _ in results for value in scores]


def launch_workers(
    option: str,
    engine: Engine,
    reward: RewardModel,
    *,
    source: ModelSource,
    device: torch.device,
    roles: Sequence[Role],
    threads: int,
    seed: int,
    release: bool,
    job_timeout_s: float,
    retries: int,
    reward_workers: bool = False,
    peers: Peers | None = None,
    liveness_timeout_s: float = 30.0,
    ray_address: str = "",
) -> tuple[WorkerPool, PoolEngine, PoolEngine | None]:
    """Start a pool with the policy engine and (if the reward has one) the generative judge's engine.

    Args:
        option: the flag that asked for workers, named in errors.
        engine: the policy engine, configured but not set up (it is pickled into every worker).
        reward: the run's reward; its judge (``RewardModel.judges``) is built on the ``judge`` workers
            and the reward is pointed at them (``Judge.use``); then the reward is set up here.
        source: the policy checkpoint the workers load.
        device: where the workers' engines run: the CPU, or this controller's GPU (shared by the workers).
        roles: the starting role of each worker (``policy``, ``judge`` or ``reward``).
        threads, seed, release, job_timeout_s, retries: as ``WorkerPool``'s.
        reward_workers: with no generative judge, workers may take the ``reward`` role (the
            rule-based reward, scored through a ``PoolReward``).
        peers: the controllers that share the pool (``WorkerPool``'s); ``None``: this controller's own.
        liveness_timeout_s: as ``WorkerPool``'s: the run's ``--trainer.heartbeat_timeout``
            (``PlacementPolicy.heartbeat_timeout``).
        ray_address: as ``WorkerPool``'s: the workers are actors of the Ray cluster there (``peers``: the job's).

    Returns the pool, the policy's ``PoolEngine`` and the judge's (``None`` without a judge).
    """
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{option}: engine worker processes run on the CPU or a CUDA GPU, not on {device.type}; "
                          "use --placement static without workers (engines in the controller's process)")
    judges = reward.judges()
    if len(judges) > 1:
        raise ConfigError(f"{option}: engine workers hold one generative judge, the reward has {len(judges)}")
    specs: dict[Role, RoleSpec] = {POLICY: RoleSpec(engine, source)}
    if judges:
        specs[JUDGE] = RoleSpec(judges[0].engine, judges[0].source)
    elif JUDGE in roles:
        raise ConfigError(f"{option}: a judge partition needs a generative judge (--reward generative, or "
                          "--reward combined with one)")
    elif reward_workers:
        specs[REWARD] = RoleSpec(None, reward=reward)
    for role, spec in specs.items():
        try:
            pickle.dumps(spec.reward if spec.reward is not None else spec.engine)
        except Exception as err:
            what = spec.reward if spec.reward is not None else spec.engine
            raise ConfigError(f"{option}: the {role} {type(what).__name__} cannot be sent to a "
                              f"worker process: {err}") from err
    pool = WorkerPool(len(roles), specs, roles, threads=threads, seed=seed, release=release,
                      job_timeout_s=job_timeout_s, retries=retries, device=str(device), peers=peers,
                      liveness_timeout_s=liveness_timeout_s, ray_address=ray_address)
    if pool.owner and not ray_address and pool.threads * len(roles) > usable_cores():
        log.info("%d engine workers x %d threads on %d cores: oversubscribed", len(roles), pool.threads, usable_cores())
    policy = PoolEngine(pool, POLICY, [i for i, r in enumerate(roles) if r == POLICY])
    judge = None
    if judges:
        judge = PoolEngine(pool, JUDGE, [i for i, r in enumerate(roles) if r == JUDGE])
        judges[0].use(judge)
    reward.setup(device)
    return pool, policy, judge
