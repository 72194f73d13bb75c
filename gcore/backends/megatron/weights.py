"""This rank's megatron parameters (a pipeline stage's layers, a tensor-parallel shard) as full
HF-named tensors and back, over the tensor-parallel group and the pipeline stages.

The tensor conversions themselves are in ``convert.py`` (no megatron-core, no process groups);
this module adds the ranks: which layers a stage holds, which experts an expert-parallel rank holds, and the
gathers that make full tensors.
The same gathers serve the weights (engine sync, ``save_pretrained``, checkpoints) and the Adam
moments (checkpoints), so a checkpoint is HF-layout and loads at any parallel layout.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from gcore.backends.megatron.convert import (
    Layout,
    hf_state_to_megatron,
    is_expert,
    is_tensor_parallel,
    megatron_shards_to_hf,
    stack_experts,
)
from gcore.backends.megatron.parallel import ParallelGroups

_LAYER_INDEX = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")


class HFWeights:
    """Converts between this rank's megatron tensors and the whole model's HF tensors."""

    def __init__(self, layout: Layout, groups: ParallelGroups) -> None:
        self.layout = layout
        self.groups = groups
        # a pipeline stage numbers its layers from 0: add this to get the whole model's index
        self.layer_offset = groups.pp_rank * (layout.num_layers // groups.pipeline_parallel_size)
        # an expert-parallel rank numbers its experts from 0: expert-parallel rank r holds experts r*E/EP ...
        self.experts_per_rank = layout.num_experts // groups.expert_parallel_size if layout.is_moe else 0

    def global_name(self, name: str, ep_rank: int | None = None) -> str:
        """The whole model's name of this rank's parameter (a pipeline stage numbers its layers from 0, an
        expert-parallel rank its experts: ``ep_rank`` names another expert-parallel rank's, default this one's)."""
        match = _LAYER_INDEX.match(name)
        if not match:
            return name
        layer, rest = int(match.group(1)) + self.layer_offset, match.group(2)
        expert = _LOCAL_EXPERT.match(rest)
        if expert:
            rank = self.groups.ep_rank if ep_rank is None else ep_rank
            rest = f"mlp.experts.local_experts.{int(expert.group(1)) + rank * self.experts_per_rank}.{expert.group(2)}"
        return f"decoder.layers.{layer}.{rest}"

    def local_shards(self, hf_state: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
        """This rank's (stage's, tensor-parallel shard's) tensors of megatron parameters ``names`` from HF tensors."""
        hf_state = dict(hf_state)
        if self.layout.tied_embeddings and "lm_head.weight" not in hf_state:  # the last stage's copy
            hf_state["lm_head.weight"] = hf_state["model.embed_tokens.weight"]
        global_names = [self.global_name(n) for n in names]
        shards = hf_state_to_megatron(hf_state, global_names, self.layout, self.groups.tensor_parallel_size,
                                      self.groups.tp_rank)
        return {name: shards[g] for name, g in zip(names, global_names, strict=False)}

    @torch.no_grad()
    def load(self, model: torch.nn.Module, hf_state: dict[str, torch.Tensor]) -> None:
        """Copy the HF checkpoint's tensors into this rank's parameters of ``model``."""
        params = dict(model.named_parameters())
        shards = self.local_shards(hf_state, list(params))
        for name, param in params.items():
            if tuple(shards[name].shape) != tuple(param.shape):
                raise RuntimeError(f"{name}: converted shape {tuple(shards[name].shape)} != {tuple(param.shape)}")
            param.copy_(shards[name])

    def gather_shards(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every tensor-parallel rank's shard of parameter ``name`` (copies of a replicated one)."""
        tp = self.groups.tensor_parallel_size
        if tp == 1:
            return [tensor.detach()]
        if not is_tensor_parallel(name):
            return [tensor.detach()] * tp
        shards = [torch.empty_like(tensor) for _ in range(tp)]
        dist.all_gather(shards, tensor.detach().contiguous(), group=self.groups.tp_group)
        return shards

    def to_hf(self, per_param: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF-layout full tensors of a megatron tensor per parameter (weights or optimizer moments),
        gathered over the tensor-parallel group and the pipeline stages (a collective)."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in per_param.items():
            if is_expert(name) and self.groups.expert_parallel_size > 1:  # every expert-parallel rank's experts
                held = [torch.empty_like(tensor) for _ in range(self.groups.expert_parallel_size)]
                dist.all_gather(held, tensor.detach().contiguous(), group=self.groups.ep_group)
                for rank, expert in enumerate(held):
                    out.update(megatron_shards_to_hf(self.global_name(name, rank), [expert], self.layout))
                continue
            shards = self.gather_shards(name, tensor)
            if name == "output_layer.weight" and self.layout.tied_embeddings:
                continue  # the last stage's copy of the first stage's embedding
            out.update(megatron_shards_to_hf(self.global_name(name), shards, self.layout))
        out = stack_experts(out, self.layout)
        stages_count = self.groups.pipeline_parallel_size
        if stages_count > 1:
            stages: list[dict | None] = [None] * stages_count
            dist.all_gather_object(stages, {k: v.cpu() for k, v in out.items()}, group=self.groups.pp_group)
            out = {k: v.to(self.groups.device) for stage in stages if stage is not None for k, v in stage.items()}
        return out
