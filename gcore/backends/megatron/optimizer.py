"""The policy's optimizer: torch AdamW over each rank's shards, or megatron-core's distributed optimizer;
gradient reduction and clipping; the Adam moments as full tensors for checkpoints.

Gradients are summed over the data-parallel (x context-parallel) group only (an expert's, with expert
parallelism, over the ranks that hold the same experts, the expert-data-parallel group): by megatron's
distributed optimizer (its ``DistributedDataParallel`` grad buffers, reduce-scattered; Adam state
sharded over the data-parallel ranks; parameters all-gathered after the step), or by an all-reduce
before torch AdamW. Both clip by the same global norm and give the same update (tested).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gcore.backends.common import OptimizerOptions
from gcore.backends.megatron.convert import is_expert, is_tensor_parallel
from gcore.backends.megatron.parallel import ParallelGroups

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

#: per policy parameter: the tensor its Adam state is keyed by, that state's dict, and the slice of the
#: flattened parameter it covers (``None``: the whole parameter)
AdamSlots = dict[str, tuple[torch.Tensor, dict, slice | None]]


class MegatronOptimizer:
    """AdamW for the policy's shards with a linear warm-up; counts the updates it made.

    ``distributed``: megatron's ``DistributedOptimizer`` over its ``DistributedDataParallel``
    (``grad_buffers``); else torch AdamW (``optimizer``) with the gradients all-reduced here.
    """

    def __init__(self, policy: GPTModel, options: OptimizerOptions, base_lr: float, groups: ParallelGroups,
                 tied_embeddings: bool, dtype: torch.dtype, distributed: bool) -> None:
        self.policy = policy
        self.options = options
        self.base_lr = base_lr
        self.groups = groups
        self.tied_embeddings = tied_embeddings
        self.updates = 0  # optimizer steps taken
        self.grad_buffers: Any = None  # megatron DistributedDataParallel around the policy (distributed optimizer)
        self.optimizer: Any  # torch AdamW, or megatron's (chained) DistributedOptimizer
        if distributed:
            self._setup_distributed(dtype)
        else:
            self.optimizer = torch.optim.AdamW(policy.parameters(), lr=self.learning_rate(), betas=options.betas,
                                               weight_decay=options.weight_decay)

    def _setup_distributed(self, dtype: torch.dtype) -> None:
        """Wrap the policy in megatron's ``DistributedDataParallel`` and build its ``DistributedOptimizer``."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        # gradients are summed over data-parallel ranks (the model config's calculate_per_token_loss:
        # no 1/DP scaling), as LossScale already normalises the loss globally
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            overlap_param_gather=False,
        )
        c = self.options
        optimizer_config = MegatronOptimizerConfig(
            optimizer="adam", lr=self.learning_rate(), weight_decay=c.weight_decay, adam_beta1=c.betas[0],
            adam_beta2=c.betas[1], adam_eps=1e-8, clip_grad=0.0,  # clipping is done in _distributed_step
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
            use_distributed_optimizer=True,
        )
        with self.groups.cuda_calls():
            self.grad_buffers = DistributedDataParallel(self.policy.config, ddp_config, self.policy)
            self.optimizer = get_megatron_optimizer(optimizer_config, [self.grad_buffers],
                                                    use_gloo_process_groups=False)

    def learning_rate(self) -> float:
        """The learning rate of the next update: linear warm-up over ``warmup_steps`` updates."""
        return self.base_lr * self.options.warmup_factor(self.updates)

    # the update ------------------------------------------------------------------------------

    def step(self, loss_finite: bool) -> tuple[float, bool]:
        """Reduce and clip the accumulated gradients, step (not when the loss or the norm is non-finite)
        and clear them; returns the gradient norm and whether it stepped."""
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
            self.updates += 1
        return grad_norm, stepped

    def _distributed_step(self, loss_finite: bool) -> tuple[float, bool]:
        """Reduce-scatter the gradients, clip by the global norm and step megatron's distributed
        optimizer (which all-gathers the updated parameters); returns the norm and whether it stepped."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        optimizers = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        with self.groups.cuda_calls():
            finalize_model_grads([self.grad_buffers])  # reduce-scatter over DP; tied embeddings over stages
            self.optimizer.prepare_grads()
            norm = float(self.optimizer.get_grad_norm())
            stepped = math.isfinite(norm) and loss_finite
            if stepped:
                if self.options.max_grad_norm:
                    for optimizer in optimizers:
                        clip_grad_by_total_norm_fp32(optimizer.get_parameters(), self.options.max_grad_norm, norm)
                for group in self.optimizer.param_groups:
                    group["lr"] = self.learning_rate()
                self.optimizer.step_with_ready_grads()
            self.grad_buffers.zero_grad_buffer()
            self.optimizer.zero_grad()
        return norm, stepped

    def _reduce_and_clip_gradients(self) -> float:
        """Sum gradients over data-parallel (x context-parallel) ranks, then clip by the global norm;
        returns the norm."""
        g_ = self.groups
        named = [(n, p) for n, p in self.policy.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        experts = [is_expert(n) for n, _ in named]
        dense_grads = [g for g, e in zip(grads, experts, strict=True) if not e]
        expert_grads = [g for g, e in zip(grads, experts, strict=True) if e]
        for part, size, group in ((dense_grads, g_.dp_cp_size, g_.dp_cp_group),
                                  (expert_grads, g_.expert_dp_size, g_.expert_dp_group)):
            if size > 1 and part:  # each context-parallel rank holds its tokens' share of the gradient
                flat = torch.cat([g.reshape(-1) for g in part])
                dist.all_reduce(flat, group=group)
                offset = 0
                for g in part:
                    g.copy_(flat[offset: offset + g.numel()].view_as(g))
                    offset += g.numel()
        for p, g in zip(params, grads, strict=False):
            p.grad = g
        tied = self._tied_across_stages()
        if tied is not None:  # the first stage's embedding and the last stage's output layer: one weight
            from megatron.core import parallel_state

            dist.all_reduce(tied.grad, group=parallel_state.get_embedding_group())
        # squares of tensor-parallel shards and of pipeline stages add up; replicated tensors count once
        square = torch.zeros((), dtype=torch.float64, device=g_.device)
        expert_square = torch.zeros((), dtype=torch.float64, device=g_.device)
        for (name, param), g, expert in zip(named, grads, experts, strict=True):
            if expert:  # each expert-parallel rank's experts are its own
                expert_square += g.double().pow(2).sum()
            elif (is_tensor_parallel(name) or g_.tp_rank == 0) and not getattr(param, "shared", False):
                square += g.double().pow(2).sum()
        if g_.expert_parallel_size > 1:
            expert_square = g_.all_reduce(expert_square.unsqueeze(0), group=g_.ep_group)[0].to(g_.device)
        square = square + expert_square
        norm = float(g_.all_reduce(square.unsqueeze(0), group=g_.mp_group)[0].sqrt())
        max_norm = self.options.max_grad_norm
        if max_norm and math.isfinite(norm):
            coef = min(1.0, max_norm / (norm + 1e-6))
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        return norm

    def _tied_across_stages(self) -> torch.Tensor | None:
        """The tied embedding/output weight on this rank when pipeline stages hold two copies of it."""
        g_ = self.groups
        if g_.pipeline_parallel_size == 1 or not self.tied_embeddings:
            return None
        if not (g_.first_stage or g_.last_stage):
            return None
        return self.policy.shared_embedding_or_output_weight()  # (a GPTModel method)

    # Adam moments for checkpoints ------------------------------------------------------------

    def adam_slots(self) -> AdamSlots:
        """Per policy parameter: the tensor its Adam state is keyed by, that state's dict, and the
        slice of the flattened parameter it covers (``None``: the whole parameter)."""
        if self.grad_buffers is None:
            return {n: (p, self.optimizer.state, None) for n, p in self.policy.named_parameters()}
        slots: dict[int, tuple[torch.Tensor, dict, slice | None]] = {}
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            pairs = [(optimizer.model_fp32_groups, optimizer.shard_fp32_groups),
                     (optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups)]
            for model_groups, shard_groups in pairs:
                for model_group, shard_group in zip(model_groups, shard_groups, strict=False):
                    for param, shard in zip(model_group, shard_group, strict=False):
                        owned = optimizer._get_model_param_range_map(param)["param"]
                        slots[id(param)] = (shard, optimizer.optimizer.state, slice(owned.start, owned.end))
        return {n: slots[id(p)] for n, p in self.policy.named_parameters() if id(p) in slots}

    def adam_moments(self) -> tuple[dict[str, dict[str, torch.Tensor]], float]:
        """Full (this tensor-parallel rank's) Adam moments per parameter, and the step count.

        With the distributed optimizer each data-parallel rank holds a slice of every moment: the
        slices are summed over the data-parallel group into full tensors (a collective)."""
        g_ = self.groups
        slots = self.adam_slots()
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
        if self.grad_buffers is not None and g_.dp_cp_size > 1:  # megatron shards over DP x CP
            for _key, per_param in moments.items():
                flat = torch.cat([t.reshape(-1) for t in per_param.values()])
                dist.all_reduce(flat, group=g_.dp_cp_group)
                offset = 0
                for _name, tensor in per_param.items():
                    tensor.copy_(flat[offset: offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()
            top = torch.tensor([step], device=g_.device)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=g_.dp_cp_group)
            step = float(top[0])
        return moments, step

    @torch.no_grad()
    def load(self, moments: dict[str, dict[str, torch.Tensor]], step: float, updates: int) -> None:
        """Restore the Adam moments (full tensors per parameter of this rank: ``adam_moments``'s form),
        the Adam step count and the update count, after the policy's weights were loaded."""
        slots = self.adam_slots()
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
            with self.groups.cuda_calls():
                self.optimizer.reload_model_params()  # main (fp32) copies of the loaded weights
        self.updates = updates
