"""LoRDO's inner optimizer: AdamW whose moments of each weight matrix live in a rank-r
subspace, plus a full-rank quasi-hyperbolic term.

GaLore (Zhao et al., arXiv 2403.03507), LoRDO (Jovanovic et al., arXiv 2602.04396), QHM (Ma &
Yarats, arXiv 1810.06801). The update, its state and our choices: docs/lowcomm-lordo.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loomtrain import comm
from loomtrain.parallel.placement import Placement


def top_singular_vectors(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """The top-`rank` left singular vectors of `matrix` (m x n, m <= n) as an orthonormal
    m x rank matrix: the best rank-`rank` subspace of its columns (Eckart-Young)."""
    u, _, _ = torch.linalg.svd(matrix, full_matrices=False)
    return u[:, :rank].contiguous()


def oriented(tensor: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A matrix seen with its shorter side first (a view: writes reach the parameter); a
    tensor-parallel piece is seen as its whole matrix, of `shape`, is."""
    shape = tensor.shape if shape is None else shape
    return tensor.T if shape[0] > shape[1] else tensor


def matrix_rank(shape: tuple[int, ...], rank: int) -> int:
    """The projection's rank for a matrix of `shape`: `rank`, at most its shorter side."""
    return min(rank, min(shape))


@dataclass(frozen=True)
class Split:
    """A tensor-parallel rank's piece of a projected matrix (lordo.py sets it): `placement`
    says where it sits in the whole matrix. The projection is the whole matrix's. A piece
    that cuts the free (longer, n) side holds its own columns of the moments and updates
    alone; one that cuts the projected (shorter, m) side holds `rows` of the projection,
    and its coordinates Q_rows^T G_piece are summed over `mesh`'s tp into the whole
    matrix's Q^T G, every step (docs/lowcomm-lordo.md, "Tensor parallelism")."""

    placement: Placement
    rows: torch.Tensor | None  # the piece's rows of the projection, where it cuts the m side
    mesh: object

    @property
    def shape(self) -> tuple[int, ...]:
        return self.placement.shape

    def moments(self, rank: int) -> Placement | None:
        """Where the piece's moments (rank x its columns) sit in the whole moments, or None
        where they are the whole moments (a piece of the m side)."""
        if self.rows is not None:
            return None
        return Placement((rank, max(self.shape)), 1, self.placement.runs)


