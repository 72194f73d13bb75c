"""``torch`` backend: a transformers model trained under Lightning Fabric (DDP or FSDP2, on CPU and GPU)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch.distributed.constants import default_pg_timeout

from gcore.algorithms.base import Algorithm
from gcore.backends import lora
from gcore.backends import sequence_parallel as seqpar
from gcore.backends.base import TrainingBackend
from gcore.backends.common import OptimizerOptions, check_sequence_parallel_controllers
from gcore.backends.shared_prompts import (
    distinct_prompts,
    packed_attention,
    packed_response_logits,
    packing_saves,
    prompt_keys,
    shared_prompt_logits,
    to_batch_layout,
    to_response_layout,
)
from gcore.balance import micro_batches_by_length, micro_batches_sharing_prompts, padding_fraction
from gcore.errors import ConfigError
from gcore.model import ModelSource, causal_lm_class, check_compiler, image_text_to_text
from gcore.types import RolloutBatch, concat_visual
from gcore.vision import multimodal_positions, vision_parameters

if TYPE_CHECKING:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import Strategy
    from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer
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
        self.trunk = cast("PreTrainedModel", _load(causal_lm_class(source), source, attn_implementation).base_model)
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


#: ``share_prompts=None`` shares a micro-batch's prompts when that saves at least this share of its tokens
SHARE_PROMPTS_MIN_SAVING = 0.2


class TorchBackend(OptimizerOptions, TrainingBackend):
    """Trains an HF causal LM with AdamW under Fabric.

    When the algorithm needs a critic (PPO), a separate ``ValueModel`` is built from the same
    checkpoint and trained with its own AdamW in the same mini-batch loop as the policy.

    Args:
        gradient_checkpointing: trade compute for memory in the policy's (and critic's) forward pass.
        critic_lr: the critic's learning rate; ``None`` uses the policy's.
        sequence_parallel_size: split every sequence's tokens over this many ranks (groups of
            consecutive ranks; must divide the world size). See docs/long_context.md.
        sequence_parallel_mode: ``ring`` (any head count) or ``ulysses`` (heads divisible by the size).
        packing: concatenate each micro-batch's samples into one row without padding (position
            ids restart per sample); ``None``: on with sequence parallelism, off without.
        strategy: ``ddp`` (every rank holds the whole model) or ``fsdp`` (parameters, gradients and
            optimizer state sharded over all the ranks: torch's FSDP2 ``fully_shard`` per decoder layer
            and on the root, under Fabric's ``ModelParallelStrategy``); both on CPU (gloo) and GPU. The
            policy, the critic and the reference model are sharded; the engine sync gathers the full
            weights on every rank. Not with ``sequence_parallel_size`` > 1. See docs/architecture.md.
        skip_inert_rows: run no forward/backward for rows whose loss and gradient are exactly zero
            (``Algorithm.rows_to_train``: GRPO-family groups that all scored the same, when there is no
            KL term or entropy bonus); the update is unchanged. Token-mean metrics (entropy, ratio,
            clip fraction) are then over the rows that ran (0 when none ran); the ``trained_rows_frac``
            metric says how many.
        share_prompts: in the policy's forward (training and log-probabilities), run each distinct prompt
            of a micro-batch once and the responses on its keys and values (``shared_prompts``); the same
            numbers up to float rounding, less work when several samples share a prompt. ``None``: only
            where it saves at least a fifth of a micro-batch's tokens (below that the second model call
            costs about what it saves; measured in BENCHMARKS.md); ``true``: wherever a prompt repeats.
        pack_responses: where a micro-batch shares its prompts, run its responses as one sequence without
            padding, each token seeing its own prompt and response (a block mask; ``packed_response_logits``);
            the same numbers up to float rounding. ``None``: where that does fewer multiply-adds than responses
            padded to the longest one (``packing_saves``: short, uneven responses); ``true``: always; ``false``:
            never. SDPA and eager attention only (others get the padded layout).
        lora_rank: train LoRA adapters of this rank (the ``peft`` library, ``pip install gcore[lora]``) instead
            of every weight; 0 (default): full fine-tuning. Only the adapters are trained and given to the
            optimizer; the engines receive the merged weights ``W + (alpha / rank) * B @ A`` under the base
            model's names (only the linear layers LoRA changes, and their sibling projections), and
            ``save_pretrained`` writes a plain merged HF checkpoint. Not with ``strategy fsdp`` or
            ``sequence_parallel_size`` > 1. See docs/real_models.md.
        lora_alpha: the LoRA scaling numerator (scale ``alpha / rank``); ``None``: 2 x ``lora_rank``.
        lora_target_modules: the linear modules that get adapters, matched against the end of their
            qualified names (e.g. ``[q_proj, v_proj]``); ``None``: every linear layer but the output head
            (for Llama-style models the attention and MLP projections).
        freeze_vision: with an image-text-to-text checkpoint, train only the language part: the vision encoder
            and its projector (``gcore.vision.vision_parameters``) keep their weights (the policy's and the
            critic's). Refused for a model without one. (``lora_rank`` with such a model puts adapters on the
            language part only and freezes the rest anyway.)
        attn_implementation: the attention of the models this backend runs (policy, reference, critic):
            transformers' ``attn_implementation`` (``sdpa``, ``eager``, ``flash_attention_2``, ...); ``None``:
            transformers' default (``sdpa`` where the model supports it). ``eager`` (two matmuls and a softmax,
            which ``compile`` fuses into the blocks' graphs) keeps a rows x heads x length x length score
            matrix per layer for the backward; ``flash_attention_2`` needs the ``flash-attn`` package and a
            GPU. Not with ``sequence_parallel_size`` > 1 or ``packing``, which bring their own attention.
        compile: compile each transformer block of the policy with ``torch.compile`` (TorchInductor, dynamic
            shapes; "regional" compilation: one block's code is compiled once and serves every block and every
            micro-batch size and length). A micro-batch that shares its prompts (``share_prompts``) runs
            eagerly: its KV cache would make a graph per block. Inductor fuses the
            elementwise work around the matmuls (norms, rotary embeddings, activations); the arithmetic is the
            same up to float rounding. It costs a one-off compilation at the first step (seconds; Inductor's
            on-disk cache serves later runs), so it pays on long runs (BENCHMARKS.md). On CPU it needs a C++
            compiler. Not with ``strategy fsdp``, ``sequence_parallel_size`` > 1, ``packing``, ``lora_rank`` or
            ``gradient_checkpointing`` (untested).
        **optimizer: the optimizer options, ``gcore.backends.common.OptimizerOptions``'s arguments
            (``lr``, ``weight_decay``, ``betas``, ``max_grad_norm``, ``micro_batch_size``, ``warmup_steps``).
    """

    supports_critic = True

    # built by ``setup`` (reading one before is an AttributeError)
    fabric: Fabric
    hf_model: PreTrainedModel  # the policy's parameters, unwrapped, with HF names
    policy: _FabricModule  # the same parameters, Fabric-wrapped: the module that trains
    optimizer: _FabricOptimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    reference: torch.nn.Module | None  # only for algorithms that need a reference model
    critic: _FabricModule | None  # the Fabric-wrapped ValueModel, only for algorithms with a critic
    critic_optimizer: _FabricOptimizer  # only with a critic

    def __init__(
        self,
        gradient_checkpointing: bool = False,
        critic_lr: float | None = None,
        sequence_parallel_size: int = 1,
        sequence_parallel_mode: Literal["ring", "ulysses"] = "ring",
        packing: bool | None = None,
        strategy: Literal["ddp", "fsdp"] = "ddp",
        skip_inert_rows: bool = True,
        share_prompts: bool | None = None,
        pack_responses: bool | None = None,
        lora_rank: int = 0,
        lora_alpha: int | None = None,
        lora_target_modules: list[str] | None = None,
        attn_implementation: str | None = None,
        compile: bool = False,
        freeze_vision: bool = False,
        **optimizer: Any,  # noqa: ANN401  OptimizerOptions's arguments, checked there
    ) -> None:
        self.freeze_vision = freeze_vision
        self.fsdp = strategy == "fsdp"
        self.sequence_parallel_size, self.sequence_parallel_mode = sequence_parallel_size, sequence_parallel_mode
        self.packing, self.skip_inert_rows, self.share_prompts = packing, skip_inert_rows, share_prompts
        self.pack_responses = pack_responses
        self.lora_rank, self.lora_alpha, self.lora_target_modules = lora_rank, lora_alpha, lora_target_modules
        self.gradient_checkpointing, self.critic_lr = gradient_checkpointing, critic_lr
        self.attn_implementation, self.compile = attn_implementation, compile
        self._check_options(strategy)
        super().__init__(**optimizer)  # the optimizer options: lr, ..., micro_batch_size, warmup_steps (checked there)
        self.sp: seqpar.SequenceParallelGroup | None = None  # set by setup when sequence parallel
        self._lora_synced: list[str] = []  # LoRA: the linear modules the engine sync sends
        self._synced: dict[str, torch.Tensor] | None = None  # FSDP: the full weights of the last sync
        #: ``freeze_vision``: the names of the frozen vision weights, which ``named_weights`` leaves out
        self._frozen: frozenset[str] = frozenset()

    def _check_options(self, strategy: str) -> None:
        """Refuse an invalid or untested combination of the options (one ``ConfigError`` naming the flags)."""
        if strategy not in ("ddp", "fsdp"):
            raise ConfigError(f"--backend.strategy {strategy!r}: valid choices: ddp, fsdp")
        size = self.sequence_parallel_size
        if size < 1:
            raise seqpar.ConfigError(f"--backend.sequence_parallel_size {size} must be >= 1")
        if self.fsdp and size > 1:
            raise ConfigError(
                f"--backend.strategy fsdp does not support --backend.sequence_parallel_size {size} "
                "(untested: the sequence-parallel groups' collectives would interleave with FSDP's over all ranks); "
                "use --backend.strategy ddp with sequence parallelism, or --backend.sequence_parallel_size 1 with fsdp"
            )
        lora.check_options(self.lora_rank, self.lora_alpha, self.lora_target_modules)
        if self.lora_rank and (self.fsdp or size > 1):
            flag = "--backend.strategy fsdp" if self.fsdp else "--backend.sequence_parallel_size > 1"
            raise ConfigError(f"--backend.lora_rank {self.lora_rank} does not support {flag} (untested); use "
                              "--backend.strategy ddp and --backend.sequence_parallel_size 1, or --backend.lora_rank 0")
        if self.attn_implementation is not None and (size > 1 or self.packing):
            flag = f"--backend.sequence_parallel_size {size}" if size > 1 else "--backend.packing true"
            raise ConfigError(f"--backend.attn_implementation {self.attn_implementation} does not apply with {flag}: "
                              "it brings its own attention; leave --backend.attn_implementation unset")
        if self.compile:
            _check_compile(strategy, size, self.packing, self.lora_rank, self.gradient_checkpointing)

    def validate_images(self) -> None:
        """Refuse the options not yet tested with image prompts (one line naming the flag)."""
        clash = {f"--backend.sequence_parallel_size {self.sequence_parallel_size}": self.sequence_parallel_size > 1,
                 "--backend.packing true": bool(self.packing), "--backend.compile true": self.compile}
        for flag, on in clash.items():
            if on:
                raise ConfigError(f"{flag} does not take image prompts yet (untested: the visual inputs are not "
                                  "split or packed, nor run through compiled blocks); leave it at its default for "
                                  "image prompts")

    def strategy(self, world_size: int, device_type: str, timeout: timedelta = default_pg_timeout) -> str | Strategy:
        if not self.fsdp:
            return super().strategy(world_size, device_type, timeout)
        from lightning.fabric.strategies import ModelParallelStrategy

        # FSDP2 over one data-parallel mesh dimension of all the ranks (no tensor parallelism); unlike
        # Fabric's FSDPStrategy (FSDP1), ModelParallelStrategy runs on the CPU accelerator too (gloo)
        return ModelParallelStrategy(parallelize_fn=shard_per_layer, data_parallel_size=world_size,
                                     tensor_parallel_size=1, timeout=timeout)

    def validate(self, algorithm: Algorithm, world_size: int, single_controller: bool) -> None:
        super().validate(algorithm, world_size, single_controller)
        check_sequence_parallel_controllers(self.sequence_parallel_size, single_controller)

    def setup(self, fabric: Fabric, source: ModelSource, algorithm: Algorithm, embedded: bool) -> None:
        self.fabric = fabric
        model_class = causal_lm_class(source)
        self.hf_model = _load(model_class, source, self.attn_implementation)
        if self.freeze_vision:
            _freeze_vision(self.hf_model)
            self._frozen = frozenset(name for name, p in self.hf_model.named_parameters() if not p.requires_grad)
        if self.lora_rank:
            self._lora_synced = lora.add_adapters(self.hf_model, self.lora_rank, self.lora_alpha,
                                                  self.lora_target_modules)
        if self.gradient_checkpointing:
            self.hf_model.gradient_checkpointing_enable()
            if self.lora_rank:  # the frozen embeddings' output must carry a gradient through the checkpoints
                self.hf_model.enable_input_require_grads()
        self.hf_model.train()
        lr = self.base_lr(embedded, vision=image_text_to_text(source.path, source.trust_remote_code))
        if self.compile:
            check_compiler("--backend.compile", fabric.device)
            compile_blocks(self.hf_model)
        self.policy, self.optimizer = self._setup_trained(
            self.hf_model, lambda params: _adamw((p for p in params if p.requires_grad)
                                                 if self.lora_rank or self.freeze_vision else params,
                                                 lr=lr, betas=self.betas, weight_decay=self.weight_decay)
        )
        # Fabric's optimizer wrapper is an instance of the optimizer's class (it subclasses it at run time)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(cast(torch.optim.Optimizer, self.optimizer),
                                                           lambda step: self.warmup_factor(step))
        self.reference = None
        hf_models = [self.hf_model]  # the HF models this backend runs
        if algorithm.needs_reference:
            reference = _load(model_class, source, self.attn_implementation)
            reference.eval().requires_grad_(False)
            # under FSDP sharded like the policy (ModelParallelStrategy moves no unsharded module to the device)
            self.reference = fabric.setup_module(reference) if self.fsdp else fabric.to_device(reference)
            hf_models.append(reference)
        self.critic = None
        if algorithm.needs_critic:
            critic = ValueModel(source, self.attn_implementation)
            if self.freeze_vision:
                _freeze_vision(critic.trunk)
            if self.gradient_checkpointing:
                critic.trunk.gradient_checkpointing_enable()
            critic.train()
            critic_lr = self.critic_lr if self.critic_lr is not None else lr
            self.critic, self.critic_optimizer = self._setup_trained(
                critic,
                lambda params: _adamw((p for p in params if p.requires_grad), lr=critic_lr, betas=self.betas,
                                      weight_decay=self.weight_decay),
            )
            hf_models.append(critic.trunk)
        self._setup_sequence_parallel(hf_models)

    def _setup_trained(
        self, module: torch.nn.Module, make_optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
    ) -> tuple[_FabricModule, _FabricOptimizer]:
        """Fabric-wrap a trained module and its AdamW. FSDP2 replaces the parameters with sharded ones
        (DTensors), so under FSDP the optimizer is built after the module is set up."""
        if self.fsdp:
            wrapped = self.fabric.setup_module(module)
            optimizer = self.fabric.setup_optimizers(make_optimizer(wrapped.parameters()))
            return wrapped, cast("_FabricOptimizer", optimizer)  # one optimizer in, one out (not a tuple)
        return self.fabric.setup(module, make_optimizer(module.parameters()))

    def _setup_sequence_parallel(self, hf_models: list[PreTrainedModel]) -> None:
        """Create the sequence-parallel groups and switch the models (the policy, the reference model, the
        critic's trunk) to the distributed attention."""
        if self.sequence_parallel_size == 1 and not self.packing:
            return
        self.sp = seqpar.SequenceParallelGroup.create(self.sequence_parallel_size, self.sequence_parallel_mode)
        heads = self.hf_model.config.num_attention_heads
        if self.sequence_parallel_mode == "ulysses" and heads % self.sequence_parallel_size:
            raise seqpar.ConfigError(
                f"--backend.sequence_parallel_mode ulysses needs the model's {heads} attention heads divisible by "
                f"--backend.sequence_parallel_size {self.sequence_parallel_size}; use ring"
            )
        for model in hf_models:
            seqpar.use_sequence_parallel_attention(model)

    def _forward_logprobs(self, model: torch.nn.Module, micro: RolloutBatch,
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
        if self.sp is None:
            shared = None
            if self.share_prompts is not False:  # auto: where it saves a fifth of the tokens or more
                shared = distinct_prompts(micro, min_saving=0.0 if self.share_prompts else SHARE_PROMPTS_MIN_SAVING)
                if self.fsdp and self.fabric.world_size > 1 and self._global_max(int(shared is None)):
                    shared = None  # FSDP: every rank must make the same model calls (each gathers the weights)
            if shared is not None:  # each distinct prompt runs once for all the rows that share it
                # compiled blocks would recompile for each block's state of the prompts' KV cache: run eagerly
                eager = torch.compiler.set_stance("force_eager") if self.compile else contextlib.nullcontext()
                inner = getattr(model, "module", model)
                pack = self._may_pack(inner) and (
                    self.pack_responses or packing_saves(micro, len(shared[0]), inner.config))
                with self.fabric.autocast(), eager:  # the unwrapped module gets the precision the wrapper gives
                    if pack:
                        logits, targets, rows, columns = packed_response_logits(model, micro, *shared,
                                                                                input_ids.device, prefix_model=inner)
                    else:
                        logits, targets = shared_prompt_logits(model, micro, *shared, input_ids.device,
                                                               prefix_model=inner)
                logprobs, entropy = seqpar.next_token_logprobs(logits, targets, temperature)
                if pack:
                    logprobs, entropy = (to_response_layout(v, rows, columns, len(micro)) for v in (logprobs, entropy))
                return to_batch_layout(logprobs, micro), to_batch_layout(entropy, micro)
            # the last position predicts no token of the batch and, the attention being causal, no other
            # position reads it: leave it out. No KV cache either (HF builds one by default).
            attention_mask = self.fabric.to_device(micro.attention_mask)
            logits = model(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1], use_cache=False).logits
            return seqpar.next_token_logprobs(logits, input_ids[:, 1:], temperature)
        return seqpar.sequence_parallel_logprobs(model, input_ids, micro.attention_mask, temperature, self.sp,
                                                 self._pack(self.sp))

    def _forward_values(self, critic: torch.nn.Module, micro: RolloutBatch) -> torch.Tensor:
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

    def _per_row_pass(self, batch: RolloutBatch, forward: Callable[[RolloutBatch], torch.Tensor]) -> torch.Tensor:
        """``forward(micro)`` over the batch in micro-batches, masked to the response: ``[B, L-1]``. Under
        sequence parallelism the group runs on the union of its members' batches; each rank gets its own rows."""
        own, offset, count = batch, 0, len(batch)
        if self.sp is not None:
            batch, offset, count = seqpar.gather_group_batch(batch, self.sp)
        out = torch.zeros_like(batch.response_mask)
        chunks = list(torch.arange(len(batch)).split(self.micro_batch_size))
        # under FSDP a forward is a collective (it gathers the weights): every rank makes as many, padding
        # passes last (as in training, so that the real passes pair up)
        padding = self._global_max(len(chunks)) - len(chunks) if self.fsdp else 0
        for rows in chunks:
            micro = batch.select(rows)
            values = forward(micro)
            out[rows, : values.shape[1]] = values.cpu() * micro.response_mask
        for _ in range(padding):
            forward(batch.select(torch.tensor([0])))
        return out[offset: offset + count, : own.response_mask.shape[1]]

    # PREPARE ---------------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch, role: Literal["policy", "reference"]) -> torch.Tensor:
        model = self.policy if role == "policy" else self.reference
        if model is None:
            raise RuntimeError(f"no {role} model: it was not set up")
        return self._per_row_pass(batch, lambda micro: self._forward_logprobs(model, micro, batch.temperature)[0])

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        critic = self.critic
        if critic is None:
            raise RuntimeError("no critic: it was not set up (the algorithm's needs_critic was False)")
        return self._per_row_pass(batch, lambda micro: self._forward_values(critic, micro))

    # TRAIN -----------------------------------------------------------------------------------

    def _all_reduce(self, values: torch.Tensor, reduce_op: Literal["sum", "max"]) -> torch.Tensor:
        reduced = self.fabric.all_reduce(values, reduce_op=reduce_op)
        assert isinstance(reduced, torch.Tensor)  # a tensor in, a tensor out
        return reduced

    def _global_sums(self, values: list[float]) -> list[float]:
        if self.fabric.world_size == 1:
            return [float(v) for v in values]
        return self._all_reduce(torch.tensor(values, dtype=torch.float64), "sum").tolist()

    def _global_max(self, value: int) -> int:
        if self.fabric.world_size == 1:
            return int(value)
        return int(self._all_reduce(torch.tensor(float(value)), "max"))

    def train(self, batch: RolloutBatch, algorithm: Algorithm) -> dict[str, float]:
        if self.sp is not None:  # the group trains on the union of its members' batches
            batch, _, _ = seqpar.gather_group_batch(batch, self.sp)
        return super().train(batch, algorithm)

    def optimizer_step(self, stats: dict[str, float], loss_finite: bool) -> tuple[float, bool]:
        grad_norm = _norm_value(self.fabric.clip_gradients(
            self.policy, self.optimizer, max_norm=self.max_grad_norm or math.inf,
            error_if_nonfinite=False,
        ))
        if self.critic is not None:
            stats.update(self._critic_step(self.critic, stats))
        stepped = math.isfinite(grad_norm) and loss_finite
        if stepped:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, stepped

    def learning_rate(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def _critic_step(self, critic: _FabricModule, stats: dict[str, float]) -> dict[str, float]:
        """Clip and apply the critic's accumulated gradients (skipped when non-finite)."""
        grad_norm = _norm_value(self.fabric.clip_gradients(
            critic, self.critic_optimizer, max_norm=self.max_grad_norm or math.inf,
            error_if_nonfinite=False,
        ))
        skipped = 0.0
        if math.isfinite(grad_norm) and math.isfinite(stats.get("critic/value_loss", 0.0)):
            self.critic_optimizer.step()
        else:
            skipped = 1.0
        self.critic_optimizer.zero_grad(set_to_none=True)
        return {"critic/grad_norm": grad_norm, "critic/skipped_updates": skipped}

    def _may_pack(self, model: torch.nn.Module) -> bool:
        """Whether a micro-batch that shares its prompts may run its replies packed on ``model``: not with
        ``--backend.pack_responses false``, nor where its attention takes no block mask (``packed_attention``)."""
        return self.pack_responses is not False and packed_attention(model) is not None

    def train_mini_batch(self, batch: RolloutBatch, rows: torch.Tensor, algorithm: Algorithm) -> dict[str, float]:
        """Accumulate the gradients of one mini-batch over micro-batches; returns its global metrics."""
        fabric, world = self.fabric, self.fabric.world_size
        replicas = self.sp.size if self.sp is not None else 1  # each group holds its rows K times
        # the denominators count every row; only the rows whose loss is not exactly zero are run
        trained = rows[algorithm.rows_to_train(batch)[rows]] if self.skip_inert_rows else rows
        totals = self._global_sums([batch.response_mask[rows].sum().item(), len(rows),
                                    batch.response_mask[trained].sum().item(), len(trained)])
        tokens, sequences, trained_tokens, trained_rows = (total / replicas for total in totals)
        scale = algorithm.loss_scale(tokens, sequences)
        rows = trained
        lengths = batch.attention_mask[rows].sum(-1).tolist()
        sharing = self.sp is None and self.share_prompts is not False and batch.visual is None
        if sharing and batch.prompt_lengths is not None:
            # each micro-batch runs each of its prompts once: fewer prompts per micro-batch against less reply padding
            prompt_lengths = batch.prompt_lengths[rows].tolist()
            prompts = prompt_keys(batch.input_ids[rows], prompt_lengths)
            groups = micro_batches_sharing_prompts(lengths, prompt_lengths, prompts, self.micro_batch_size,
                                                   packed=self._may_pack(self.hf_model))
        else:  # similar lengths in a micro-batch: less padding
            groups = micro_batches_by_length(lengths, self.micro_batch_size)
        micro_rows = [rows[torch.tensor(g, dtype=torch.long)] for g in groups] or [torch.tensor([], dtype=torch.long)]
        n_micro = self._global_max(len(micro_rows))  # every rank runs as many backward passes
        local: dict[str, float] = {}
        for i in range(n_micro):
            real = i < len(micro_rows) and len(micro_rows[i]) > 0
            micro = batch.select(micro_rows[i] if real else torch.tensor([0]))
            with fabric.no_backward_sync(self.policy, enabled=i < n_micro - 1):
                logprobs, entropy = self._forward_logprobs(self.policy, micro, batch.temperature)
                micro = _to_device(micro, fabric)
                loss, shares = algorithm.loss(logprobs, micro, scale, entropy)
                if not real:
                    loss = loss * 0.0  # a rank with fewer micro-batches still joins the gradient all-reduce
                fabric.backward(loss * world)  # DDP averages over ranks; the loss is already a global sum
            if self.critic is not None:
                with fabric.no_backward_sync(self.critic, enabled=i < n_micro - 1):
                    predicted = self._forward_values(self.critic, micro)
                    value_loss, value_shares = algorithm.value_loss(predicted, micro, scale)
                    fabric.backward(value_loss * (world if real else 0.0))
                shares.update(value_shares)
            shares["entropy"] = (entropy.detach() * micro.response_mask).sum() / max(scale.tokens, 1.0)
            shares["loss"] = loss.detach()
            for key, value in shares.items():  # every rank sums the same keys (a zero pass adds zeros)
                local[key] = local.get(key, 0.0) + (float(value) if real else 0.0)
        # the mean over ranks after the sum and the division by the replicas of each row
        local["padding_frac"] = padding_fraction(lengths, groups) * replicas / world
        keys = sorted(set(local) | {"loss", "entropy"})
        values = [local.get(k, 0.0) for k in keys]
        if world > 1:
            values = [v / replicas for v in self._all_reduce(torch.tensor(values), "sum").tolist()]
        metrics = dict(zip(keys, values, strict=False))
        # token means over the rows that ran (the shares were divided by every row's tokens); 0 when no
        # row ran (trained_rows_frac 0), so that every metric stays finite and comparable across resumes
        for key in metrics.keys() - {"loss", "padding_frac"}:
            metrics[key] = metrics[key] * tokens / trained_tokens if trained_tokens else 0.0
        metrics["trained_rows_frac"] = trained_rows / max(sequences, 1.0)
        return metrics

    # SYNC and SAVE ---------------------------------------------------------------------------

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """FSDP: the policy's full (unsharded) weights with HF names on every rank (a collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        weights = cast("dict[str, torch.Tensor]",  # full_state_dict: plain tensors
                       get_model_state_dict(self.policy.module, options=StateDictOptions(full_state_dict=True)))
        if getattr(self.hf_model.config, "tie_word_embeddings", False) and "lm_head.weight" not in weights:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        return weights

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's weights (under FSDP gathered from the shards: every rank calls it) that training can change:
        with LoRA, the weights of the linear modules LoRA changes (and their siblings), merged, under the base
        model's names; with ``freeze_vision``, all but the vision encoder's and its projector's. Every weight left
        out is frozen and equals what the engine loaded from the checkpoint, so a sync sends only what changed."""
        if self.lora_rank:
            yield from lora.merged_weights(self.hf_model, self._lora_synced)
            return
        if self.fsdp:
            self._synced = self._full_state_dict()  # whole: ``save_pretrained`` writes it
            yield from ((name, t) for name, t in self._synced.items() if name not in self._frozen)
            return
        for name, tensor in self.hf_model.state_dict().items():
            if name not in self._frozen:
                yield name, tensor.detach()

    def save_pretrained(self, path: str) -> None:
        """Write an HF checkpoint (rank 0 alone; under FSDP the weights of the last ``named_weights`` call,
        which the controller makes after every update). With LoRA: a plain checkpoint of the merged weights."""
        if self.lora_rank:
            self.hf_model.save_pretrained(path, state_dict=lora.merged_state_dict(self.hf_model))
            return
        if self.fsdp:
            if self._synced is None:
                raise RuntimeError("save_pretrained under FSDP needs a named_weights() call on every rank first")
            self.hf_model.save_pretrained(path, state_dict={k: v.cpu() for k, v in self._synced.items()})
            return
        self.hf_model.save_pretrained(path)

    # CHECKPOINT ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        # under FSDP the wrapped root gives sharded tensors, which DCP writes shard by shard
        model, optim = get_state_dict(self._policy_root(), self.optimizer.optimizer)
        state = {"model": model, "optim": optim, "scheduler": self.scheduler.state_dict()}
        if self.critic is not None:
            critic, critic_optim = get_state_dict(self.critic.module, self.critic_optimizer.optimizer)
            state.update(critic=critic, critic_optim=critic_optim)
        return state

    def _policy_root(self) -> torch.nn.Module:
        """The module whose state dict holds the policy: the FSDP root under FSDP, else the HF model."""
        return self.policy.module if self.fsdp else self.hf_model

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self._policy_root(), self.optimizer.optimizer,
                       model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.critic is not None:
            set_state_dict(self.critic.module, self.critic_optimizer.optimizer,
                           model_state_dict=state["critic"], optim_state_dict=state["critic_optim"])


def _load(auto_class: type[AutoModel] | type[AutoModelForCausalLM], source: ModelSource,
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


def _freeze_vision(model: torch.nn.Module) -> None:
    """``--backend.freeze_vision``: no gradient for the vision encoder and its projector."""
    frozen = vision_parameters(model)
    if not frozen:
        raise ConfigError(f"--backend.freeze_vision true: {type(model).__name__} has no vision encoder to freeze; "
                          "use --backend.freeze_vision false")
    for parameter in frozen:
        parameter.requires_grad_(False)


def _check_compile(strategy: str, sequence_parallel_size: int, packing: bool | None, lora_rank: int,
                   gradient_checkpointing: bool) -> None:
    """Refuse ``--backend.compile true`` where it is untested."""
    clash = {"--backend.strategy fsdp": strategy == "fsdp",
             f"--backend.sequence_parallel_size {sequence_parallel_size}": sequence_parallel_size > 1,
             "--backend.packing true": bool(packing), f"--backend.lora_rank {lora_rank}": lora_rank > 0,
             "--backend.gradient_checkpointing true": gradient_checkpointing}
    for flag, on in clash.items():
        if on:
            raise ConfigError(f"--backend.compile true does not support {flag} (untested); use --backend.compile false")


def _adamw(params: Iterable[torch.nn.Parameter], *, lr: float, betas: tuple[float, float],
           weight_decay: float) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel where it has one (floating-point parameters on CPU or CUDA): one
    op per parameter instead of a dozen, the default of transformers' Trainer (and so of TRL). Under FSDP
    the parameters are DTensors, which torch's fused AdamW takes (it runs on each rank's shard; checked
    on torch 2.13, CPU); where a torch lacks the DTensor rule, the default (foreach) implementation runs."""
    parameters = list(params)
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in parameters)
    if fused and any(hasattr(p, "full_tensor") for p in parameters):
        fused = _fused_adamw_takes_dtensor()
    return torch.optim.AdamW(parameters, fused=True if fused else None, lr=lr, betas=betas, weight_decay=weight_decay)


def _norm_value(norm: torch.Tensor | None) -> float:
    """A gradient norm (``Fabric.clip_gradients``'s, which is ``None`` only with ``clip_val``) as a float. Under
    FSDP ``clip_grad_norm_`` returns a replicated DTensor: the global norm over every rank's shards (torch reduces
    the per-shard norms), the same value on every rank."""
    assert norm is not None  # clipped by max_norm
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def _to_device(batch: RolloutBatch, fabric: Fabric) -> RolloutBatch:
    from dataclasses import fields, replace

    moved = {
        f.name: fabric.to_device(getattr(batch, f.name))
        for f in fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    return replace(batch, **moved)


def _fused_adamw_takes_dtensor() -> bool:
    """Whether this torch has a DTensor sharding rule for the fused AdamW kernel."""
    try:
        from torch.distributed.tensor import DTensor

        propagator = DTensor._op_dispatcher.sharding_propagator
        rules = (getattr(propagator, name, {}) for name in ("op_strategy_funcs", "op_single_dim_strategy_funcs"))
        return any(torch.ops.aten._fused_adamw_.default in rule for rule in rules)
    except Exception:  # noqa: BLE001  an internal that moved may fail in any way: take the safe path
        return False
