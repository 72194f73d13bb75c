"""The models the torch backend trains and how they are built: the critic (``ValueModel``), a checkpoint loaded with
``--backend.attn_implementation``, the transformer blocks that ``--backend.compile`` compiles and FSDP2 shards, and
``--backend.freeze_vision``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from gcore.backends import sequence_parallel as seqpar
from gcore.errors import ConfigError
from gcore.model import ModelSource, causal_lm_class
from gcore.vision import multimodal_positions, vision_parameters

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel


class ValueModel(torch.nn.Module):
    """The critic: the policy checkpoint's transformer trunk (its base model, no LM head) and a linear
    head from the last hidden state to one value per position, initialised to zero.

    The trunk is the base model of the checkpoint loaded as the policy is (``causal_lm_class``), not
    ``AutoModel``'s: transformers 5 loads a Qwen2-VL checkpoint's ``model.visual.*`` weights into ``AutoModel``
    under other names and initialises its vision encoder at random (a Llava one loads right either way)."""

    def __init__(self, source: ModelSource, attn_implementation: str | None = None) -> None:
        super().__init__()
        loaded = load_model(causal_lm_class(source), source, attn_implementation)
        self.trunk = cast("PreTrainedModel", loaded.base_model)
        self.head = torch.nn.Linear(self.trunk.config.get_text_config().hidden_size, 1, dtype=source.dtype)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def _values(self, hidden: torch.Tensor) -> torch.Tensor:
        """One float32 value per position. A tensor of its own, not a view of the head's output: FSDP2 warns that a
        view returned by the module it wraps could lose its pre-backward hook."""
        return self.head(hidden)[..., 0].to(torch.float32, copy=True)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, sp_layout: seqpar.ShardLayout | None = None,
                visual: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Values ``[B, L-1]``: position ``t`` values the state that predicts token ``t+1``. With
        ``sp_layout`` (sequence parallelism): one value per token of this rank's share, ``[R, S/K]``.
        ``visual``: the rows' images (``concat_visual``), for an image-text-to-text checkpoint's trunk."""
        if visual:
            assert attention_mask is not None  # the backend passes one with images
            ids, mask = input_ids[:, :-1], attention_mask[:, :-1]
            rope = multimodal_positions(self.trunk, ids, mask, visual)
            positions = {} if rope is None else {"position_ids": rope[0]}
            hidden = self.trunk(input_ids=ids, attention_mask=mask, use_cache=False, **positions,
                                **visual).last_hidden_state
            return self._values(hidden)
        if sp_layout is not None:
            hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                sp_layout=sp_layout, use_cache=False).last_hidden_state
            return self._values(hidden)
        # the last position is never valued and (causal attention) never read: leave it out
        hidden = self.trunk(input_ids=input_ids[:, :-1],
                            attention_mask=None if attention_mask is None else attention_mask[:, :-1],
                            position_ids=None if position_ids is None else position_ids[:, :-1],
                            use_cache=False).last_hidden_state
        return self._values(hidden)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks (transformers names their classes ``*DecoderLayer``)."""
    return [m for m in model.modules() if m is not model and type(m).__name__.endswith("DecoderLayer")]


def compile_blocks(model: torch.nn.Module) -> None:
    """``--backend.compile``: each transformer block's forward through ``torch.compile`` (in place)."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise ConfigError(f"--backend.compile true: {type(model).__name__} has no *DecoderLayer blocks to compile; "
                          "use --backend.compile false")
    for block in blocks:
        block.compile(dynamic=True)


def shard_per_layer(model: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
    """``ModelParallelStrategy``'s ``parallelize_fn``: FSDP2 ``fully_shard`` on every transformer block
    (transformers names them ``*DecoderLayer``), then on the root, which holds the rest (embeddings,
    final norm, LM or value head; tied embeddings stay one parameter). Each block's parameters are
    gathered just before it runs and freed after; gradients are reduce-scattered block by block."""
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"]
    for module in transformer_blocks(model):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def load_model(auto_class: type[AutoModel] | type[AutoModelForCausalLM], source: ModelSource,
               attn_implementation: str | None) -> PreTrainedModel:
    """``auto_class.from_pretrained`` of the checkpoint, with ``--backend.attn_implementation`` when set."""
    kwargs: dict[str, Any] = dict(dtype=source.dtype, trust_remote_code=source.trust_remote_code)
    if attn_implementation is None:
        return auto_class.from_pretrained(source.path, **kwargs)
    try:
        return auto_class.from_pretrained(source.path, attn_implementation=attn_implementation, **kwargs)
    except (ValueError, ImportError) as error:  # transformers' message names the implementations it knows
        if isinstance(error, ValueError) and "attn_implementation" not in str(error):
            raise  # another fault of the checkpoint: not this option's
        reason = " ".join(str(error).split())
        raise ConfigError(f"--backend.attn_implementation {attn_implementation}: {reason}") from None


def freeze_vision(model: torch.nn.Module) -> None:
    """``--backend.freeze_vision``: no gradient for the vision encoder and its projector."""
    frozen = vision_parameters(model)
    if not frozen:
        raise ConfigError(f"--backend.freeze_vision true: {type(model).__name__} has no vision encoder to freeze; "
                          "use --backend.freeze_vision false")
    for parameter in frozen:
        parameter.requires_grad_(False)
