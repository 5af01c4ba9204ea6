"""LoRDO: a rank-r projected AdamW on every replica, synchronized every H steps, its
projection computed globally from the averaged pseudo-gradient.

Jovanovic et al., arXiv 2602.04396 (after GaLore, arXiv 2403.03507). The algorithm as built,
deviations and failure semantics: docs/lowcomm-lordo.md (its optimizer: lowrank_adamw.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from loomtrain import comm
from loomtrain.lowcomm.diloco import DiLoCo
from loomtrain.lowcomm.lowrank_adamw import LowRankAdamW, Split, oriented, top_singular_vectors
from loomtrain.parallel.tensor_layers import (ColumnParallelLinear, RowParallelLinear,
                                              VocabParallelEmbedding, VocabParallelHead)
from loomtrain.parallel.tensor_llama import ReplicatedKVLinear
from loomtrain.sparsity.split import Pieces

# tensor parallelism's stand-ins for an nn.Linear (a piece of it, or the whole on every rank)
# and for an nn.Embedding
_LINEARS = (nn.Linear, ColumnParallelLinear, RowParallelLinear, VocabParallelHead,
            ReplicatedKVLinear)
_EMBEDDINGS = (nn.Embedding, VocabParallelEmbedding)


def build(model, optimizer, mesh, cfg, seed: int):
    """apply_lowcomm's builder for algorithm="lordo": returns the wrapper and its own inner
    optimizer, with the hyperparameters and weight-decay groups of the trainer's AdamW."""
    inner = lowrank_adamw(model, optimizer, cfg.rank)
    return LoRDO(model, inner, mesh, cfg.inner_steps, cfg.outer_lr, cfg.outer_momentum,
                 nesterov=cfg.outer_optimizer == "nesterov"), inner


