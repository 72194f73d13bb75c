"""Sequence parallelism: the tokens of each sequence are split over K ranks (docs/long_context.md).

Two distributed attentions, both written with torch.distributed collectives:

- ``ring``: each rank keeps its queries; key/value blocks travel around the ring of K ranks and
  are merged with an online softmax. Works for any head count. Custom backward: the key/value
  blocks travel the ring again, carrying their gradient accumulators home.
- ``ulysses``: an all-to-all turns "all heads, 1/K of the tokens" into "1/K of the heads, all
  tokens", attention runs locally, and the reverse all-to-all turns it back. Needs the number of
  attention heads and of key/value heads... (key/value heads that do not divide are repeated).

Tokens are dealt out in zig-zag order (the padded row is cut into 2K chunks; rank r holds chunks
r and 2K-1-r) so that causal attention costs every rank about the same. Masking is by token
index in the row and by segment (sample) id, so packed rows (several samples in one row, position
ids restarting per sample) stay correct across the split.

The HF model uses this through ``AttentionInterface`` under the name ``gcore_sp``; the layout of a
forward pass reaches the attention function as the keyword argument ``sp_layout``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from gcore.backends.common import concat_batches
from gcore.errors import ConfigError
from gcore.types import RolloutBatch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTENTION_NAME = "gcore_sp"
QUERY_TILE = 256  # ring attention: local queries per score matrix
SequenceParallelMode = Literal["ring", "ulysses"]


# ---------------------------------------------------------------------------------------------
# Process groups and layouts
# ---------------------------------------------------------------------------------------------


@dataclass
class SequenceParallelGroup:
    """The K ranks that share every sequence (consecutive global ranks)."""

    size: int
    rank: int  # rank inside the group
    group: dist.ProcessGroup | None  # None when size == 1
    global_ranks: list[int]
    mode: SequenceParallelMode = "ring"

    @classmethod
    def create(cls, size: int, mode: SequenceParallelMode = "ring") -> SequenceParallelGroup:
        """Split the world into groups of ``size`` consecutive ranks (a collective: call on every rank)."""
        if mode not in ("ring", "ulysses"):
            raise ConfigError(f"--backend.sequence_parallel_mode {mode!r}: valid choices are ring, ulysses")
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        if size < 1 or world % size != 0:
            raise ConfigError(f"--backend.sequence_parallel_size {size} must divide the world size {world}")
        if size == 1:
            return cls(1, 0, None, [rank], mode)
        mine: tuple[Any, list[int]] | None = None
        for start in range(0, world, size):
            ranks = list(range(start, start + size))
            group = dist.new_group(ranks)  # every rank must create every group
            if rank in ranks:
                mine = (group, ranks)
        assert mine is not None  # every rank is in one group
        group, ranks = mine
        return cls(size, ranks.index(rank), group, ranks, mode)


@dataclass
class ShardLayout:
    """Where this rank's tokens sit in the (padded) rows, and the same for every rank of the group.

    ``all_index[j]`` / ``all_segment[j]`` are rank j's token indices in the row and sample ids
    (``[R, S/K]`` each); a query may see a key iff same segment and key index <= query index.
    """

    sp: SequenceParallelGroup
    all_index: torch.Tensor  # [K, R, S/K] long
    all_segment: torch.Tensor  # [K, R, S/K] long

    @property
    def index(self) -> torch.Tensor:
        return self.all_index[self.sp.rank]

    @property
    def segment(self) -> torch.Tensor:
        return self.all_segment[self.sp.rank]


def zigzag_indices(length: int, size: int) -> torch.Tensor:
    """``[K, length/K]``: rank r's token indices, chunks r and 2K-1-r of 2K (length divisible by 2K)."""
    chunk = length // (2 * size)
    chunks = torch.arange(length).view(2 * size, chunk)
    return torch.stack([torch.cat([chunks[r], chunks[2 * size - 1 - r]]) for r in range(size)])


def visible(
    q_index: torch.Tensor, q_segment: torch.Tensor, k_index: torch.Tensor, k_segment: torch.Tensor
) -> torch.Tensor:
    """``[R, Sq, Sk]`` bool: causal within the same segment."""
    same = q_segment[:, :, None] == k_segment[:, None, :]
    return same & (k_index[:, None, :] <= q_index[:, :, None])


