"""``megatron`` backend: megatron-core's GPT model with tensor, pipeline, context and data parallelism.

One launcher: Lightning Fabric starts the processes and the default process group; ``setup``
calls ``parallel_state.initialize_model_parallel`` on top of it. The ranks that hold one copy of
the model (tensor x pipeline group) are separate controllers with separate samples; they train on
the union of their batches (gathered before each forward pass), and each gets back its own rows'
log-probabilities. With pipeline stages, micro-batches go through megatron-core's 1F1B schedule.
With context parallelism (``--backend.sequence_parallel_size``) the tensor x context group shares
one union of batches and every row is split zig-zag over the context ranks, with gcore's
distributed attention inside megatron's layers (``megatron_cp.py``).
Gradients are summed over the data-parallel (x context-parallel) group only (by megatron's
distributed optimizer when DP > 1, else an all-reduce before torch AdamW); the loss follows ``Algorithm.loss`` and
``LossScale`` exactly as in the torch backend, so both backends compute the same update.

What is supported and what is not: ``docs/megatron.md``.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from dataclasses import fields
from typing import Literal

import torch
import torch.distributed as dist

from gcore.algorithms.base import Algorithm, LossScale
from gcore.backends.base import TrainingBackend
from gcore.backends.megatron_convert import (
    Layout,
    hf_state_to_megatron,
    is_tensor_parallel,
    layout_from_hf,
    megatron_shards_to_hf,
)
from gcore.backends.torch import token_logprobs
from gcore.errors import ConfigError, GcoreError
from gcore.types import RolloutBatch

_LAYER_INDEX = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
INSTALL_HINT = "--backend megatron needs megatron-core: pip install 'gcore[megatron]'"
_MASKED_LOGIT = -1e30  # logits of vocabulary padding rows: exp() underflows to exactly 0


def _require_megatron() -> None:
    try:
        import megatron.core  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"{INSTALL_HINT} ({err})") from None


class MegatronBackend(TrainingBackend):
    """Trains the policy as a megatron-core ``GPTModel`` (Llama/Qwen2 families): TP, PP, DP, Adam.

    Args:
        tensor_parallel_size: ranks that split every layer (must divide the world size, the
            attention heads, the key/value heads and the MLP width).
        pipeline_parallel_size: pipeline stages (consecutive layers per stage; must divide the
            number of layers and, times the tensor-parallel size, the world size). Micro-batches go
            through megatron-core's pipeline schedule (1F1B).
        sequence_parallel_size: split every sequence over this many ranks, the same flag as the torch
            backend's; it is megatron-core's ``context_parallel_size`` (zig-zag split of each row in
            2*K chunks), with gcore's distributed attention as the layers' ``core_attention`` (CPU and
            GPU, no Transformer Engine; ``gcore/backends/megatron_cp.py``). Not with pipeline
            parallelism; tensor x sequence size must divide the number of ranks (the rest are data parallel).
        sequence_parallel_mode: the distributed attention with ``sequence_parallel_size`` > 1: ``ring``
            (any head count) or ``ulysses`` (attention heads per tensor-parallel rank divisible by the size).
        lr: learning rate; ``None`` picks 1e-6 for a checkpoint given with ``--model.path`` and
            5e-3 for the embedded tiny model.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        max_grad_norm: clip the global gradient norm to this (0: no clipping).
        micro_batch_size: sequences per forward/backward pass of a tensor-parallel group.
        warmup_steps: linear learning-rate warm-up, in optimizer steps.
        transformer_engine: use the Transformer Engine layer spec (``auto``: on GPU when importable).
        distributed_optimizer: megatron-core's distributed optimizer (``DistributedOptimizer`` over
            megatron's ``DistributedDataParallel`` grad buffers: gradients reduce-scattered, Adam
            state sharded over the data-parallel ranks, parameters all-gathered after the step);
            ``None``: on when the data-parallel size is above 1. ``False``: torch AdamW over each
            rank's local shards, gradients all-reduced.
    """

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        sequence_parallel_size: int = 1,
        sequence_parallel_mode: Literal["ring", "ulysses"] = "ring",
        lr: float | None = None,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        max_grad_norm: float = 1.0,
        micro_batch_size: int = 32,
        warmup_steps: int = 0,
        transformer_engine: Literal["auto", "true", "false"] = "auto",
        distributed_optimizer: bool | None = None,
    ) -> None:
        _require_megatron()
        if tensor_parallel_size < 1:
            raise ConfigError(f"--backend.tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if pipeline_parallel_size < 1:
            raise ConfigError(f"--backend.pipeline_parallel_size must be >= 1, got {pipeline_parallel_size}")
        if sequence_parallel_size < 1:
            raise ConfigError(f"--backend.sequence_parallel_size must be >= 1, got {sequence_parallel_size}")
        if sequence_parallel_mode not in ("ring", "ulysses"):
            raise ConfigError(f"--backend.sequence_parallel_mode {sequence_parallel_mode!r}: valid choices are "
                              "ring, ulysses")
        if sequence_parallel_size > 1 and pipeline_parallel_size > 1:
            raise ConfigError(
                f"--backend.sequence_parallel_size {sequence_parallel_size} with --backend.pipeline_parallel_size "
                f"{pipeline_parallel_size}: the megatron backend's context parallelism runs without pipeline stages; "
                "set one of them to 1")
        if sequence_parallel_size > 1 and transformer_engine == "true":
            raise ConfigError(
                f"--backend.sequence_parallel_size {sequence_parallel_size} with --backend.transformer_engine true: "
                "context parallelism uses gcore's attention in megatron-core's local layer spec, not Transformer "
                "Engine's; use --backend.transformer_engine auto or false")
        if micro_batch_size < 1:
            raise ConfigError(f"--backend.micro_batch_size must be >= 1, got {micro_batch_size}")
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.sequence_parallel_size = sequence_parallel_size
        self.sequence_parallel_mode = sequence_parallel_mode
        self.context_parallel_size = sequence_parallel_size  # megatron-core's name
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = tuple(betas)
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        self.warmup_steps = warmup_steps
        self.transformer_engine = transformer_engine
        self.distributed_optimizer = distributed_optimizer
        self.fabric = None
        self.policy = None
        self.reference = None
        self.optimizer = None  # torch AdamW, or megatron's (chained) DistributedOptimizer
        self.grad_buffers = None  # megatron DistributedDataParallel around the policy (distributed optimizer)
        self.base_lr = 0.0
        self.hf_config = None
        self.layout: Layout | None = None
        self._updates = 0  # optimizer steps taken; tells save_pretrained whether the last sync is current
        self._synced: tuple[int, dict[str, torch.Tensor]] | None = None

    def strategy(self, world_size: int, device_type: str) -> str:
        # Fabric only launches the processes and the process group; megatron does the parallelism
        return "ddp" if world_size > 1 else "auto"

    # SETUP -----------------------------------------------------------------------------------

    def setup(self, fabric, model_path: str, dtype: torch.dtype, trust_remote_code: bool,  # noqa: ANN001
              algorithm: Algorithm, embedded: bool) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.fabric = fabric
        self.device = fabric.device
        if getattr(algorithm, "entropy_coef", 0.0) and self.tensor_parallel_size > 1:
            raise ConfigError("--algorithm.entropy_coef with --backend megatron needs "
                              "--backend.tensor_parallel_size 1: "
                              "the vocabulary-parallel entropy is computed without its gradient")
        world, tp, pp, cp = (fabric.world_size, self.tensor_parallel_size, self.pipeline_parallel_size,
                             self.context_parallel_size)
        if world % tp:
            raise ConfigError(f"--backend.tensor_parallel_size {tp} does not divide the number of ranks ({world})")
        if world % (tp * pp):
            raise ConfigError(f"--backend.tensor_parallel_size {tp} times --backend.pipeline_parallel_size {pp} "
                              f"does not divide the number of ranks ({world})")
        if world % (tp * pp * cp):  # (cp > 1: pp is 1)
            raise ConfigError(f"--backend.sequence_parallel_size {cp} times --backend.tensor_parallel_size {tp} "
                              f"does not divide the number of ranks ({world})")
        self.hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.layout = layout_from_hf(self.hf_config, tp)
        if cp > 1 and self.sequence_parallel_mode == "ulysses" and (self.layout.num_heads // tp) % cp:
            raise ConfigError(
                f"--backend.sequence_parallel_mode ulysses needs the attention heads per tensor-parallel rank "
                f"({self.layout.num_heads} / {tp}) divisible by --backend.sequence_parallel_size {cp}; "
                "use --backend.sequence_parallel_mode ring")
        if self.layout.num_layers % pp:
            raise ConfigError(f"--backend.pipeline_parallel_size {pp} does not divide the model's "
                              f"{self.layout.num_layers} layers")
        self._init_parallel_state(fabric)
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, trust_remote_code=trust_remote_code)
        hf_state = hf.state_dict()
        # HF's nn.Embedding(padding_idx=pad): a pad token in the input gives the embedding no gradient
        self.padding_idx = getattr(hf.get_input_embeddings(), "padding_idx", None)
        del hf
        self.policy = self._build_model(dtype)
        self._load_hf_state(self.policy, hf_state)
        self.policy.train()
        self.base_lr = self.lr if self.lr is not None else (5e-3 if embedded else 1e-6)
        use_distributed = self.distributed_optimizer if self.distributed_optimizer is not None else self.dp_size > 1
        if use_distributed:
            self._setup_distributed_optimizer(dtype)
        else:
            self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=self.learning_rate(), betas=self.betas,
                                               weight_decay=self.weight_decay)
        if algorithm.needs_reference:
            self.reference = self._build_model(dtype)
            self._load_hf_state(self.reference, hf_state)
            self.reference.eval().requires_grad_(False)

    def _setup_distributed_optimizer(self, dtype: torch.dtype) -> None:
        """Wrap the policy in megatron's ``DistributedDataParallel`` and build its ``DistributedOptimizer``."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        # gradients are summed over data-parallel ranks (the model config's calculate_per_token_loss:
        # no 1/DP scaling), as LossScale already normalises the loss globally
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            overlap_param_gather=False,
        )
        optimizer_config = OptimizerConfig(
            optimizer="adam", lr=self.learning_rate(), weight_decay=self.weight_decay, adam_beta1=self.betas[0],
            adam_beta2=self.betas[1], adam_eps=1e-8, clip_grad=0.0,  # clipping is done in _distributed_step
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
            use_distributed_optimizer=True,
        )
        with self._cuda_calls():
            self.grad_buffers = DistributedDataParallel(self.policy.config, ddp_config, self.policy)
            self.optimizer = get_megatron_optimizer(optimizer_config, [self.grad_buffers],
                                                    use_gloo_process_groups=False)

    def _cuda_calls(self):  # noqa: ANN202
        """Context for megatron's CUDA-assuming code (distributed optimizer, pipeline sends): CPU on a CPU run."""
        if self.device.type != "cpu":
            return contextlib.nullcontext()
        from gcore.backends.megatron_cpu import cuda_calls_on_cpu

        return cuda_calls_on_cpu()

    def learning_rate(self) -> float:
        """The learning rate of the next update: linear warm-up over ``warmup_steps`` updates."""
        warmup = self.warmup_steps
        return self.base_lr * (min(1.0, (self._updates + 1) / warmup) if warmup > 0 else 1.0)

    def _init_parallel_state(self, fabric) -> None:  # noqa: ANN001
        from megatron.core import parallel_state

        if not dist.is_initialized():  # one process: a group of one, so megatron's collectives work
            import os
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(port))
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", rank=0, world_size=1)
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        # megatron's groups get the launcher's collective timeout (--trainer.collective_timeout), not
        # torch's 30-minute default for new groups: a rank that never joins fails the others in time
        timeout = getattr(fabric.strategy, "_timeout", None)
        self.collective_timeout_s = timeout.total_seconds() if timeout is not None else 1800.0
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tensor_parallel_size,
            pipeline_model_parallel_size=self.pipeline_parallel_size,
            context_parallel_size=self.context_parallel_size,
            create_gloo_process_groups=False,
            distributed_timeout_minutes=self.collective_timeout_s / 60,  # (a timedelta(minutes=...) inside)
        )
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        # the ranks that hold one copy of the model (TP x PP) train on the union of their batches
        self.mp_group = parallel_state.get_model_parallel_group()
        self.mp_size = dist.get_world_size(self.mp_group)
        self.mp_rank = dist.get_rank(self.mp_group)
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.first_stage = parallel_state.is_pipeline_first_stage()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.last_stage_rank = parallel_state.get_pipeline_model_parallel_last_rank()
        self.layer_offset = self.pp_rank * (self.layout.num_layers // self.pipeline_parallel_size)
        self.dp_group = parallel_state.get_data_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        # gradients are summed over data-parallel x context-parallel ranks (megatron's DDP does the same)
        self.dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.dp_cp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        # the ranks that train on one union of batches: tensor x pipeline, or tensor x context (no PP with CP)
        if self.context_parallel_size > 1:
            from gcore.backends.megatron_cp import context_parallel_group

            self.cp = context_parallel_group(self.sequence_parallel_mode)
            self.data_group = parallel_state.get_tensor_and_context_parallel_group()
        else:
            self.cp = None
            self.data_group = self.mp_group
        self.data_size = dist.get_world_size(self.data_group)
        self.data_rank = dist.get_rank(self.data_group)
        if self.device.type == "cpu":
            from gcore.backends.megatron_cpu import install_cpu_adaptations

            install_cpu_adaptations(seed=1234)
        else:
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(1234)

    def _use_transformer_engine(self) -> bool:
        if self.transformer_engine == "false" or self.device.type != "cuda":
            if self.transformer_engine == "true":
                raise ConfigError("--backend.transformer_engine true needs a CUDA device")
            return False
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            if self.transformer_engine == "true":
                raise ConfigError("--backend.transformer_engine true: transformer_engine is not installed") from None
            return False
        return True

    def _build_model(self, dtype: torch.dtype):  # noqa: ANN202
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
        )
        from megatron.core.transformer.transformer_config import TransformerConfig

        c, lay = self.hf_config, self.layout
        on_cpu = self.device.type == "cpu"
        pipelined = self.pipeline_parallel_size > 1
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
            tensor_model_parallel_size=self.tensor_parallel_size,
            pipeline_model_parallel_size=self.pipeline_parallel_size,
            context_parallel_size=self.context_parallel_size,
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
            moe_token_dispatcher_type="alltoall",  # (no experts; megatron's check of variable_seq_lengths)
            batch_p2p_sync=not on_cpu,  # (a torch.cuda.synchronize after pipeline sends)
        )
        if self.context_parallel_size > 1:  # gcore's ring/Ulysses attention: megatron_cp.py
            from gcore.backends.megatron_cp import context_parallel_layer_spec

            spec = context_parallel_layer_spec()
        elif self._use_transformer_engine():
            spec = get_gpt_layer_with_transformer_engine_spec()
        else:
            spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        rope = _rope(c)
        with self._cuda_calls() if pipelined else contextlib.nullcontext():  # (a .cuda() on the tied embedding)
            model = GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=lay.padded_vocab_size,
                max_sequence_length=c.max_position_embeddings,
                parallel_output=True,
                pre_process=self.first_stage,
                post_process=self.last_stage,
                share_embeddings_and_output_weights=lay.tied_embeddings,
                position_embedding_type="rope",
                rotary_base=int(rope["theta"]),
                rope_scaling=rope["llama3"],
                rope_scaling_factor=rope["factor"],
            )
        if on_cpu:
            from gcore.backends.megatron_cpu import keep_rotary_on_cpu

            keep_rotary_on_cpu(model)
        _mark_tensor_parallel(model)
        if self.first_stage and getattr(self, "padding_idx", None) is not None:
            _no_gradient_through_padding(model.embedding.word_embeddings, self.padding_idx)
        return model.to(self.device)

    def _global_name(self, name: str) -> str:
        """The whole model's name of this pipeline stage's parameter (its layers are numbered from 0)."""
        match = _LAYER_INDEX.match(name)
        if not match or self.layer_offset == 0:
            return name
        return f"decoder.layers.{int(match.group(1)) + self.layer_offset}.{match.group(2)}"

    def _local_shards(self, hf_state: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
        """This rank's (stage's, tensor-parallel shard's) tensors of megatron parameters ``names`` from HF tensors."""
        hf_state = dict(hf_state)
        if self.layout.tied_embeddings and "lm_head.weight" not in hf_state:  # the last stage's copy
            hf_state["lm_head.weight"] = hf_state["model.embed_tokens.weight"]
        global_names = [self._global_name(n) for n in names]
        shards = hf_state_to_megatron(hf_state, global_names, self.layout, self.tensor_parallel_size, self.tp_rank)
        return {name: shards[g] for name, g in zip(names, global_names, strict=False)}

    @torch.no_grad()
    def _load_hf_state(self, model, hf_state: dict[str, torch.Tensor]) -> None:  # noqa: ANN001
        params = dict(model.named_parameters())
        shards = self._local_shards(hf_state, list(params))
        for name, param in params.items():
            if tuple(shards[name].shape) != tuple(param.shape):
                raise RuntimeError(f"{name}: converted shape {tuple(shards[name].shape)} != {tuple(param.shape)}")
            param.copy_(shards[name])

    # FORWARD ---------------------------------------------------------------------------------

    def _stage_forward(self, model, input_ids: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        """This pipeline stage's output: logits ``[B, L, V/tp]`` on the last stage, hidden states before."""
        input_ids = input_ids.to(self.device)
        length = input_ids.shape[1]
        positions = torch.arange(length, device=self.device).unsqueeze(0).expand_as(input_ids)
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=self.device), diagonal=1)
        with self.fabric.autocast():  # --trainer.precision bf16-mixed etc., as the torch backend gets from Fabric
            return model(input_ids, positions, causal.view(1, 1, length, length))

    def _logprobs_from_logits(self, logits: torch.Tensor, input_ids: torch.Tensor, temperature: float
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probabilities and entropies ``[B, L-1]`` (entropies without gradient)."""
        input_ids = input_ids.to(self.device)
        if self.tensor_parallel_size == 1:
            return token_logprobs(logits[..., : self.layout.vocab_size], input_ids, temperature)
        return self._vocab_parallel_logprobs(logits, input_ids, temperature)

    def _forward_logprobs(self, model, input_ids: torch.Tensor, temperature: float,  # noqa: ANN001
                          attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities and entropies of a whole (unpipelined) model."""
        if self.cp is not None:
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            return self._context_parallel_logprobs(model, input_ids, attention_mask, temperature)
        return self._logprobs_from_logits(self._stage_forward(model, input_ids), input_ids, temperature)

    def _context_parallel_logprobs(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor,  # noqa: ANN001
                                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, L-1]`` log-probabilities and entropies with this rank holding 1/CP of every row.

        Each right-padded row is padded to a multiple of 2*CP and split zig-zag (megatron's split;
        megatron's rotary embedding picks the same chunks of its table, so positions are the row's);
        gcore's attention joins the CP ranks; the per-token results are gathered back to whole rows
        on every CP rank (backward: each rank keeps its own tokens' gradient).
        """
        from gcore.backends import sequence_parallel as seqpar
        from gcore.backends.megatron_cp import attention_layout

        rows = seqpar.shard_rows(input_ids.to(self.device), attention_mask.to(self.device), self.cp, pack=False)
        with self.fabric.autocast(), attention_layout(rows.layout):
            logits = model(rows.input_ids, rows.position_ids, None)  # [B, S/CP, V/tp]
        if self.tensor_parallel_size == 1:
            logprobs, entropy = seqpar.next_token_logprobs(logits[..., : self.layout.vocab_size], rows.targets,
                                                           temperature)
        else:
            logprobs, entropy = self._vocab_parallel_target_logprobs(logits, rows.targets, temperature)
        return seqpar.gather_per_token(logprobs, rows), seqpar.gather_per_token(entropy, rows)

    def _run_micro_batches(self, model, micros: list[RolloutBatch], temperature: float,  # noqa: ANN001
                           loss_fn, forward_only: bool) -> list[dict]:  # noqa: ANN001
        """Forward (and backward unless ``forward_only``) every micro-batch; returns ``loss_fn``'s
        outputs in order (on the last pipeline stage; an empty list on the others).

        ``loss_fn(logprobs, entropy, micro)`` returns ``(loss, outputs)``. Without pipeline
        parallelism this is a plain loop; with it, megatron-core's 1F1B schedule, whose sends and
        receives between stages go over the default process group (gloo on CPU).
        """
        results: list[dict] = []
        if self.pipeline_parallel_size == 1:
            for micro in micros:
                logprobs, entropy = self._forward_logprobs(model, micro.input_ids, temperature, micro.attention_mask)
                loss, outputs = loss_fn(logprobs, entropy, micro)
                if not forward_only:
                    loss.backward()
                results.append(outputs)
            return results
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, stage):  # noqa: ANN001, ANN202
            micro = next(data_iterator)
            output = self._stage_forward(stage, micro.input_ids)

            def loss_func(logits: torch.Tensor):  # noqa: ANN202
                logprobs, entropy = self._logprobs_from_logits(logits, micro.input_ids, temperature)
                loss, outputs = loss_fn(logprobs, entropy, micro)
                results.append(outputs)
                # (loss, token count, reduced metrics): with calculate_per_token_loss megatron keeps the loss as is
                return loss, torch.ones((), dtype=torch.int), {}

            return output, loss_func

        if not micros:
            return results
        with self._cuda_calls():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micros), model=[model],
                num_microbatches=len(micros), seq_length=micros[0].input_ids.shape[1],
                micro_batch_size=max(len(m) for m in micros), forward_only=forward_only,
            )
        return results

    def _vocab_parallel_logprobs(self, logits: torch.Tensor, input_ids: torch.Tensor, temperature: float
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_logprobs`` on vocabulary shards: megatron's vocab-parallel cross-entropy."""
        return self._vocab_parallel_target_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)

    def _vocab_parallel_target_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities of ``targets`` (aligned with ``logits``) and entropies, on vocabulary shards."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits = logits.float()
        if temperature not in (0.0, 1.0):
            logits = logits / temperature
        shard = logits.shape[-1]
        start = self.tp_rank * shard
        if start + shard > self.layout.vocab_size:  # vocabulary padding on the last ranks
            padding = torch.arange(start, start + shard, device=logits.device) >= self.layout.vocab_size
            logits = logits.masked_fill(padding, _MASKED_LOGIT)
        with torch.no_grad():
            entropy = self._vocab_parallel_entropy(logits.detach())
        # the cross-entropy works on its input in place: give it its own copy
        chosen = -vocab_parallel_cross_entropy(logits.clone(), targets)
        return chosen, entropy

    def _vocab_parallel_entropy(self, logits: torch.Tensor) -> torch.Tensor:
        top = logits.max(-1, keepdim=True).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.tp_group)
        shifted = logits - top
        exp = shifted.exp()
        sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])
        dist.all_reduce(sums, group=self.tp_group)
        return sums[0].log() - sums[1] / sums[0]

    # batches across the tensor-parallel group -------------------------------------------------

    def _mp_union(self, batch: RolloutBatch) -> tuple[RolloutBatch, int]:
        """The concatenation of every peer's batch (the TP x PP, or TP x CP, group), and where this
        rank's rows start."""
        if self.data_size == 1:
            return batch, 0
        parts: list[RolloutBatch | None] = [None] * self.data_size
        dist.all_gather_object(parts, _to_cpu(batch), group=self.data_group)
        offset = sum(len(p) for p in parts[: self.data_rank])
        return _concat_batches(parts), offset

    # PREPARE ---------------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch, role: Literal["policy", "reference"]) -> torch.Tensor:
        model = self.policy if role == "policy" else self.reference
        if model is None:
            raise RuntimeError(f"no {role} model: it was not set up")
        was_training = model.training
        model.eval()
        union, offset = self._mp_union(batch)
        out = torch.zeros(len(union), union.input_ids.shape[1] - 1)
        row_groups = list(torch.arange(len(union)).split(self.micro_batch_size))
        micros = [union.select(rows) for rows in row_groups]
        logprobs = self._run_micro_batches(model, micros, union.temperature,
                                           lambda lp, _, micro: (lp.sum() * 0.0, lp.cpu()), forward_only=True)
        for rows, micro, part in zip(row_groups, micros, logprobs, strict=False):
            out[rows, : part.shape[1]] = part * micro.response_mask
        if self.pipeline_parallel_size > 1:  # the last stage computed them
            out = out.to(self.device)
            dist.broadcast(out, src=self.last_stage_rank, group=self.pp_group)
            out = out.cpu()
        model.train(was_training)
        own = out[offset: offset + len(batch)]
        width = batch.response_mask.shape[1]
        result = torch.zeros_like(batch.response_mask)
        result[:, : min(width, own.shape[1])] = own[:, :width]
        return result

    # TRAIN -----------------------------------------------------------------------------------

    def _all_reduce(self, values: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:  # noqa: ANN001
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            values = values.to(self.device)
            dist.all_reduce(values, op=op, group=group)
        return values.cpu()

    def optimizer_step(self, stats: dict[str, float], loss_finite: bool) -> tuple[float, bool]:
        if self.grad_buffers is not None:
            grad_norm, stepped = self._distributed_step(loss_finite)
        else:
            grad_norm = self._reduce_and_clip_gradients()
            stepped = math.isfinite(grad_norm) and loss_finite
            if stepped:
                for group in self.optimizer.param_groups:
                    group["lr"] = self.learning_rate()
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if stepped:
            self._updates += 1
        return grad_norm, stepped

    def _distributed_step(self, loss_finite: bool) -> tuple[float, bool]:
        """Reduce-scatter the gradients, clip by the global norm and step megatron's distributed
        optimizer (which all-gathers the updated parameters); returns the norm and whether it stepped."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        optimizers = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        with self._cuda_calls():
            finalize_model_grads([self.grad_buffers])  # reduce-scatter over DP; tied embeddings over stages
            self.optimizer.prepare_grads()
            norm = float(self.optimizer.get_grad_norm())
            stepped = math.isfinite(norm) and loss_finite
            if stepped:
                if self.max_grad_norm:
                    for optimizer in optimizers:
                        clip_grad_by_total_norm_fp32(optimizer.get_parameters(), self.max_grad_norm, norm)
                for group in self.optimizer.param_groups:
                    group["lr"] = self.learning_rate()
                self.optimizer.step_with_ready_grads()
            self.grad_buffers.zero_grad_buffer()
            self.optimizer.zero_grad()
        return norm, stepped

    def train_mini_batch(self, batch: RolloutBatch, rows: torch.Tensor, algorithm: Algorithm,
                          max_new_tokens: int) -> dict[str, float]:
        """Accumulate this mini-batch's gradients (local to the rank); returns its global metrics."""
        own = batch.select(rows) if len(rows) else None
        counts = self._all_reduce(torch.tensor([
            float(batch.response_mask[rows].sum()), float(len(rows))], dtype=torch.float64))
        scale = LossScale(tokens=float(counts[0]), sequences=float(counts[1]), max_length=float(max_new_tokens))
        if self.data_size > 1:
            parts: list[RolloutBatch | None] = [None] * self.data_size
            dist.all_gather_object(parts, _to_cpu(own) if own is not None else None, group=self.data_group)
            parts = [p for p in parts if p is not None]
            union = _concat_batches(parts) if parts else None
        else:
            union = own

        def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor, micro: RolloutBatch):  # noqa: ANN202
            micro = _to_device(micro, self.device)
            loss, shares = algorithm.loss(logprobs, micro, scale, entropy if self.tensor_parallel_size == 1 else None)
            shares["entropy"] = (entropy.detach() * micro.response_mask).sum() / max(scale.tokens, 1.0)
            shares["loss"] = loss.detach()
            return loss, {key: float(value) for key, value in shares.items()}

        local: dict[str, float] = {}
        if union is not None:
            micros = [union.select(r) for r in torch.arange(len(union)).split(self.micro_batch_size)]
            for shares in self._run_micro_batches(self.policy, micros, batch.temperature, loss_fn, forward_only=False):
                for key, value in shares.items():
                    local[key] = local.get(key, 0.0) + value
        # every model-parallel (and context-parallel) peer trained on the same union; the last pipeline
        # stage has its metrics: sum over data-parallel ranks, then take the last stage's
        keys = sorted(set(local) | {"loss", "entropy"})
        keys = self._agree_on_keys(keys)
        values = self._all_reduce(torch.tensor([local.get(k, 0.0) for k in keys], dtype=torch.float64),
                                  group=self.dp_group)
        if self.pipeline_parallel_size > 1:
            values = self._all_reduce(values, group=self.pp_group)  # zeros on the other stages
        return dict(zip(keys, values.tolist(), strict=False))

    def _tied_across_stages(self) -> torch.Tensor | None:
        """The tied embedding/output weight on this rank when pipeline stages hold two copies of it."""
        if self.pipeline_parallel_size == 1 or not self.layout.tied_embeddings:
            return None
        if not (self.first_stage or self.last_stage):
            return None
        return self.policy.shared_embedding_or_output_weight()

    def _agree_on_keys(self, keys: list[str]) -> list[str]:
        """Metric names present on any rank (a rank without rows has none of the algorithm's)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return keys
        everyone: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, keys)
        return sorted({k for ks in everyone for k in ks})

    def _reduce_and_clip_gradients(self) -> float:
        """Sum gradients over data-parallel (x context-parallel) ranks, then clip by the global norm;
        returns the norm."""
        named = [(n, p) for n, p in self.policy.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if self.dp_cp_size > 1:  # each context-parallel rank holds its tokens' share of the gradient
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_cp_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset: offset + g.numel()].view_as(g))
                offset += g.numel()
        for p, g in zip(params, grads, strict=False):
            p.grad = g
        tied = self._tied_across_stages()
        if tied is not None:  # the first stage's embedding and the last stage's output layer: one weight
            from megatron.core import parallel_state

            dist.all_reduce(tied.grad, group=parallel_state.get_embedding_group())
        # squares of tensor-parallel shards and of pipeline stages add up; replicated tensors count once
        square = torch.zeros((), dtype=torch.float64, device=self.device)
        for (name, param), g in zip(named, grads, strict=False):
            if (is_tensor_parallel(name) or self.tp_rank == 0) and not getattr(param, "shared", False):
                square += g.double().pow(2).sum()
        norm = float(self._all_reduce(square.unsqueeze(0), group=self.mp_group)[0].sqrt())
        if self.max_grad_norm and math.isfinite(norm):
            coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        return norm

    # SYNC and SAVE ---------------------------------------------------------------------------

    def _gather_shards(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every tensor-parallel rank's shard of parameter ``name`` (copies of a replicated one)."""
        if self.tensor_parallel_size == 1:
            return [tensor.detach()]
        if not is_tensor_parallel(name):
            return [tensor.detach()] * self.tensor_parallel_size
        shards = [torch.empty_like(tensor) for _ in range(self.tensor_parallel_size)]
        dist.all_gather(shards, tensor.detach().contiguous(), group=self.tp_group)
        return shards

    def _hf_tensors(self, per_param: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF-layout full tensors of a megatron tensor per parameter (weights or optimizer moments),
        gathered over the tensor-parallel group and the pipeline stages (a collective)."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in per_param.items():
            shards = self._gather_shards(name, tensor)
            if name == "output_layer.weight" and self.layout.tied_embeddings:
                continue  # the last stage's copy of the first stage's embedding
            out.update(megatron_shards_to_hf(self._global_name(name), shards, self.layout))
        if self.pipeline_parallel_size > 1:
            stages: list[dict | None] = [None] * self.pipeline_parallel_size
            dist.all_gather_object(stages, {k: v.cpu() for k, v in out.items()}, group=self.pp_group)
            out = {k: v.to(self.device) for stage in stages for k, v in stage.items()}
        return out

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-layout weights, gathered over the tensor-parallel group (a collective: every rank calls it)."""
        weights = self._hf_tensors({n: p.data for n, p in self.policy.named_parameters()})
        if self.layout.tied_embeddings:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        self._synced = (self._updates, weights)
        yield from weights.items()

    def save_pretrained(self, path: str) -> None:
        """Write an HF checkpoint (rank 0 alone: uses the weights of the last ``named_weights`` call)."""
        from transformers import AutoModelForCausalLM

        if self._synced is not None and self._synced[0] == self._updates:
            weights = self._synced[1]
        elif self.mp_size == 1:
            weights = dict(self.named_weights())
        else:
            raise RuntimeError("save_pretrained with tensor or pipeline parallelism needs a named_weights() call "
                               "on every rank after the last update")
        model = AutoModelForCausalLM.from_config(self.hf_config)
        model.load_state_dict({k: v.cpu() for k, v in weights.items()}, strict=False)
        model.save_pretrained(path)

    # CHECKPOINT ------------------------------------------------------------------------------

    def _adam_slots(self) -> dict[str, tuple[torch.Tensor, dict, slice | None]]:
        """Per policy parameter: the tensor its Adam state is keyed by, that state's dict, and the
        slice of the flattened parameter it covers (``None``: the whole parameter)."""
        if self.grad_buffers is None:
            return {n: (p, self.optimizer.state, None) for n, p in self.policy.named_parameters()}
        slots: dict[int, tuple[torch.Tensor, dict, slice]] = {}
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            pairs = [(optimizer.model_fp32_groups, optimizer.shard_fp32_groups),
                     (optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups)]
            for model_groups, shard_groups in pairs:
                for model_group, shard_group in zip(model_groups, shard_groups, strict=False):
                    for param, shard in zip(model_group, shard_group, strict=False):
                        owned = optimizer._get_model_param_range_map(param)["param"]
                        slots[id(param)] = (shard, optimizer.optimizer.state, slice(owned.start, owned.end))
        return {n: slots[id(p)] for n, p in self.policy.named_parameters() if id(p) in slots}

    def _adam_moments(self) -> tuple[dict[str, dict[str, torch.Tensor]], float]:
        """Full (this tensor-parallel rank's) Adam moments per parameter, and the step count.

        With the distributed optimizer each data-parallel rank holds a slice of every moment: the
        slices are summed over the data-parallel group into full tensors (a collective)."""
        slots = self._adam_slots()
        params = dict(self.policy.named_parameters())
        moments: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
        step = 0.0
        for key in moments:
            for name, param in params.items():
                tensor, state, owned = slots.get(name, (None, {}, None))
                held = state.get(tensor, {}) if tensor is not None else {}
                step = max(step, float(held.get("step", 0.0)))
                full = torch.zeros(param.numel(), dtype=torch.float32 if owned is not None else param.dtype,
                                   device=param.device)
                if key in held:
                    full[owned if owned is not None else slice(None)] = held[key].reshape(-1)
                moments[key][name] = full.view(param.shape)
        if self.grad_buffers is not None and self.dp_cp_size > 1:  # megatron shards over DP x CP
            for _key, per_param in moments.items():
                flat = torch.cat([t.reshape(-1) for t in per_param.values()])
                dist.all_reduce(flat, group=self.dp_cp_group)
                offset = 0
                for _name, tensor in per_param.items():
                    tensor.copy_(flat[offset: offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()
            top = torch.tensor([step], device=self.device)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.dp_cp_group)
            step = float(top[0])
        return moments, step

    def state_dict(self) -> dict:
        """Weights and Adam moments as full HF-layout tensors: loads at any parallel layout and with
        or without the distributed optimizer.

        Every rank holds the same full tensors (DCP writes replicated tensors once). This is a
        collective over the tensor-parallel and pipeline groups (and, with the distributed optimizer,
        the data-parallel group); a peer that does not join within the collective timeout fails it
        with a ``GcoreError`` instead of a hang.
        """
        try:
            return self._state_dict()
        except (RuntimeError, dist.DistError) as err:
            raise GcoreError(
                f"megatron backend: gathering the checkpoint state over the model-parallel ranks failed after at "
                f"most {self.collective_timeout_s:.0f} s (--trainer.collective_timeout); every rank must save "
                f"together ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
            ) from err

    def _state_dict(self) -> dict:
        weights = {n: p.data.clone() for n, p in self.policy.named_parameters()}  # a snapshot, not live views
        model = self._hf_tensors(weights)
        moments, step = self._adam_moments()
        optim: dict[str, object] = {key: self._hf_tensors(per_param) for key, per_param in moments.items()}
        optim["step"] = torch.tensor(step)
        return {"model": model, "optim": optim, "updates": torch.tensor(float(self._updates))}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        names = [n for n, _ in self.policy.named_parameters()]
        self._load_hf_state(self.policy, dict(state["model"]))
        step = float(state["optim"]["step"])
        moments = {key: self._local_shards(dict(state["optim"][key]), names) for key in ("exp_avg", "exp_avg_sq")}
        slots = self._adam_slots()
        for _, held, _ in slots.values():
            held.clear()
        if step > 0:
            for name, (tensor, held, owned) in slots.items():
                part = owned if owned is not None else slice(None)
                held[tensor] = {"step": torch.tensor(step)} | {
                    key: moments[key][name].reshape(-1)[part].to(tensor.device, tensor.dtype).view_as(tensor).clone()
                    for key in ("exp_avg", "exp_avg_sq")
                }
        if self.grad_buffers is not None:
            with self._cuda_calls():
                self.optimizer.reload_model_params()  # main (fp32) copies of the loaded weights
        self._updates = int(float(state["updates"]))
        self._synced = None


def _mark_tensor_parallel(model) -> None:  # noqa: ANN001
    """Set megatron's ``tensor_model_parallel`` attributes, which weights built with
    ``perform_initialization=False`` lack; megatron's optimizer reads them for the gradient norm."""
    for name, param in model.named_parameters():
        row_parallel = name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight")
        param.tensor_model_parallel = is_tensor_parallel(name)
        param.partition_dim = 1 if row_parallel else 0
        param.partition_stride = 1


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


def _rope(config) -> dict:  # noqa: ANN001
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


def _to_cpu(batch: RolloutBatch) -> RolloutBatch:
    from dataclasses import replace

    return replace(batch, **{f.name: getattr(batch, f.name).cpu() for f in fields(batch)
                             if isinstance(getattr(batch, f.name), torch.Tensor)})


def _to_device(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    from dataclasses import replace

    return replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in fields(batch)
                             if isinstance(getattr(batch, f.name), torch.Tensor)})


def _concat_batches(parts: list[RolloutBatch]) -> RolloutBatch:
    """Stack batches of different lengths (right-padded with zeros to the longest)."""
    if len(parts) == 1:
        return parts[0]
    length = max(p.input_ids.shape[1] for p in parts)
    out = {}
    for f in fields(RolloutBatch):
        values = [getattr(p, f.name) for p in parts]
        if not isinstance(values[0], torch.Tensor):
            out[f.name] = values[0]
            continue
        if any(v is None for v in values):
            raise ValueError(f"cannot stack batches where only some have {f.name}")
        padded = []
        for p, v in zip(parts, values, strict=False):
            if v.dim() == 2:
                width = length if v.shape[1] == p.input_ids.shape[1] else length - 1
                v = torch.nn.functional.pad(v, (0, width - v.shape[1]))
            padded.append(v)
        if len({v.dim() for v in padded}) > 1:  # advantages: [B] on some ranks, [B, L-1] on others
            raise ValueError(f"cannot stack batches whose {f.name} have different ranks")
        out[f.name] = torch.cat(padded)
    return RolloutBatch(**out)
