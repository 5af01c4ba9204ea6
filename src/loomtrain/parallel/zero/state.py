"""ZeRO checkpoints in the same layout as an unsharded one, so any run can load any other.

Each rank writes its slice of every tensor as boxes of the full tensor (parallel/placement.py),
which DCP reshards on load. What is saved and how: docs/zero.md, "Checkpoints and resharding".
"""

from __future__ import annotations

import torch

from loomtrain.parallel.placement import Boxes, placement_of
from loomtrain.parallel.state import (
    StateLayout,
    aliases,
    hyperparameters,
    loaded_groups,
    persistent_buffers,
)


def zero_state(engine, optimizer, for_saving: bool) -> dict:
    """{"model": ..., "optim": {"state": ..., "param_groups": ...}} with live views: DCP saves
    from them, or loads into them in place. `for_saving`: leave out what another replica saves."""
    names = aliases(engine.module)
    placements = {name: placement_of(p) for name, p in engine.module.named_parameters()}
    model, state = {}, {}

    def boxes(flat, piece) -> Boxes:
        return Boxes.flat_range(flat, piece.slot.shape, piece.start).placed(placements[piece.slot.name])

    for name, group, view, unit, piece in optimizer.slices:
        plan = unit.plan  # another replica of the unit saves it
        if for_saving and plan.replica_index > 0 and not plan.optimizer_over_replicas:
            continue
        shard = boxes(view.detach(), piece)
        for alias in names[name]:
            model[alias] = shard
        entry = state.setdefault(name, {})
        if for_saving:  # under every name, as the model (a pipeline stage finds its own)
            state.update(dict.fromkeys(names[name], entry))
        for key, value in optimizer.inner.state.get(view, {}).items():
            if torch.is_tensor(value) and value.shape == view.shape and value.dim() == 1:
                entry[key] = boxes(value, piece)
            else:
                entry[key] = value  # "step": one scalar, the same for every slice
    in_units = {p for u in engine.all_units for p in u.params}
    for name, p in engine.module.named_parameters():
        if p not in in_units:  # frozen parameters stay whole (on the dp axis)
            model[name] = Boxes.whole(p.detach()).placed(placement_of(p))
    model.update(persistent_buffers(engine.module))
    return {"model": model, "optim": {"state": state,
                                      "param_groups": hyperparameters(optimizer.param_groups)}}


def load_zero_state(engine, optimizer, loaded: dict) -> None:
    """After DCP filled the views of `ZeroStateLayout.to_load`: take the loaded
    hyperparameters and publish the weights to every rank that keeps them."""
    saved = loaded_groups(loaded["optim"]["param_groups"], optimizer.group_names)
    for group, values in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in values.items() if k in group})
    engine.publish()


class ZeroStateLayout(StateLayout):
    """The ZeRO engine's layout (this module): live views of the shards, saved as boxes of
    the full tensors."""

    def state(self, model, optimizer, for_saving: bool = True) -> dict:
        return zero_state(model, optimizer, for_saving)

    def load(self, model, optimizer, state: dict) -> None:
        load_zero_state(model, optimizer, state)


ZERO = ZeroStateLayout()
