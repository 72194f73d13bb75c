"""HF <-> megatron-core weight layout for Llama-, Qwen2- and Qwen3-MoE-family models (pure tensor functions).

Megatron's layout differs from HF's in three ways:

- ``linear_qkv`` fuses q, k and v, interleaved per query group: for each of the ``G`` key/value
  heads, the rows of its ``heads/G`` query heads, then its key head, then its value head. Tensor
  parallelism splits whole groups, so the full tensor is the concatenation of the ranks' shards.
- ``linear_fc1`` fuses SwiGLU's gate and up projections *per tensor-parallel rank*: rank ``r``
  holds ``[gate_r; up_r]``, so the full tensor depends on the tensor-parallel size.
- The vocabulary is padded to a multiple of the tensor-parallel size (padding rows are zero and
  their logits are masked); HF tensors keep the true vocabulary size.

A mixture of experts (Qwen3-MoE) adds, per layer: the router (HF ``mlp.gate.weight`` is megatron's
``mlp.router.weight``), the experts (HF holds them fused, ``mlp.experts.gate_up_proj`` ``[experts, 2 x width,
hidden]`` with each expert's gate rows before its up rows, and ``mlp.experts.down_proj`` ``[experts, hidden,
width]``; megatron's ``SequentialMLP`` holds one ``linear_fc1`` ``[gate; up]`` and one ``linear_fc2`` per expert,
``mlp.experts.local_experts.{e}``, numbered from 0 on each expert-parallel rank: ``convert`` works on the whole
model's expert numbers, ``weights.py`` maps them), and Qwen3's per-head query/key RMSNorms (``self_attn.q_norm``,
``k_norm``; megatron's ``q_layernorm``, ``k_layernorm``). Experts are not split over tensor-parallel ranks.

Names follow megatron-core's local layer spec (``input_layernorm``, ``pre_mlp_layernorm``) and its
Transformer Engine spec (layer norms fused into ``linear_qkv``/``linear_fc1`` as ``layer_norm_weight``).
Functions here never import megatron-core, so they run (and are tested) without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from gcore.errors import ConfigError

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
#: an expert's slice of an HF fused expert tensor, before ``stack_experts``: ``{hf name}#{expert}``
_EXPERT_SLICE = re.compile(r"^(.+)#(\d+)$")


@dataclass(frozen=True)
class Layout:
    """The shapes the conversion needs, read from an HF config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    padded_vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    num_experts: int = 0  # 0: a dense model
    moe_ffn_size: int = 0  # each expert's MLP width
    moe_top_k: int = 0  # experts per token
    norm_topk_prob: bool = True  # the top-k weights renormalised to sum to 1
    qk_norm: bool = False  # per-head RMSNorm on queries and keys (Qwen3)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def layout_from_hf(config, tensor_parallel_size: int) -> Layout:  # noqa: ANN001
    """Read a Llama/Qwen2/Qwen3-MoE HF config; a one-line ``ConfigError`` for what megatron cannot hold."""
    model_type = getattr(config, "model_type", "?")
    if model_type not in ("llama", "qwen2", "mistral", "qwen3_moe"):
        raise ConfigError(f"--backend megatron supports Llama, Qwen2 and Qwen3-MoE models, not model_type "
                          f"{model_type!r}")
    moe = model_type == "qwen3_moe"
    if moe and (getattr(config, "decoder_sparse_step", 1) != 1 or list(getattr(config, "mlp_only_layers", []) or [])):
        raise ConfigError("--backend megatron: a Qwen3-MoE model with dense layers (decoder_sparse_step != 1 or "
                          "mlp_only_layers) is not supported; every layer must be a mixture of experts")
    if getattr(config, "mlp_bias", False):
        raise ConfigError("--backend megatron: MLP biases (mlp_bias=true) are not supported")
    qkv_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
    if model_type != "qwen2" and getattr(config, "attention_bias", False):
        raise ConfigError("--backend megatron: attention_bias=true puts a bias on o_proj too, which is not supported")
    if getattr(config, "use_sliding_window", False) or (
        model_type == "mistral" and getattr(config, "sliding_window", None)
    ):
        raise ConfigError("--backend megatron: sliding-window attention is not supported")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"--backend megatron: hidden_act {config.hidden_act!r} is not supported (only silu/SwiGLU)")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    tp = tensor_parallel_size
    split = [("num_attention_heads", heads), ("num_key_value_heads", kv_heads)]
    if not moe:  # (experts are not split over tensor-parallel ranks)
        split.append(("intermediate_size", config.intermediate_size))
    for what, count in split:
        if count % tp:
            raise ConfigError(f"--backend.tensor_parallel_size {tp} does not divide the model's {what} ({count})")
    vocab = config.vocab_size
    return Layout(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_size=config.intermediate_size,
        vocab_size=vocab,
        padded_vocab_size=-(-vocab // tp) * tp,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        num_experts=int(config.num_experts) if moe else 0,
        moe_ffn_size=int(config.moe_intermediate_size) if moe else 0,
        moe_top_k=int(config.num_experts_per_tok) if moe else 0,
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)) if moe else True,
        qk_norm=moe,
    )


