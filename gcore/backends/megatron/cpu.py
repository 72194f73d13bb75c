"""The places where megatron-core 0.16.1 assumes CUDA, made to work on a CPU (gloo) run.

Everything else of megatron-core's local (no Transformer Engine) GPT model runs on CPU as is.
These adaptations are only installed when the run is on CPU (``install_cpu_adaptations`` after
``initialize_model_parallel``, ``keep_rotary_on_cpu`` on each model built):

1. ``parallel_state``'s global memory buffer (scratch space for the attention scores of the
   local ``DotProductAttention``) allocates on ``torch.cuda.current_device()``. It is replaced
   by a buffer that allocates on the CPU.
2. The tensor-parallel RNG tracker (``tensor_parallel.get_cuda_rng_tracker``) saves and restores
   the CUDA generator around dropout. It is replaced by a tracker with the same interface that
   forks the CPU generator.
3. ``RotaryEmbedding.get_emb`` moves its inverse frequencies to the current CUDA device on the
   first forward pass. The model's instance gets a ``get_emb`` that computes the same embedding
   where the frequencies are (non-interleaved RoPE, as Llama and Qwen2 use), and a ``forward``
   whose context-parallel slice (``get_pos_emb_on_this_cp_rank`` allocates a pinned CUDA index)
   selects the same zig-zag chunks on the CPU (``context_parallel.rotary_on_this_cp_rank``).

4. megatron's ``DistributedDataParallel`` grad/param buffers, ``DistributedOptimizer`` and the
   pipeline schedules' send/receive buffers allocate on ``torch.cuda.current_device()`` or
   ``device="cuda"``, call ``torch.cuda.synchronize()``, and the optimizer accepts only parameters
   whose ``Tensor.type()`` is ``torch.cuda.*Tensor``. ``cuda_calls_on_cpu()`` runs those calls
   (construction, gradient reduce-scatter, optimizer step, pipeline schedule) with CUDA device
   requests sent to the CPU and CPU tensors reporting a CUDA type name; nothing outside the block
   is affected.

A fifth spot, the default causal mask (``get_default_causal_mask`` builds it on ``"cuda"``), needs
no patch: the backend always passes its own causal mask. ``tests/backends/test_megatron.py`` checks each
adaptation against the pinned version (``MEGATRON_CORE_VERSION``).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from functools import reduce

import torch
from torch.overrides import TorchFunctionMode

MEGATRON_CORE_VERSION = "0.16.1"


class CPUMemoryBuffer:
    """Drop-in for ``megatron.core.utils.GlobalMemoryBuffer`` that allocates on the CPU."""

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):  # noqa: ANN001, ANN201
        required = reduce(operator.mul, tensor_shape, 1)
        held = self.buffer.get((name, dtype))
        if held is None or held.numel() < required:
            held = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype)
        return held[:required].view(*tensor_shape)


class CPURNGStatesTracker:
    """Named CPU random-generator states, with the interface of megatron's CUDA RNG tracker.

    ``fork(name)`` runs its block with the named state and keeps where it left off, so dropout in
    tensor-parallel regions draws from a stream of its own, as on GPU.
    """

    def __init__(self) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"rng state {name} is not added")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


def install_cpu_adaptations(seed: int) -> None:
    """Point megatron-core's memory buffer and RNG tracker at the CPU (after ``initialize_model_parallel``)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    parallel_state._GLOBAL_MEMORY_BUFFER = CPUMemoryBuffer()
    tracker = CPURNGStatesTracker()
    # the same stream names and seed offsets as megatron's model_parallel_cuda_manual_seed
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tracker.add(tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(tp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(tp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + tp_rank)
    tp_random._CUDA_RNG_STATE_TRACKER = tracker
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def keep_rotary_on_cpu(model) -> None:  # noqa: ANN001
    """Give ``model.rotary_pos_emb`` a ``get_emb`` that leaves its frequencies on the CPU."""
    rotary = model.rotary_pos_emb
    if rotary.rotary_interleaved:
        raise NotImplementedError("interleaved RoPE is not adapted to CPU")

    def get_emb(max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = rotary.get_freqs_non_repeated(max_seq_len, offset)  # [seq, dim/2] on inv_freq's device
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group=None) -> torch.Tensor:  # noqa: ANN001
        # RotaryEmbedding.forward, whose context-parallel slice (get_pos_emb_on_this_cp_rank) builds
        # a pinned CUDA index: the same zig-zag selection on the CPU
        from gcore.backends.megatron.context_parallel import rotary_on_this_cp_rank

        emb = get_emb(max_seq_len, offset)
        group = cp_group if cp_group is not None else rotary.cp_group
        if group is not None and group.size() > 1 and not packed_seq:
            emb = rotary_on_this_cp_rank(emb, group.size(), group.rank())
        return emb

    rotary.get_emb = get_emb
    rotary.forward = forward


def _cpu_if_cuda(device):  # noqa: ANN001, ANN202
    if device is None or isinstance(device, int):
        return torch.device("cpu") if device is not None else None
    return torch.device("cpu") if torch.device(device).type == "cuda" else device


class _CudaCallsOnCPU(TorchFunctionMode):
    """Torch calls that ask for a CUDA device get the CPU; ``Tensor.type()`` names a CUDA type."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _cpu_if_cuda(kwargs["device"])}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)  # e.g. torch.FloatTensor: megatron checks for torch.cuda.FloatTensor
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_calls_on_cpu() -> Iterator[None]:
    """Run megatron-core's distributed-optimizer code (which assumes CUDA) on CPU tensors.

    Inside the block ``torch.cuda.current_device()`` returns the CPU device, ``torch.cuda.synchronize()``
    does nothing (the pipeline's shape exchange calls it), ``device="cuda"``
    arguments become the CPU, ``Tensor.cuda()`` returns the tensor itself and ``Tensor.type()``
    reports ``torch.cuda.<Type>`` for CPU tensors. Only for CPU runs; not thread-safe (it swaps a
    module attribute for the duration of the block).
    """
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda device=None: None  # CPU work is done when the call returns
    try:
        with _CudaCallsOnCPU():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved
