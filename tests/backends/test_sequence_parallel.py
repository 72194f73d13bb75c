"""Sequence parallelism on 2 CPU ranks (gloo) equals one rank, within float32 tolerance.

Tolerance: atol 2e-5 / rtol 1e-4 on attention outputs and log-probabilities, atol 1e-5 / rtol 1e-3
on gradients and parameter updates (float32; the split only reorders sums).
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port

from gcore.backends import sequence_parallel as seqpar
from gcore.backends.common import concat_batches
from gcore.errors import ConfigError
from gcore.testing import make_batch

ATOL, RTOL = 2e-5, 1e-4
GRAD_ATOL, GRAD_RTOL = 1e-5, 1e-3



def _worker(rank, world, port, fn, args, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn, *args, world: int = 2):
    """Run ``fn(rank, *args)`` on ``world`` gloo ranks; return the results by rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world, free_port(), fn, args, out_dir), nprocs=world, join=True)
        return [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(world)]


# --- attention --------------------------------------------------------------------------------

LENGTHS = [5, 7, 3]  # 15 tokens: not divisible by 2 ranks (nor by the 4 zig-zag chunks)


def _reference_attention(q, k, v):
    """Causal attention of every packed sample on its own, on one rank."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    outs, start = [], 0
    for n in LENGTHS:
        s = slice(start, start + n)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q[:, :, s], k[:, :, s], v[:, :, s],
                                                                     is_causal=True))
        start += n
    return torch.cat(outs, dim=2)


def _attention_inputs(heads: int, kv_heads: int):
    torch.manual_seed(0)
    total = sum(LENGTHS)
    q = torch.randn(1, heads, total, 8)
    k, v = torch.randn(1, kv_heads, total, 8), torch.randn(1, kv_heads, total, 8)
    weight = torch.randn(1, heads, total, 8)
    return q, k, v, weight


def _sp_attention(rank, mode, heads, kv_heads, tile):
    seqpar.QUERY_TILE = tile
    sp = seqpar.SequenceParallelGroup.create(dist.get_world_size(), mode)
    q, k, v, weight = _attention_inputs(heads, kv_heads)
    ids = torch.ones(1, sum(LENGTHS), dtype=torch.long)
    rows = seqpar.shard_rows(ids.repeat(len(LENGTHS), 1), _packed_mask(), sp, pack=True)
    index = rows.layout.index[0]
    pad = rows.row_length - q.shape[2]

    def local(t):
        return torch.nn.functional.pad(t, (0, 0, 0, pad))[:, :, index].clone().requires_grad_(True)

    ql, kl, vl = local(q), local(k), local(v)
    attend = seqpar.ring_attention if mode == "ring" else seqpar.ulysses_attention
    out = attend(ql, kl, vl, rows.layout, 8 ** -0.5)
    (out * local(weight).detach()).sum().backward()
    return {"index": index, "out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}


def _packed_mask():
    """Right-padded attention mask of the three samples of LENGTHS (rows of a ``[3, 15]`` batch)."""
    mask = torch.zeros(len(LENGTHS), sum(LENGTHS), dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    return mask


def _assemble(results, key, total):
    """Put each rank's zig-zag share back in token order (dropping the padding)."""
    full = torch.zeros(results[0][key].shape[:2] + (max(int(r["index"].max()) for r in results) + 1,) +
                       results[0][key].shape[3:])
    for r in results:
        full[:, :, r["index"]] = r[key]
    return full[:, :, :total]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("mode,heads,kv_heads,tile", [
    ("ring", 4, 2, 1024), ("ring", 3, 1, 3),  # tile 3: 8 local queries in tiles of 3, 3 and 2
    ("ulysses", 4, 2, 1024), ("ulysses", 4, 1, 1024),
])
def test_attention_and_gradients_match_one_rank(mode, heads, kv_heads, tile):
    results = run_ranks(_sp_attention, mode, heads, kv_heads, tile)
    q, k, v, weight = _attention_inputs(heads, kv_heads)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    expected = _reference_attention(q, k, v)
    (expected * weight).sum().backward()
    total = sum(LENGTHS)
    torch.testing.assert_close(_assemble(results, "out", total), expected.detach(), atol=ATOL, rtol=RTOL)
    for name, ref in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        torch.testing.assert_close(_assemble(results, name, total), ref, atol=GRAD_ATOL, rtol=GRAD_RTOL)


def test_segment_causal_attention_in_zigzag_order_matches_per_sample_attention():
    q, k, v, weight = _attention_inputs(4, 4)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    expected = _reference_attention(q, k, v)
    index = seqpar.zigzag_indices(16, 2).reshape(-1)  # a shuffled token order
    index = index[index < 15]  # the padding slot dropped
    segment = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])[index].unsqueeze(0)
    out = seqpar.segment_causal_attention(q[:, :, index], k[:, :, index], v[:, :, index], index, segment, 8 ** -0.5)
    torch.testing.assert_close(out, expected[:, :, index], atol=ATOL, rtol=RTOL)
    (out * weight[:, :, index]).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (expected * weight).sum().backward()
    for got, t in zip(grads, (q, k, v), strict=False):
        torch.testing.assert_close(got, t.grad, atol=GRAD_ATOL, rtol=GRAD_RTOL)


