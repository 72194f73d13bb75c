"""Context parallelism for the megatron backend without Transformer Engine (CPU, or GPU without TE).

megatron-core 0.16.1 runs context parallelism (``context_parallel_size > 1``) only with Transformer
Engine's attention: its local ``DotProductAttention`` asserts ``context_parallel_size == 1``, and TE
needs CUDA. gcore has its own distributed attention (``gcore.backends.sequence_parallel``: ring and
Ulysses, written with torch.distributed collectives, CPU and GPU). This module plugs it in where
megatron-core expects an attention kernel: the ``core_attention`` submodule of the local layer spec
(``get_gpt_layer_local_spec``), megatron's documented extension point (a ``ModuleSpec`` swap). The
rest of the model is megatron's own.

The pieces and how they fit megatron's conventions:

- Token split: each padded row (length a multiple of 2*CP) is cut into 2*CP chunks and rank r holds
  chunks r and 2*CP-1-r, in that order. That is megatron's ``get_batch_on_this_cp_rank`` split and
  gcore's ``zigzag_indices`` (the same thing; ``tests/backends/test_megatron_cp.py`` checks it).
- Positions: megatron's ``RotaryEmbedding.forward`` computes the rotary table for the whole row
  (``get_rotary_seq_len`` multiplies the local length by CP) and keeps this rank's two chunks
  (``get_pos_emb_on_this_cp_rank``), so each token gets its true position in the row. That helper
  allocates a pinned CUDA index, so on CPU ``keep_rotary_on_cpu`` runs the same selection with
  ``zigzag_indices`` instead.
- Attention: ``GcoreCoreAttention`` gets megatron's ``[s/CP, b, heads, dim]`` query/key/value after
  RoPE and runs gcore's ring (or Ulysses) attention over megatron's context-parallel group
  (``parallel_state.get_context_parallel_group()``). The layout of the current forward pass (which
  row positions and segments every rank holds) is set by the backend with ``attention_layout``.
- Gradients: every CP rank computes the same loss on the gathered per-token log-probabilities;
  the gather's backward keeps each rank's own tokens (``gather_replicated``), so a parameter's
  gradient is the sum over the CP ranks (and over DP): megatron's ``DistributedDataParallel``
  reduces over ``get_data_parallel_group(with_context_parallel=True)``, and the backend's own
  all-reduce (torch AdamW path) uses the same group.

Limits: no pipeline parallelism with CP (the layout is set around one whole-model forward pass), no
attention dropout, rows are padded (not packed) as the rest of the megatron backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from gcore.backends.sequence_parallel import (
    SequenceParallelGroup,
    SequenceParallelMode,
    ShardLayout,
    ring_attention,
    ulysses_attention,
    zigzag_indices,
)

_LAYOUT: list[ShardLayout] = []  # the layout of the forward pass in progress (a stack: nested calls)


@contextlib.contextmanager
def attention_layout(layout: ShardLayout) -> Iterator[None]:
    """Run the model's forward pass with ``layout`` for every ``GcoreCoreAttention`` in it."""
    _LAYOUT.append(layout)
    try:
        yield
    finally:
        _LAYOUT.pop()


def context_parallel_group(mode: SequenceParallelMode) -> SequenceParallelGroup:
    """megatron's context-parallel group (``initialize_model_parallel`` made it) as gcore's group."""
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    ranks = list(parallel_state.get_context_parallel_global_ranks())
    size = len(ranks)
    return SequenceParallelGroup(size, parallel_state.get_context_parallel_rank(), group if size > 1 else None,
                                 ranks, mode)


def _core_attention_class():  # noqa: ANN202
    from megatron.core.transformer.module import MegatronModule

    class GcoreCoreAttention(MegatronModule):
        """megatron ``core_attention`` whose attention is gcore's ring/Ulysses over the CP group.

        Same constructor as megatron's ``DotProductAttention``; ``forward`` takes
        ``[s, b, heads, dim]`` query and ``[s, b, groups, dim]`` key/value (this rank's tokens, RoPE
        applied) and returns ``[s, b, heads * dim]``. The mask argument is ignored: causal masking by
        row position and by segment comes from the layout (``attention_layout``).
        """

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,  # noqa: ANN001
                     softmax_scale=None, cp_comm_type=None, pg_collection=None) -> None:  # noqa: ANN001
            super().__init__(config=config)
            dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            if dropout:
                raise ValueError("gcore's context-parallel attention does not support attention dropout")
            head_dim = config.kv_channels
            self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5

        def forward(self, query, key, value, attention_mask,  # noqa: ANN001
                    attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> torch.Tensor:  # noqa: ANN001
            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError("gcore's context-parallel attention takes neither packed_seq_params nor a bias")
            if not _LAYOUT:
                raise RuntimeError("GcoreCoreAttention needs the forward pass inside attention_layout(...)")
            layout = _LAYOUT[-1]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
            attend = ulysses_attention if layout.sp.mode == "ulysses" else ring_attention
            out = attend(q, k, v, layout, self.softmax_scale)  # [b, heads, s, dim]
            seq, batch = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    return GcoreCoreAttention


_CLASS = None


def core_attention_class():  # noqa: ANN201
    """The ``GcoreCoreAttention`` class (built once megatron-core is importable)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _core_attention_class()
    return _CLASS


def context_parallel_layer_spec():  # noqa: ANN201
    """megatron's local GPT layer spec with gcore's attention as ``core_attention``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = core_attention_class()
    return spec


def rotary_on_this_cp_rank(emb: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``get_pos_emb_on_this_cp_rank`` (sequence dim 0) on the embedding's own device: this rank's
    zig-zag chunks of the ``[S, 1, 1, dim]`` rotary table."""
    index = zigzag_indices(emb.shape[0], cp_size)[cp_rank].to(emb.device)
    return emb.index_select(0, index)
