"""Checkpoints of low-communication runs: one model, one outer state, each replica's own
inner optimizer, written only where the replicas are synchronized. A replica split over tp
and pp ranks writes its pieces as the synchronous layouts do (the plain layout): tensor-
parallel pieces as boxes of the full tensors, the optimizer's groups by index.

The keys, resume and its limits: docs/lowcomm.md, "Checkpoints".
"""

from __future__ import annotations

import torch

from loomtrain.parallel.placement import Boxes, placement_of
from loomtrain.parallel.state import PLAIN, REPLICA_KEY, StateLayout, unboxed
from loomtrain.parallel.zero.state import ZERO


def lowcomm_state(model, optimizer) -> dict:
    """{"model": ..., "optim": {"replica<R>": ...}, "lowcomm": ...} of `model` (a LocalSGD or
    DiLoCo wrapper): DCP saves from it, or loads into it."""
    inner = _replica_layout(model).state(_replica_model(model), optimizer)
    if getattr(optimizer, "splits", None):
        _place_lowrank(inner["optim"]["state"], model.module, optimizer)
    return {"model": inner["model"], "optim": {f"replica{model.replica}": inner["optim"]},
            "lowcomm": _boxed(model.outer_state(), model)}


def _replica_layout(model) -> StateLayout:
    """A replica's own layout: the plain one, or ZeRO's for a replica run by the sharded
    engine (its master weights and optimizer slices as boxes of the full tensors)."""
    return PLAIN if model.engine is None else ZERO


def _replica_model(model):
    return model if model.engine is None else model.engine


def _place_lowrank(state: dict, module, optimizer) -> None:
    """LoRDO's optimizer (lowcomm/lowrank_adamw.py) on tp pieces: its projections are the
    whole matrices', on every tp rank, and its moments (rank x columns) are either whole too
    or this piece's columns of the whole moments (`Split.moments`): placed so, not as the
    parameter is (the plain layout boxes every tensor of the parameter's shape)."""
    for name, p in module.named_parameters():
        split = optimizer.splits.get(p)
        if split is None or name not in state:
            continue
        own = optimizer.state[p]
        placement = split.moments(own["projection"].shape[1])
        state[name] = {**state[name], "projection": own["projection"],
                       **{k: Boxes.whole(own[k]).placed(placement) if placement else own[k]
                          for k in ("exp_avg", "exp_avg_sq") if k in own}}


def _boxed(outer: dict[str, torch.Tensor], model) -> dict:
    """The outer state's per-parameter tensors (keys "<kind>.<parameter name>", each shaped as
    what the wrapper syncs of that parameter) as boxes of the full tensors where a rank holds
    a piece: a tensor-parallel slice, a ZeRO slice of the master weights, or both."""
    params = dict(model.module.named_parameters()) if model.engine is None else dict(
        model.engine.module.named_parameters())
    slices = dict(zip(model.names, model.slices or [None] * len(model.names)))
    out = {}
    for key, value in outer.items():
        parts = key.split(".")
        name = next((n for n in (".".join(parts[i:]) for i in range(1, len(parts)))
                     if n in slices), None)
        if name is None or key.startswith(getattr(model, "whole_prefixes", ())):
            out[key] = value
            continue
        piece, placement = slices[name], placement_of(params[name])
        if piece is not None:
            out[key] = Boxes.flat_range(value, piece.slot.shape, piece.start).placed(placement)
        elif placement is not None:
            out[key] = Boxes.whole(value).placed(placement)
        else:
            out[key] = value
    return out


def load_lowcomm_state(model, optimizer, state: dict) -> None:
    """Put what DCP loaded into `state` (from `lowcomm_state`) into the model, the inner
    optimizer and the wrapper's outer state."""
    _replica_layout(model).load(_replica_model(model), optimizer,
                                {"model": state["model"],
                                 "optim": state["optim"][f"replica{model.replica}"]})
    model.load_outer_state(unboxed(state["lowcomm"]))


class LowcommStateLayout(StateLayout):
    """One model, the outer state, each replica's own inner optimizer (this module)."""

    portable = False  # torch's own optimizer state dict, per replica

    def state(self, model, optimizer, for_saving: bool = True) -> dict:
        return lowcomm_state(model, optimizer)

    def load(self, model, optimizer, state: dict) -> None:
        load_lowcomm_state(model, optimizer, state)

    def check(self, keys, model) -> str | None:
        """The inner optimizer states must be one per replica of this run."""
        saved = {k.split(".")[1] for k in keys if k.startswith(REPLICA_KEY)}
        if not saved:
            return ("it was written without lowcomm.algorithm (one optimizer state for all "
                    "replicas); resume it with lowcomm.algorithm=\"none\"")
        if len(saved) != model.mesh.size(model.axis):
            fix = (f"parallel.dp={len(saved)}" if model.axis == "dp" else
                   f"{len(saved)} nodes (parallel.nproc / parallel.ranks_per_node, each node a "
                   "ZeRO-sharded replica)")
            return (f"it holds the optimizer states of {len(saved)} replicas, one each, and this "
                    f"run has {model.mesh.size(model.axis)}; resume it with {fix}")
        return None


LOWCOMM = LowcommStateLayout()
