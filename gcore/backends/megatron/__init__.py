"""``megatron`` backend: megatron-core's GPT model with tensor, pipeline, context and data parallelism.

One module per job, in the order a step uses them:

- this file: ``MegatronBackend``, the ``TrainingBackend`` (flags, setup, PREPARE, TRAIN, SYNC, checkpoints),
  each step delegated to the modules below;
- ``parallel.py``: megatron-core's process groups over Fabric's, and the union of batches a group trains on;
- ``model.py``: the ``GPTModel`` (this rank's stage and tensor-parallel shard) from an HF config;
- ``weights.py``: this rank's tensors as full HF tensors and back (weights and Adam moments);
- ``convert.py``: the HF <-> megatron tensor conversion itself (no megatron-core needed);
- ``forward.py``: forward/backward passes, log-probabilities, the 1F1B micro-batch schedule;
- ``logprobs.py``: log-probabilities and entropies on vocabulary shards (tensor parallelism);
- ``optimizer.py``: torch AdamW or megatron's distributed optimizer, gradient reduction and clipping;
- ``context_parallel.py``: gcore's ring/Ulysses attention inside megatron's layers (``sequence_parallel_size``);
- ``cpu.py``: what megatron-core needs to run on a CPU-only torch.

The loss follows ``Algorithm.loss`` and ``LossScale`` exactly as in the torch backend, so both
backends compute the same update (tested). Nothing here imports megatron-core at import time:
choosing the backend without it stops with the install hint. What is supported and what is not:
``docs/megatron.md``.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from gcore.algorithms.base import Algorithm, is_max_metric
from gcore.backends.base import TrainingBackend
from gcore.backends.common import OptimizerOptions, check_sequence_parallel_controllers
from gcore.backends.megatron.convert import Layout, layout_from_hf
from gcore.backends.megatron.forward import ForwardPasses
from gcore.backends.megatron.model import build_gpt_model
from gcore.backends.megatron.optimizer import MegatronOptimizer
from gcore.backends.megatron.parallel import ParallelGroups, agree_on_keys, init_parallel_state, to_device
from gcore.backends.megatron.weights import HFWeights
from gcore.errors import ConfigError, GcoreError
from gcore.model import ModelSource
from gcore.types import RolloutBatch

if TYPE_CHECKING:
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import Strategy

INSTALL_HINT = "--backend megatron needs megatron-core: pip install 'gcore[megatron]'"


def _require_megatron() -> None:
    try:
        import megatron.core  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"{INSTALL_HINT} ({err})") from None


class MegatronBackend(OptimizerOptions, TrainingBackend):
    """Trains the policy as a megatron-core ``GPTModel`` (Llama/Qwen2 families): TP, PP, CP, DP, Adam.

    Args:
        tensor_parallel_size: ranks that split every layer (must divide the world size, the
            attention heads, the key/value heads and the MLP width).
        pipeline_parallel_size: pipeline stages (consecutive layers per stage; must divide the
            number of layers and, times the tensor-parallel size, the world size). Micro-batches go
            through megatron-core's pipeline schedule (1F1B).
        sequence_parallel_size: split every sequence over this many ranks, the same flag as the torch
            backend's; it is megatron-core's ``context_parallel_size`` (zig-zag split of each row in
            2*K chunks), with gcore's distributed attention as the layers' ``core_attention`` (CPU and
            GPU, no Transformer Engine; ``gcore/backends/megatron/context_parallel.py``). Not with pipeline
            parallelism; tensor x sequence size must divide the number of ranks (the rest are data parallel).
        sequence_parallel_mode: the distributed attention with ``sequence_parallel_size`` > 1: ``ring``
            (any head count) or ``ulysses`` (attention heads per tensor-parallel rank divisible by the size).
        transformer_engine: use the Transformer Engine layer spec (``auto``: on GPU when importable).
        expert_parallel_size: split every MoE layer's experts over this many ranks (a mixture-of-experts model,
            Qwen3-MoE: megatron-core's ``MoELayer``; it must divide the number of experts and of ranks; the dense
            layers stay data parallel over them). Not with tensor, sequence or pipeline parallelism, nor with the
            distributed optimizer (one line says why; docs/moe.md, "Megatron expert parallelism").
        distributed_optimizer: megatron-core's distributed optimizer (``DistributedOptimizer`` over
            megatron's ``DistributedDataParallel`` grad buffers: gradients reduce-scattered, Adam
            state sharded over the data-parallel ranks, parameters all-gathered after the step);
            ``None``: on when the data-parallel size is above 1. ``False``: torch AdamW over each
            rank's local shards, gradients all-reduced.
        **optimizer: the optimizer options, ``gcore.backends.common.OptimizerOptions``'s arguments
            (``lr``, ``weight_decay``, ``betas``, ``max_grad_norm``, ``micro_batch_size``: sequences per
            forward/backward pass of a tensor-parallel group, ``warmup_steps``).
    """

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        sequence_parallel_size: int = 1,
        sequence_parallel_mode: Literal["ring", "ulysses"] = "ring",
        transformer_engine: Literal["auto", "true", "false"] = "auto",
        expert_parallel_size: int = 1,
        distributed_optimizer: bool | None = None,
        **optimizer: Any,  # noqa: ANN401  OptimizerOptions's arguments, checked there
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
        if expert_parallel_size < 1:
            raise ConfigError(f"--backend.expert_parallel_size must be >= 1, got {expert_parallel_size}")
        if expert_parallel_size > 1:
            for flag, size in (("sequence_parallel_size", sequence_parallel_size),
                               ("pipeline_parallel_size", pipeline_parallel_size)):
                if size > 1:
                    raise ConfigError(
                        f"--backend.expert_parallel_size {expert_parallel_size} with --backend.{flag} {size}: the "
                        f"megatron backend's expert parallelism runs without {flag.split('_parallel')[0]} "
                        "parallelism; set one of them to 1")
            if distributed_optimizer:
                raise ConfigError(
                    f"--backend.expert_parallel_size {expert_parallel_size} with --backend.distributed_optimizer true: "
                    "the megatron backend's expert parallelism uses torch AdamW (expert gradients summed over the "
                    "expert-data-parallel ranks); leave --backend.distributed_optimizer unset or false")
        self.expert_parallel_size = expert_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.sequence_parallel_size = sequence_parallel_size
        self.sequence_parallel_mode = sequence_parallel_mode
        self.context_parallel_size = sequence_parallel_size  # megatron-core's name
        super().__init__(**optimizer)  # the optimizer options: lr, ..., micro_batch_size, warmup_steps
        self.transformer_engine = transformer_engine
        self.distributed_optimizer = distributed_optimizer
        # set up by ``setup``
        self.groups: ParallelGroups
        self.hf_config: Any = None
        self.layout: Layout
        self.weights: HFWeights
        self.forward: ForwardPasses
        self.policy: Any = None
        self.reference: Any = None
        self.optimizer: MegatronOptimizer
        self.dispatcher = "allgather"  # megatron's MoE token dispatcher (``alltoall`` on CUDA; setup)
        self._synced: tuple[int, dict[str, torch.Tensor]] | None = None  # (updates, weights) of the last sync
        #: how long a collective of megatron's own groups waits for a rank (set from the trainer's ``strategy`` call)
        self.collective_timeout: timedelta = default_pg_timeout

    def strategy(self, world_size: int, device_type: str, timeout: timedelta = default_pg_timeout) -> str | Strategy:
        """The base class's DDP (Fabric only launches the processes and the process group; megatron does the
        parallelism); megatron's groups get the same ``timeout`` (``--trainer.collective_timeout``)."""
        self.collective_timeout = timeout
        return super().strategy(world_size, device_type, timeout)

    def validate(self, algorithm: Algorithm, world_size: int, single_controller: bool) -> None:
        super().validate(algorithm, world_size, single_controller)
        check_sequence_parallel_controllers(self.sequence_parallel_size, single_controller)
        if algorithm.entropy_coef and self.tensor_parallel_size > 1:
            raise ConfigError("--algorithm.entropy_coef with --backend megatron needs "
                              "--backend.tensor_parallel_size 1: "
                              "the vocabulary-parallel entropy is computed without its gradient")
        self._check_world_size(world_size)

    def _check_world_size(self, world: int) -> None:
        tp, pp, cp = self.tensor_parallel_size, self.pipeline_parallel_size, self.context_parallel_size
        if world % tp:
            raise ConfigError(f"--backend.tensor_parallel_size {tp} does not divide the number of ranks ({world})")
        if world % (tp * pp):
            raise ConfigError(f"--backend.tensor_parallel_size {tp} times --backend.pipeline_parallel_size {pp} "
                              f"does not divide the number of ranks ({world})")
        if world % (tp * pp * cp):  # (cp > 1: pp is 1)
            raise ConfigError(f"--backend.sequence_parallel_size {cp} times --backend.tensor_parallel_size {tp} "
                              f"does not divide the number of ranks ({world})")
        ep = self.expert_parallel_size
        if world % ep:
            raise ConfigError(f"--backend.expert_parallel_size {ep} does not divide the number of ranks ({world})")

    # SETUP -----------------------------------------------------------------------------------

    def setup(self, fabric: Fabric, source: ModelSource, algorithm: Algorithm, embedded: bool) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        dtype = source.dtype
        self.validate(algorithm, fabric.world_size, single_controller=False)
        tp, pp, cp = self.tensor_parallel_size, self.pipeline_parallel_size, self.context_parallel_size
        self.hf_config = AutoConfig.from_pretrained(source.path, trust_remote_code=source.trust_remote_code)
        self.trust_remote_code = source.trust_remote_code  # save_pretrained rebuilds the model from the config
        self.layout = layout_from_hf(self.hf_config, tp)
        self._check_experts(self.layout)
        if cp > 1 and self.sequence_parallel_mode == "ulysses" and (self.layout.num_heads // tp) % cp:
            raise ConfigError(
                f"--backend.sequence_parallel_mode ulysses needs the attention heads per tensor-parallel rank "
                f"({self.layout.num_heads} / {tp}) divisible by --backend.sequence_parallel_size {cp}; "
                "use --backend.sequence_parallel_mode ring")
        if self.layout.num_layers % pp:
            raise ConfigError(f"--backend.pipeline_parallel_size {pp} does not divide the model's "
                              f"{self.layout.num_layers} layers")
        self.groups = init_parallel_state(fabric, tp, pp, cp, self.sequence_parallel_mode, self.collective_timeout,
                                          self.expert_parallel_size)
        self.weights = HFWeights(self.layout, self.groups)
        self.forward = ForwardPasses(fabric, self.groups, self.layout.vocab_size, moe=self.layout.is_moe)
        hf = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, trust_remote_code=source.trust_remote_code)
        hf_state = hf.state_dict()
        # HF's nn.Embedding(padding_idx=pad): a pad token in the input gives the embedding no gradient
        padding_idx = getattr(hf.get_input_embeddings(), "padding_idx", None)
        del hf
        # megatron's all-to-all dispatcher makes a CUDA stream when built: on CPU (gloo) the all-gather one
        self.dispatcher = "alltoall" if self.groups.device.type == "cuda" else "allgather"
        self.policy = build_gpt_model(self.hf_config, self.layout, self.groups, dtype, self.transformer_engine,
                                      padding_idx, self.dispatcher)
        self.weights.load(self.policy, hf_state)
        self.policy.train()
        distributed = self.distributed_optimizer if self.distributed_optimizer is not None else (
            self.groups.dp_size > 1 and self.expert_parallel_size == 1)  # (EP: torch AdamW, see __init__)
        self.optimizer = MegatronOptimizer(self.policy, self, self.base_lr(embedded), self.groups,
                                           self.layout.tied_embeddings, dtype, distributed)
        if algorithm.needs_reference:
            self.reference = build_gpt_model(self.hf_config, self.layout, self.groups, dtype,
                                             self.transformer_engine, padding_idx, self.dispatcher)
            self.weights.load(self.reference, hf_state)
            self.reference.eval().requires_grad_(False)

    def _check_experts(self, layout: Layout) -> None:
        """One line for a mixture of experts the megatron backend cannot train here (or EP without one)."""
        ep, tp = self.expert_parallel_size, self.tensor_parallel_size
        model_type = getattr(self.hf_config, "model_type", "?")
        if ep > 1 and not layout.is_moe:
            raise ConfigError(f"--backend.expert_parallel_size {ep} needs a mixture-of-experts model (Qwen3-MoE, e.g. "
                              f"--model.architecture qwen3_moe); model_type {model_type!r} has no experts")
        if layout.is_moe and layout.num_experts % ep:
            raise ConfigError(f"--backend.expert_parallel_size {ep} does not divide the model's {layout.num_experts} "
                              "experts")
        if layout.is_moe and tp > 1:
            raise ConfigError(
                f"--backend.tensor_parallel_size {tp} with a mixture-of-experts model: megatron-core "
                "0.16 trains MoE layers under tensor parallelism only with its sequence parallelism, which the "
                "megatron backend does not use; use --backend.tensor_parallel_size 1 (and "
                "--backend.expert_parallel_size to split the experts)")
        if layout.is_moe and self.context_parallel_size > 1:
            raise ConfigError(
                f"--backend.sequence_parallel_size {self.context_parallel_size} with a mixture-of-experts model: the "
                "megatron backend's context parallelism has no MoE layer spec; use --backend.sequence_parallel_size 1")

    # PREPARE ---------------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch, role: Literal["policy", "reference", "teacher"]) -> torch.Tensor:
        model = {"policy": self.policy, "reference": self.reference}.get(role)  # no teacher: supports_teacher False
        if model is None:
            raise RuntimeError(f"no {role} model: it was not set up")
        g = self.groups
        was_training = model.training
        model.eval()
        union, offset = g.union(batch)
        out = torch.zeros(len(union), union.input_ids.shape[1] - 1)
        row_groups = list(torch.arange(len(union)).split(self.micro_batch_size))
        micros = [union.select(rows) for rows in row_groups]
        logprobs = self.forward.run_micro_batches(model, micros, union.temperature,
                                                  lambda lp, _, micro: (lp.sum() * 0.0, lp.cpu()), forward_only=True)
        for rows, micro, part in zip(row_groups, micros, logprobs, strict=False):
            out[rows, : part.shape[1]] = part * micro.response_mask
        if self.pipeline_parallel_size > 1:  # the last stage computed them
            out = out.to(g.device)
            dist.broadcast(out, src=g.last_stage_rank, group=g.pp_group)
            out = out.cpu()
        model.train(was_training)
        own = out[offset: offset + len(batch)]
        width = batch.response_mask.shape[1]
        result = torch.zeros_like(batch.response_mask)
        result[:, : min(width, own.shape[1])] = own[:, :width]
        return result

    # TRAIN -----------------------------------------------------------------------------------

    def train_mini_batch(self, batch: RolloutBatch, rows: torch.Tensor, algorithm: Algorithm) -> dict[str, float]:
        """Accumulate this mini-batch's gradients (local to the rank); returns its global metrics."""
        g = self.groups
        own = batch.select(rows) if len(rows) else None
        counts = g.all_reduce(torch.tensor([
            float(batch.response_mask[rows].sum()), float(len(rows))], dtype=torch.float64))
        scale = algorithm.loss_scale(float(counts[0]), float(counts[1]))
        union = g.union_of_rows(own)

        def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor, micro: RolloutBatch
                    ) -> tuple[torch.Tensor, dict[str, float]]:
            micro = to_device(micro, g.device)
            loss, shares = algorithm.loss(logprobs, micro, scale, entropy if self.tensor_parallel_size == 1 else None)
            shares["entropy"] = (entropy.detach() * micro.response_mask).sum() / max(scale.tokens, 1.0)
            shares["loss"] = loss.detach()
            return loss, {key: float(value) for key, value in shares.items()}

        local: dict[str, float] = {}
        # (no rows: no micro-batch, but expert-parallel peers still need this rank's forwards, run_micro_batches)
        splits = torch.arange(len(union)).split(self.micro_batch_size) if union is not None else ()
        micros = [union.select(r) for r in splits if union is not None]
        for shares in self.forward.run_micro_batches(self.policy, micros, batch.temperature, loss_fn,
                                                     forward_only=False):
            for key, value in shares.items():
                local[key] = max(local.get(key, 0.0), value) if is_max_metric(key) else local.get(key, 0.0) + value
        # every model-parallel (and context-parallel) peer trained on the same union; the last pipeline
        # stage has its metrics: sum over data-parallel ranks, then take the last stage's (a maximum,
        # ``is_max_metric``, is non-negative: the maximum over them, with zeros on the other stages)
        keys = agree_on_keys(sorted(set(local) | {"loss", "entropy"}))
        maxima = [k for k in keys if is_max_metric(k)]
        keys = [k for k in keys if not is_max_metric(k)]
        values = g.all_reduce(torch.tensor([local.get(k, 0.0) for k in keys], dtype=torch.float64),
                              group=g.dp_group)
        highest = g.all_reduce(torch.tensor([local.get(k, 0.0) for k in maxima], dtype=torch.float64),
                               op=dist.ReduceOp.MAX, group=g.dp_group)
        if self.pipeline_parallel_size > 1:
            values = g.all_reduce(values, group=g.pp_group)  # zeros on the other stages
            highest = g.all_reduce(highest, op=dist.ReduceOp.MAX, group=g.pp_group)
        return {**dict(zip(keys, values.tolist(), strict=True)), **dict(zip(maxima, highest.tolist(), strict=True))}

    def optimizer_step(self, stats: dict[str, float], loss_finite: bool) -> tuple[float, bool]:
        return self.optimizer.step(loss_finite)

    def learning_rate(self) -> float:
        """The learning rate of the next update: linear warm-up over ``warmup_steps`` updates."""
        return self.optimizer.learning_rate()

    # SYNC and SAVE ---------------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-layout weights, gathered over the tensor-parallel group (a collective: every rank calls it)."""
        weights = self.weights.to_hf({n: p.data for n, p in self.policy.named_parameters()})
        if self.layout.tied_embeddings:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        self._synced = (self.optimizer.updates, weights)
        yield from weights.items()

    def save_pretrained(self, path: str) -> None:
        """Write an HF checkpoint (rank 0 alone: uses the weights of the last ``named_weights`` call)."""
        from transformers import AutoModelForCausalLM

        if self._synced is not None and self._synced[0] == self.optimizer.updates:
            weights = self._synced[1]
        elif self.groups.mp_size == 1 and self.expert_parallel_size == 1:
            weights = dict(self.named_weights())
        else:
            raise RuntimeError("save_pretrained with tensor, pipeline or expert parallelism needs a named_weights() "
                               "call on every rank after the last update")
        model = AutoModelForCausalLM.from_config(self.hf_config, trust_remote_code=self.trust_remote_code)
        model.load_state_dict({k: v.cpu() for k, v in weights.items()}, strict=False)
        model.save_pretrained(path)

    # CHECKPOINT ------------------------------------------------------------------------------

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
                f"most {self.groups.collective_timeout_s:.0f} s (--trainer.collective_timeout); every rank must save "
                f"together ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
            ) from err

    def _state_dict(self) -> dict:
        weights = {n: p.data.clone() for n, p in self.policy.named_parameters()}  # a snapshot, not live views
        model = self.weights.to_hf(weights)
        moments, step = self.optimizer.adam_moments()
        optim: dict[str, object] = {key: self.weights.to_hf(per_param) for key, per_param in moments.items()}
        optim["step"] = torch.tensor(step)
        return {"model": model, "optim": optim, "updates": torch.tensor(float(self.optimizer.updates))}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        names = [n for n, _ in self.policy.named_parameters()]
        self.weights.load(self.policy, dict(state["model"]))
        moments = {key: self.weights.local_shards(dict(state["optim"][key]), names)
                   for key in ("exp_avg", "exp_avg_sq")}
        self.optimizer.load(moments, float(state["optim"]["step"]), updates=int(float(state["updates"])))
        self._synced = None
