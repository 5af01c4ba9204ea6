"""Where every parameter lives in ZeRO's flat buffers: pure functions of shapes and rank counts.

A unit is flattened and padded so that every rank owns an equal contiguous range (ZeRO,
Rajbhandari et al., arXiv 1910.02054, section 5; FSDP's flat parameters); the optimizer sees
slices and a checkpoint sees boxes. Details: docs/zero.md, "Units and flat buffers".
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """One parameter inside a unit's flat buffer."""

    name: str  # its first fully qualified name in the model
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Slice:
    """The part [start, stop) (flat, row-major) of parameter `slot` that falls in a range."""

    slot: Slot
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def unit_offset(self) -> int:
        """Where the slice begins in the unit's flat buffer."""
        return self.slot.offset + self.start


@dataclass(frozen=True)
class UnitLayout:
    name: str
    slots: tuple[Slot, ...]
    padded: int  # flat length: the parameters' numel rounded up to a multiple of `multiple`

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    def range(self, index: int, parts: int) -> tuple[int, int]:
        """The flat range of part `index` of `parts` equal parts."""
        assert self.padded % parts == 0, (self.padded, parts)
        size = self.padded // parts
        return index * size, (index + 1) * size

    def slices(self, start: int, stop: int) -> list[Slice]:
        """The parameters' parts inside the flat range [start, stop), in order (padding has none)."""
        out = []
        for slot in self.slots:
            lo, hi = max(start, slot.offset), min(stop, slot.offset + slot.numel)
            if lo < hi:
                out.append(Slice(slot, lo - slot.offset, hi - slot.offset))
        return out


def unit_layout(name: str, params: list[tuple[str, tuple[int, ...]]], multiple: int) -> UnitLayout:
    """Lay out `params` ((name, shape) in order) back to back, padded to a multiple of `multiple`."""
    slots, offset = [], 0
    for pname, shape in params:
        slots.append(Slot(pname, tuple(shape), offset))
        offset += math.prod(shape)
    padded = -(-offset // multiple) * multiple if offset else 0
    return UnitLayout(name, tuple(slots), padded)


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the rectangular boxes that tile the row-major range [start, stop) of a
    tensor of `shape`, in memory order; each box is itself contiguous in that order.

    A range of a matrix is at most three boxes: the end of its first row, whole rows, the start
    of its last row; each extra dimension can split the partial rows again. A 0-d tensor is one
    box of no dimensions.
    """
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    boxes = []

    def inner(r: int, lo: int, hi: int) -> None:  # part [lo, hi) of row r
        if lo == 0 and hi == row:
            boxes.append(((r,) + (0,) * (len(shape) - 1), (1,) + tuple(shape[1:])))
        else:
            boxes.extend(((r,) + off, (1,) + size) for off, size in flat_range_boxes(shape[1:], lo, hi))

    head_lo = start - first * row
    if first == last:
        inner(first, head_lo, stop - first * row)
        return _merge_rows(boxes)
    inner(first, head_lo, row)
    if last > first + 1:
        boxes.append(((first + 1,) + (0,) * (len(shape) - 1), (last - first - 1,) + tuple(shape[1:])))
    inner(last, 0, stop - last * row)
    return _merge_rows(boxes)


def _merge_rows(boxes):
    """Join neighbouring whole-row boxes (a full first row followed by the middle rows)."""
    out = []
    for off, size in boxes:
        if out:
            poff, psize = out[-1]
            whole = lambda o, s: all(x == 0 for x in o[1:])  # noqa: E731
            if (whole(poff, psize) and whole(off, size) and psize[1:] == size[1:]
                    and poff[0] + psize[0] == off[0]):
                out[-1] = (poff, (psize[0] + size[0],) + size[1:])
                continue
        out.append((off, size))
    return out


# --- memory per rank, in bytes (the formulas docs/zero.md states and the tests check) --------


@dataclass(frozen=True)
class ZeroMemory:
    """Persistent training state per rank after the first step; see `zero_memory`."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int  # optimizer states plus fp32 master weights where they are separate

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


def zero_memory(padded: list[int], stage: int, shard_ranks: int, optimizer_ranks: int,
                states: int, compute_bytes: int = 4, separate_master: bool = False,
                separate_grad: bool = False) -> ZeroMemory:
    """Bytes of parameters, gradients and optimizer state one rank keeps between steps.

    `padded`: every unit's flat length (its parameter count P_u rounded up to a multiple of the
    world); P = sum(padded). `shard_ranks` L: ranks the parameters (stage 3) are split over;
    `optimizer_ranks` S: ranks the optimizer state is split over (L, or the whole dp group with
    hierarchical `optimizer_shard = "dp"`). `states`: fp32 tensors per parameter (AdamW 2).
    `compute_bytes`: 4 (fp32) or 2 (bf16). `separate_master`: fp32 master weights are a tensor
    of their own (bf16 compute, or offload); otherwise the master weights are a view of the
    fp32 parameters.
    `separate_grad`: stage 1 with offload also keeps its reduced range in host memory.

        parameters    stage 0-2: c P                stage 3: c P / L
        gradients     stage 0-1: 4 P (fp32 buffer)  stage 2-3: 4 P / S
                      (+ 4 P / S for stage 1's offloaded gradient range)
        optimizer     4 states P / S  (+ 4 P / S fp32 master when separate)

    Padding (fewer than N elements per unit, at the end of the last rank's range) is counted
    everywhere; it has no optimizer state, so that rank keeps up to 4 states N bytes per unit less.
    (stage 0 here is the sharded engine with L = S = 1, used for bf16; with c = 4 it is the
    classic 4P + 4P + 8P of fp32 AdamW. Stage 1: 4P + 4P + 8P/N; stage 2: 4P + 12P/N; stage 3:
    16P/N, all for fp32 AdamW.) Not included: what exists only during a step (gathered units,
    a unit's gradient buffer in flight, activations) — `transient_bytes` below.
    """
    total = sum(padded)
    params = compute_bytes * (total if stage < 3 else total // shard_ranks)
    grads = 4 * (total if stage < 2 else total // optimizer_ranks)
    if separate_grad:
        grads += 4 * total // optimizer_ranks
    optim = 4 * states * total // optimizer_ranks
    if separate_master:
        optim += 4 * total // optimizer_ranks
    return ZeroMemory(params, grads, optim)
