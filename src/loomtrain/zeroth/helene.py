"""HELENE: annealed gradient averaging, a diagonal Hessian estimate from the ZO signal, and
layer-wise clipping of the preconditioned update.

Zhao et al., arXiv 2411.10696 (with Sophia's clipping, Liu et al., arXiv 2305.14342). The
update as implemented and which parts are our reading of the paper: docs/zeroth.md,
"The methods".
"""

from __future__ import annotations

import math

import torch

from loomtrain.zeroth.optimizers import Pair, ZOOptimizer
from loomtrain.zeroth.perturb import Perturber
from loomtrain.zeroth.split import whole_means


class Helene(ZOOptimizer):
    name = "helene"
    state_kinds = ("m", "h")

    def __init__(self, perturber: Perturber, lr: float, betas: tuple[float, float] = (0.9, 0.99),
                 anneal_steps: float = 1000.0, hessian_every: int = 1, gamma: float = 1.0,
                 hessian_clip: float = 0.5, precond_eps: float = 1e-12, **base):
        super().__init__(perturber, lr, **base)
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"helene: betas={betas} must be in [0, 1)")
        if not anneal_steps > 0 or hessian_every < 1 or not gamma > 0 or not hessian_clip >= 0:
            raise ValueError(f"helene: anneal_steps={anneal_steps} and gamma={gamma} must be "
                             f"positive, hessian_every={hessian_every} >= 1, hessian_clip="
                             f"{hessian_clip} >= 0")
        self.betas, self.anneal_steps = tuple(betas), anneal_steps
        self.hessian_every, self.gamma = hessian_every, gamma
        self.hessian_clip, self.precond_eps = hessian_clip, precond_eps
        self.hessian_updates = 0

    def annealing(self, step: int) -> float:
        b1 = self.betas[0]
        return b1 + (1 - b1) * math.exp(-step / self.anneal_steps)

    @torch.no_grad()
    def _update(self, pairs: list[Pair], lr: float) -> None:
        """m and h of every tensor first, then the update: the clipping floors are the whole
        tensors' means of h (split.py `whole_means`, one all-reduce over tp for them all)."""
        b1, b2 = self.betas
        alpha = self.annealing(self.step_count)
        update_hessian = self.step_count % self.hessian_every == 0
        ms, hs = self.state["m"], self.state["h"]
        for pos in range(len(self.params)):
            g = self.estimate(pos, pairs)
            ms[pos].mul_(b1).add_(g, alpha=alpha)
            if update_hessian:
                if self.hessian_updates == 0:
                    torch.mul(g, g, out=hs[pos])
                else:
                    hs[pos].mul_(b2).addcmul_(g, g, value=1 - b2)
        for p, m, h, mean in zip(self.params, ms, hs, whole_means(self.perturber, hs)):
            floor = mean * self.hessian_clip
            denom = torch.maximum(h, floor).mul_(self.gamma).add_(self.precond_eps)
            p.add_(torch.div(m, denom).clamp_(-1, 1), alpha=-lr)
        if update_hessian:
            self.hessian_updates += 1

    def _extra_state(self) -> dict:
        return {"hessian_updates": self.hessian_updates}

    def _load_extra_state(self, state: dict) -> None:
        self.hessian_updates = state["hessian_updates"]
