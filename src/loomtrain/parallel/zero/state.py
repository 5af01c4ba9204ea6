"""ZeRO checkpoints in the same layout as an unsharded one, so any run can load any other.

Each rank writes its slice of every tensor as boxes of the full tensor (parallel/placement.py),
which DCP reshards on load. What is saved and how: docs/zero.md, "Checkpoints and resharding".
"""

from __future__ import annotations

import torch

from loomtrain.parallel.placement import Boxes, placement_of
from loomtrain.parallel.state import StateLayout


def _aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """First name of each parameter -> all its names (a tied head is saved under both)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {v[0]: v for v in names.values()}


def zero_state(engine, optimizer, for_saving: bool) -> dict:
    """{"model": ..., "optim": {"state": ..., "param_groups": ...}} with live views: DCP saves
    from them, or loads into them in place. `for_saving`: leave out what another replica saves."""
    plan = engine.plan
    writes = not (for_saving and plan.replica_index > 0 and not plan.optimizer_over_replicas)
    aliases = _aliases(engine.module)
    placements = {name: placement_of(p) for name, p in engine.module.named_parameters()}
    model, state = {}, {}

    def boxes(flat, piece) -> Boxes:
        return Boxes.flat_range(flat, piece.slot.shape, piece.start).placed(placements[piece.slot.name])

    for name, group, view, unit, piece in optimizer.slices:
        if not writes:
            continue
        shard = boxes(view.detach(), piece)
        for alias in aliases[name]:
            model[alias] = shard
        entry = state.setdefault(name, {})
        for key, value in optimizer.inner.state.get(view, {}).items():
            if torch.is_tensor(value) and value.shape == view.shape and value.dim() == 1:
                entry[key] = boxes(value, piece)
            else:
                entry[key] = value  # "step": one scalar, the same for every slice
    in_units = {p for u in engine.all_units for p in u.params}
    for name, p in engine.module.named_parameters():
        if p not in in_units:  # frozen parameters stay whole (on the dp axis)
            model[name] = Boxes.whole(p.detach()).placed(placement_of(p))
    for name, b in engine.module.named_buffers():
        model[name] = b
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": list(names)}
              for g, names in zip(optimizer.param_groups, optimizer.group_names)]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def load_zero_state(engine, optimizer, loaded: dict) -> None:
    """After DCP filled the views of `zero_state(..., for_saving=False)`: take the loaded
    hyperparameters and publish the weights to every rank that keeps them."""
    from loomtrain.parallel.zero.communication import publish

    for group, saved in zip(optimizer.param_groups, loaded["optim"]["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params" and k in group})
    publish(engine.all_units, engine.mesh)


class ZeroStateLayout(StateLayout):
    """The ZeRO engine's layout (this module): live views of the shards, saved as boxes of
    the full tensors."""

    def state(self, model, optimizer, for_saving: bool = True) -> dict:
        return zero_state(model, optimizer, for_saving)

    def load(self, model, optimizer, state: dict) -> None:
        load_zero_state(model, optimizer, state)


ZERO = ZeroStateLayout()
