"""The receiving side of the ``vllm`` engine's cross-process sync, run inside vLLM's worker process.

A vLLM weight-transfer backend (``gcore_broadcast``, registered by
:func:`gcore.engines.vllm_sync.register`): the worker joins a two-rank torch.distributed group with
the trainer (gloo on CPU, NCCL on GPU) and, per bucket, receives one broadcast byte buffer, cuts it
into the named tensors and streams them through the model's ``load_weights`` inside vLLM's
layerwise reload (started and finalized around the whole update, as for checkpoint-format weights).
Imports vLLM: only vLLM's factory loads this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from gcore.engines.vllm_sync import unpack


@dataclass
class BroadcastInitInfo(WeightTransferInitInfo):
    """Where the trainer listens, the group's backend, and the limit for every collective."""

    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float


@dataclass
class BroadcastUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: its tensors' names, dtypes and shapes, and the packed buffer's size."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    num_bytes: int


class BroadcastReceiver(WeightTransferEngine[BroadcastInitInfo, BroadcastUpdateInfo]):
    init_info_cls = BroadcastInitInfo
    update_info_cls = BroadcastUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401  passed through to vLLM's engine
        super().__init__(*args, **kwargs)
        self.group = None
        self.backend = "gloo"
        self.timeout = timedelta(seconds=600)

    def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.timeout = timedelta(seconds=init_info.timeout_s)
        self.backend = init_info.backend
        self.group = stateless_init_torch_distributed_process_group(
            init_info.host, init_info.port, 1, init_info.world_size, init_info.backend, timeout=self.timeout)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: BroadcastUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gcore_broadcast: update_weights before init_weight_transfer_engine")
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank = 0
        options.timeout = self.timeout
        device = self.device if self.backend == "nccl" else torch.device("cpu")  # gloo: host memory
        buffer = torch.empty(update_info.num_bytes, dtype=torch.uint8, device=device)
        self.group.broadcast([buffer], options).wait()
        self.model.load_weights(unpack(buffer, update_info.names, update_info.dtype_names, update_info.shapes))

    def shutdown(self) -> None:
        if self.group is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            stateless_destroy_torch_distributed_process_group(self.group)
            self.group = None