# ---------------------------------------------------------------------------------------------
# Collectives with autograd
# ---------------------------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, sp: SequenceParallelGroup) -> torch.Tensor:
    inputs = [t.contiguous() for t in x.chunk(sp.size, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(sp.size)]
    dist.all_to_all(outputs, inputs, group=sp.group)
    return torch.cat(outputs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """All-to-all that scatters ``scatter_dim`` and gathers ``gather_dim``; backward is the reverse."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, sp):  # noqa: ANN001, ANN205
        ctx.dims, ctx.sp = (scatter_dim, gather_dim), sp
        return _all_to_all(x, scatter_dim, gather_dim, sp)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.sp), None, None, None


class _GatherReplicated(torch.autograd.Function):
    """All-gather along a new leading dim whose result feeds a loss computed identically on every rank.

    Backward keeps this rank's slice of the gradient without summing: each rank's loss is the same
    number, so summing would count it K times.
    """

    @staticmethod
    def forward(ctx, x, sp):  # noqa: ANN001, ANN205
        ctx.rank = sp.rank
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(parts, x.contiguous(), group=sp.group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad[ctx.rank].contiguous(), None


def gather_replicated(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """``[K, *x.shape]``: every rank's ``x`` (differentiable, for a loss replicated on the group)."""
    if sp.size == 1:
        return x.unsqueeze(0)
    return _GatherReplicated.apply(x, sp)


def _ring_exchange(tensors: list[torch.Tensor], sp: SequenceParallelGroup) -> list[torch.Tensor]:
    """Send ``tensors`` to the next rank of the ring and receive the previous rank's."""
    nxt = sp.global_ranks[(sp.rank + 1) % sp.size]
    prv = sp.global_ranks[(sp.rank - 1) % sp.size]
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, sp.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prv, sp.group) for r in received]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


class _RingAttention(torch.autograd.Function):
    """Causal ring attention over ``[R, H, S/K, D]`` blocks with online-softmax merging.

    Blocks that the mask hides entirely are skipped (the zig-zag split makes the skipped share
    even across ranks). Accumulates in float32.
    """

    @staticmethod
    def forward(ctx, q, k, v, layout, scale):  # noqa: ANN001, ANN205
        sp = layout.sp
        qf = q.float()
        rows, heads, length, _ = q.shape
        running_max = torch.full((rows, heads, length), -torch.inf, device=q.device)
        denom = torch.zeros((rows, heads, length), device=q.device)
        acc = torch.zeros(qf.shape, device=q.device)
        cur_k, cur_v = k, v
        for step in range(sp.size):
            src = (sp.rank - step) % sp.size
            kf, vf = cur_k.float(), cur_v.float()
            for tile, mask in _query_tiles(layout, src):
                scores = (qf[:, :, tile] @ kf.transpose(-1, -2)) * scale
                scores = scores.masked_fill(~mask[:, None], -torch.inf)
                new_max = torch.maximum(running_max[..., tile], scores.amax(-1))
                safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
                probs = torch.exp(scores - safe_max[..., None])
                correction = torch.exp(running_max[..., tile] - safe_max)
                denom[..., tile] = denom[..., tile] * correction + probs.sum(-1)
                acc[:, :, tile] = acc[:, :, tile] * correction[..., None] + probs @ vf
                running_max[..., tile] = new_max
            if step < sp.size - 1:
                cur_k, cur_v = _ring_exchange([cur_k, cur_v], sp)
        out = acc / denom[..., None]
        lse = running_max + torch.log(denom)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale = layout, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        sp = layout.sp
        qf, dout = q.float(), grad_out.float()
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        cur_k, cur_v = k, v
        dk = torch.zeros(k.shape, device=k.device)
        dv = torch.zeros(v.shape, device=v.device)
        for step in range(sp.size):
            src = (sp.rank - step) % sp.size
            kf, vf = cur_k.float(), cur_v.float()
            for tile, mask in _query_tiles(layout, src):
                q_tile, dout_tile = qf[:, :, tile], dout[:, :, tile]
                scores = (q_tile @ kf.transpose(-1, -2)) * scale
                probs = torch.exp(scores - lse[:, :, tile, None]).masked_fill(~mask[:, None], 0.0)
                dv = dv + probs.transpose(-1, -2) @ dout_tile
                dscores = probs * (dout_tile @ vf.transpose(-1, -2) - delta[:, :, tile])
                dq[:, :, tile] += (dscores @ kf) * scale
                dk = dk + (dscores.transpose(-1, -2) @ q_tile) * scale
            if sp.size > 1:  # K passes bring each block (and its gradient) back to its owner
                if step < sp.size - 1:
                    cur_k, cur_v, dk, dv = _ring_exchange([cur_k, cur_v, dk, dv], sp)
                else:
                    dk, dv = _ring_exchange([dk, dv], sp)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _query_tiles(layout: ShardLayout, src: int):  # noqa: ANN202
    """``(slice, mask)`` for each tile of ``QUERY_TILE`` local queries that sees any key of rank ``src``'s
    block; tiling bounds the score matrices at ``QUERY_TILE x S/K`` per head."""
    length = layout.index.shape[1]
    for start in range(0, length, QUERY_TILE):
        tile = slice(start, min(start + QUERY_TILE, length))
        mask = visible(layout.index[:, tile], layout.segment[:, tile], layout.all_index[src], layout.all_segment[src])
        if mask.any():
            yield tile, mask


