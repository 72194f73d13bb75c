"""The micro-batch cut of the torch backend, and what the ranks agree on around it.

A mini-batch's rows are cut into micro-batches of similar length (less padding) or, where the rows share their
prompts, of few distinct prompts each (each prompt runs once per micro-batch). Every rank then runs as many passes
(``global_max``: a rank with fewer pads with passes whose loss is zero), and the loss denominators count every rank's
tokens (``global_sums``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from gcore.backends.shared_prompts import prompt_keys
from gcore.balance import micro_batches_by_length, micro_batches_sharing_prompts
from gcore.types import RolloutBatch

if TYPE_CHECKING:
    from lightning_fabric import Fabric


def cut(batch: RolloutBatch, rows: torch.Tensor, micro_batch_size: int, sharing: bool,
        packed: bool) -> tuple[list[int], list[list[int]], list[torch.Tensor]]:
    """``rows`` of ``batch`` in micro-batches: the rows' lengths, the groups (positions in ``rows``) and each
    micro-batch's rows (one empty micro-batch when ``rows`` is empty). ``sharing``: cut by shared prompt where the
    batch knows its prompts' lengths; ``packed``: the replies of such a micro-batch run packed (``packing_saves``)."""
    lengths = batch.attention_mask[rows].sum(-1).tolist()
    if sharing and batch.prompt_lengths is not None:
        # each micro-batch runs each of its prompts once: fewer prompts per micro-batch against less reply padding
        prompt_lengths = batch.prompt_lengths[rows].tolist()
        prompts = prompt_keys(batch.input_ids[rows], prompt_lengths)
        groups = micro_batches_sharing_prompts(lengths, prompt_lengths, prompts, micro_batch_size, packed=packed)
    else:  # similar lengths in a micro-batch: less padding
        groups = micro_batches_by_length(lengths, micro_batch_size)
    micro_rows = [rows[torch.tensor(g, dtype=torch.long)] for g in groups] or [torch.tensor([], dtype=torch.long)]
    return lengths, groups, micro_rows


def all_reduce(fabric: Fabric, values: torch.Tensor, reduce_op: Literal["sum", "max"]) -> torch.Tensor:
    reduced = fabric.all_reduce(values, reduce_op=reduce_op)
    assert isinstance(reduced, torch.Tensor)  # a tensor in, a tensor out
    return reduced


def global_sums(fabric: Fabric, values: list[float]) -> list[float]:
    """The sums of ``values`` over every rank (float64)."""
    if fabric.world_size == 1:
        return [float(v) for v in values]
    return all_reduce(fabric, torch.tensor(values, dtype=torch.float64), "sum").tolist()


def global_max(fabric: Fabric, value: int) -> int:
    """The largest ``value`` of any rank."""
    if fabric.world_size == 1:
        return int(value)
    return int(all_reduce(fabric, torch.tensor(float(value)), "max"))
