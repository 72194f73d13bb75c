"""megatron-core's process groups on top of Fabric's, and the batches the ranks of a group share.

One launcher: Lightning Fabric starts the processes and the default process group;
``init_parallel_state`` calls ``parallel_state.initialize_model_parallel`` on top of it and returns
this rank's place in the layout (``ParallelGroups``). The ranks that hold one copy of the model
(tensor x pipeline group, or tensor x context group) are separate controllers with separate samples:
they run on the union of their batches (``ParallelGroups.union``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from gcore.backends.common import concat_batches
from gcore.types import RolloutBatch

if TYPE_CHECKING:
    from lightning_fabric import Fabric

    from gcore.backends.sequence_parallel import SequenceParallelGroup, SequenceParallelMode


@dataclass
class ParallelGroups:
    """This rank's process groups, ranks and sizes in megatron-core's layout.

    ``mp`` is the model-parallel group (tensor x pipeline: one copy of the model), ``dp_cp`` the group
    gradients are summed over (data x context parallel), and ``data`` the group that trains on one
    union of batches (tensor x pipeline, or tensor x context: there is no pipeline with context parallelism).
    """

    device: torch.device
    tensor_parallel_size: int
    pipeline_parallel_size: int
    context_parallel_size: int
    collective_timeout_s: float  # megatron's groups fail a collective a peer does not join after this
    tp_group: Any
    tp_rank: int
    pp_group: Any
    pp_rank: int
    first_stage: bool
    last_stage: bool
    last_stage_rank: int
    mp_group: Any
    mp_size: int
    dp_group: Any
    dp_size: int
    dp_cp_group: Any
    dp_cp_size: int
    data_group: Any
    data_size: int
    data_rank: int
    cp: SequenceParallelGroup | None  # gcore's group over megatron's context-parallel group, None without CP
    # expert parallelism (MoE): the ranks that split a layer's experts, and the ranks holding the same experts
    expert_parallel_size: int = 1
    ep_group: Any = None
    ep_rank: int = 0
    expert_dp_group: Any = None  # expert gradients are summed over this group (dense ones over dp_cp_group)
    expert_dp_size: int = 1

    def cuda_calls(self) -> contextlib.AbstractContextManager:
        """Context for megatron's CUDA-assuming code (distributed optimizer, pipeline sends): CPU on a CPU run."""
        if self.device.type != "cpu":
            return contextlib.nullcontext()
        from gcore.backends.megatron.cpu import cuda_calls_on_cpu

        return cuda_calls_on_cpu()

    def all_reduce(self, values: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """``values`` reduced over ``group`` (the default group when ``None``), on the CPU."""
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            values = values.to(self.device)
            dist.all_reduce(values, op=op, group=group)
        return values.cpu()

    def union(self, batch: RolloutBatch) -> tuple[RolloutBatch, int]:
        """The concatenation of every peer's batch (the data group), and where this rank's rows start."""
        if self.data_size == 1:
            return batch, 0
        parts: list[RolloutBatch | None] = [None] * self.data_size
        dist.all_gather_object(parts, to_cpu(batch), group=self.data_group)
        offset = sum(len(p) for p in parts[: self.data_rank] if p is not None)
        return concat_batches([p for p in parts if p is not None]), offset

    def union_of_rows(self, own: RolloutBatch | None) -> RolloutBatch | None:
        """The concatenation of the peers' batches where some peers may have none (``None``: nobody has rows)."""
        if self.data_size == 1:
            return own
        parts: list[RolloutBatch | None] = [None] * self.data_size
        dist.all_gather_object(parts, to_cpu(own) if own is not None else None, group=self.data_group)
        held = [p for p in parts if p is not None]
        return concat_batches(held) if held else None


def init_parallel_state(fabric: Fabric, tensor_parallel_size: int, pipeline_parallel_size: int,
                        context_parallel_size: int, sequence_parallel_mode: SequenceParallelMode,
                        timeout: timedelta = default_pg_timeout, expert_parallel_size: int = 1) -> ParallelGroups:
    """Initialise megatron-core's parallel state over Fabric's processes (a process group of one when
    there is none) and seed megatron's random-number trackers; returns this rank's groups. A collective
    of megatron's groups fails after ``timeout`` (the trainer's ``--trainer.collective_timeout``)."""
    from megatron.core import parallel_state

    device = fabric.device
    if not dist.is_initialized():  # one process: a group of one, so megatron's collectives work
        import os
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    collective_timeout_s = timeout.total_seconds()  # a rank that never joins fails the others in time
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_parallel_size,
        expert_tensor_parallel_size=1,  # experts whole on each rank (split over expert-parallel ranks instead)
        create_gloo_process_groups=False,
        distributed_timeout_minutes=collective_timeout_s / 60,  # (a timedelta(minutes=...) inside)
    )
    mp_group = parallel_state.get_model_parallel_group()
    # the ranks that train on one union of batches: tensor x pipeline, or tensor x context (no PP with CP)
    if context_parallel_size > 1:
        from gcore.backends.megatron.context_parallel import context_parallel_group

        cp = context_parallel_group(sequence_parallel_mode)
        data_group = parallel_state.get_tensor_and_context_parallel_group()
    else:
        cp = None
        data_group = mp_group
    groups = ParallelGroups(
        device=device,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        context_parallel_size=context_parallel_size,
        collective_timeout_s=collective_timeout_s,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_group=parallel_state.get_pipeline_model_parallel_group(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        first_stage=parallel_state.is_pipeline_first_stage(),
        last_stage=parallel_state.is_pipeline_last_stage(),
        last_stage_rank=parallel_state.get_pipeline_model_parallel_last_rank(),
        mp_group=mp_group,
        mp_size=dist.get_world_size(mp_group),
        dp_group=parallel_state.get_data_parallel_group(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        # gradients are summed over data-parallel x context-parallel ranks (megatron's DDP does the same)
        dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        dp_cp_size=parallel_state.get_data_parallel_world_size(with_context_parallel=True),
        data_group=data_group,
        data_size=dist.get_world_size(data_group),
        data_rank=dist.get_rank(data_group),
        cp=cp,
        expert_parallel_size=expert_parallel_size,
        ep_group=parallel_state.get_expert_model_parallel_group(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        expert_dp_group=parallel_state.get_expert_data_parallel_group(),
        expert_dp_size=parallel_state.get_expert_data_parallel_world_size(),
    )
    if device.type == "cpu":
        from gcore.backends.megatron.cpu import install_cpu_adaptations

        install_cpu_adaptations(seed=1234)
    else:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return groups


def agree_on_keys(keys: list[str]) -> list[str]:
    """Metric names present on any rank (a rank without rows has none of the algorithm's)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return keys
    everyone: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, keys)
    return sorted({k for ks in everyone if ks is not None for k in ks})


def _map_tensors(batch: RolloutBatch, move: Callable[[torch.Tensor], torch.Tensor]) -> RolloutBatch:
    moved: dict[str, Any] = {f.name: move(getattr(batch, f.name)) for f in fields(batch)
                             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return replace(batch, **moved)


def to_cpu(batch: RolloutBatch) -> RolloutBatch:
    """The batch with its tensors on the CPU (to send it with ``all_gather_object``)."""
    return _map_tensors(batch, lambda t: t.cpu())


def to_device(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    """The batch with its tensors on ``device``."""
    return _map_tensors(batch, lambda t: t.to(device))
