"""Mixture-of-experts models (docs/moe.md): the routers of a transformers MoE model, what they chose in a forward (the
trainer's or the engine's: per-layer expert load and its imbalance, the load-balancing loss), and routing replay (a
token routed to experts given from outside, the gate still trained).

transformers' MoE blocks (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) route through a ``*TopKRouter`` module whose forward
takes the block's hidden states flattened to ``[tokens, hidden]`` and returns ``(router_logits, routing_weights,
expert_indices)``: a softmax over the experts' logits, its ``top_k`` largest (renormalised where the router says so),
and their indices. A forward hook on each such router sees every token's choice in the forward the trainer already
runs (no second forward), and may replace the choice (``RouterTap.replay``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from gcore.errors import ConfigError


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers in layer order (modules of a class named ``*TopKRouter`` with ``top_k`` and
    ``num_experts``); ``[]`` for a dense model."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "num_experts")]


def is_moe(model: torch.nn.Module) -> bool:
    """Whether ``model`` routes tokens through transformers top-k routers (``routers``)."""
    return bool(routers(model))


def routing_weights(router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """The weights the router gives experts ``indices`` ``[tokens, k]`` from its ``logits`` ``[tokens, experts]``: the
    softmax (in float32) at those experts, renormalised over them where the router renormalises its top-k
    (``norm_topk_prob``; Mixtral always does). Differentiable in ``logits``: the gate keeps its gradient."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights = probs.gather(-1, indices)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype)


class RouterTap:
    """Forward hooks on every router of a model: each call's logits and chosen experts, and optionally the experts
    each token must be routed to (``replay``).

    Use as a context manager around the forwards to observe; ``calls`` then holds, per router call in order,
    ``(layer, logits [tokens, experts], indices [tokens, k])`` (logits with their graph, for the load-balancing loss).
    """

    def __init__(self, model: torch.nn.Module, keep_logits: bool = False) -> None:
        self.routers = routers(model)
        if not self.routers:
            raise ConfigError(f"{type(model).__name__} has no top-k MoE router (a *TopKRouter module) to observe")
        self.layer = {id(r): i for i, r in enumerate(self.routers)}
        self.num_experts: int = getattr(self.routers[0], "num_experts")  # noqa: B009  an int attribute, not a submodule
        self.top_k: int = getattr(self.routers[0], "top_k")  # noqa: B009
        self.keep_logits = keep_logits
        self.calls: list[tuple[int, torch.Tensor | None, torch.Tensor]] = []
        #: ``[tokens, layers, k]`` long: the experts the engine routed the next forward's tokens to (flattened like the
        #: routers' input: row-major over ``[batch, length]``; -1 where not recorded); ``None``: none recorded
        self.recorded: torch.Tensor | None = None
        #: route the tokens with a record to the recorded experts (routing replay) instead of the router's choice
        self.replay = False
        #: per router call with a record: ``(layer, known, router_disagrees, routed_differently)``, each ``[tokens]``
        #: bool: the token has a record; the router's own top-k differs from it; the experts used differ from it
        self.compared: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.replayed = 0  # router calls whose choice was replaced
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> RouterTap:
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, router: torch.nn.Module, args: tuple, output: tuple) -> tuple | None:
        logits, scores, indices = output
        layer = self.layer[id(router)]
        replaced = None
        if self.recorded is not None:
            recorded = self.recorded[:, layer].to(indices.device)
            if recorded.shape != indices.shape:
                raise ValueError(f"routing replay: layer {layer}'s router routes {tuple(indices.shape)} "
                                 f"(tokens, k) but {tuple(recorded.shape)} were recorded")
            known = (recorded >= 0).all(-1)
            disagrees = known & (indices.sort(-1).values != recorded.sort(-1).values).any(-1)
            if self.replay:  # tokens without a record keep the router's choice
                indices = torch.where(known[:, None], recorded, indices)
                replaced = (logits, routing_weights(router, logits, indices, scores.dtype), indices)
                self.replayed += 1
            differs = known & (indices.sort(-1).values != recorded.sort(-1).values).any(-1)
            self.compared.append((layer, known.detach(), disagrees.detach(), differs.detach()))
        self.calls.append((layer, logits if self.keep_logits else None, indices.detach()))
        return replaced

    def reset(self) -> None:
        """Forget the calls observed (before a new forward)."""
        self.calls = []
        self.compared = []

    def mismatch_counts(self, mask: torch.Tensor) -> tuple[float, float, float]:
        """Over the tokens where ``mask`` (flattened like the routers' input) is set and the engine recorded routes,
        since the last ``reset``: how many there are, how many the trainer's routers would route to other experts than
        the engine did in some layer, and how many were routed to other experts (0 under replay)."""
        if not self.compared:
            return 0.0, 0.0, 0.0
        keep = mask.reshape(-1).bool().to(self.compared[0][1].device)
        known = torch.stack([c[1] for c in self.compared]).all(0) & keep
        disagrees = torch.stack([c[2] for c in self.compared]).any(0) & known
        differs = torch.stack([c[3] for c in self.compared]).any(0) & known
        return float(known.sum()), float(disagrees.sum()), float(differs.sum())

    def indices(self) -> torch.Tensor:
        """The chosen experts of the last forward, ``[tokens, layers, k]`` (one call per layer expected)."""
        per_layer: dict[int, torch.Tensor] = {}
        for layer, _, idx in self.calls:
            per_layer[layer] = idx
        return torch.stack([per_layer[i] for i in range(len(self.routers))], dim=1)

    def expert_counts(self, mask: torch.Tensor) -> torch.Tensor:
        """``[layers, experts]`` float64: per layer, how many of the tokens where ``mask`` (flattened like the
        routers' input) is set chose each expert, over every call since the last ``reset``."""
        counts = torch.zeros(len(self.routers), self.num_experts, dtype=torch.float64)
        keep = mask.reshape(-1).bool().cpu()
        for layer, _, idx in self.calls:
            if keep.numel() != idx.shape[0]:
                raise ValueError(f"expert load: a mask of {keep.numel()} tokens for a router call on {idx.shape[0]}")
            chosen = idx.cpu()[keep]
            counts[layer] += torch.bincount(chosen.reshape(-1), minlength=self.num_experts).to(torch.float64)
        return counts

    def load_balancing_loss(self, mask: torch.Tensor) -> torch.Tensor:
        """Switch Transformer's auxiliary loss over the calls since the last ``reset`` (transformers'
        ``load_balancing_loss_func`` with an attention mask): ``experts * sum_e f_e * P_e``, ``f_e`` the share of
        the top-k assignments to expert ``e`` and ``P_e`` its mean router probability, over the tokens where
        ``mask`` is set and every layer. ``top_k`` at a uniform load; differentiable through the logits."""
        keep = mask.reshape(-1).to(torch.float32)
        tokens = torch.zeros(self.num_experts)
        probs = torch.zeros(self.num_experts)
        rows = torch.zeros(())
        for _, logits, idx in self.calls:
            if logits is None:
                raise RuntimeError("RouterTap(keep_logits=True) is needed for the load-balancing loss")
            weight = keep.to(logits.device)
            assigned = torch.zeros(self.num_experts, device=logits.device).scatter_add_(
                0, idx.reshape(-1), weight.repeat_interleave(self.top_k))
            tokens = tokens.to(logits.device) + assigned
            probs = probs.to(logits.device) + (torch.softmax(logits.float(), -1) * weight[:, None]).sum(0)
            rows = rows.to(logits.device) + weight.sum()
        rows = rows.clamp(min=1.0)
        return (tokens / rows * probs / rows).sum() * self.num_experts


