"""Log-probabilities and entropies on vocabulary shards (tensor parallelism): the logits are never gathered.

At tensor-parallel size 1 the backend uses ``token_logprobs`` on the whole logits instead; both give
the same numbers (``tests/backends/test_megatron.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gcore.backends.megatron.parallel import ParallelGroups

_MASKED_LOGIT = -1e30  # logits of vocabulary padding rows: exp() underflows to exactly 0


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int,
                            groups: ParallelGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``targets`` (aligned with ``logits``, ``[..., V/tp]``) and entropies (without
    gradient): megatron's vocab-parallel cross-entropy over the tensor-parallel group."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    shard = logits.shape[-1]
    start = groups.tp_rank * shard
    if start + shard > vocab_size:  # vocabulary padding on the last ranks
        padding = torch.arange(start, start + shard, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padding, _MASKED_LOGIT)
    with torch.no_grad():
        entropy = vocab_parallel_entropy(logits.detach(), groups.tp_group)
    # the cross-entropy works on its input in place: give it its own copy
    chosen = -vocab_parallel_cross_entropy(logits.clone(), targets)
    return chosen, entropy


def vocab_parallel_entropy(logits: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """The entropy of each distribution whose logits ``[..., V/tp]`` are split over ``tp_group``."""
    top = logits.max(-1, keepdim=True).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - top
    exp = shifted.exp()
    sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])
    dist.all_reduce(sums, group=tp_group)
    return sums[0].log() - sums[1] / sums[0]
