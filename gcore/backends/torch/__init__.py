"""``torch`` backend: a transformers model trained under Lightning Fabric (DDP or FSDP2, on CPU and GPU).

One module per job, in the order a step uses them:

- this file: ``TorchBackend``, the ``TrainingBackend`` (flags, setup, PREPARE, TRAIN, SYNC, checkpoints), each job
  delegated to the modules below;
- ``options.py``: the refusal tables, the combinations of flags that are invalid or untested;
- ``model.py``: the models and how they are built: the critic (``ValueModel``), loading with
  ``attn_implementation``, the transformer blocks that ``compile`` compiles and FSDP2 shards, ``freeze_vision``;
- ``forward.py``: the forward passes (``ForwardPasses``): log-probabilities and values of a micro-batch through
  images, shared prompts (replies padded or packed), sequence parallelism, and PREPARE's per-row pass;
- ``microbatch.py``: the micro-batch cut of TRAIN and the sums and maxima the ranks agree on;
- ``optim.py``: AdamW (fused where it runs) and the gradient norm as a float;
- the other modules of ``gcore/backends/``: ``common.py`` (the optimizer options and the log-probabilities both
  backends share), ``shared_prompts.py``, ``sequence_parallel.py``, ``lora.py``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch.distributed.constants import default_pg_timeout

from gcore import moe
from gcore.algorithms.base import Algorithm, is_max_metric
from gcore.algorithms.distill import check_teacher_vocabulary
from gcore.backends import lora
from gcore.backends import sequence_parallel as seqpar
from gcore.backends.base import TrainingBackend
from gcore.backends.common import OptimizerOptions, check_sequence_parallel_controllers
from gcore.backends.torch import microbatch
from gcore.backends.torch.forward import SHARE_PROMPTS_MIN_SAVING, ForwardPasses, to_device
from gcore.backends.torch.microbatch import global_max, global_sums
from gcore.backends.torch.model import (
    ValueModel,
    compile_blocks,
    freeze_vision,
    load_model,
    shard_per_layer,
    transformer_blocks,
)
from gcore.backends.torch.optim import adamw, norm_value
from gcore.backends.torch.options import check_images, check_options
from gcore.backends.torch.routing import MiniBatchRouting
from gcore.balance import padding_fraction
from gcore.errors import ConfigError
from gcore.model import ModelSource, causal_lm_class, check_compiler, image_text_to_text
from gcore.types import RolloutBatch

if TYPE_CHECKING:
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import Strategy
    from lightning_fabric.wrappers import _FabricModule, _FabricOptimizer
    from transformers import PreTrainedModel

__all__ = ["SHARE_PROMPTS_MIN_SAVING", "ForwardPasses", "TorchBackend", "ValueModel", "compile_blocks",
           "shard_per_layer", "transformer_blocks"]


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
        router_aux_loss_coef: mixture-of-experts policies (docs/moe.md): add this multiple of the routers'
            load-balancing loss (Switch Transformer's, transformers' ``load_balancing_loss_func``, over every MoE
            layer and the micro-batch's tokens) to the policy's loss. 0 (default) for RL: the loss pulls the router
            toward a uniform load, which is not the RL objective, and it moves the routing (so the policy) between
            what the engine sampled with and what the trainer trains on. Refused for a dense model.
        routing_replay: mixture-of-experts policies: route each token of the trainer's forwards (training and the
            old log-probabilities) to the experts the engine chose when it sampled it (``Generation.routed_experts``,
            recorded by the ``hf`` engine in-process, which this turns on: ``--engine.record_routes``); the routing
            weights are recomputed from the current gate's
            logits at those experts, so the gate still trains. Tokens without a record keep the router's choice.
            Refused for a dense model, with engines that do not record routes (vLLM, SGLang, engine workers).
        **optimizer: the optimizer options, ``gcore.backends.common.OptimizerOptions``'s arguments
            (``lr``, ``weight_decay``, ``betas``, ``max_grad_norm``, ``micro_batch_size``, ``warmup_steps``).
    """

    supports_critic = True
    supports_teacher = True

    # built by ``setup`` (reading one before is an AttributeError)
    fabric: Fabric
    hf_model: PreTrainedModel  # the policy's parameters, unwrapped, with HF names
    policy: _FabricModule  # the same parameters, Fabric-wrapped: the module that trains
    optimizer: _FabricOptimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    reference: torch.nn.Module | None  # only for algorithms that need a reference model
    teacher: torch.nn.Module | None  # only for algorithms with a teacher (on-policy distillation)
    critic: _FabricModule | None  # the Fabric-wrapped ValueModel, only for algorithms with a critic
    critic_optimizer: _FabricOptimizer  # only with a critic
    passes: ForwardPasses  # the forward passes of the models above

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
        router_aux_loss_coef: float = 0.0,
        routing_replay: bool = False,
        **optimizer: Any,  # noqa: ANN401  OptimizerOptions's arguments, checked there
    ) -> None:
        self.freeze_vision = freeze_vision
        if router_aux_loss_coef < 0:
            raise ConfigError(f"--backend.router_aux_loss_coef {router_aux_loss_coef} must be >= 0")
        self.router_aux_loss_coef, self.routing_replay = router_aux_loss_coef, routing_replay
        self.fsdp = strategy == "fsdp"
        self.sequence_parallel_size, self.sequence_parallel_mode = sequence_parallel_size, sequence_parallel_mode
        self.packing, self.skip_inert_rows, self.share_prompts = packing, skip_inert_rows, share_prompts
        self.pack_responses = pack_responses
        self.lora_rank, self.lora_alpha, self.lora_target_modules = lora_rank, lora_alpha, lora_target_modules
        self.gradient_checkpointing, self.critic_lr = gradient_checkpointing, critic_lr
        self.attn_implementation, self.compile = attn_implementation, compile
        check_options(strategy, sequence_parallel_size=sequence_parallel_size, packing=packing, lora_rank=lora_rank,
                      lora_alpha=lora_alpha, lora_target_modules=lora_target_modules,
                      attn_implementation=attn_implementation, compile=compile,
                      gradient_checkpointing=gradient_checkpointing)
        super().__init__(**optimizer)  # the optimizer options: lr, ..., micro_batch_size, warmup_steps (checked there)
        self.sp: seqpar.SequenceParallelGroup | None = None  # set by setup when sequence parallel
        self._lora_synced: list[str] = []  # LoRA: the linear modules the engine sync sends
        self._synced: dict[str, torch.Tensor] | None = None  # FSDP: the full weights of the last sync
        #: ``freeze_vision``: the names of the frozen vision weights, which ``named_weights`` leaves out
        self._frozen: frozenset[str] = frozenset()
        #: a mixture-of-experts policy's router hooks (``gcore.backends.moe``); ``None`` for a dense model
        self.router_tap: moe.RouterTap | None = None
        self.reference_tap: moe.RouterTap | None = None

    def validate_images(self) -> None:
        """Refuse the options not yet tested with image prompts (one line naming the flag)."""
        check_images(self.sequence_parallel_size, self.packing, self.compile)

    def strategy(self, world_size: int, device_type: str, timeout: timedelta = default_pg_timeout) -> str | Strategy:
        if not self.fsdp:
            return super().strategy(world_size, device_type, timeout)
        from lightning_fabric.strategies import ModelParallelStrategy

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
        self.hf_model = load_model(model_class, source, self.attn_implementation)
        self._setup_moe(self.hf_model)
        if self.freeze_vision:
            freeze_vision(self.hf_model)
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
            self.hf_model, lambda params: adamw((p for p in params if p.requires_grad)
                                                 if self.lora_rank or self.freeze_vision else params,
                                                 lr=lr, betas=self.betas, weight_decay=self.weight_decay)
        )
        # Fabric's optimizer wrapper is an instance of the optimizer's class (it subclasses it at run time)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(cast(torch.optim.Optimizer, self.optimizer),
                                                           lambda step: self.warmup_factor(step))
        self.reference = None
        hf_models = [self.hf_model]  # the HF models this backend runs
        if algorithm.needs_reference:
            reference = load_model(model_class, source, self.attn_implementation)
            reference.eval().requires_grad_(False)
            if self.routing_replay:
                self.reference_tap = moe.RouterTap(reference)
            # under FSDP sharded like the policy (ModelParallelStrategy moves no unsharded module to the device)
            self.reference = fabric.setup_module(reference) if self.fsdp else fabric.to_device(reference)
            hf_models.append(reference)
        self.teacher = None
        if algorithm.teacher_path is not None:  # on-policy distillation: a second frozen model, the teacher's
            teacher_source = ModelSource(algorithm.teacher_path, source.dtype, source.trust_remote_code)
            check_teacher_vocabulary(source, teacher_source)
            teacher = load_model(causal_lm_class(teacher_source), teacher_source, self.attn_implementation)
            teacher.eval().requires_grad_(False)
            self.teacher = fabric.setup_module(teacher) if self.fsdp else fabric.to_device(teacher)
            hf_models.append(teacher)
        self.critic = None
        if algorithm.needs_critic:
            critic = ValueModel(source, self.attn_implementation)
            if self.freeze_vision:
                freeze_vision(critic.trunk)
            if self.gradient_checkpointing:
                critic.trunk.gradient_checkpointing_enable()
            critic.train()
            critic_lr = self.critic_lr if self.critic_lr is not None else lr
            self.critic, self.critic_optimizer = self._setup_trained(
                critic,
                lambda params: adamw((p for p in params if p.requires_grad), lr=critic_lr, betas=self.betas,
                                      weight_decay=self.weight_decay),
            )
            hf_models.append(critic.trunk)
        self._setup_sequence_parallel(hf_models)
        self.passes = ForwardPasses(fabric, self.sp, micro_batch_size=self.micro_batch_size,
                                    share_prompts=self.share_prompts, pack_responses=self.pack_responses,
                                    packing=self.packing, fsdp=self.fsdp, compile=self.compile)

    def _setup_moe(self, model: PreTrainedModel) -> None:
        """A mixture-of-experts policy: its router hooks, and the refusals (one line naming the flag) of what is
        untested with it; the MoE options refused for a dense model."""
        if not moe.is_moe(model):
            for flag, on in {f"--backend.router_aux_loss_coef {self.router_aux_loss_coef}": self.router_aux_loss_coef,
                             "--backend.routing_replay true": self.routing_replay}.items():
                if on:
                    raise ConfigError(f"{flag}: {type(model).__name__} is not a mixture of experts (no top-k router); "
                                      "leave it at its default, or use an MoE model (--model.architecture qwen3_moe)")
            return
        clash = {f"--backend.sequence_parallel_size {self.sequence_parallel_size}": self.sequence_parallel_size > 1,
                 "--backend.packing true": bool(self.packing), "--backend.compile true": self.compile,
                 "--backend.share_prompts true": bool(self.share_prompts),
                 "--backend.pack_responses true": bool(self.pack_responses)}
        for flag, on in clash.items():
            if on:
                raise ConfigError(f"{flag} does not support a mixture-of-experts policy ({type(model).__name__}) yet "
                                  "(untested: the routers' hooks need the plain padded forward); leave it at its "
                                  "default")
        # the expert load and routing replay follow the tokens of the plain padded forward, one router call per layer
        self.share_prompts, self.pack_responses = False, False
        self.router_tap = moe.RouterTap(model, keep_logits=self.router_aux_loss_coef > 0)

    def routed(self, tap: moe.RouterTap | None, micro: RolloutBatch) -> contextlib.AbstractContextManager:
        """The router hooks around a forward on ``micro`` (none for a dense model), routing its tokens to the engine's
        experts with ``routing_replay``."""
        if tap is None:
            return contextlib.nullcontext()
        tap.reset()
        tap.recorded, tap.replay = None, self.routing_replay
        if self.routing_replay and micro.routed_experts is None:
            raise ConfigError("--backend.routing_replay true: the engine recorded no routes for these samples "
                              "(only the in-process hf engine records them, for single-turn episodes); use --engine hf "
                              "without engine workers, or --backend.routing_replay false")
        if micro.routed_experts is not None:
            tap.recorded = micro.routed_experts.reshape(-1, *micro.routed_experts.shape[2:]).long()
        return tap

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

    # PREPARE ---------------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch, role: Literal["policy", "reference", "teacher"]) -> torch.Tensor:
        model = {"policy": self.policy, "reference": self.reference, "teacher": self.teacher}.get(role)
        if model is None:
            raise RuntimeError(f"no {role} model: it was not set up")
        # the teacher's routes are its own (no replay of the engine's, which are the student's)
        tap = {"policy": self.router_tap, "reference": self.reference_tap}.get(role)

        def forward(micro: RolloutBatch) -> torch.Tensor:
            with self.routed(tap, micro):
                return self.passes.logprobs(model, micro, batch.temperature)[0]
        return self.passes.per_row(batch, forward)

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        critic = self.critic
        if critic is None:
            raise RuntimeError("no critic: it was not set up (the algorithm's needs_critic was False)")
        return self.passes.per_row(batch, lambda micro: self.passes.values(critic, micro))

    # TRAIN -----------------------------------------------------------------------------------

    def train(self, batch: RolloutBatch, algorithm: Algorithm) -> dict[str, float]:
        if self.sp is not None:  # the group trains on the union of its members' batches
            batch, _, _ = seqpar.gather_group_batch(batch, self.sp)
        return super().train(batch, algorithm)

    def optimizer_step(self, stats: dict[str, float], loss_finite: bool) -> tuple[float, bool]:
        grad_norm = norm_value(self.fabric.clip_gradients(
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
        grad_norm = norm_value(self.fabric.clip_gradients(
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

    def train_mini_batch(self, batch: RolloutBatch, rows: torch.Tensor, algorithm: Algorithm) -> dict[str, float]:
        """Accumulate the gradients of one mini-batch over micro-batches; returns its global metrics."""
        fabric, world = self.fabric, self.fabric.world_size
        replicas = self.sp.size if self.sp is not None else 1  # each group holds its rows K times
        # the denominators count every row; only the rows whose loss is not exactly zero are run
        trained = rows[algorithm.rows_to_train(batch)[rows]] if self.skip_inert_rows else rows
        totals = global_sums(fabric, [batch.response_mask[rows].sum().item(), len(rows),
                                      batch.response_mask[trained].sum().item(), len(trained)])
        tokens, sequences, trained_tokens, trained_rows = (total / replicas for total in totals)
        scale = algorithm.loss_scale(tokens, sequences)
        sharing = self.sp is None and self.share_prompts is not False and batch.visual is None
        lengths, groups, micro_rows = microbatch.cut(batch, trained, self.micro_batch_size, sharing,
                                                     packed=self.passes.may_pack(self.hf_model))
        n_micro = global_max(fabric, len(micro_rows))  # every rank runs as many backward passes
        local: dict[str, float] = {}
        tap = self.router_tap
        routed = MiniBatchRouting(tap, self.router_aux_loss_coef, fabric, batch, trained)
        for i in range(n_micro):
            real = i < len(micro_rows) and len(micro_rows[i]) > 0
            micro = batch.select(micro_rows[i] if real else torch.tensor([0]))
            with fabric.no_backward_sync(self.policy, enabled=i < n_micro - 1):
                with self.routed(tap, micro):  # gradient checkpointing's recomputation runs inside backward
                    logprobs, entropy = self.passes.logprobs(self.policy, micro, batch.temperature)
                    micro = to_device(micro, fabric)
                    loss, shares = algorithm.loss(logprobs, micro, scale, entropy)
                    loss = loss + routed.observe(micro, real)  # the load-balancing term (0 without it)
                    if not real:
                        loss = loss * 0.0  # a rank with fewer micro-batches still joins the gradient all-reduce
                    fabric.backward(loss * world)  # DDP averages over ranks; the loss is already a global sum
            if self.critic is not None:
                with fabric.no_backward_sync(self.critic, enabled=i < n_micro - 1):
                    predicted = self.passes.values(self.critic, micro)
                    value_loss, value_shares = algorithm.value_loss(predicted, micro, scale)
                    fabric.backward(value_loss * (world if real else 0.0))
                shares.update(value_shares)
            shares["entropy"] = (entropy.detach() * micro.response_mask).sum() / max(scale.tokens, 1.0)
            shares["loss"] = loss.detach()
            for key, value in shares.items():  # every rank sums the same keys (a zero pass adds zeros)
                number = float(value) if real else 0.0
                local[key] = max(local.get(key, 0.0), number) if is_max_metric(key) else local.get(key, 0.0) + number
        # the mean over ranks after the sum and the division by the replicas of each row
        local["padding_frac"] = padding_fraction(lengths, groups) * replicas / world
        keys = sorted(set(local) | {"loss", "entropy"})
        maxima = [k for k in keys if is_max_metric(k)]  # the maximum over ranks (every rank has the same keys)
        keys = [k for k in keys if not is_max_metric(k)]
        values = [local.get(k, 0.0) for k in keys]
        highest = [local[k] for k in maxima]
        if world > 1:
            values = [v / replicas for v in microbatch.all_reduce(fabric, torch.tensor(values), "sum").tolist()]
            if maxima:
                highest = microbatch.all_reduce(fabric, torch.tensor(highest, dtype=torch.float64), "max").tolist()
        metrics = dict(zip(keys, values, strict=False))
        # token means over the rows that ran (the shares were divided by every row's tokens); 0 when no
        # row ran (trained_rows_frac 0), so that every metric stays finite and comparable across resumes
        for key in metrics.keys() - {"loss", "padding_frac"}:
            metrics[key] = metrics[key] * tokens / trained_tokens if trained_tokens else 0.0
        metrics["trained_rows_frac"] = trained_rows / max(sequences, 1.0)
        metrics.update(zip(maxima, highest, strict=True))
        metrics.update(routed.metrics())  # MoE: the expert load of the forwards above (a collective: every rank)
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