class LowRankAdamW(torch.optim.Optimizer):
    """`LowRankAdamW(groups, lr, betas, eps, weight_decay, qh_weight)`: every group has a
    `rank` (0: plain AdamW for its parameters; r > 0: its 2-D parameters are projected).
    `qh_weight` is w above: 1 turns the full-rank term off."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, rank: int = 0,
                 qh_weight: float = 0.7):
        if not 0.0 <= qh_weight <= 1.0:
            raise ValueError(f"qh_weight is a mixing weight in [0, 1], got {qh_weight}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, rank=rank,
                        qh_weight=qh_weight)
        super().__init__(params, defaults)
        self.splits: dict[torch.Tensor, Split] = {}  # tensor-parallel pieces (`Split`)
        for group in self.param_groups:
            for p in group["params"]:
                assert group["rank"] == 0 or p.dim() == 2, "only matrices are projected"

    def projected(self):
        """(parameter, rank) of every projected matrix, in group order."""
        return [(p, matrix_rank(self.shape(p), g["rank"])) for g in self.param_groups
                if g["rank"] for p in g["params"]]

    def shape(self, param: torch.Tensor) -> tuple[int, ...]:
        """The whole matrix's shape: `param`'s own, or that of which it is a piece."""
        split = self.splits.get(param)
        return tuple(param.shape) if split is None else split.shape

    @torch.no_grad()
    def set_projection(self, param: torch.Tensor, projection: torch.Tensor) -> None:
        """Make `projection` (orthonormal, shorter side x rank) the subspace of `param`'s
        moments, rotating the moments already there into its basis."""
        state = self.state[param]
        old = state.get("projection")
        if old is not None and "exp_avg" in state:
            change = projection.T @ old  # C: old coordinates -> new ones
            state["exp_avg"] = change @ state["exp_avg"]
            state["exp_avg_sq"] = (change * change) @ state["exp_avg_sq"]
        state["projection"] = projection.clone()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        coordinates = self._coordinates([(p, g) for p, g in todo if g["rank"]])
        for p, group in todo:
            self._update(p, group, coordinates.get(p))
        return loss

    def _start(self, p: torch.Tensor, rank: int) -> None:
        """GaLore's first projection, from the first gradient. A piece has not the whole
        gradient: LoRDO sets its projection before its first step, so this one (identity
        columns) only shapes the state a checkpoint loads into."""
        split = self.splits.get(p)
        self.state[p]["projection"] = (
            top_singular_vectors(oriented(p.grad), rank) if split is None
            else torch.eye(min(split.shape), rank, dtype=p.dtype, device=p.device))

    def _basis(self, p: torch.Tensor) -> torch.Tensor:
        """The projection's rows that this rank's `p` spans: all, but for a piece of the m
        side."""
        split, projection = self.splits.get(p), self.state[p]["projection"]
        return projection if split is None or split.rows is None else projection[split.rows]

    def _coordinates(self, todo: list[tuple[torch.Tensor, dict]]) -> dict:
        """Q^T G of every projected matrix in `todo`, pieces of the m side summed over tp in
        one all-reduce."""
        out = {}
        for p, group in todo:
            if "projection" not in self.state[p]:
                self._start(p, matrix_rank(self.shape(p), group["rank"]))
            out[p] = self._basis(p).T @ oriented(p.grad, self.shape(p))
        summed = [p for p in out if p in self.splits and self.splits[p].rows is not None]
        if summed:
            flat = torch.cat([out[p].flatten() for p in summed])
            comm.all_reduce(flat, self.splits[summed[0]].mesh, "tp")
            for p, part in zip(summed, flat.split([out[p].numel() for p in summed])):
                out[p] = part.view_as(out[p])
        return out

    def _update(self, p: torch.Tensor, group: dict, coordinates: torch.Tensor | None) -> None:
        state = self.state[p]
        lowrank = group["rank"] > 0
        grad = oriented(p.grad, self.shape(p)) if lowrank else p.grad
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            shape = coordinates.shape if lowrank else p.shape
            state["exp_avg"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
            state["exp_avg_sq"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        lr, step = group["lr"], float(state["step"])
        correction1, correction2 = 1 - beta1 ** step, math.sqrt(1 - beta2 ** step)
        p.mul_(1 - lr * group["weight_decay"])  # decoupled, as AdamW
        coordinates = coordinates if lowrank else grad
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(coordinates, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(coordinates, coordinates, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / correction2).add_(group["eps"])
        if not lowrank:
            p.addcdiv_(exp_avg, denom, value=-lr / correction1)
            return
        weight = group["qh_weight"]
        target = oriented(p, self.shape(p))
        target.add_(self._basis(p) @ (exp_avg / denom), alpha=-lr * weight / correction1)
        if weight < 1:  # the full-rank term: the raw gradient over each column's RMS
            column = (exp_avg_sq.mean(0, keepdim=True).sqrt() / correction2).add_(group["eps"])
            target.add_(grad / column, alpha=-lr * (1 - weight))

    def state_bytes(self) -> tuple[int, int]:
        """(bytes of this optimizer's state, bytes AdamW's would take for the same
        parameters): moments and projections; the step counters left out of both."""
        mine = sum(t.numel() * t.element_size() for s in self.state.values()
                   for k, t in s.items() if k != "step")
        adamw = sum(2 * p.numel() * p.element_size() for g in self.param_groups
                    for p in g["params"])
        return mine, adamw
