"""Sparse all-reduce: the sum over a mesh axis of every rank's sparse tensor, written dense.

Schemes: "allgather" (every rank's (index, value) pairs), "balanced" (after Zen, Wang et al.,
arXiv 2309.13254: a hashed partition of the indices, each owner sums its part) and "auto",
which prices both. Formats, cost model and measurements: docs/sparse-allreduce.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from loomtrain.comm.collectives import Pending, all_gather, all_to_all
from loomtrain.comm.meter import wire_bytes
from loomtrain.comm.sparse_plan import (
    FORMATS,
    Encoding,
    bottom_hashes,
    choose_scheme,
    estimate_union,
    gap_decode,
    gap_encode,
    index_wire_dtype,
    owner_of,
    partition_layout,
    partition_loads,
    sketch_size,
    true_positions,
)

SCHEMES = ("auto", "allgather", "balanced")


@dataclass(frozen=True)
class SparseResult:
    """What one sparse all-reduce did on this rank."""

    scheme: str  # "allgather" or "balanced", the one that ran
    wire_bytes: int  # sent by this rank over every phase: counts, indices, values, padding
    # wire bytes per phase, in order: "counts", "pairs" (allgather); "counts", "to_owners",
    # "reduced_counts", "from_owners" (balanced; only "counts" when no rank holds a pair)
    phases: dict[str, int] = field(default_factory=dict)
    owner_formats: tuple[str, ...] = ()  # balanced: how each owner's sums travelled
    union_pairs: int | None = None  # balanced: u, the distinct indices over all ranks


class PendingSparse:
    """A sparse all-reduce in flight. `wait()` waits for the transfer started at the call,
    runs the remaining phases, writes `out`, and returns the `SparseResult` (also `result`)."""

    def __init__(self, pending: Pending | None, finish):
        self._pending, self._finish = pending, finish
        self.result: SparseResult | None = None

    def wait(self) -> SparseResult:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        if self._finish is not None:
            self.result = self._finish()
            self._finish = None
        return self.result


def sparse_all_reduce(indices: torch.Tensor, values: torch.Tensor, out: torch.Tensor, mesh,
                      axis: str, scheme: str = "auto",
                      async_op: bool = False) -> SparseResult | PendingSparse:
    """Overwrite `out` with the sum over `axis` of every rank's sparse tensor (zero where no
    rank has an entry), the same bits on every rank.

    `indices`: 1-D int64, unique (not checked: a duplicate is summed too, but priced as two),
    in [0, out.numel()); `values`: as long, out's dtype; both may be empty, and their length
    may differ between ranks. `out`: contiguous, not aliasing them.

    The count exchange, the choice of "auto" and the packing run at the call; async_op=True
    then returns a `PendingSparse` with the big transfer in flight, overlapping the caller's
    work: allgather's pairs, or balanced's all-to-all to the owners. `wait()` runs the rest
    (balanced: the owner's sums, the reduced counts, the all-gather of the sums) and writes
    `out`, which is not touched before. Costs: docs/sparse-allreduce.md; what was sent: the
    `SparseResult`."""
    _check(indices, values, out, scheme)
    flat, n = out.view(-1), mesh.size(axis)
    if n == 1:
        return _run(PendingSparse(None, lambda: _alone(indices, values, flat, scheme)), async_op)
    owners = counts = gapped = None
    if scheme != "balanced":  # allgather sends the pairs sorted, maybe as int16 gaps
        indices, values = _sorted_pairs(indices, values, indices, flat.numel())
        gapped = gap_encode(indices, values)
        with_fillers = torch.tensor([gapped[0].numel()], device=flat.device)
    if scheme == "allgather":
        table, sent = _exchange(torch.cat([torch.tensor([indices.numel()], device=flat.device),
                                           with_fillers]), mesh, axis)
        per_rank, filled = table[:, 0], table[:, 1]
    else:
        owners = owner_of(indices, n)
        row = torch.bincount(owners, minlength=n)
        size = sketch_size(flat.numel()) if scheme == "auto" else 0
        if scheme == "auto":
            row = torch.cat([row, with_fillers, bottom_hashes(indices, size)])
        table, sent = _exchange(row, mesh, axis)
        counts = table[:, :n]  # counts[sender, owner]: the pairs sender holds in owner's part
        per_rank = counts.sum(1)
        if scheme == "auto":
            filled = table[:, n]
            narrow = _narrow(per_rank, filled, flat)
            scheme = _auto(counts, table[:, n + 1:] if size else None, flat, narrow)
    phases = {"counts": sent}
    if scheme == "allgather":
        if not _narrow(per_rank, filled, flat):
            gapped = None
        pending = _start_allgather(indices, values, gapped, flat, mesh, axis,
                                   (filled if gapped else per_rank).tolist(), phases)
    else:
        pending = _start_balanced(indices, values, owners, flat, mesh, axis, counts.tolist(),
                                  phases)
    return _run(pending, async_op)


def _run(pending: PendingSparse, async_op: bool):
    return pending if async_op else pending.wait()


def _check(indices, values, out, scheme) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"sparse_all_reduce scheme={scheme!r} is not one of {SCHEMES}")
    if indices.dim() != 1 or indices.dtype != torch.int64:
        raise ValueError(f"sparse_all_reduce indices must be 1-D int64, got shape "
                         f"{tuple(indices.shape)} {indices.dtype}")
    if values.shape != indices.shape:
        raise ValueError(f"sparse_all_reduce values must match indices: {indices.numel()} "
                         f"indices, values of shape {tuple(values.shape)}")
    if values.dtype != out.dtype or not out.is_floating_point():
        raise ValueError(f"sparse_all_reduce values ({values.dtype}) and out ({out.dtype}) "
                         f"must share one floating dtype")
    if not out.is_contiguous() or not indices.device == values.device == out.device:
        raise ValueError("sparse_all_reduce needs a contiguous out on the device of indices "
                         "and values")
    if indices.numel() and (indices.min() < 0 or indices.max() >= out.numel()):
        raise ValueError(f"sparse_all_reduce indices must lie in [0, {out.numel()}) (out's "
                         f"numel), got [{indices.min().item()}, {indices.max().item()}]")


def _alone(indices, values, flat, scheme: str) -> SparseResult:
    flat.zero_()
    flat[indices] = values
    return SparseResult(choose_scheme(indices.numel(), flat.numel(), 1)
                        if scheme == "auto" else scheme, 0)


def _narrow(per_rank: torch.Tensor, filled: torch.Tensor, flat: torch.Tensor) -> bool:
    """Whether int16 gaps (fillers included) make allgather's padded chunk smaller than
    indices of `index_wire_dtype`: from the exchanged counts, so alike on every rank."""
    b_i, b_v = _encoding(flat).index_dtype.itemsize, flat.element_size()
    return int(filled.max()) * (2 + b_v) < int(per_rank.max()) * (b_i + b_v)


def _auto(counts: torch.Tensor, sketches: torch.Tensor | None, flat: torch.Tensor,
          narrow: bool) -> str:
    """`choose_scheme` on what every rank received alike, so every rank picks the same."""
    n, per_rank = counts.shape[0], counts.sum(1)
    union = None  # without sketches: independent sets of the same density
    if sketches is not None:
        estimate = estimate_union(sketches, sketches.shape[1])
        union = min(max(estimate, per_rank.max().item()), flat.numel())
    return choose_scheme(math.ceil(per_rank.sum().item() / n), flat.numel(), n,
                         max_nnz=per_rank.max().item(), union=union,
                         value_bytes=flat.element_size(), gap_bytes=2 if narrow else None)


def _exchange(row: torch.Tensor, mesh, axis: str) -> tuple[torch.Tensor, int]:
    """Every rank's int64 `row`, as an (N, len) matrix; and this rank's wire bytes for it."""
    pending, table, sent = _start_exchange(row, mesh, axis)
    pending.wait()
    return table, sent


def _start_exchange(row: torch.Tensor, mesh, axis: str):
    """`_exchange` in flight: (its `Pending`, the matrix once waited for, the wire bytes)."""
    n = mesh.size(axis)
    table = torch.empty(n * row.numel(), dtype=torch.int64, device=row.device)
    pending = all_gather(table, row.contiguous(), mesh, axis, async_op=True)
    return pending, table.view(n, -1), wire_bytes("ring_all_gather", table.numel() * 8, n)


def _encoding(flat: torch.Tensor) -> Encoding:
    return Encoding(index_wire_dtype(flat.numel()), flat.dtype)


def _sorted_pairs(indices, values, key, bound: int):
    """The pairs in increasing order of their distinct `key`s, all below `bound`. Sorted by
    index, a rank's pairs go into `out` in memory order on every receiver: 419,430 fp32 pairs
    into 2^22 elements take 1 ms so against 6 ms in random order (measured here, one thread),
    for one sort by their sender: 2.5 ms as int32 keys (used when they fit), 6.7 ms as int64.
    No bits change: each element gets one value per rank."""
    order = torch.sort(key.int() if bound <= 2**31 else key).indices
    return indices.index_select(0, order), values.index_select(0, order)


def _padded(parts: list[torch.Tensor], chunk_bytes: int, device) -> torch.Tensor:
    """An (len(parts), chunk_bytes) uint8 buffer, part j at the start of row j, zeros after."""
    buffer = torch.zeros(len(parts), chunk_bytes, dtype=torch.uint8, device=device)
    for row, part in zip(buffer, parts):
        row[:part.numel()] = part
    return buffer


def _nothing_sent(flat, result: SparseResult) -> PendingSparse:
    """No rank holds a pair (known from the counts, alike everywhere): `out` is zero."""
    def finish() -> SparseResult:
        flat.zero_()
        return result
    return PendingSparse(None, finish)


def _start_allgather(indices, values, gapped, flat, mesh, axis, counts: list[int], phases):
    """`indices` sorted; `gapped`: `gap_encode`'s (gaps, values) to send as int16, or None
    (send `indices`); `counts`: every rank's pairs as sent."""
    n, numel = len(counts), flat.numel()
    enc = Encoding(torch.int16, flat.dtype) if gapped else _encoding(flat)
    chunk = enc.bytes("pairs", max(counts), numel)
    if chunk == 0:
        return _nothing_sent(flat, SparseResult("allgather", sum(phases.values()), phases))
    positions, values = gapped if gapped else (indices, values)
    mine = _padded([enc.encode("pairs", positions, values, numel)], chunk, flat.device).view(-1)
    gathered = torch.empty(n * chunk, dtype=torch.uint8, device=flat.device)
    pending = all_gather(gathered, mine, mesh, axis, async_op=True)
    phases["pairs"] = wire_bytes("ring_all_gather", gathered.numel(), n)

    def finish() -> SparseResult:
        flat.zero_()
        for chunk_r, count in zip(gathered.view(n, chunk), counts):  # in rank order
            positions, vals = enc.decode("pairs", chunk_r, count, numel)
            if gapped:
                positions = gap_decode(positions)
            flat.index_add_(0, positions, vals)
        return SparseResult("allgather", sum(phases.values()), phases)
    return PendingSparse(pending, finish)


def _start_balanced(indices, values, owners, flat, mesh, axis, counts: list[list[int]], phases):
    n, me, enc, numel = len(counts), mesh.local_rank(axis), _encoding(flat), flat.numel()
    layout = partition_layout(numel, n, flat.device)
    chunk = enc.bytes("pairs", max(max(row) for row in counts), numel)
    if chunk == 0:
        return _nothing_sent(flat, SparseResult("balanced", sum(phases.values()), phases,
                                                union_pairs=0))
    order = _grouped_by_owner(owners, n)
    values = values.index_select(0, order)
    slots = layout.slot.index_select(0, indices.index_select(0, order))
    parts = [enc.encode("pairs", slots_p - offset, values_p, 0) for slots_p, values_p, offset
             in zip(slots.split(counts[me]), values.split(counts[me]), layout.offsets)]
    sends = _padded(parts, chunk, flat.device)
    received = torch.empty_like(sends)
    pending = all_to_all(received.view(-1), sends.view(-1), mesh, axis, async_op=True)
    phases["to_owners"] = wire_bytes("all_to_all", sends.numel(), n)

    def finish() -> SparseResult:
        return _reduce_and_gather(received, [row[me] for row in counts], layout, flat, mesh,
                                  axis, phases)
    return PendingSparse(pending, finish)


def _grouped_by_owner(owners: torch.Tensor, n: int) -> torch.Tensor:
    """The order that groups the pairs by owner, each owner's in their given order: a stable
    sort of the owners as the narrowest integer type, 0.9 ms for 419,430 pairs as int8 here
    (one thread), against 1.9 ms sorting them by (owner, index) as int32 keys. The order
    within an owner changes no bits (each position gets one value per sender) and little
    time: its sums, 1/N of out, stay in cache (105k random `index_add_`s: 0.13 ms, sorted
    0.10)."""
    narrow = torch.int8 if n <= 2**7 else torch.int16 if n <= 2**15 else torch.int32
    return torch.sort(owners.to(narrow), stable=True).indices


def _reduce_and_gather(received, counts_from: list[int], layout, flat, mesh, axis, phases):
    """The owner's sums (`_sum_at_owner`), all-gathered from every owner in its cheapest format
    (chosen from the exchanged union sizes: alike on every rank) and written into `flat`
    (`_write_sums`). The exchange of union sizes overlaps the owner's sums; the all-gather, the
    zeroing of the slices it fills."""
    n, me, enc = mesh.size(axis), mesh.local_rank(axis), _encoding(flat)
    sizes = layout.sizes
    sent = [enc.decode("pairs", chunk, count, sizes[me]) for chunk, count
            in zip(received, counts_from)]
    present = torch.zeros(8 * math.ceil(sizes[me] / 8), dtype=torch.bool, device=flat.device)
    for positions, _ in sent:
        present[positions] = True
    union = present.count_nonzero()
    pending, unions, phases["reduced_counts"] = _start_exchange(union.view(1), mesh, axis)
    partitions = torch.empty_like(flat)  # the partitions' values, in `Layout.by_owner` order
    fmt = enc.best(union.item(), sizes[me], FORMATS)  # this owner's: known before the wait
    mine = _sum_at_owner(sent, present, fmt, layout.part(partitions, me))
    encoded = enc.encode(fmt, *mine, sizes[me])
    pending.wait()
    unions = unions[:, 0].tolist()
    formats = tuple(enc.best(u, s, FORMATS) for u, s in zip(unions, sizes))
    chunk = max(enc.bytes(f, u, s) for f, u, s in zip(formats, unions, sizes))  # > 0: u >= 1
    gathered = torch.empty(n * chunk, dtype=torch.uint8, device=flat.device)
    pending = all_gather(gathered, _padded([encoded], chunk, flat.device).view(-1), mesh, axis,
                         async_op=True)
    phases["from_owners"] = wire_bytes("ring_all_gather", gathered.numel(), n)
    scatter = all(f == "pairs" for f in formats)  # few values: into a zeroed `flat`
    for target in [flat] if scatter else [layout.part(partitions, p) for p, f
                                          in enumerate(formats) if p != me and f != "dense"]:
        target.zero_()  # while the sums travel
    pending.wait()
    chunks = gathered.view(n, chunk)
    decoded = [mine if p == me else enc.decode(formats[p], chunks[p], unions[p], sizes[p])
               for p in range(n)]
    _write_sums(decoded, formats, me, scatter, layout, partitions, flat)
    return SparseResult("balanced", sum(phases.values()), phases, formats, sum(unions))


def _sum_at_owner(sent, present, fmt: str, sums: torch.Tensor):
    """Add the senders' (positions, values) into `sums` (this owner's slice of the partitions),
    in rank order as allgather adds them; return (where, values) for this owner's chunk in
    `fmt`, `present` the mask of the positions received (padded to whole bytes)."""
    sums.zero_()
    for positions, vals in sent:
        sums.index_add_(0, positions, vals)
    if fmt == "dense":
        return None, sums
    positions = true_positions(present[:sums.numel()])
    return present if fmt == "bitmap" else positions, sums.index_select(0, positions)


def _write_sums(decoded, formats, me: int, scatter: bool, layout, partitions, flat) -> None:
    """Every owner's (where, values) into `flat`, zeroed if `scatter`, else through
    `partitions`, where this owner's sums already are and the others' slices are zeroed
    unless dense.

    Through `partitions`: each other owner's sums fill its slice (`index_copy_` at the
    positions, 1 ms per million here, one thread), then one gather by `Layout.slot` writes
    every element of `flat` in memory order: 2.6 ms per 2^22. Scattering each owner's values
    straight into a zeroed `flat` costs 1.7 ms per million (its writes land all over out),
    so it runs only when every owner sent pairs: fewer values than elements."""
    for p, (where, vals) in enumerate(decoded):
        if scatter:
            flat[layout.members(p)[where]] = vals
        elif p != me:
            _write_partition(formats[p], where, vals, layout.part(partitions, p))
    if not scatter:
        torch.index_select(partitions, 0, layout.slot, out=flat)


def _write_partition(fmt: str, where, vals, part: torch.Tensor) -> None:
    """An owner's decoded sums into its slice `part` of the partitions (zeroed unless dense)."""
    if fmt == "dense":
        part.copy_(vals)
    else:
        part.index_copy_(0, true_positions(where) if fmt == "bitmap" else where.long(), vals)


__all__ = ["SCHEMES", "PendingSparse", "SparseResult", "choose_scheme",
           "partition_loads", "sparse_all_reduce"]
