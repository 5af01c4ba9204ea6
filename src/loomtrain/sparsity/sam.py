"""Sharpness-aware gradients for (sparse) training: SAM, and ZO-SAM.

SAM: Foret et al., arXiv 2010.01412, eq. 2 and Algorithm 1. ZO-SAM: Ji et al., arXiv
2603.13115, here with one SPSA probe (loomtrain.zeroth's `Perturber`). What is implemented,
how the masks are kept, exactness, memory and the logged loss: docs/sparsity.md, "SAM and
ZO-SAM".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from loomtrain import comm
from loomtrain.parallel.data import clip_replica_grads, grad_norm, weighted_groups
from loomtrain.zeroth.perturb import Perturber, mix_seed, rng_state, set_rng_state

_ZO_STREAM = 0x2050  # the seed stream of ZO-SAM's probe directions


class MaskedPerturber(Perturber):
    """A `Perturber` whose z is masked by the sparsity masks current at each use; `whole`
    and `mesh` as Perturber's (a piece's z is its slice of the whole tensor's)."""

    def __init__(self, model: nn.Module, masks: Callable[[], dict[nn.Parameter, torch.Tensor]],
                 whole: dict[str, int] | None = None, mesh=None):
        super().__init__(model, whole=whole, mesh=mesh)
        self._masks = masks

    def mask(self, pos: int) -> torch.Tensor | None:
        return self._masks().get(self.params[pos])