def projected_matrices(model: nn.Module) -> set[torch.Tensor]:
    """The weights LoRDO projects: those of nn.Linear layers (or tensor parallelism's pieces
    of them, but those of a transposed GPT-2 Conv1D, which is no nn.Linear whole), except one
    tied to an embedding (GaLore projects the transformer blocks' matrices, not the
    embeddings), also on a pipeline stage that holds the tied head without its embedding
    (`pp_copies`: the same exception as on the stage that holds both, so the copies get the
    same updates)."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, _EMBEDDINGS)}
    return {m.weight for m in model.modules() if isinstance(m, _LINEARS)
            and not getattr(m, "transposed", False)
            and m.weight.dim() == 2 and id(m.weight) not in embedded
            and getattr(m.weight, "pp_copies", 1) == 1}


def lowrank_adamw(model: nn.Module, adamw: torch.optim.AdamW, rank: int) -> LowRankAdamW:
    """A LowRankAdamW over `adamw`'s parameters with its hyperparameters: each of its groups
    split in two, the projected matrices (`rank`) and the rest (rank 0)."""
    assert isinstance(adamw, torch.optim.AdamW), "config: lordo needs train.optimizer=adamw"
    matrices = projected_matrices(model)
    groups = []
    for group in adamw.param_groups:
        options = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}
        for r in (rank, 0):
            params = [p for p in group["params"] if (p in matrices) == (r > 0)]
            if params:
                groups.append({"params": params, "rank": r, **options})
    return LowRankAdamW(groups)


class LoRDO(DiLoCo):
    """`model = LoRDO(model, optimizer, mesh, inner_steps=H)` with `optimizer` a LowRankAdamW
    over the model's parameters; then as DiLoCo. The outer optimizer defaults to the paper's
    plain average (SGD, learning rate 1).

    On a replica split over tp, each projection is computed from the whole matrix's
    (pseudo-)gradient, gathered from the tp pieces, and every tp rank keeps the whole
    projection; its optimizer steps each piece (`Split`), so the run is the whole
    replicas' (docs/lowcomm-lordo.md, "Tensor parallelism")."""

    whole_prefixes = ("projection.",)  # outer state whole on every tp rank (lowcomm/state.py)

    def __init__(self, module: nn.Module, optimizer: LowRankAdamW, mesh, inner_steps: int,
                 outer_lr: float = 1.0, outer_momentum: float = 0.9, nesterov: bool = False,
                 axis: str | None = None):
        super().__init__(module, mesh, inner_steps, outer_lr, outer_momentum, nesterov, axis)
        self.optimizer = optimizer
        ranks = dict((id(p), r) for p, r in optimizer.projected())
        # (index in self.params, rank) of every projected matrix
        self.matrices = [(i, ranks[id(p)]) for i, p in enumerate(self.params) if id(p) in ranks]
        self.rank = max((r for _, r in self.matrices), default=0)
        self.pieces = [Pieces(self.params[i], mesh) for i, _ in self.matrices]
        for pieces, (i, _) in zip(self.pieces, self.matrices):
            if pieces.placement is not None:
                optimizer.splits[self.params[i]] = _split(pieces, mesh)
        self.has_projections = False  # set at the first step, or by a checkpoint
        self.captured: float | None = None  # share of the last pseudo-gradient's norm ...
        self.captured_before: float | None = None  # ... in the new and the old projections

    def before_update(self) -> None:
        """At the run's first step: the initial projections, from the replicas' averaged
        gradients of the projected matrices (one all-reduce, once)."""
        if not self.has_projections:
            self._initial_projections()

    @torch.no_grad()
    def _initial_projections(self) -> None:
        grads = [self.params[i].grad for i, _ in self.matrices]
        grads = [g if g is not None else torch.zeros_like(self.params[i])
                 for g, (i, _) in zip(grads, self.matrices)]
        flat = _flatten_dense_tensors(grads)
        comm.all_reduce(flat, self.mesh, self.axis)
        flat.div_(self.mesh.size(self.axis))
        flat = torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0)  # see failure semantics
        for average, pieces, (i, rank) in zip(_unflatten_dense_tensors(flat, grads), self.pieces,
                                              self.matrices):
            self.optimizer.set_projection(self.params[i], top_singular_vectors(
                oriented(pieces.whole(average)), rank))
        self.has_projections = True

    @torch.no_grad()
    def synchronize(self) -> None:
        """DiLoCo's outer step on the averaged pseudo-gradient, then every projection
        recomputed from that pseudo-gradient."""
        local = _flatten_dense_tensors([p.detach() for p in self.params])
        pseudo_gradient = torch.sub(self.global_params, local)
        comm.all_reduce(pseudo_gradient, self.mesh, self.axis)
        pseudo_gradient.div_(self.mesh.size(self.axis))
        self.global_params.grad = pseudo_gradient
        self.outer.step()
        self.global_params.grad = None
        self._set_params(self.global_params)
        self._refresh_projections(_unflatten_dense_tensors(pseudo_gradient, self.params))

    def _refresh_projections(self, pseudo_gradients) -> None:
        total, new, old = 0.0, 0.0, 0.0
        for pieces, (i, rank) in zip(self.pieces, self.matrices):
            block = torch.nan_to_num(oriented(pieces.whole(pseudo_gradients[i])), nan=0.0,
                                     posinf=0.0, neginf=0.0)
            projection = top_singular_vectors(block, rank)
            previous = self.optimizer.state[self.params[i]].get("projection")
            total += float(block.square().sum())
            new += float((projection.T @ block).square().sum())
            if previous is not None:
                old += float((previous.T @ block).square().sum())
            self.optimizer.set_projection(self.params[i], projection)
        self.has_projections = True
        if total > 0:
            self.captured, self.captured_before = (new / total) ** 0.5, (old / total) ** 0.5

    def metrics(self) -> dict:
        """The rank, the optimizer state's bytes against AdamW's (this replica's; equal on
        every replica), and the share of the last averaged pseudo-gradient's norm (over all
        projected matrices) inside the new projections and inside the ones it was made with."""
        state, adamw = self.optimizer.state_bytes()
        out = {"lordo_rank": self.rank, "lordo_state_bytes": state,
               "lordo_adamw_state_bytes": adamw}
        if self.captured is not None:
            out["lordo_captured"] = round(self.captured, 6)
            out["lordo_captured_before"] = round(self.captured_before, 6)
        return out

    def projections(self) -> dict[str, torch.Tensor]:
        """Every projected matrix's projection by parameter name (shorter side x rank)."""
        states = [(self.names[i], self.optimizer.state.get(self.params[i], {}))
                  for i, _ in self.matrices]  # .get: no empty entries in the defaultdict
        return {name: state["projection"] for name, state in states if "projection" in state}

    def outer_state(self) -> dict[str, torch.Tensor]:
        """DiLoCo's (the outer momentum, with Nesterov) and the projections, identical on
        every replica at a sync: "projection.<name>"."""
        state = super().outer_state()
        state.update({f"projection.{n}": q.clone() for n, q in self.projections().items()})
        return state

    @torch.no_grad()
    def load_outer_state(self, state: dict[str, torch.Tensor]) -> None:
        """After the model and the inner optimizer were loaded: the projections are the
        saved ones (equal to the ones in each replica's optimizer state)."""
        outer = {k: v for k, v in state.items() if not k.startswith("projection.")}
        super().load_outer_state(outer)
        for i, _ in self.matrices:
            key = f"projection.{self.names[i]}"
            if key in state:
                self.optimizer.state[self.params[i]]["projection"] = state[key].clone()
                self.has_projections = True


def _split(pieces: Pieces, mesh) -> Split:
    """A tp piece's `Split`: where it cuts the whole matrix's shorter (projected) side, which
    rows of the projection it spans (`pieces.indices`: every rank's full indices along the
    cut dimension)."""
    placement = pieces.placement
    shape = placement.shape
    across = placement.dim == (1 if shape[0] > shape[1] else 0)  # the oriented matrix's m side
    if not across:
        return Split(placement, None, mesh)
    rows = pieces.indices[mesh.local_rank(pieces.axis)]
    assert bool((rows >= 0).all()), "a padded vocabulary's piece cuts the free side"
    return Split(placement, rows, mesh)
