"""The torch backend's optimizer pieces: AdamW with torch's fused kernel where it runs, and a gradient norm as a
float (also under FSDP, where it is a DTensor)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def adamw(params: Iterable[torch.nn.Parameter], *, lr: float, betas: tuple[float, float],
          weight_decay: float) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel where it has one (floating-point parameters on CPU or CUDA): one
    op per parameter instead of a dozen, the default of transformers' Trainer (and so of TRL). Under FSDP
    the parameters are DTensors, which torch's fused AdamW takes (it runs on each rank's shard; checked
    on torch 2.13, CPU); where a torch lacks the DTensor rule, the default (foreach) implementation runs."""
    parameters = list(params)
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in parameters)
    if fused and any(hasattr(p, "full_tensor") for p in parameters):
        fused = fused_adamw_takes_dtensor()
    return torch.optim.AdamW(parameters, fused=True if fused else None, lr=lr, betas=betas, weight_decay=weight_decay)


def norm_value(norm: torch.Tensor | None) -> float:
    """A gradient norm (``Fabric.clip_gradients``'s, which is ``None`` only with ``clip_val``) as a float. Under
    FSDP ``clip_grad_norm_`` returns a replicated DTensor: the global norm over every rank's shards (torch reduces
    the per-shard norms), the same value on every rank."""
    assert norm is not None  # clipped by max_norm
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def fused_adamw_takes_dtensor() -> bool:
    """Whether this torch has a DTensor sharding rule for the fused AdamW kernel."""
    try:
        from torch.distributed.tensor import DTensor

        propagator = DTensor._op_dispatcher.sharding_propagator
        rules = (getattr(propagator, name, {}) for name in ("op_strategy_funcs", "op_single_dim_strategy_funcs"))
        return any(torch.ops.aten._fused_adamw_.default in rule for rule in rules)
    except Exception:  # noqa: BLE001  an internal that moved may fail in any way: take the safe path
        return False
