"""Sharpness-aware gradients for (sparse) training: SAM, and ZO-SAM.

SAM: Foret et al., arXiv 2010.01412, eq. 2 and Algorithm 1. ZO-SAM: Ji et al., arXiv
2603.13115, here with one SPSA probe (loomtrain.zeroth's `Perturber`). What is implemented,
how the masks are kept, exactness, memory and the logged loss: docs/sparsity.md, "SAM and
ZO-SAM".
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from loomtrain import comm
from loomtrain.parallel.data import clip_replica_grads
from loomtrain.zeroth.perturb import Perturber, mix_seed, rng_state, set_rng_state

_ZO_STREAM = 0x2050  # the seed stream of ZO-SAM's probe directions


class MaskedPerturber(Perturber):
    """A `Perturber` whose z is masked by the sparsity masks current at each use."""

    def __init__(self, model: nn.Module, masks: Callable[[], dict[nn.Parameter, torch.Tensor]]):
        super().__init__(model)
        self._masks = masks

    def mask(self, pos: int) -> torch.Tensor | None:
        return self._masks().get(self.params[pos])


class SharpnessAware:
    """`kind` "sam" or "zo-sam" over the trainable parameters of `module` (unwrapped: the
    engine's `.module`). `mask_gradients()` and `masks()` come from the sparsifier (no-ops
    without one); `axis`: the mesh axis whose ranks split the batch (ZO-SAM's all-reduce).
    On a model split by tp or pp, SAM's norm is the whole gradient's (`clip_replica_grads`).
    In the ZeRO engine (`sharded`: its `ShardedOptimizer`, SAM only) the ascent moves this
    rank's slices of the fp32 master weights by its slices of the reduced gradient, whose
    norm is the engine's clip norm, and publishes them to the compute weights (an all-gather
    of the parameters at stages 1-2 on the way up and on the way back)."""

    def __init__(self, kind: str, module: nn.Module, rho: float, mesh, axis: str = "dp",
                 seed: int = 0, zo_eps: float = 1e-3,
                 mask_gradients: Callable[[], None] = lambda: None,
                 masks: Callable[[], dict] = dict, sharded=None):
        assert kind in ("sam", "zo-sam"), kind
        assert sharded is None or kind == "sam", "ZO-SAM perturbs whole parameters"
        self.kind, self.rho, self.mesh, self.axis = kind, rho, mesh, axis
        self.seed, self.zo_eps, self.sharded = seed, zo_eps, sharded
        if sharded is not None:  # the master slices the inner optimizer steps, `.grad` theirs
            self.params = [view for _, _, view, _, _ in sharded.slices]
        else:
            self.params = [p for p in dict.fromkeys(module.parameters()) if p.requires_grad]
        self._mask_gradients = mask_gradients
        self.perturber = MaskedPerturber(module, masks) if kind == "zo-sam" else None

    def gradient(self, t: int, forward_backward: Callable[[], torch.Tensor],
                 forward_loss: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Leaves the sharpness-aware gradient of step t in `.grad` (masked gradients are
        the caller's to mask again: only SAM's first pass is masked here). `forward_backward()`
        runs the step's forward and backward (gradients reduced over dp) and returns this
        rank's loss sum; `forward_loss()` its forwards only. Returns the loss sum to log."""
        if self.kind == "sam":
            loss_sum = forward_backward()
            self._mask_gradients()
            norm = self._norm()
            scale = float(self.rho / (norm + 1e-12))
            with self._perturbed(lambda p: p.grad, scale):
                self._zero_grad()
                forward_backward()
            return loss_sum
        seed = mix_seed(self.seed, _ZO_STREAM, t)
        probe = self._probe(seed, forward_loss)  # this rank's (L+ sum, L- sum)
        totals = probe.clone()
        comm.all_reduce(totals, self.mesh, self.axis)
        difference = float(totals[0] - totals[1])  # its sign is the direction's
        if difference == 0.0:  # no uphill side measured: the plain gradient
            forward_backward()
            return probe.mean()
        positions = range(len(self.perturber.params))
        z_norm = sum(float(self.perturber.direction(i, seed, self.perturber.mask(i)).square().sum())
                     for i in positions) ** 0.5
        scale = (1.0 if difference > 0 else -1.0) * self.rho / max(z_norm, 1e-12)
        directions = {id(p): i for i, p in enumerate(self.perturber.params)}
        with self._perturbed(lambda p: self.perturber.direction(directions[id(p)], seed,
                                                                self.perturber.mask(directions[id(p)])),
                             scale):
            forward_backward()
        return probe.mean()

    def _probe(self, seed: int, forward_loss) -> torch.Tensor:
        """(L(w + eps z), L(w - eps z)) as this rank's loss sums; both forwards start from the
        same RNG state (dropout draws the same masks), which the perturbed backward reuses."""
        rng = rng_state(self.params)
        losses = []
        with torch.no_grad():
            for sign in (1.0, -1.0):
                set_rng_state(rng)
                with self.perturber.perturbed(seed, sign * self.zo_eps):
                    losses.append(forward_loss().double())
        set_rng_state(rng)
        return torch.stack(losses).to(self.mesh.device)

    def _norm(self) -> torch.Tensor:
        """The 2-norm of the whole (masked) gradient."""
        if self.sharded is not None:
            return self.sharded.engine.clip_grad_norm_(0.0)
        return clip_replica_grads(self.params, 0.0, self.mesh)

    def _perturbed(self, direction: Callable[[nn.Parameter], torch.Tensor], scale: float):
        """Context: w += scale * direction(p) for every parameter of the perturbed set (SAM:
        those with a gradient; ZO-SAM: the perturber's), w restored bitwise on exit."""
        publish = self.sharded.engine.publish if self.sharded is not None else lambda: None
        return _Perturbation(self.params if self.kind == "sam" else self.perturber.params,
                             direction, scale, publish)

    def _zero_grad(self) -> None:
        if self.sharded is not None:  # its shards, and stage 1's whole fp32 accumulator
            self.sharded.zero_grad(set_to_none=False)
            return
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()  # in place: the engine's gradients are views into its buckets


class _Perturbation:
    """`publish()` follows each change (the sharded engine's master weights into its compute
    weights)."""

    def __init__(self, params, direction, scale: float, publish: Callable[[], None]):
        self.params, self.direction, self.scale, self.publish = params, direction, scale, publish
        self.saved: list[torch.Tensor] = []

    @torch.no_grad()
    def __enter__(self):
        for p in self.params:
            d = self.direction(p)
            self.saved.append(p.detach().clone())
            if d is not None:
                p.add_(d, alpha=self.scale)
        self.publish()

    @torch.no_grad()
    def __exit__(self, *exc):
        for p, saved in zip(self.params, self.saved):
            p.copy_(saved)
        self.publish()
        return False
