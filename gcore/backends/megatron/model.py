"""This rank's part of the policy as a megatron-core ``GPTModel``, built from an HF config.

The model is built empty (``perform_initialization=False``): every weight comes from the HF
checkpoint (``weights.HFWeights.load``). Llama/Qwen2 families: RMSNorm, SwiGLU, RoPE (default or
Llama-3 scaling), optional QKV bias, tied or untied embeddings. Qwen3-MoE: query/key RMSNorm and, in every
layer, megatron's ``MoELayer`` (its ``TopKRouter`` and ``SequentialMLP`` experts, split over expert-parallel
ranks; docs/moe.md, "Megatron expert parallelism").
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from gcore.backends.megatron.convert import Layout, is_tensor_parallel
from gcore.backends.megatron.parallel import ParallelGroups
from gcore.errors import ConfigError

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from transformers import PretrainedConfig


def moe_settings(layout: Layout, groups: ParallelGroups, dispatcher: str) -> dict:
    """The ``TransformerConfig`` fields of a mixture of experts (``{}`` for a dense model): HF Qwen3-MoE's routing.

    HF takes a float32 softmax over all experts' logits, keeps the top k and, with ``norm_topk_prob``, divides them
    by their sum. megatron's ``TopKRouter`` with the softmax score function takes the top k logits and a softmax over
    them (the same weights as renormalising), or with ``moe_router_pre_softmax`` the softmax over all first (HF
    without renormalising); ``moe_router_dtype="fp32"`` as HF. No load-balancing loss (gcore's RL default), no token
    dropping (capacity ``None``). ``dispatcher``: megatron's token dispatcher (``alltoall`` or ``allgather``)."""
    if not layout.is_moe:
        return {"moe_token_dispatcher_type": "alltoall"}  # (no experts; megatron's check of variable_seq_lengths)
    return {
        "num_moe_experts": layout.num_experts,
        "moe_ffn_hidden_size": layout.moe_ffn_size,
        "moe_router_topk": layout.moe_top_k,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not layout.norm_topk_prob,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": dispatcher,
        "moe_grouped_gemm": False,  # SequentialMLP: one linear_fc1/linear_fc2 per expert (no Transformer Engine)
        "expert_model_parallel_size": groups.expert_parallel_size,
        "expert_tensor_parallel_size": 1,
        "qk_layernorm": layout.qk_norm,
    }


def build_gpt_model(hf_config: PretrainedConfig, layout: Layout, groups: ParallelGroups, dtype: torch.dtype,
                    transformer_engine: str, padding_idx: int | None, dispatcher: str = "alltoall") -> GPTModel:
    """This pipeline stage's tensor-parallel shard of the model, on the rank's device.

    ``transformer_engine``: ``auto``, ``true`` or ``false`` (the layer spec; context parallelism uses
    gcore's attention in megatron's local spec). ``padding_idx``: the input token whose embedding gets
    no gradient, as HF's ``nn.Embedding(padding_idx=...)`` (``None``: none).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    c, lay = hf_config, layout
    on_cpu = groups.device.type == "cpu"
    pipelined = groups.pipeline_parallel_size > 1
    config = TransformerConfig(
        num_layers=lay.num_layers,
        hidden_size=lay.hidden_size,
        num_attention_heads=lay.num_heads,
        num_query_groups=lay.num_kv_heads,
        kv_channels=lay.head_dim,
        ffn_hidden_size=lay.ffn_size,
        normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=lay.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=groups.tensor_parallel_size,
        pipeline_model_parallel_size=groups.pipeline_parallel_size,
        context_parallel_size=groups.context_parallel_size,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=on_cpu,
        perform_initialization=False,  # every weight is loaded from the HF checkpoint
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        calculate_per_token_loss=True,  # LossScale normalises the loss: no averaging by megatron
        pipeline_dtype=dtype if pipelined else None,
        variable_seq_lengths=pipelined,  # micro-batches differ in size: send shapes before tensors
        batch_p2p_sync=not on_cpu,  # (a torch.cuda.synchronize after pipeline sends)
        **moe_settings(lay, groups, dispatcher),
    )
    if lay.is_moe:
        _router_gemm_without_transformer_engine()
    if groups.context_parallel_size > 1:  # gcore's ring/Ulysses attention: context_parallel.py
        from gcore.backends.megatron.context_parallel import context_parallel_layer_spec

        spec = context_parallel_layer_spec()
    elif lay.is_moe:  # megatron's local MoE layer (SequentialMLP experts; no Transformer Engine grouped GEMM)
        spec = get_gpt_layer_local_spec(num_experts=lay.num_experts, moe_grouped_gemm=False, qk_layernorm=lay.qk_norm,
                                        normalization="RMSNorm")
    elif use_transformer_engine(transformer_engine, groups.device):
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    rope = rope_settings(c)
    with groups.cuda_calls() if pipelined else contextlib.nullcontext():  # (a .cuda() on the tied embedding)
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=lay.padded_vocab_size,
            max_sequence_length=c.max_position_embeddings,
            parallel_output=True,
            pre_process=groups.first_stage,
            post_process=groups.last_stage,
            share_embeddings_and_output_weights=lay.tied_embeddings,
            position_embedding_type="rope",
            rotary_base=int(rope["theta"]),
            rope_scaling=rope["llama3"],
            rope_scaling_factor=rope["factor"],
        )
    if on_cpu:
        from gcore.backends.megatron.cpu import keep_rotary_on_cpu

        keep_rotary_on_cpu(model)
    _mark_tensor_parallel(model)
    if groups.first_stage and padding_idx is not None:
        _no_gradient_through_padding(model.embedding.word_embeddings, padding_idx)
    return model.to(groups.device)


def _router_gemm_without_transformer_engine() -> None:
    """megatron-core 0.16.1's router linear (``moe_utils.RouterGatingLinearFunction``) tests
    ``te_general_gemm is not None`` to choose its plain torch path, but the module defines the name only when
    Transformer Engine imports: without it the router's forward fails with a ``NameError``. Define it as ``None``
    (the torch path megatron means) where the import did not."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def use_transformer_engine(choice: str, device: torch.device) -> bool:
    """Whether to build Transformer Engine's layer spec (``--backend.transformer_engine auto|true|false``)."""
    if choice == "false" or device.type != "cuda":
        if choice == "true":
            raise ConfigError("--backend.transformer_engine true needs a CUDA device")
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        if choice == "true":
            raise ConfigError("--backend.transformer_engine true: transformer_engine is not installed") from None
        return False
    return True


def rope_settings(config: PretrainedConfig) -> dict:
    """RoPE base and Llama-3 scaling from an HF config (old ``rope_theta`` or new ``rope_parameters``)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ConfigError(f"--backend megatron: rope type {kind!r} is not supported (default, llama3)")
    if kind == "llama3":
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, value in expected.items():
            if float(params.get(key, value)) != float(value):
                raise ConfigError(f"--backend megatron: llama3 rope {key}={params[key]} is not supported ({value} is)")
    return {"theta": theta, "llama3": kind == "llama3", "factor": float(params.get("factor", 8.0))}


def _mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Set megatron's ``tensor_model_parallel`` attributes, which weights built with
    ``perform_initialization=False`` lack; megatron's optimizer reads them for the gradient norm."""
    for name, param in model.named_parameters():
        row_parallel = name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight")
        param.tensor_model_parallel = is_tensor_parallel(name)  # type: ignore[attr-defined]
        param.partition_dim = 1 if row_parallel else 0  # type: ignore[attr-defined]
        param.partition_stride = 1  # type: ignore[attr-defined]


def _no_gradient_through_padding(embedding: torch.nn.Module, padding_idx: int) -> None:
    """Give ``padding_idx`` in the input no embedding gradient, as HF's ``nn.Embedding(padding_idx=...)``
    does, so that both backends train alike on sequences holding the pad token (the output layer's
    gradient, tied or not, is untouched). The forward values are unchanged."""

    def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        ids = args[0]
        if not torch.is_grad_enabled() or output.shape[:2] != ids.shape:  # [b, s, h]: no sequence-parallel scatter
            return output
        return torch.where((ids == padding_idx).unsqueeze(-1), output.detach(), output)

    embedding.register_forward_hook(hook)
