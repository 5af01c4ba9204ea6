"""Sparse training on a split model: the communication that makes every mask decision the
whole model's. Tensor parallelism leaves a rank a piece of a layer (`Pieces`: the tp ranks'
pieces gathered into the whole weight, mask or gradient, and the whole cut back to this
rank's piece); a pipeline leaves it some of the layers (the whole model's list,
sparsifier.whole_layers, sets every layer's index and density); `whole_counts` sums the kept
weights over the ranks that hold different parts.

Why gathering rather than a distributed k-th value, and the bytes per mask update:
docs/sparsity.md, "Split models".
"""

from __future__ import annotations

import torch
import torch.nn as nn

from loomtrain import comm
from loomtrain.parallel.placement import placement_of


class Pieces:
    """How the `axis` ranks' pieces of `param` make the whole tensor (its `tp_placement`);
    a parameter without one is whole on every rank, and nothing travels. The full indices
    each rank's piece holds along the split dimension are all-gathered once, here (-1 for a
    padded vocabulary's rows, which hold no entry of the whole). `shape`: the piece's shape
    where `param` is empty between uses (ZeRO-3), else its own."""

    def __init__(self, param: nn.Parameter, mesh, axis: str = "tp",
                 shape: tuple[int, ...] | None = None):
        self.placement = placement_of(param)
        self.mesh, self.axis = mesh, axis
        if self.placement is None:
            return
        dim = self.placement.dim
        self.length = (shape or param.shape)[dim]
        mine = torch.full((self.length,), -1, dtype=torch.int64, device=param.device)
        for full_start, local_start, n in self.placement.runs:
            mine[local_start:local_start + n] = torch.arange(full_start, full_start + n)
        self.indices = mine.new_empty((mesh.size(axis), self.length))
        comm.all_gather(self.indices, mine, mesh, axis)

    def whole(self, piece: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every rank's `piece` of it (collective over the axis; a bool
        tensor travels as one byte per entry)."""
        if self.placement is None:
            return piece
        wire = piece.to(torch.uint8) if piece.dtype == torch.bool else piece.detach()
        pieces = wire.new_empty((self.indices.shape[0], *wire.shape))
        comm.all_gather(pieces, wire.contiguous(), self.mesh, self.axis)
        dim = self.placement.dim
        whole = wire.new_zeros(self.placement.shape)
        for rows, values in zip(self.indices, pieces):
            held = rows >= 0  # a padded vocabulary's rows last (Placement.take)
            whole.index_copy_(dim, rows[held], values.narrow(dim, 0, int(held.sum())))
        return whole.bool() if piece.dtype == torch.bool else whole

    def piece(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of `whole` (a padded row: False, or 0)."""
        if self.placement is None:
            return whole
        return self.placement.take(whole, self.length)

    def counted(self) -> bool:
        """Whether this rank counts the piece in the whole model's figures: a piece always,
        a whole copy on tp rank 0 only."""
        return self.placement is not None or self.mesh is None or self.mesh.local_rank(self.axis) == 0


def whole_counts(counts: torch.Tensor, mesh) -> torch.Tensor:
    """`counts` (one entry per whole layer, this rank's share) summed over the ranks that
    hold different parts of the model: tp (pieces) and pp (stages). dp and cp ranks hold
    copies and are not summed."""
    if mesh is None:
        return counts
    for axis in ("tp", "pp"):
        comm.all_reduce(counts, mesh, axis)
    return counts