def test_zigzag_indices_balance_causal_work():
    index = seqpar.zigzag_indices(16, 2)
    assert index.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    assert index[0].sum() == index[1].sum()  # equal causal work: sum of visible keys per rank


def test_bad_sequence_parallel_size_is_a_config_error():
    with pytest.raises(ConfigError, match="must divide the world size"):
        seqpar.SequenceParallelGroup.create(3)
    with pytest.raises(ConfigError, match="valid choices"):
        seqpar.SequenceParallelGroup.create(1, "spiral")


# --- whole model ------------------------------------------------------------------------------


def _tiny_model(heads: int = 4, kv_heads: int = 2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=64, max_position_embeddings=64,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).float()


def _batch():
    torch.manual_seed(1)
    lengths = [11, 6, 9]  # longest 11: not divisible by 2
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, 40, (n,))
        mask[i, :n] = 1
    return ids, mask


def _one_rank_logprobs(model, temperature=0.8):
    from gcore.backends import token_logprobs

    ids, mask = _batch()
    logprobs, _ = token_logprobs(model(input_ids=ids, attention_mask=mask).logits, ids, temperature)
    return logprobs * mask[:, 1:]


def _sp_model(rank, mode, pack):
    sp = seqpar.SequenceParallelGroup.create(dist.get_world_size(), mode)
    model = _tiny_model()
    seqpar.use_sequence_parallel_attention(model)
    ids, mask = _batch()
    logprobs, _ = seqpar.sequence_parallel_logprobs(model, ids, mask, 0.8, sp, pack)
    logprobs = logprobs * mask[:, 1:]
    (logprobs * torch.linspace(-1, 1, logprobs.numel()).view_as(logprobs)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for g in grads.values():  # each rank holds the gradient through its own tokens: sum them
        dist.all_reduce(g)
    return {"logprobs": logprobs.detach(), "grads": grads}


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("mode,pack", [("ring", False), ("ring", True), ("ulysses", False), ("ulysses", True)])
def test_model_logprobs_and_gradients_match_one_rank(mode, pack):
    results = run_ranks(_sp_model, mode, pack)
    model = _tiny_model()
    expected = _one_rank_logprobs(model)
    (expected * torch.linspace(-1, 1, expected.numel()).view_as(expected)).sum().backward()
    for r in results:
        torch.testing.assert_close(r["logprobs"], expected.detach(), atol=ATOL, rtol=RTOL)
    for name, p in model.named_parameters():
        torch.testing.assert_close(results[0]["grads"][name], p.grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=name)


def test_packing_on_one_rank_matches_padded():
    sp = seqpar.SequenceParallelGroup.create(1)
    model = _tiny_model()
    expected = _one_rank_logprobs(model)
    seqpar.use_sequence_parallel_attention(model)
    ids, mask = _batch()
    packed, _ = seqpar.sequence_parallel_logprobs(model, ids, mask, 0.8, sp, pack=True)
    torch.testing.assert_close(packed * mask[:, 1:], expected.detach(), atol=ATOL, rtol=RTOL)


def _ulysses_bad_heads(rank):
    sp = seqpar.SequenceParallelGroup.create(2, "ulysses")
    q = torch.randn(1, 3, 4, 8)
    rows = seqpar.shard_rows(torch.ones(1, 7, dtype=torch.long), torch.ones(1, 7, dtype=torch.long), sp, pack=False)
    try:
        seqpar.ulysses_attention(q, q, q, rows.layout, 1.0)
    except ConfigError as err:
        return str(err)
    return ""


@pytest.mark.integration
@pytest.mark.slow
def test_ulysses_with_indivisible_heads_is_a_config_error():
    messages = run_ranks(_ulysses_bad_heads)
    assert all("divisible" in m for m in messages)


def test_a_group_union_pads_each_part_to_the_longest_and_refuses_mixed_fields():
    # what gather_group_batch (sequence parallelism) and megatron's data-parallel union both stack
    short, long = make_batch([1.0, 0.0], [0, 0], length=3), make_batch([0.5], [1], length=5)
    short.ref_logprobs, long.ref_logprobs = torch.ones(2, 2), torch.ones(1, 4)
    union = concat_batches([short, long])
    assert union.input_ids.shape == (3, 5) and union.response_mask.shape == (3, 4)  # [B, L] and [B, L-1]
    assert union.ref_logprobs.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]  # right-padded with 0
    assert union.rewards.tolist() == [1.0, 0.0, 0.5] and union.old_logprobs is None  # None everywhere: None
    long.ref_logprobs = None
    with pytest.raises(ValueError, match="only some have ref_logprobs"):
        concat_batches([short, long])

