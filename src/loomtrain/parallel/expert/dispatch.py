"""Expert parallelism (docs/moe.md, "Expert parallelism"), as Megatron-Core's all-to-all token
dispatcher and TorchTitan build it: the "ep" ranks of a dp group each hold `n_experts / ep`
of a block's experts, and every token copy travels to the rank of the expert it picked.

A MoE block sorts its token copies by expert (models/moe.py `MoE.route`); sorted by expert
they are sorted by the rank holding it. `ExpertParallelExperts` takes them in that order:
1. the counts: how many rows go to each member for each of its experts (an all-to-all);
2. dispatch: the rows, in uneven chunks (an all-to-all);
3. the received rows, grouped by source member, are regrouped by local expert and run grouped;
4. combine: the outputs go back in the inverse all-to-all, in the order they came.
Dropless: every row reaches its expert, so a parallel run computes what one process does.
The communication: parallel/expert/exchange.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from loomtrain.models.moe import GroupedExperts, MoE
from loomtrain.parallel.expert.exchange import exchange_counts, exchange_rows
from loomtrain.parallel.placement import Placement

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


class ExpertParallelExperts(GroupedExperts):
    """This ep rank's slice of `whole`'s experts (global indices [first, first + n)), taking
    every member's rows sorted by global expert. Each weight is the slice of the full tensor
    (its placement, parallel/placement.py: checkpoints save boxes of the full tensor, and the
    meta build materializes the slice of the single-process values) and is replicated over
    "edp", the ranks holding the same experts, and their cp peers ("edpcp" under context
    parallelism, as the other weights over "dpcp"): `dp_axis`, where the gradient is reduced."""

    def __init__(self, whole: GroupedExperts, mesh):
        ep, rank = mesh.size("ep"), mesh.local_rank("ep")
        n = whole.n_experts // ep
        super().__init__(0, 1, 1, first=whole.first + rank * n)
        self.mesh, self.weight_entry = mesh, whole.weight_entry
        replicas = "edpcp" if mesh.size("cp") > 1 else "edp"
        for name in EXPERT_WEIGHTS:
            full = getattr(whole, name)
            placement = Placement(tuple(full.shape), 0, ((self.first, 0, n),))
            piece = nn.Parameter(placement.take(full.detach(), n), requires_grad=full.requires_grad)
            piece.tp_placement, piece.dp_axis = placement, replicas
            setattr(self, name, piece)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: this rank's rows sorted by global expert, `counts[e]` of them for expert e."""
        ep = self.mesh.size("ep")
        sent = counts.view(ep, -1)
        received = exchange_counts(sent, self.mesh)
        to, back = sent.sum(1).tolist(), received.sum(1).tolist()
        rows = exchange_rows(x, to, back, self.mesh)
        order = by_expert(received)
        out = torch.empty_like(order)
        out[order] = torch.arange(len(order), device=order.device)
        y = super().forward(rows[order], received.sum(0))[out]
        return exchange_rows(y, back, to, self.mesh)


def by_expert(received: torch.Tensor) -> torch.Tensor:
    """The order that regroups rows received member by member (`received` [ep, n]: rows from
    member j for local expert e, in that order) expert by expert, members in order within
    each. Pure."""
    sizes = received.reshape(-1)
    starts = (sizes.cumsum(0) - sizes).view(received.shape).t().reshape(-1)
    sizes = received.t().reshape(-1)
    at = sizes.cumsum(0) - sizes
    total = int(sizes.sum())
    steps = torch.arange(total, device=received.device)
    return torch.repeat_interleave(starts - at, sizes, output_size=total) + steps


def apply_expert_parallel(model: nn.Module, mesh) -> nn.Module:
    """Every MoE block's experts sharded over "ep" (in place; a no-op at ep = 1)."""
    if mesh.size("ep") == 1:
        return model
    for module in model.modules():
        if isinstance(module, MoE):
            module.experts = ExpertParallelExperts(module.experts, mesh)
    return model


__all__ = ["EXPERT_WEIGHTS", "ExpertParallelExperts", "apply_expert_parallel", "by_expert"]
