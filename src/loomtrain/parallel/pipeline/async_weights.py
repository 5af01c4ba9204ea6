"""Where the asynchronous pipeline's weights and gradients live (asynchronous.py): whole on
every dp rank (`LiveWeights`: no data parallelism, or DataParallel), or in ZeRO's sharded
engine (`ShardedWeights`: stages 1-3, bf16). The runtime's update is the same on both: the
stashed forward's gradients, summed over dp, clipped per group, an optimizer step; what
differs is where each of these happens. docs/pipeline.md, "The asynchronous runtime in
detail".
"""

from __future__ import annotations

import contextlib

import torch

from loomtrain import comm


class LiveWeights:
    """The weights are the stage's parameters themselves, whole on every rank: a stash is a
    copy of each, gradients are the parameters' `.grad`, reduced by the dp engine."""

    def snapshot(self, named) -> dict[str, torch.Tensor]:
        """{name: a copy of the parameter, a leaf of its own}: the weights one forward uses."""
        return {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in named}

    def aside(self):
        return contextlib.nullcontext()

    def reduce(self, grads: dict, engine) -> None:
        """`grads` ({parameter: gradient or None}) summed over dp into `.grad` (None stays
        None: the optimizer leaves that parameter alone)."""
        for p, grad in grads.items():
            p.grad = grad
        engine.sync_gradients()  # DataParallel fills every `.grad`: zeros for a None
        for p, grad in grads.items():
            if grad is None:
                p.grad = None

    def has(self, p) -> bool:
        return p.grad is not None

    def clip(self, params: list, max_norm: float) -> torch.Tensor:
        """Clips the gradients of `params` to `max_norm` (0: no clipping); their norm before."""
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)

    def skip(self, params: list) -> None:
        for p in params:
            p.grad = None

    def step(self, optimizer) -> None:
        optimizer.step()


class ShardedWeights:
    """The weights in ZeRO's engine (`engine`, `optimizer` its ShardedOptimizer): a stash is
    each unit gathered whole (stage 3: all-gathered from the shards, the version the shards
    hold now) or copied (stages 1-2: every rank keeps it), in the compute dtype; gradients are
    reduce-scattered into the fp32 gradient shards, and a group's norm is the root of its
    shards' squares summed over the ranks whose optimizer ranges tile it: the norm of the
    whole dp-summed gradient, as `LiveWeights` takes it."""

    def __init__(self, engine, optimizer):
        self.engine, self.optimizer = engine, optimizer
        self.slices: dict = {}  # parameter -> the optimizer's views of my slices of it
        for _, _, view, unit, piece in optimizer.slices:
            param = unit.params[unit.layout.slots.index(piece.slot)]
            self.slices.setdefault(param, []).append(view)
        self.given: set = set()  # the parameters with a gradient in this update
        self.skipped: list = []  # (slice view, its gradient view) set aside for one step

    def snapshot(self, named) -> dict[str, torch.Tensor]:
        of = {}
        for u in self.engine.all_units:
            if u.sharded_params:
                full = torch.empty(u.layout.padded, dtype=u.store.dtype, device=u.store.device)
                comm.all_gather(full, u.store, self.engine.mesh, u.plan.shard_axis)
            else:
                full = u.store.clone()
            for p, slot in zip(u.params, u.layout.slots):
                of[p] = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
        out = {}
        for n, p in named:  # a parameter outside the units (frozen) is copied as it is
            weights = of[p] if p in of else p.detach().clone()
            out[n] = weights.detach().requires_grad_(p.requires_grad)
        return out

    def aside(self):
        return self.engine.aside()

    def reduce(self, grads: dict, engine) -> None:
        self.given = {p for p, grad in grads.items() if grad is not None}
        self.engine.reduce_given(grads.get)

    def has(self, p) -> bool:
        return p in self.given

    def _grads(self, params: list) -> list[torch.Tensor]:
        return [v.grad for p in params for v in self.slices.get(p, ())]

    def clip(self, params: list, max_norm: float) -> torch.Tensor:
        """As LiveWeights.clip, over the shards (one all-reduce of a number)."""
        grads = self._grads(params)
        square = torch.zeros((), dtype=torch.float32, device=self.engine.mesh.device)
        if grads:
            square = torch.stack(torch._foreach_norm(grads)).float().square().sum()
        comm.all_reduce(square, self.engine.mesh, self.engine.plan.optimizer_axis)
        norm = square.sqrt()
        if max_norm > 0 and grads:
            torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    def skip(self, params: list) -> None:
        """The optimizer leaves `params` alone in the next step (their slices lose `.grad`)."""
        for p in params:
            for v in self.slices.get(p, ()):
                if v.grad is not None:
                    self.skipped.append((v, v.grad))
                    v.grad = None

    def step(self, optimizer) -> None:
        self.skip([p for p in self.slices if p not in self.given])
        optimizer.step()
        for v, grad in self.skipped:
            v.grad = grad
        self.skipped = []
        optimizer.zero_grad(set_to_none=True)  # the shards fill again at the next update
