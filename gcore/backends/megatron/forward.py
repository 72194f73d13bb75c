"""Forward (and backward) passes of the sharded model: per-token log-probabilities at any tensor,
pipeline and context parallel size, micro-batches through megatron-core's 1F1B pipeline schedule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from gcore.backends.common import token_logprobs
from gcore.backends.megatron.logprobs import vocab_parallel_logprobs
from gcore.backends.megatron.parallel import ParallelGroups
from gcore.types import RolloutBatch

if TYPE_CHECKING:
    from lightning_fabric import Fabric

    from gcore.backends.sequence_parallel import SequenceParallelGroup

#: ``loss_fn(logprobs, entropy, micro)`` of ``run_micro_batches``: returns the loss and what to collect
LossFn = Callable[[torch.Tensor, torch.Tensor, RolloutBatch], tuple[torch.Tensor, Any]]


class ForwardPasses:
    """Runs this rank's part of a model on token ids; ``vocab_size`` excludes megatron's vocabulary padding."""

    def __init__(self, fabric: Fabric, groups: ParallelGroups, vocab_size: int, moe: bool = False) -> None:
        self.fabric = fabric
        self.groups = groups
        self.vocab_size = vocab_size
        #: a mixture of experts: megatron's router moves a CPU weight to ``torch.cuda.current_device()`` in every
        #: forward, so on a CPU run the forwards go through ``groups.cuda_calls()`` (the CPU stays the device)
        self.moe = moe
        #: forwards run on pad tokens to match an expert-parallel peer's micro-batch count (``run_micro_batches``)
        self.placeholder_forwards = 0

    def stage_output(self, model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """This pipeline stage's output: logits ``[B, L, V/tp]`` on the last stage, hidden states before."""
        device = self.groups.device
        input_ids = input_ids.to(device)
        length = input_ids.shape[1]
        positions = torch.arange(length, device=device).unsqueeze(0).expand_as(input_ids)
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)
        with self.fabric.autocast(), self.moe_cuda_calls():
            # (autocast: --trainer.precision bf16-mixed etc., as the torch backend gets from Fabric)
            return model(input_ids, positions, causal.view(1, 1, length, length))

    def moe_cuda_calls(self) -> contextlib.AbstractContextManager:
        """``groups.cuda_calls()`` for a mixture of experts (megatron's router and its token dispatcher's gathers ask
        for ``torch.cuda.current_device()`` in the forward and the backward: the CPU on a CPU run)."""
        return self.groups.cuda_calls() if self.moe else contextlib.nullcontext()

    def logprobs_from_logits(self, logits: torch.Tensor, input_ids: torch.Tensor, temperature: float
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probabilities and entropies ``[B, L-1]`` (entropies without gradient at TP > 1)."""
        input_ids = input_ids.to(self.groups.device)
        if self.groups.tensor_parallel_size == 1:
            return token_logprobs(logits[..., : self.vocab_size], input_ids, temperature)
        return vocab_parallel_logprobs(logits[:, :-1], input_ids[:, 1:], temperature, self.vocab_size, self.groups)

    def logprobs(self, model: torch.nn.Module, input_ids: torch.Tensor, temperature: float,
                 attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities and entropies ``[B, L-1]`` of a whole (unpipelined) model."""
        if self.groups.cp is not None:
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            return self._context_parallel_logprobs(model, input_ids, attention_mask, temperature, self.groups.cp)
        return self.logprobs_from_logits(self.stage_output(model, input_ids), input_ids, temperature)

    def _context_parallel_logprobs(self, model: torch.nn.Module, input_ids: torch.Tensor,
                                   attention_mask: torch.Tensor, temperature: float, cp: SequenceParallelGroup
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, L-1]`` log-probabilities and entropies with this rank holding 1/CP of every row.

        Each right-padded row is padded to a multiple of 2*CP and split zig-zag (megatron's split;
        megatron's rotary embedding picks the same chunks of its table, so positions are the row's);
        gcore's attention joins the CP ranks; the per-token results are gathered back to whole rows
        on every CP rank (backward: each rank keeps its own tokens' gradient).
        """
        from gcore.backends import sequence_parallel as seqpar
        from gcore.backends.megatron.context_parallel import attention_layout

        device = self.groups.device
        rows = seqpar.shard_rows(input_ids.to(device), attention_mask.to(device), cp, pack=False)
        with self.fabric.autocast(), attention_layout(rows.layout):
            logits = model(rows.input_ids, rows.position_ids, None)  # [B, S/CP, V/tp]
        if self.groups.tensor_parallel_size == 1:
            logprobs, entropy = seqpar.next_token_logprobs(logits[..., : self.vocab_size], rows.targets, temperature)
        else:
            logprobs, entropy = vocab_parallel_logprobs(logits, rows.targets, temperature, self.vocab_size,
                                                        self.groups)
        return seqpar.gather_per_token(logprobs, rows), seqpar.gather_per_token(entropy, rows)

    def expert_parallel_shapes(self, micros: list[RolloutBatch]) -> list[tuple[int, int]]:
        """Per forward, the ``(rows, length)`` every expert-parallel rank runs it at: the largest over the ranks, and
        as many forwards as the rank with the most micro-batches has (``[]`` without expert parallelism; a collective
        over the expert-parallel group otherwise). megatron's all-gather token dispatcher (the one that runs on CPU)
        gathers equal-sized token blocks from the ranks, and every rank must join every MoE layer's exchange."""
        g = self.groups
        if g.expert_parallel_size == 1:
            return []
        import torch.distributed as dist

        own = [tuple(m.input_ids.shape) for m in micros]
        everyone: list[list[tuple[int, int]] | None] = [None] * g.expert_parallel_size
        dist.all_gather_object(everyone, own, group=g.ep_group)
        shapes = [s for s in everyone if s is not None]
        count = max(len(s) for s in shapes)
        return [(max(s[i][0] for s in shapes if len(s) > i), max(s[i][1] for s in shapes if len(s) > i))
                for i in range(count)]

    def run_micro_batches(self, model: torch.nn.Module, micros: list[RolloutBatch], temperature: float,
                          loss_fn: LossFn, forward_only: bool) -> list[Any]:
        """Forward (and backward unless ``forward_only``) every micro-batch; returns ``loss_fn``'s
        outputs in order (on the last pipeline stage; an empty list on the others).

        ``loss_fn(logprobs, entropy, micro)`` returns ``(loss, outputs)``. Without pipeline
        parallelism this is a plain loop; with it, megatron-core's 1F1B schedule, whose sends and
        receives between stages go over the default process group (gloo on CPU).

        With expert parallelism every MoE layer exchanges tokens with the other expert-parallel ranks, which train
        on other batches: each forward runs at the shape every peer agrees on (``expert_parallel_shapes``), and a
        rank with fewer micro-batches than a peer runs forwards (and zero backwards) on pad tokens until both have
        run as many, or the peer would wait forever.
        """
        results: list[Any] = []
        if self.groups.pipeline_parallel_size == 1:
            shapes = self.expert_parallel_shapes(micros)
            padded: list[tuple[int, int] | None] = list(shapes[: len(micros)]) if shapes else [None] * len(micros)
            for micro, shape in zip(micros, padded, strict=True):
                if shape is None:
                    logprobs, entropy = self.logprobs(model, micro.input_ids, temperature, micro.attention_mask)
                else:  # right-padded to the peers' shape (causal: the row's own tokens see the same), cut back
                    rows, length = micro.input_ids.shape
                    ids = torch.nn.functional.pad(micro.input_ids, (0, shape[1] - length, 0, shape[0] - rows))
                    logprobs, entropy = self.logprobs(model, ids, temperature)
                    logprobs, entropy = logprobs[:rows, : length - 1], entropy[:rows, : length - 1]
                loss, outputs = loss_fn(logprobs, entropy, micro)
                if not forward_only:
                    with self.moe_cuda_calls():
                        loss.backward()
                results.append(outputs)
            for shape in shapes[len(micros):]:  # a peer has more micro-batches: join its exchanges on pad tokens
                logprobs, _entropy = self.logprobs(model, torch.zeros(shape, dtype=torch.long), temperature)
                if not forward_only:
                    with self.moe_cuda_calls():
                        (logprobs.sum() * 0.0).backward()  # (no gradient; the peers' backward exchanges need this one)
                self.placeholder_forwards += 1
            return results
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[RolloutBatch], stage: torch.nn.Module
                         ) -> tuple[torch.Tensor, Callable]:
            micro = next(data_iterator)
            output = self.stage_output(stage, micro.input_ids)

            def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
                logprobs, entropy = self.logprobs_from_logits(logits, micro.input_ids, temperature)
                loss, outputs = loss_fn(logprobs, entropy, micro)
                results.append(outputs)
                # (loss, token count, reduced metrics): with calculate_per_token_loss megatron keeps the loss as is
                return loss, torch.ones((), dtype=torch.int), {}

            return output, loss_func

        if not micros:
            return results
        with self.groups.cuda_calls():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micros), model=[model],
                num_microbatches=len(micros), seq_length=micros[0].input_ids.shape[1],
                micro_batch_size=max(len(m) for m in micros), forward_only=forward_only,
            )
        return results
