"""LoRDO's inner optimizer: AdamW whose moments of each weight matrix live in a rank-r
subspace, plus a full-rank quasi-hyperbolic term.

GaLore (Zhao et al., arXiv 2403.03507), LoRDO (Jovanovic et al., arXiv 2602.04396), QHM (Ma &
Yarats, arXiv 1810.06801). The update, its state and our choices: docs/lowcomm-lordo.md.
"""

from __future__ import annotations

import math

import torch


def top_singular_vectors(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """The top-`rank` left singular vectors of `matrix` (m x n, m <= n) as an orthonormal
    m x rank matrix: the best rank-`rank` subspace of its columns (Eckart-Young)."""
    u, _, _ = torch.linalg.svd(matrix, full_matrices=False)
    return u[:, :rank].contiguous()


def oriented(tensor: torch.Tensor) -> torch.Tensor:
    """A matrix seen with its shorter side first (a view: writes reach the parameter)."""
    return tensor.T if tensor.shape[0] > tensor.shape[1] else tensor


def matrix_rank(param: torch.Tensor, rank: int) -> int:
    """The projection's rank for `param`: `rank`, at most its shorter side."""
    return min(rank, min(param.shape))


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
        for group in self.param_groups:
            for p in group["params"]:
                assert group["rank"] == 0 or p.dim() == 2, "only matrices are projected"

    def projected(self):
        """(parameter, rank) of every projected matrix, in group order."""
        return [(p, matrix_rank(p, g["rank"])) for g in self.param_groups if g["rank"]
                for p in g["params"]]

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
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        lowrank = group["rank"] > 0
        grad = oriented(p.grad) if lowrank else p.grad
        if lowrank and "projection" not in state:  # GaLore's: from the first gradient
            state["projection"] = top_singular_vectors(grad, matrix_rank(p, group["rank"]))
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            shape = (state["projection"].shape[1], grad.shape[1]) if lowrank else p.shape
            state["exp_avg"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
            state["exp_avg_sq"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        lr, step = group["lr"], float(state["step"])
        correction1, correction2 = 1 - beta1 ** step, math.sqrt(1 - beta2 ** step)
        p.mul_(1 - lr * group["weight_decay"])  # decoupled, as AdamW
        coordinates = state["projection"].T @ grad if lowrank else grad
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(coordinates, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(coordinates, coordinates, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / correction2).add_(group["eps"])
        if not lowrank:
            p.addcdiv_(exp_avg, denom, value=-lr / correction1)
            return
        weight = group["qh_weight"]
        target = oriented(p)
        target.add_(state["projection"] @ (exp_avg / denom), alpha=-lr * weight / correction1)
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
