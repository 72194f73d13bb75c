"""Cross-process weight sync for the ``vllm`` engine: the sending side, and the plugin hook.

When vLLM's engine core runs in its own process (``--engine.separate_process``), the trainer's
tensors cannot be handed over in memory. vLLM's RL path for that case is its weight-transfer API:
the engine is built with a ``weight_transfer_config`` naming a backend, and the trainer drives the
workers' ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` through ``collective_rpc`` while it sends the bytes on a data plane of its
own. vLLM's built-in backends need CUDA (NCCL, CUDA IPC), so gcore registers one more backend,
``gcore_broadcast`` (:mod:`gcore.engines.vllm_receiver`): a two-rank torch.distributed group, gloo
on CPU and NCCL on GPU, over which the trainer (rank 0) broadcasts the weights in packed buckets.

This module imports nothing from vLLM at import time, so gcore imports without vLLM.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch

from gcore.engines.base import buckets
from gcore.errors import GcoreError

T = TypeVar("T")

BACKEND = "gcore_broadcast"
TIMEOUT_FLAG = "--engine.sync_timeout_s"


def register() -> None:
    """Register the ``gcore_broadcast`` backend with vLLM's weight-transfer factory.

    The ``vllm.general_plugins`` entry point of gcore's package: vLLM calls it in every process
    it starts (the engine core included) before building workers. Safe to call more than once.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "gcore.engines.vllm_receiver", "BroadcastReceiver")
    except ValueError:  # already registered in this process
        pass


ALIGN = 16  # every tensor starts at a multiple of this many bytes in a bucket, so any dtype can view it


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pack(bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
    """One flat byte buffer on ``device`` holding the bucket's tensors, and the metadata to cut it up."""
    sizes = [t.numel() * t.element_size() for _, t in bucket]
    buffer = torch.empty(sum(_padded(n) for n in sizes), dtype=torch.uint8, device=device)
    offset = 0
    for (_, tensor), nbytes in zip(bucket, sizes, strict=False):
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset : offset + nbytes].copy_(flat)
        offset += _padded(nbytes)
    meta = {
        "names": [name for name, _ in bucket],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "num_bytes": int(buffer.numel()),
    }
    return buffer, meta


