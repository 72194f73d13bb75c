"""The vllm engine's cross-process sync, the parts that need no vLLM: buckets and their packing."""

import pytest
import torch

from gcore.engines.base import buckets
from gcore.engines.vllm_sync import pack, unpack
from gcore.errors import GcoreError


def test_pack_then_unpack_gives_back_every_tensor_bit_for_bit():
    weights = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("c", torch.arange(4)),
               ("d", torch.randn(4, 6).t())]  # a non-contiguous view
    buffer, meta = pack(weights, torch.device("cpu"))
    assert buffer.dtype == torch.uint8 and meta["num_bytes"] >= sum(t.numel() * t.element_size() for _, t in weights)
    out = unpack(buffer, meta["names"], meta["dtype_names"], meta["shapes"])
    assert [n for n, _ in out] == ["a", "b", "c", "d"]
    for (_, sent), (_, got) in zip(weights, out, strict=False):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)


def test_unpack_refuses_metadata_that_does_not_match_the_buffer():
    buffer, meta = pack([("a", torch.randn(4))], torch.device("cpu"))
    with pytest.raises(GcoreError, match="holds 32 bytes, its metadata describes 16"):
        unpack(torch.cat([buffer, buffer]), meta["names"], meta["dtype_names"], meta["shapes"])


def test_buckets_keep_order_and_send_a_tensor_larger_than_the_bucket_alone():
    weights = [("small1", torch.zeros(2)), ("big", torch.zeros(100)), ("small2", torch.zeros(2)),
               ("small3", torch.zeros(2))]
    groups = [[n for n, _ in b] for b in buckets(weights, max_bytes=20)]
    assert groups == [["small1"], ["big"], ["small2", "small3"]]
