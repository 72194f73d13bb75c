"""The torch backend's forward passes: per-token log-probabilities and the critic's values of a micro-batch, through
whichever path the options and the batch choose (image prompts, shared prompts with padded or packed replies,
sequence parallelism and packing, or the plain padded forward), and the per-row pass of PREPARE over a whole batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from gcore.backends import sequence_parallel as seqpar
from gcore.backends.shared_prompts import (
    distinct_prompts,
    packed_attention,
    packed_response_logits,
    packing_saves,
    shared_prompt_logits,
    to_batch_layout,
    to_response_layout,
)
from gcore.backends.torch.microbatch import global_max
from gcore.types import RolloutBatch, concat_visual
from gcore.vision import multimodal_positions

if TYPE_CHECKING:
    from lightning_fabric import Fabric

#: ``share_prompts=None`` shares a micro-batch's prompts when that saves at least this share of its tokens
SHARE_PROMPTS_MIN_SAVING = 0.2


class ForwardPasses:
    """Runs the policy, the reference model or the critic on micro-batches (built by ``TorchBackend.setup``; the
    options are the backend's, ``sp`` its sequence-parallel group or ``None``)."""

    def __init__(self, fabric: Fabric, sp: seqpar.SequenceParallelGroup | None, *, micro_batch_size: int,
                 share_prompts: bool | None, pack_responses: bool | None, packing: bool | None, fsdp: bool,
                 compile: bool) -> None:
        self.fabric, self.sp, self.micro_batch_size = fabric, sp, micro_batch_size
        self.share_prompts, self.pack_responses, self.packing = share_prompts, pack_responses, packing
        self.fsdp, self.compile = fsdp, compile

    def may_pack(self, model: torch.nn.Module) -> bool:
        """Whether a micro-batch that shares its prompts may run its replies packed on ``model``: not with
        ``--backend.pack_responses false``, nor where its attention takes no block mask (``packed_attention``)."""
        return self.pack_responses is not False and packed_attention(model) is not None

    def logprobs(self, model: torch.nn.Module, micro: RolloutBatch,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_logprobs`` of a micro-batch, through sequence parallelism / packing when set up."""
        input_ids = self.fabric.to_device(micro.input_ids)
        if micro.visual is not None:  # image prompts: the plain forward with the visual inputs (``validate_images``)
            ids, mask = input_ids[:, :-1], self.fabric.to_device(micro.attention_mask)[:, :-1]
            visual = {k: self.fabric.to_device(v) for k, v in concat_visual(micro.visual).items()}
            rope = multimodal_positions(model, ids, mask, visual)
            positions = {} if rope is None else {"position_ids": rope[0]}
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False, **positions, **visual).logits
            return seqpar.next_token_logprobs(logits, input_ids[:, 1:], temperature)
        if self.sp is not None:
            return seqpar.sequence_parallel_logprobs(model, input_ids, micro.attention_mask, temperature, self.sp,
                                                     self._pack(self.sp))
        shared = None
        if self.share_prompts is not False:  # auto: where it saves a fifth of the tokens or more
            shared = distinct_prompts(micro, min_saving=0.0 if self.share_prompts else SHARE_PROMPTS_MIN_SAVING)
            if self.fsdp and self.fabric.world_size > 1 and global_max(self.fabric, int(shared is None)):
                shared = None  # FSDP: every rank must make the same model calls (each gathers the weights)
        if shared is not None:  # each distinct prompt runs once for all the rows that share it
            return self._shared_prompt_logprobs(model, micro, shared, input_ids.device, temperature)
        # the last position predicts no token of the batch and, the attention being causal, no other
        # position reads it: leave it out. No KV cache either (HF builds one by default).
        attention_mask = self.fabric.to_device(micro.attention_mask)
        logits = model(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1], use_cache=False).logits
        return seqpar.next_token_logprobs(logits, input_ids[:, 1:], temperature)

    def _shared_prompt_logprobs(self, model: torch.nn.Module, micro: RolloutBatch,
                                shared: tuple[torch.Tensor, torch.Tensor], device: torch.device,
                                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``logprobs`` of a micro-batch whose distinct prompts (``shared``, ``distinct_prompts``) run once each, the
        replies padded or packed (``pack_responses``)."""
        # compiled blocks would recompile for each block's state of the prompts' KV cache: run eagerly
        eager = torch.compiler.set_stance("force_eager") if self.compile else contextlib.nullcontext()
        inner = getattr(model, "module", model)
        pack = self.may_pack(inner) and (self.pack_responses or packing_saves(micro, len(shared[0]), inner.config))
        with self.fabric.autocast(), eager:  # the unwrapped module gets the precision the wrapper gives
            if pack:
                logits, targets, rows, columns = packed_response_logits(model, micro, *shared, device,
                                                                        prefix_model=inner)
            else:
                logits, targets = shared_prompt_logits(model, micro, *shared, device, prefix_model=inner)
        logprobs, entropy = seqpar.next_token_logprobs(logits, targets, temperature)
        if pack:
            logprobs, entropy = (to_response_layout(v, rows, columns, len(micro)) for v in (logprobs, entropy))
        return to_batch_layout(logprobs, micro), to_batch_layout(entropy, micro)

    def values(self, critic: torch.nn.Module, micro: RolloutBatch) -> torch.Tensor:
        """The critic's values ``[B, L-1]`` of a micro-batch, through sequence parallelism / packing when set up."""
        input_ids = self.fabric.to_device(micro.input_ids)
        if micro.visual is not None:
            visual = {k: self.fabric.to_device(v) for k, v in concat_visual(micro.visual).items()}
            return critic(input_ids=input_ids, attention_mask=self.fabric.to_device(micro.attention_mask),
                          visual=visual)
        if self.sp is None:
            return critic(input_ids=input_ids, attention_mask=self.fabric.to_device(micro.attention_mask))
        return seqpar.sequence_parallel_values(critic, input_ids, micro.attention_mask, self.sp, self._pack(self.sp))

    def _pack(self, sp: seqpar.SequenceParallelGroup) -> bool:
        return self.packing if self.packing is not None else sp.size > 1

    def per_row(self, batch: RolloutBatch, forward: Callable[[RolloutBatch], torch.Tensor]) -> torch.Tensor:
        """``forward(micro)`` over the batch in micro-batches, masked to the response: ``[B, L-1]``. Under
        sequence parallelism the group runs on the union of its members' batches; each rank gets its own rows."""
        own, offset, count = batch, 0, len(batch)
        if self.sp is not None:
            batch, offset, count = seqpar.gather_group_batch(batch, self.sp)
        out = torch.zeros_like(batch.response_mask)
        chunks = list(torch.arange(len(batch)).split(self.micro_batch_size))
        # under FSDP a forward is a collective (it gathers the weights): every rank makes as many, padding
        # passes last (as in training, so that the real passes pair up)
        padding = global_max(self.fabric, len(chunks)) - len(chunks) if self.fsdp else 0
        for rows in chunks:
            micro = batch.select(rows)
            values = forward(micro)
            out[rows, : values.shape[1]] = values.cpu() * micro.response_mask
        for _ in range(padding):
            forward(batch.select(torch.tensor([0])))
        return out[offset: offset + count, : own.response_mask.shape[1]]


def to_device(batch: RolloutBatch, fabric: Fabric) -> RolloutBatch:
    """``batch`` with every tensor field on Fabric's device."""
    from dataclasses import fields, replace

    moved = {
        f.name: fabric.to_device(getattr(batch, f.name))
        for f in fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    return replace(batch, **moved)