class SharpnessAware:
    """`kind` "sam" or "zo-sam" over the trainable parameters of `module` (unwrapped: the
    engine's `.module`). `mask_gradients()` and `masks()` come from the sparsifier (no-ops
    without one); `axis`: the mesh axis whose ranks split the batch (ZO-SAM's all-reduce,
    with cp's and pp's). On a model split by tp or pp, SAM's norm is the whole gradient's
    (`clip_replica_grads`), and ZO-SAM's z is the whole model's (`whole`: its
    `parameter_indices`), each piece's its slice of the whole tensor's. In the ZeRO engine
    (`sharded`: its `ShardedOptimizer`) both move this rank's slices of the fp32 master
    weights (SAM by its slices of the reduced gradient, whose norm is the engine's clip
    norm; ZO-SAM by its slices of z, also for the probes) and publish them to the compute
    weights (an all-gather of the parameters at stages 1-2 on the way up and on the way
    back)."""

    def __init__(self, kind: str, module: nn.Module, rho: float, mesh, axis: str = "dp",
                 seed: int = 0, zo_eps: float = 1e-3,
                 mask_gradients: Callable[[], None] = lambda: None,
                 masks: Callable[[], dict] = dict, sharded=None,
                 whole: dict[str, int] | None = None):
        assert kind in ("sam", "zo-sam"), kind
        self.kind, self.rho, self.mesh, self.axis = kind, rho, mesh, axis
        self.seed, self.zo_eps, self.sharded = seed, zo_eps, sharded
        if sharded is not None:  # the master slices the inner optimizer steps, `.grad` theirs
            self.params = [view for _, _, view, _, _ in sharded.slices]
        else:
            self.params = [p for p in dict.fromkeys(module.parameters()) if p.requires_grad]
        self._mask_gradients = mask_gradients
        self.perturber = None
        if kind == "zo-sam":
            self.perturber = MaskedPerturber(module, masks, whole, mesh)
            self.targets = _zo_targets(self.perturber, sharded)

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
            with self._perturbed(self.params, lambda p: p.grad, scale):
                self._zero_grad()
                forward_backward()
            return loss_sum
        seed = mix_seed(self.seed, _ZO_STREAM, t)
        probe = self._probe(seed, forward_loss)  # this rank's (L+ sum, L- sum)
        totals = probe.clone()
        for axis in (self.axis, "cp", "pp"):  # the batch's rows, its sequence, the last stage
            comm.all_reduce(totals, self.mesh, axis)
        difference = float(totals[0] - totals[1])  # its sign is the direction's
        if difference == 0.0:  # no uphill side measured: the plain gradient
            forward_backward()
            return probe.mean()
        z_norm = float(self._z_norm(seed))
        scale = (1.0 if difference > 0 else -1.0) * self.rho / max(z_norm, 1e-12)
        with self._zo_perturbed(seed, scale):
            forward_backward()
        return probe.mean()

    def _probe(self, seed: int, forward_loss) -> torch.Tensor:
        """(L(w + eps z), L(w - eps z)) as this rank's loss sums (zeros off a pipeline's last
        stage); both forwards start from the same RNG state (dropout draws the same masks),
        which the perturbed backward reuses."""
        rng = rng_state(self.params)
        losses = []
        with torch.no_grad():
            for sign in (1.0, -1.0):
                set_rng_state(rng)
                with self._zo_perturbed(seed, sign * self.zo_eps):
                    loss = forward_loss()
                losses.append(torch.zeros((), dtype=torch.float64, device=self.mesh.device)
                              if loss is None else loss.double())
        set_rng_state(rng)
        return torch.stack(losses).to(self.mesh.device)

    def _z(self, target: "_Target", seed: int) -> torch.Tensor:
        """The masked z of `target`: its parameter's (piece's) slice of the whole tensor's
        z, and in the sharded engine this rank's flat range of it."""
        z = self.perturber.direction(target.pos, seed, self.perturber.mask(target.pos),
                                     target.shape, target.tensor.dtype)
        return z if target.span is None else z.flatten()[target.span[0]:target.span[1]]

    def _z_norm(self, seed: int) -> torch.Tensor:
        """The 2-norm of the whole model's masked z, from the pieces and slices the ranks
        hold (each counted as the gradient norm counts it: `norm_weight`)."""
        groups = weighted_groups(((t.param, self._z(t, seed)) for t in self.targets), self.mesh)
        axis = "self" if self.sharded is None else self.sharded.engine.plan.optimizer_axis
        return grad_norm(groups, self.mesh, axis)

    def _zo_perturbed(self, seed: int, scale: float):
        z = {id(t.tensor): t for t in self.targets}
        return self._perturbed([t.tensor for t in self.targets],
                               lambda p: self._z(z[id(p)], seed), scale)

    def _norm(self) -> torch.Tensor:
        """The 2-norm of the whole (masked) gradient."""
        if self.sharded is not None:
            return self.sharded.engine.clip_grad_norm_(0.0)
        return clip_replica_grads(self.params, 0.0, self.mesh)

    def _perturbed(self, tensors, direction: Callable[[torch.Tensor], torch.Tensor],
                   scale: float):
        """Context: w += scale * direction(w) for every tensor w of `tensors` (parameters, or
        master slices), w restored bitwise on exit."""
        publish = self.sharded.engine.publish if self.sharded is not None else lambda: None
        return _Perturbation(tensors, direction, scale, publish)

    def _zero_grad(self) -> None:
        if self.sharded is not None:  # its shards, and stage 1's whole fp32 accumulator
            self.sharded.zero_grad(set_to_none=False)
            return
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()  # in place: the engine's gradients are views into its buckets


@dataclass(frozen=True)
class _Target:
    """A tensor ZO-SAM moves: a parameter (`pos` in the perturber), or in the sharded engine
    the master slice of its flat range `span`, of a parameter of `shape` (ZeRO-3 leaves the
    parameter empty)."""

    tensor: torch.Tensor
    param: nn.Parameter
    pos: int
    shape: tuple[int, ...] | None = None
    span: tuple[int, int] | None = None


def _zo_targets(perturber: Perturber, sharded) -> list[_Target]:
    if sharded is None:
        return [_Target(p, p, pos) for pos, p in enumerate(perturber.params)]
    position = {name: pos for pos, name in enumerate(perturber.names)}
    return [_Target(view, unit.params[unit.layout.slots.index(piece.slot)],
                    position[name], tuple(piece.slot.shape), (piece.start, piece.stop))
            for name, _, view, unit, piece in sharded.slices]


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
