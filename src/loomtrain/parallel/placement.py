"""Where a rank's piece of a tensor sits in the full tensor, for checkpoints any layout reads.

A rank's part (a ZeRO flat range, a tensor-parallel slice, or both) goes to
torch.distributed.checkpoint as boxes of the full tensor, so a run resumes under another
layout. Details: docs/tensor.md, "Checkpoints", and docs/zero.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


@dataclass(frozen=True)
class Placement:
    """A local tensor that is a slice of a tensor of `shape` along `dim`: local indices
    [local_start, local_start + length) are full indices [full_start, ...) for each run."""

    shape: tuple[int, ...]
    dim: int
    runs: tuple[tuple[int, int, int], ...]  # (full_start, local_start, length)

    @staticmethod
    def of_index(shape: tuple[int, ...], dim: int, index: torch.Tensor) -> "Placement":
        """The placement of `full.index_select(dim, index)` (index increasing)."""
        runs, values = [], index.tolist()
        for local, full in enumerate(values):
            if runs and runs[-1][0] + runs[-1][2] == full:
                runs[-1][2] += 1
            else:
                runs.append([full, local, 1])
        return Placement(tuple(shape), dim, tuple(tuple(r) for r in runs))

    def take(self, full: torch.Tensor, length: int) -> torch.Tensor:
        """The local tensor, `length` long along `dim`, of `full` (a tensor of `shape`): the
        runs' entries, then zeros (the padded rows of a vocabulary tp does not divide,
        models/config.py `padded_vocab`: held by no run, so checkpoints skip them)."""
        parts = [full.narrow(self.dim, start, n) for start, _, n in self.runs]
        held = sum(n for *_, n in self.runs)  # of_index's runs fill [0, held) in order
        if length > held:
            padding = list(full.shape)
            padding[self.dim] = length - held
            parts.append(full.new_zeros(padding))
        return torch.cat(parts, self.dim)


Box = tuple[torch.Size, torch.Size, torch.Tensor]  # (offsets, sizes, view of the values)


class Boxes:
    """Part of a tensor of full `shape`, as boxes with views of the values. Implements the
    three methods DCP's planners ask of a sharded value; `local` is the tensor the views look
    into (checkpoint loading hands it back to torch's state-dict helpers)."""

    def __init__(self, shape, boxes: list[Box], local: torch.Tensor | None = None):
        self.shape, self.boxes, self.local = torch.Size(shape), boxes, local

    @staticmethod
    def flat_range(flat: torch.Tensor, shape, start: int) -> "Boxes":
        """Elements [start, start + flat.numel()) (row-major) of a tensor of `shape`, held by
        the 1-D `flat` (a ZeRO shard of a parameter)."""
        from loomtrain.parallel.zero.layout import flat_range_boxes  # zero/ imports this module

        boxes, at = [], 0
        for offsets, sizes in flat_range_boxes(tuple(shape), start, start + flat.numel()):
            n = math.prod(sizes)
            boxes.append((torch.Size(offsets), torch.Size(sizes), flat[at:at + n].view(sizes)))
            at += n
        return Boxes(shape, boxes, flat)

    @staticmethod
    def whole(tensor: torch.Tensor) -> "Boxes":
        return Boxes(tensor.shape, [(torch.Size([0] * tensor.dim()), tensor.shape, tensor)], tensor)

    def placed(self, placement: Placement | None) -> "Boxes":
        """These boxes (in local coordinates) in the full tensor's coordinates."""
        if placement is None:
            return self
        d, out = placement.dim, []
        for offsets, sizes, view in self.boxes:
            lo, hi = offsets[d], offsets[d] + sizes[d]
            for full_start, local_start, length in placement.runs:
                a, b = max(lo, local_start), min(hi, local_start + length)
                if a >= b:
                    continue
                at = list(offsets)
                at[d] = a - local_start + full_start
                size = list(sizes)
                size[d] = b - a
                out.append((torch.Size(at), torch.Size(size), view.narrow(d, a - lo, b - a)))
        return Boxes(placement.shape, out, self.local)

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


def placement_of(tensor) -> Placement | None:
    return getattr(tensor, "tp_placement", None)


def split_over_tp(tensor) -> bool:
    """Whether the tp ranks hold different pieces of `tensor`: it has a placement, and not
    an expert's slice, which expert parallelism cuts over ep, a sub-axis of dp, and every tp
    rank holds whole (its `dp_axis` is "edp", parallel/expert/dispatch.py)."""
    return placement_of(tensor) is not None and not hasattr(tensor, "dp_axis")


def dp_axis_of(tensor, axis: str) -> str:
    """The axis whose ranks hold the same values of `tensor` among the replicas of `axis`:
    `axis` itself, or the sub-axis a split names (an expert's weights: "edp", the dp ranks
    that hold the same experts, parallel/expert/dispatch.py)."""
    return getattr(tensor, "dp_axis", axis)


__all__ = ["Box", "Boxes", "Placement", "dp_axis_of", "placement_of", "split_over_tp"]
