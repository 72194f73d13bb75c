"""``PoolEngine``: the ``Engine`` a controller calls, one role on a set of the pool's workers."""

# mypy: strict-equality

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import torch

from gcore.engines.base import POLICY, Engine, EngineCapabilities, Role
from gcore.engines.pool.pool import WorkerPool
from gcore.errors import GcoreError
from gcore.model import ModelSource
from gcore.types import Generation, SamplingParams, VisualInputs


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

    def token_logprobs(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
                       temperature: float = 1.0) -> list[list[float]]:
        """Split over the role's workers like ``generate``; each sequence's log-probabilities from its start on, in
        the order of ``sequences`` (an engine there without ``token_logprobs`` fails the request: the distillation
        teacher refuses that before, on the configured engine)."""
        jobs = self.pool.submit_split("token_logprobs", self.role, sequences, temperature, self.workers,
                                      starts=starts)
        return cast("list[list[float]]", self.pool.collect(jobs))

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        if self.role != POLICY:
            raise GcoreError(f"weight sync goes to the policy engine, not the {self.role} engine")
        self.last_sync = self.pool.sync_weights(weights)
        return int(self.last_sync["bytes"])

    def shutdown(self) -> None:
        self.pool.close()
