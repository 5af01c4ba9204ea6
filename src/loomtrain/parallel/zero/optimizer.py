"""The sharded optimizer: the user's optimizer, rebuilt over this rank's slices of the parameters
(ZeRO stage 1, Rajbhandari et al., arXiv 1910.02054, section 5.1), with optional host offload
(ZeRO-Offload, Ren et al., arXiv 2101.06840). Why only elementwise optimizers, and what
offload does on a CPU: docs/zero.md, "The optimizer over slices" and "Offload".
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from loomtrain.parallel.zero.engine import ShardedDataParallel

# and any optimizer class that says `elementwise = True` (the async pipeline's DelayedNesterov)
ELEMENTWISE = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)


class ShardedOptimizer:
    """Steps this rank's optimizer range, then publishes the new parameters to every rank that
    keeps them. `param_groups` are the inner optimizer's (set the learning rate there)."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: ShardedDataParallel):
        if type(optimizer) not in ELEMENTWISE and not getattr(optimizer, "elementwise", False):
            raise ValueError(
                f"ZeRO shards the optimizer by slicing parameters, which is exact only for an "
                f"elementwise update; {type(optimizer).__name__} is not one of "
                f"{', '.join(c.__name__ for c in ELEMENTWISE)}")
        self.engine = engine
        first_name = {}
        for name, p in engine.module.named_parameters():
            first_name.setdefault(p, name)
        # the groups' parameters by name, whichever rank holds them (checkpoints list them)
        self.group_names = [[first_name[p] for p in g["params"]] for g in optimizer.param_groups]
        group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": []}
                  for g in optimizer.param_groups]
        # (slot name, group index, slice view, unit, slice): what checkpoints need to find
        self.slices: list[tuple] = []
        for u in engine.all_units:
            lo, hi = u.optimizer_range
            for piece in u.layout.slices(lo, hi):
                param = u.params[u.layout.slots.index(piece.slot)]
                if param not in group_of:
                    raise ValueError(f"parameter {piece.slot.name!r} is in the model but not in "
                                     "the optimizer; ZeRO needs every trainable parameter in it")
                at = piece.unit_offset - lo
                view = nn.Parameter(u.master[at:at + piece.numel])
                view.grad = u.grad[at:at + piece.numel]
                groups[group_of[param]]["params"].append(view)
                self.slices.append((piece.slot.name, group_of[param], view, u, piece))
        # each group carries its hyperparameters; the defaults the constructor takes go too
        accepted = inspect.signature(type(optimizer)).parameters
        self.inner = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items()
                                                if k in accepted})

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @torch.no_grad()
    def step(self) -> None:
        self.engine.ready_grads()  # a unit no backward reached since zero_grad: zeros
        self.inner.step()
        self.engine.publish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient shards: with `set_to_none` (torch's default) their memory is given
        back until the next backward's reductions land (FlatUnit.free_grad), else they are
        zeroed in place. The slices' `.grad` are views of them and stay either way."""
        for u in self.engine.all_units:
            if set_to_none:
                u.free_grad()
            elif u.grad.untyped_storage().nbytes():
                u.grad.zero_()
            u.grad_is_zero = True
            if u.acc is not None:
                u.acc.zero_()