def _repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    return x if times == 1 else x.repeat_interleave(times, dim=1)


def segment_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                             segment: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention within each segment of ``[R, H, S, D]`` tensors whose tokens sit at row positions
    ``index`` (the same ``[S]`` order for every row) with segment ids ``segment`` ``[R, S]``.

    Segments are contiguous runs in row order, so each one is a causal SDPA call of its own: the fused
    kernel, with memory linear in the length (no ``S x S`` mask or score matrix is stored).
    """
    order = torch.argsort(index)
    q, k, v = q[:, :, order], k[:, :, order], v[:, :, order]
    rows = []
    for r in range(q.shape[0]):
        _, counts = torch.unique_consecutive(segment[r, order], return_counts=True)
        parts, start = [], 0
        for n in counts.tolist():
            span = slice(start, start + n)
            parts.append(torch.nn.functional.scaled_dot_product_attention(
                q[r: r + 1, :, span], k[r: r + 1, :, span], v[r: r + 1, :, span], is_causal=True, scale=scale))
            start += n
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows)[:, :, index]


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ShardLayout, scale: float
) -> torch.Tensor:
    """Attention of this rank's queries over the whole row; ``[R, H, S/K, D]`` in, same out."""
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_heads(k, groups), _repeat_heads(v, groups)
    if layout.sp.size == 1:
        return segment_causal_attention(q, k, v, layout.index[0], layout.segment, scale)
    return _RingAttention.apply(q, k, v, layout, scale)


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ShardLayout, scale: float
) -> torch.Tensor:
    """All-to-all over heads, local attention over the whole row, all-to-all back."""
    sp = layout.sp
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % sp.size != 0:
        raise ConfigError(
            f"sequence_parallel_mode ulysses needs attention heads ({heads}) divisible by "
            f"sequence_parallel_size ({sp.size}); use sequence_parallel_mode ring"
        )
    if kv_heads % sp.size != 0:  # send repeated key/value heads so every rank gets whole groups
        k, v = _repeat_heads(k, heads // kv_heads), _repeat_heads(v, heads // kv_heads)
    index = layout.all_index[:, 0].reshape(-1)  # the gathered tokens' row positions, in rank order
    segment = layout.all_segment.permute(1, 0, 2).reshape(layout.all_segment.shape[1], -1)
    if sp.size > 1:
        q, k, v = (_AllToAll.apply(t, 1, 2, sp) for t in (q, k, v))  # [R, H/K, S, D]
    k, v = _repeat_heads(k, q.shape[1] // k.shape[1]), _repeat_heads(v, q.shape[1] // v.shape[1])
    out = segment_causal_attention(q, k, v, index, segment, scale)
    return _AllToAll.apply(out, 2, 1, sp) if sp.size > 1 else out  # [R, H, S/K, D]


def gcore_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,  # noqa: ANN001, ANN201
                            sp_layout: ShardLayout | None = None,
                            **kwargs: Any):  # noqa: ANN401  transformers' attention interface passes anything on
    """HF attention function (``AttentionInterface``): distributed attention when ``sp_layout`` is given,
    else transformers' SDPA attention."""
    if sp_layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if dropout:
        raise ConfigError("sequence parallelism does not support attention dropout")
    if kwargs.get("sliding_window"):
        raise ConfigError("sequence parallelism does not support sliding-window attention")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    attend = ulysses_attention if sp_layout.sp.mode == "ulysses" else ring_attention
    out = attend(query, key, value, sp_layout, scale)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Register ``gcore_sp`` with transformers' ``AttentionInterface``; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, gcore_attention_forward)
    return ATTENTION_NAME


def use_sequence_parallel_attention(model: PreTrainedModel) -> None:
    """Make an HF model call ``gcore_sp`` (which falls back to SDPA without a layout)."""
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)


# ---------------------------------------------------------------------------------------------
# Rows: padded or packed, sharded, and back
# ---------------------------------------------------------------------------------------------