# one megatron tensor <- HF tensors -------------------------------------------------------------


def _split(tensor: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    return tensor.chunk(tp, dim=dim)[rank].clone()


def _pad_vocab(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    extra = layout.padded_vocab_size - tensor.shape[0]
    if extra == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])])


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Full ``linear_qkv`` weight (or bias) from HF's q/k/v, interleaved per query group."""
    g, d = layout.num_kv_heads, layout.head_dim
    rest = q.shape[1:]
    q = q.reshape(g, layout.heads_per_group * d, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _unfuse_qkv(qkv: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d, hpg = layout.num_kv_heads, layout.head_dim, layout.heads_per_group
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (hpg + 2) * d, *rest)
    q, k, v = grouped.split([hpg * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def is_tensor_parallel(name: str) -> bool:
    """Whether megatron parameter ``name`` is split over tensor-parallel ranks (all but the norms).

    (megatron-core marks this with a ``tensor_model_parallel`` attribute, but only for weights it
    initialises itself; weights loaded with ``perform_initialization=False`` lack it.)
    """
    return not (name.endswith("layernorm.weight") or name.endswith("layer_norm_weight") or is_expert_or_router(name))


def is_expert_or_router(name: str) -> bool:
    """Whether megatron parameter ``name`` is an MoE router's or an expert's (neither split over tensor-parallel
    ranks: the router is replicated, the experts are split over expert-parallel ranks instead)."""
    return ".mlp.router." in name or ".mlp.experts." in name


def is_expert(name: str) -> bool:
    """Whether megatron parameter ``name`` is an expert's (held by one expert-parallel rank)."""
    return ".mlp.experts." in name


def megatron_name_to_hf(name: str, layout: Layout) -> list[str]:
    """The HF tensor names that one megatron parameter is made of."""
    if name == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"]
    if name == "output_layer.weight":
        return ["lm_head.weight"]
    if name == "decoder.final_layernorm.weight":
        return ["model.norm.weight"]
    match = _LAYER.match(name)
    if not match:
        raise KeyError(f"unknown megatron parameter {name!r}")
    i, rest = match.groups()
    hf = f"model.layers.{i}."
    expert = _EXPERT.match(rest)
    if expert:
        fused = "gate_up_proj" if expert.group(2) == "linear_fc1" else "down_proj"
        return [f"{hf}mlp.experts.{fused}"]
    names = {
        "input_layernorm.weight": ["input_layernorm.weight"],
        "self_attention.linear_qkv.layer_norm_weight": ["input_layernorm.weight"],
        "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
        "mlp.linear_fc1.layer_norm_weight": ["post_attention_layernorm.weight"],
        "self_attention.linear_qkv.weight": [
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"
        ],
        "self_attention.linear_qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
        "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
        "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
        "self_attention.q_layernorm.weight": ["self_attn.q_norm.weight"],
        "self_attention.k_layernorm.weight": ["self_attn.k_norm.weight"],
        "mlp.router.weight": ["mlp.gate.weight"],
    }
    if rest not in names:
        raise KeyError(f"unknown megatron parameter {name!r}")
    return [hf + n for n in names[rest]]


def hf_to_megatron_shard(name: str, hf: dict[str, torch.Tensor], layout: Layout, tp: int, rank: int) -> torch.Tensor:
    """This tensor-parallel rank's shard of megatron parameter ``name``, from HF tensors ``hf``."""
    parts = [hf[n] for n in megatron_name_to_hf(name, layout)]
    expert = _expert_index(name)
    if expert is not None:  # one expert's [gate; up] or down projection, whole (no tensor parallelism)
        return parts[0][expert].clone()
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return _split(_pad_vocab(parts[0], layout), 0, tp, rank)
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return _split(_fuse_qkv(*parts, layout), 0, tp, rank)  # type: ignore[arg-type,call-arg]  # parts: q, k, v
    if name.endswith("linear_fc1.weight"):
        gate, up = parts
        return torch.cat([_split(gate, 0, tp, rank), _split(up, 0, tp, rank)])
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        return _split(parts[0], 1, tp, rank)
    return parts[0].clone()  # norms: replicated


def megatron_shards_to_hf(name: str, shards: list[torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """HF tensors of megatron parameter ``name`` from all tensor-parallel ranks' shards (rank order)."""
    hf_names = megatron_name_to_hf(name, layout)
    expert = _expert_index(name)
    if expert is not None:  # a slice of the fused tensor: ``stack_experts`` joins them
        return {f"{hf_names[0]}#{expert}": shards[0]}
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return {hf_names[0]: torch.cat(shards)[: layout.vocab_size]}
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return dict(zip(hf_names, _unfuse_qkv(torch.cat(shards), layout), strict=False))
    if name.endswith("linear_fc1.weight"):
        halves = [shard.chunk(2, dim=0) for shard in shards]
        gate = torch.cat([h[0] for h in halves])
        up = torch.cat([h[1] for h in halves])
        return {hf_names[0]: gate, hf_names[1]: up}
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        return {hf_names[0]: torch.cat(shards, dim=1)}
    return {hf_names[0]: shards[0]}


def _expert_index(name: str) -> int | None:
    match = _LAYER.match(name)
    expert = _EXPERT.match(match.group(2)) if match else None
    return int(expert.group(1)) if expert else None


def stack_experts(hf: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """``hf`` with the experts' slices (``{name}#{expert}``, from ``megatron_shards_to_hf``) stacked into HF's fused
    ``[experts, ...]`` tensors; a ``KeyError`` naming the first missing expert."""
    out: dict[str, torch.Tensor] = {}
    slices: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in hf.items():
        match = _EXPERT_SLICE.match(key)
        if match:
            slices.setdefault(match.group(1), {})[int(match.group(2))] = tensor
        else:
            out[key] = tensor
    for name, per_expert in slices.items():
        missing = [e for e in range(layout.num_experts) if e not in per_expert]
        if missing:
            raise KeyError(f"{name}: expert {missing[0]} missing (an expert-parallel rank did not contribute)")
        out[name] = torch.stack([per_expert[e] for e in range(layout.num_experts)])
    return out


def hf_state_to_megatron(hf: dict[str, torch.Tensor], names: list[str], layout: Layout, tp: int,
                         rank: int) -> dict[str, torch.Tensor]:
    """Every megatron parameter in ``names`` for one tensor-parallel rank."""
    missing = [n for name in names for n in megatron_name_to_hf(name, layout) if n not in hf]
    if missing:
        raise KeyError(f"HF state lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    return {name: hf_to_megatron_shard(name, hf, layout, tp, rank) for name in names}


def megatron_states_to_hf(per_rank: list[dict[str, torch.Tensor]], layout: Layout) -> dict[str, torch.Tensor]:
    """The HF state dict from every tensor-parallel rank's megatron state (a list in rank order)."""
    out: dict[str, torch.Tensor] = {}
    for name in per_rank[0]:
        out.update(megatron_shards_to_hf(name, [state[name] for state in per_rank], layout))
    out = stack_experts(out, layout)
    if layout.tied_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