def load_metrics(counts: torch.Tensor) -> dict[str, float]:
    """The metrics of per-layer expert counts ``[layers, experts]``: ``moe/layer{i}/expert{e}_load`` (the share of
    the layer's assignments that went to expert ``e``), ``moe/layer{i}/max_over_mean`` and ``moe/layer{i}/cv`` (the
    coefficient of variation of the loads), and ``moe/max_over_mean`` and ``moe/cv``, their means over the layers
    (1 and 0 at a uniform load); all 0 when no token was counted (no row trained), so that every step logs the same
    columns."""
    metrics: dict[str, float] = {}
    totals = counts.sum(-1, keepdim=True)
    shares = counts / totals.clamp(min=1.0)
    mean = shares.mean(-1)
    max_over_mean = torch.where(mean > 0, shares.max(-1).values / mean.clamp(min=1e-12), 0.0)
    cv = torch.where(mean > 0, shares.std(-1, unbiased=False) / mean.clamp(min=1e-12), 0.0)
    for layer in range(counts.shape[0]):
        for expert in range(counts.shape[1]):
            metrics[f"moe/layer{layer}/expert{expert}_load"] = float(shares[layer, expert])
        metrics[f"moe/layer{layer}/max_over_mean"] = float(max_over_mean[layer])
        metrics[f"moe/layer{layer}/cv"] = float(cv[layer])
    metrics["moe/max_over_mean"] = float(max_over_mean.mean())
    metrics["moe/cv"] = float(cv.mean())
    return metrics


@contextlib.contextmanager
def forced_routing(model: torch.nn.Module, experts: torch.Tensor) -> Iterator[RouterTap]:
    """Route the tokens of the forwards inside to ``experts`` ``[tokens, layers, k]`` (``-1``: the router chooses)."""
    with RouterTap(model) as tap:
        tap.recorded, tap.replay = experts, True
        yield tap
