"""ZeRO checkpoints in the same layout as an unsharded one, so any run can load any other.

The state dict has the keys and full shapes of `get_state_dict(model, optimizer)` on the
unsharded model ("model.blocks.0.attn.qkv.weight", "optim.state.<name>.exp_avg", ...), but
every sharded tensor is a `FlatShard`: this rank's contiguous slice of it, presented to
torch.distributed.checkpoint (DCP) as the rectangular boxes that tile the slice
(`layout.flat_range_boxes`). DCP stores boxes as chunks with their offsets and, on load,
reads for each rank whatever part of the saved chunks overlaps the boxes it asks for. So a
checkpoint written by 4 ranks at stage 3 loads into 2 ranks at stage 1, into plain data
parallel, and back (resharding), and `loom export` reads it like any other.

Saved values: the fp32 master weights (the weights of a bf16 run), the optimizer state of
every slice, the optimizer's hyperparameters, buffers. Where the optimizer range is the same
on several ranks (hierarchical, optimizer state split inside the node only), only the first
replica writes it; every rank reads its own.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from loomtrain.parallel.zero.layout import flat_range_boxes


class FlatShard:
    """Elements [start, stop) (row-major) of a tensor of `shape`, held by `flat` (1-D, length
    stop - start). Implements the three methods DCP's planners ask of a sharded value."""

    def __init__(self, flat: torch.Tensor, shape: tuple[int, ...], start: int):
        self.shape = torch.Size(shape)
        self.flat = flat
        self.boxes = []
        at = 0
        for offsets, sizes in flat_range_boxes(tuple(shape), start, start + flat.numel()):
            n = math.prod(sizes)
            self.boxes.append((torch.Size(offsets), torch.Size(sizes), flat[at:at + n].view(sizes)))
            at += n

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, _obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                              properties=TensorProperties.create_from_tensor(view), size=self.shape))
                for offsets, sizes, view in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes) for offsets, sizes, _ in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, _, view in self.boxes:
            if offsets == index.offset:
                return view
        raise ValueError(f"{index.fqn}: no box at offset {index.offset}")


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
    model, state = {}, {}
    for name, group, view, unit, piece in optimizer.slices:
        if not writes:
            continue
        shard = FlatShard(view.detach(), piece.slot.shape, piece.start)
        for alias in aliases[name]:
            model[alias] = shard
        entry = state.setdefault(name, {})
        for key, value in optimizer.inner.state.get(view, {}).items():
            if torch.is_tensor(value) and value.shape == view.shape and value.dim() == 1:
                entry[key] = FlatShard(value, piece.slot.shape, piece.start)
            else:
                entry[key] = value  # "step": one scalar, the same for every slice
    in_units = {p for u in engine.all_units for p in u.params}
    for name, p in engine.module.named_parameters():
        if p not in in_units:  # frozen parameters stay whole and replicated
            model[name] = p.detach()
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
