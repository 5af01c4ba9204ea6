"""Sparse-aware ZeRO: with gradient masks set, each unit's reductions carry only its kept
entries.

Every rank holds the same masks, so the kept entries of a flat unit, packed in flat order,
fall into the ranks' equal shard ranges in order: cut at those ranges and each cut padded to
the longest (gloo's reduce-scatter takes equal chunks), the packed vector reduce-scatters to
each rank the summed kept entries of its own range, the sums the dense reduce-scatter gives
there. Hierarchical ZeRO does the same again over the nodes: an all-reduce of the packed
entries of the shard, or, with the optimizer state split over the nodes, a second cut at the
optimizer ranges. Bytes and the oracle: docs/sparsity.md, "Sparse communication in ZeRO".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loomtrain import comm
from loomtrain.comm.mask_sync import broadcast_masks
from loomtrain.comm.meter import wire_bytes
from loomtrain.estimate import metered
from loomtrain.parallel.sparse_dp import check_masks
from loomtrain.parallel.zero.communication import GradReduction


@dataclass(frozen=True)
class PackedCut:
    """The kept entries of a flat vector of `parts` equal ranges, packed range by range into
    chunks of `width` entries: `index` (their positions, in order), `packed_at` (where each
    goes in the packed vector of parts x width), `mine` (the positions of range `me`'s, from
    the range's start)."""

    index: torch.Tensor
    packed_at: torch.Tensor
    width: int
    mine: torch.Tensor
    parts: int

    def pack(self, flat: torch.Tensor) -> torch.Tensor:
        packed = flat.new_zeros(self.parts * self.width)
        packed[self.packed_at] = flat[self.index]
        return packed

    def unpack(self, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (a range's worth) zeroed, then `values` (range `me`'s packed entries, in
        order) written at their positions."""
        out.zero_()
        out[self.mine] = values[:self.mine.numel()]
        return out


def packed_cut(keep: torch.Tensor, parts: int, me: int) -> PackedCut:
    """The `PackedCut` of the True entries of `keep` (a flat bool vector whose length `parts`
    divides). Every chunk is at least one entry long: a collective of nothing is not run."""
    size = keep.numel() // parts
    index = keep.nonzero().flatten()
    owner = index // size
    counts = torch.bincount(owner, minlength=parts)
    first = torch.cumsum(counts, 0) - counts  # each range's first entry in `index`
    width = max(1, int(counts.max()))
    packed_at = owner * width + torch.arange(index.numel(), device=keep.device) - first[owner]
    return PackedCut(index, packed_at, width, index[owner == me] - me * size, parts)


@dataclass(frozen=True)
class UnitCuts:
    """A unit's cuts: over the shard axis (the unit), and over the replica axis (my shard)
    where the optimizer state is split over the nodes."""

    shard: PackedCut
    replica: PackedCut | None


def unit_cuts(unit, keep: torch.Tensor) -> UnitCuts:
    """The cuts of `unit` (a FlatUnit) for `keep`, one bool per entry of the unit."""
    plan = unit.plan
    lo, hi = unit.shard
    shard = packed_cut(keep, plan.shard_ranks, plan.shard_index)
    replica = (packed_cut(keep[lo:hi], plan.replica_ranks, plan.replica_index)
               if plan.optimizer_over_replicas else None)
    return UnitCuts(shard, replica)


def set_unit_cuts(units: list, masks: dict | None, mesh, axis: str) -> tuple[bool, int]:
    """Each unit's `cuts` for `masks` ({parameter: bool mask of its shape in the unit}, None:
    none), member 0's of `axis` (comm/mask_sync.py, copied into the tensors this rank passed,
    as DataParallel does); a unit no mask touches keeps none (the dense reduction). Returns
    (any mask set, this rank's mask-sync wire bytes). Collective over `axis`."""
    params = [p for u in units for p in u.params]
    shapes = [slot.shape for u in units for slot in u.layout.slots]
    mine = check_masks(masks, params, shapes)
    # where this rank passed no mask, a stand-in of the shape (no memory) to unpack into
    likes = [m if m is not None else torch.zeros((), dtype=torch.bool, device=mesh.device).expand(s)
             for m, s in zip(mine, shapes)]
    synced, sent = broadcast_masks(mine, likes, mesh, axis)
    at = 0
    with torch.no_grad():
        for u in units:
            used = synced[at:at + len(u.params)]
            for given, mask in zip(mine[at:at + len(u.params)], used):
                if given is not None and mask is not None and given is not mask:
                    given.copy_(mask)
            u.cuts = None if all(m is None for m in used) else unit_cuts(u, _keep(u, used))
            at += len(u.params)
    return any(m is not None for m in synced), sent


def _keep(unit, masks: list) -> torch.Tensor:
    """One bool per entry of the unit: its slots' masks, all of an unmasked slot; the padding
    not (it is zero)."""
    keep = torch.zeros(unit.layout.padded, dtype=torch.bool, device=unit.store.device)
    for slot, mask in zip(unit.layout.slots, masks):
        keep[slot.offset:slot.offset + slot.numel] = (True if mask is None else
                                                      mask.reshape(-1).to(keep.device))
    return keep


def reduction_wire_bytes(plan, unit_bytes: int, replica_bytes: int) -> int:
    """What one rank sends to reduce `unit_bytes` over the shard axis (a reduce-scatter,
    counted as comm runs it: `metered`) and then `replica_bytes` over the replica axis (a
    reduce-scatter where the optimizer state is split over the nodes, else a ring
    all-reduce)."""
    sent = metered("", "reduce_scatter", plan.shard_axis, plan.shard_ranks, unit_bytes).wire_bytes
    if plan.optimizer_over_replicas:
        return sent + metered("", "reduce_scatter", plan.replica_axis, plan.replica_ranks,
                              replica_bytes).wire_bytes
    return sent + wire_bytes("ring_all_reduce", replica_bytes, plan.replica_ranks)


def unit_wire_bytes(unit) -> tuple[int, int]:
    """(sent, dense): one reduction of `unit` with its cuts (none: the dense one), and without."""
    plan, cuts = unit.plan, unit.cuts
    lo, hi = unit.shard
    dense = reduction_wire_bytes(plan, 4 * unit.layout.padded, 4 * (hi - lo))
    if cuts is None:
        return dense, dense
    shard = cuts.shard
    replica = (cuts.replica.parts * cuts.replica.width if cuts.replica is not None
               else shard.mine.numel())
    return reduction_wire_bytes(plan, 4 * shard.parts * shard.width, 4 * replica), dense


class PackedGradReduction(GradReduction):
    """`GradReduction` of the kept entries (`unit.cuts`): pack, reduce-scatter over the shard
    axis, then over the replica axis an all-reduce of my packed entries or (the optimizer
    state split over the nodes) unpack, pack at the second cut and reduce-scatter; unpacked
    into my optimizer range, zero at every entry not kept, divided and added into `grad`."""

    def __init__(self, unit, source: torch.Tensor, mesh, timeline=None, divisor: int = 1):
        plan, cut = unit.plan, unit.cuts.shard
        self.unit, self.mesh, self.timeline, self.divisor = unit, mesh, timeline, divisor
        source = source if source.dtype == torch.float32 else source.float()
        # stage 1 reduces into its own accumulator's optimizer range (which `grad` is, or
        # is copied from with offload), as the dense reduction does in place
        in_place = unit.acc is not None and source is unit.acc
        lo, hi = unit.optimizer_range
        self.into = source[lo:hi] if in_place else None
        packed = cut.pack(source)
        self.chunk = packed.new_empty(cut.width)
        self.phase = "shard"
        self.pending = self._start("reduce_scatter", lambda: comm.reduce_scatter(
            self.chunk, packed, mesh, plan.shard_axis, async_op=True))

    def advance(self) -> bool:
        self.pending.wait()
        plan, cuts = self.unit.plan, self.unit.cuts
        if self.phase == "shard":
            self.phase = "replica"
            if plan.replica_ranks > 1:
                self.pending = self._replica_step(plan, cuts)
                return False
        cut = cuts.replica if cuts.replica is not None else cuts.shard
        if self.divisor > 1:
            self.chunk.div_(self.divisor)
        out = self.into if self.into is not None else self.chunk.new_empty(self.unit.grad.numel())
        self.unit.accumulate(cut.unpack(self.chunk, out))
        self.chunk = self.into = None
        self.phase = "done"
        return True

    def _replica_step(self, plan, cuts: UnitCuts):
        """Start the reduction over the replica axis of my shard's summed kept entries."""
        if cuts.replica is None:
            mine = self.chunk[:cuts.shard.mine.numel()]
            return self._start("all_reduce", lambda: comm.all_reduce(
                mine, self.mesh, plan.replica_axis, async_op=True))
        lo, hi = self.unit.shard
        packed = cuts.replica.pack(cuts.shard.unpack(self.chunk, self.chunk.new_empty(hi - lo)))
        self.chunk = packed.new_empty(cuts.replica.width)
        return self._start("reduce_scatter", lambda: comm.reduce_scatter(
            self.chunk, packed, self.mesh, plan.replica_axis, async_op=True))


__all__ = ["PackedCut", "PackedGradReduction", "UnitCuts", "packed_cut", "reduction_wire_bytes",
           "set_unit_cuts", "unit_cuts", "unit_wire_bytes"]
