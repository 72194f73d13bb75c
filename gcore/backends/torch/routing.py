"""A mixture-of-experts policy's routing over one mini-batch of TRAIN (docs/moe.md): the expert load of the
micro-batches' forwards and the routers' load-balancing loss (``--backend.router_aux_loss_coef``), from the router
hooks (``gcore.moe.RouterTap``) of the forward the training already runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gcore.backends.torch.microbatch import all_reduce, global_sums
from gcore.moe import RouterTap, load_metrics
from gcore.types import RolloutBatch

if TYPE_CHECKING:
    from lightning_fabric import Fabric


class MiniBatchRouting:
    """Built per mini-batch (``rows`` of ``batch``, the rows that run); ``observe`` after each micro-batch's forward,
    ``metrics`` after the last. A dense policy (``tap`` ``None``) observes nothing and has no metrics. Every rank
    makes the same calls (``metrics`` and, with the loss, the constructor are collectives)."""

    def __init__(self, tap: RouterTap | None, coef: float, fabric: Fabric, batch: RolloutBatch,
                 rows: torch.Tensor) -> None:
        self.tap, self.coef, self.fabric = tap, coef, fabric
        self.aux_sum = 0.0
        self.tokens = 1.0
        self.mismatch = [0.0, 0.0, 0.0]  # recorded tokens, router disagrees, routed differently
        if tap is None:
            return
        self.counts = torch.zeros(len(tap.routers), tap.num_experts, dtype=torch.float64)
        if coef:  # the loss is a token mean over the mini-batch's tokens on every rank
            self.tokens = max(global_sums(fabric, [float(batch.attention_mask[rows][:, :-1].sum())])[0], 1.0)

    def observe(self, micro: RolloutBatch, real: bool) -> torch.Tensor | float:
        """Count the experts the routers chose for ``micro``'s tokens (not for a padding pass, ``real`` false) and
        return its share of the load-balancing term (``coef`` x the loss x its share of the mini-batch's tokens), 0
        without it. The router calls since ``tap.reset`` are ``micro``'s forward."""
        tap = self.tap
        if tap is None:
            return 0.0
        mask = micro.attention_mask[:, :-1]  # the forward's tokens: the last position is left out
        if real:
            self.counts += tap.expert_counts(mask)
            self.mismatch = [a + b for a, b in zip(self.mismatch, tap.mismatch_counts(mask), strict=True)]
        if not self.coef:
            return 0.0
        weight = float(mask.sum()) / self.tokens
        aux = tap.load_balancing_loss(mask) * weight
        if real:
            self.aux_sum += float(aux.detach())
        return self.coef * aux

    def metrics(self) -> dict[str, float]:
        """The expert load of the mini-batch over every rank (``gcore.moe.load_metrics``); with the loss,
        ``moe/aux_loss`` (its token mean, before the coefficient); where the engine recorded its routes, over the tokens
        it recorded: ``moe/router_disagrees``, the share the trainer's routers would route to other experts than the
        engine did (in some layer), and ``moe/routed_differently``, the share that were (0 under routing replay)."""
        if self.tap is None:
            return {}
        extra = torch.tensor([self.aux_sum, *self.mismatch], dtype=torch.float64)
        values = torch.cat([self.counts.flatten(), extra])
        if self.fabric.world_size > 1:
            values = all_reduce(self.fabric, values, "sum")
        metrics = load_metrics(values[: -len(extra)].reshape(self.counts.shape))
        aux, recorded, disagrees, differs = values[-len(extra):].tolist()
        if self.coef:
            metrics["moe/aux_loss"] = aux
        if recorded:  # the engine recorded its routes (--engine.record_routes)
            metrics["moe/router_disagrees"] = disagrees / recorded
            metrics["moe/routed_differently"] = differs / recorded
        return metrics