@dataclass
class ShardedRows:
    """One micro-batch laid out as rows and cut into this rank's zig-zag share.

    ``input_ids``/``position_ids``/``targets`` are ``[R, S/K]`` (targets: the next token in the row);
    ``sample_row``/``sample_offset``/``sample_length`` say where each of the ``B`` samples lies.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    layout: ShardLayout
    row_length: int  # S, padded
    sample_row: list[int]
    sample_offset: list[int]
    sample_length: list[int]
    batch_length: int  # L of the [B, L] batch


def shard_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, sp: SequenceParallelGroup, pack: bool,
               pad_id: int = 0) -> ShardedRows:
    """Lay out a right-padded ``[B, L]`` batch as rows (one packed row, or one row per sample) and
    keep this rank's zig-zag share. Packed samples get their own segment id and positions from 0."""
    lengths = [int(n) for n in attention_mask.sum(-1).tolist()]
    batch, batch_length = input_ids.shape
    if pack:
        total = sum(lengths)
        tokens = torch.cat([input_ids[i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
        offsets = [sum(lengths[:i]) for i in range(batch)]
        rows_of, row_length = [0] * batch, total
    else:
        tokens = input_ids.cpu()
        positions = torch.arange(batch_length).expand(batch, -1)
        segments = (attention_mask.cpu() == 0).long()  # pads (at the right end) form their own segment
        offsets, rows_of, row_length = [0] * batch, list(range(batch)), batch_length
    unit = 2 * sp.size
    padded = -(-(row_length + 1) // unit) * unit  # +1: every token, even the last, has a target column
    extra = padded - tokens.shape[1]
    tokens = torch.nn.functional.pad(tokens.cpu(), (0, extra), value=pad_id)
    positions = torch.nn.functional.pad(positions, (0, extra), value=0)
    segments = torch.nn.functional.pad(segments, (0, extra), value=-1)
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1), value=pad_id)
    index = zigzag_indices(padded, sp.size)  # [K, S/K]
    rows = tokens.shape[0]
    all_index = index[:, None, :].expand(sp.size, rows, -1).contiguous()
    all_segment = torch.stack([segments[:, index[r]] for r in range(sp.size)])
    device = input_ids.device
    mine = index[sp.rank]
    layout = ShardLayout(sp, all_index.to(device), all_segment.to(device))
    return ShardedRows(
        input_ids=tokens[:, mine].to(device), position_ids=positions[:, mine].to(device),
        targets=targets[:, mine].to(device), layout=layout, row_length=padded,
        sample_row=rows_of, sample_offset=offsets, sample_length=lengths, batch_length=batch_length,
    )


def next_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target and the entropy of each distribution (as ``token_logprobs``)."""
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return chosen, entropy


def gather_per_token(values: torch.Tensor, rows: ShardedRows) -> torch.Tensor:
    """This rank's ``[R, S/K]`` per-token values -> the batch's ``[B, L-1]`` (differentiable; zeros
    beyond each sample's length)."""
    parts = gather_replicated(values, rows.layout.sp)  # [K, R, S/K]
    full = values.new_zeros((values.shape[0], rows.row_length))
    index = rows.layout.all_index.permute(1, 0, 2).reshape(values.shape[0], -1)
    full = full.scatter(1, index, parts.permute(1, 0, 2).reshape(values.shape[0], -1))
    out = []
    for row, offset, length in zip(rows.sample_row, rows.sample_offset, rows.sample_length, strict=False):
        keep = full[row, offset: offset + max(length - 1, 0)]
        out.append(torch.nn.functional.pad(keep, (0, rows.batch_length - 1 - keep.shape[0])))
    return torch.stack(out)


def sequence_parallel_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                               temperature: float, sp: SequenceParallelGroup, pack: bool,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities and entropies ``[B, L-1]`` of a right-padded batch, computed with
    this rank holding 1/K of every row's tokens; the result is the whole batch on every rank."""
    rows = shard_rows(input_ids, attention_mask, sp, pack)
    logits = model(input_ids=rows.input_ids, position_ids=rows.position_ids, sp_layout=rows.layout).logits
    logprobs, entropy = next_token_logprobs(logits, rows.targets, temperature)
    return gather_per_token(logprobs, rows), gather_per_token(entropy, rows)


def sequence_parallel_values(critic: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             sp: SequenceParallelGroup, pack: bool) -> torch.Tensor:
    """A value model's ``[B, L-1]`` values (position t: the state before token t+1) with 1/K of every row's
    tokens on this rank; ``critic(input_ids, position_ids=..., sp_layout=...)`` returns one value per token."""
    rows = shard_rows(input_ids, attention_mask, sp, pack)
    values = critic(input_ids=rows.input_ids, position_ids=rows.position_ids, sp_layout=rows.layout)
    return gather_per_token(values, rows)


# ---------------------------------------------------------------------------------------------
# Batches of the group
# ---------------------------------------------------------------------------------------------


def gather_group_batch(batch: RolloutBatch, sp: SequenceParallelGroup) -> tuple[RolloutBatch, int, int]:
    """Every rank of the group gets the union of the group's batches (rank order, ``concat_batches``);
    returns ``(union, row offset of this rank's rows, their count)``."""
    if sp.size == 1:
        return batch, 0, len(batch)
    parts: list = [None] * sp.size
    dist.all_gather_object(parts, batch, group=sp.group)
    offset = sum(len(p) for p in parts[: sp.rank])
    return concat_batches(parts), offset, len(batch)