def unpack(buffer: torch.Tensor, names: list[str], dtype_names: list[str],
           shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a buffer built by :func:`pack` (views into it, no copy)."""
    out, offset = [], 0
    for name, dtype_name, shape in zip(names, dtype_names, shapes, strict=False):
        dtype = getattr(torch, dtype_name)
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * dtype.itemsize
        out.append((name, buffer[offset : offset + nbytes].view(dtype).view(shape)))
        offset += _padded(nbytes)
    if offset != buffer.numel():
        raise GcoreError(f"weight bucket holds {buffer.numel()} bytes, its metadata describes {offset}")
    return out


def within(timeout_s: float, what: str, fn: Callable[[], T]) -> T:
    """``fn()``, or a :class:`GcoreError` naming ``what`` and the timeout flag after ``timeout_s``.

    ``fn`` runs on a daemon thread, so a transfer stuck in a collective cannot hold the caller (or
    the interpreter's exit) past the timeout; the group's own timeout ends the stuck call later.
    """
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller below
            result["error"] = err

    thread = threading.Thread(target=run, name="gcore-vllm-sync", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise GcoreError(
            f"vLLM weight sync: {what} did not finish within {timeout_s:g} s ({TIMEOUT_FLAG}); the vLLM engine "
            "process did not take part in the transfer (crashed, hung, or never joined the sync group)"
        )
    if "error" in result:
        err = result["error"]
        if isinstance(err, GcoreError):
            raise err
        raise GcoreError(f"vLLM weight sync: {what} failed: {type(err).__name__}: {err}") from err
    return cast(T, result.get("value"))


class BroadcastSender:
    """Rank 0 of the two-rank sync group; the vLLM worker (``BroadcastReceiver``) is rank 1.

    Args:
        rpc: calls a method on the vLLM workers (``LLM.collective_rpc``'s signature:
            ``rpc(method, timeout=..., kwargs=...)``).
        device: the trainer's device; picks the group's backend when ``backend`` is ``auto``.
        timeout_s: limit for the rendezvous and for every bucket.
        bucket_bytes: buckets hold at most this many bytes (a larger tensor travels alone).
        backend: ``auto`` (NCCL on CUDA, gloo otherwise), ``nccl`` or ``gloo``. NCCL needs the
            trainer and the engine on different GPUs; gloo works anywhere (through host memory).
    """

    def __init__(self, rpc: Callable[..., Any], device: torch.device, timeout_s: float, bucket_bytes: int,
                 backend: str = "auto") -> None:
        if backend not in ("auto", "gloo", "nccl"):
            raise GcoreError(f"--engine.sync_backend must be auto, gloo or nccl, not {backend!r}")
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        self.rpc = rpc
        self.backend = backend
        self.device = device if backend == "nccl" else torch.device("cpu")  # where the buckets are packed
        self.timeout_s = timeout_s
        self.bucket_bytes = max(1, int(bucket_bytes))
        self.group = None
        self.last_buckets = 0

    def _call_workers(self, method: str, **kwargs: Any) -> Any:  # noqa: ANN401  whatever the workers' method takes and returns
        return within(self.timeout_s, f"the workers' {method}",
                      lambda: self.rpc(method, timeout=self.timeout_s, kwargs=kwargs or None))

    def connect(self, host: str = "127.0.0.1") -> None:
        """Open the group: the workers join from their process while this one listens."""
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen()
        port = listener.getsockname()[1]
        init_info = {"host": host, "port": port, "world_size": 2, "backend": self.backend,
                     "timeout_s": self.timeout_s}
        joining: dict[str, Any] = {}

        def workers_join() -> None:
            try:
                self.rpc("init_weight_transfer_engine", timeout=self.timeout_s, kwargs={"init_info": init_info})
            except BaseException as err:  # noqa: BLE001 - reported by connect
                joining["error"] = err

        thread = threading.Thread(target=workers_join, name="gcore-vllm-sync-join", daemon=True)
        thread.start()
        self.group = within(self.timeout_s, f"opening the sync group ({self.backend}, port {port})",
                            lambda: stateless_init_torch_distributed_process_group(
                                host, port, 0, 2, self.backend, listen_socket=listener,
                                timeout=timedelta(seconds=self.timeout_s)))
        thread.join(self.timeout_s)
        if thread.is_alive() or "error" in joining:
            self.close()
            reason = "timed out" if thread.is_alive() else f"{type(joining['error']).__name__}: {joining['error']}"
            raise GcoreError(f"vLLM weight sync: the workers could not join the sync group ({reason}; "
                             f"{TIMEOUT_FLAG} {self.timeout_s:g})")

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Broadcast every tensor, bucket by bucket, while the workers receive and load; the bytes sent."""
        if self.group is None:
            raise RuntimeError("BroadcastSender.send called before connect")
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank = 0
        options.timeout = timedelta(seconds=self.timeout_s)
        sent, count = 0, 0
        self._call_workers("start_weight_update")
        for bucket in buckets(weights, self.bucket_bytes):
            buffer, meta = pack(bucket, self.device)
            receiving: dict[str, Any] = {}

            def receive(meta: dict[str, Any] = meta, receiving: dict[str, Any] = receiving) -> None:
                try:
                    self.rpc("update_weights", timeout=self.timeout_s, kwargs={"update_info": meta})
                except BaseException as err:  # noqa: BLE001 - reported below
                    receiving["error"] = err

            worker = threading.Thread(target=receive, name="gcore-vllm-sync-recv", daemon=True)
            worker.start()
            what = f"bucket {count + 1} ({len(bucket)} tensors, {meta['num_bytes'] / 2**20:.1f} MiB)"
            within(self.timeout_s, what, lambda buffer=buffer: self.group.broadcast([buffer], options).wait())
            worker.join(self.timeout_s)
            if worker.is_alive():
                raise GcoreError(f"vLLM weight sync: the workers did not load {what} within {self.timeout_s:g} s "
                                 f"({TIMEOUT_FLAG})")
            if "error" in receiving:
                error = receiving["error"]
                raise GcoreError(f"vLLM weight sync: the workers failed on {what}: {type(error).__name__}: {error}")
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
            count += 1
        self._call_workers("finish_weight_update")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_buckets = count
        return sent

    def close(self) -> None:
        if self.group is not None:
            try:
                from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

                stateless_destroy_torch_distributed_process_group(self.group)
            except Exception:  # noqa: BLE001 - best effort on teardown
                pass
            self.group = None
