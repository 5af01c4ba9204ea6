"""Sparse-aware data parallel: with fixed masks, only the kept gradient entries travel.

Each masked bucket all-reduces a compact buffer of its kept entries; the masks travel once per
change (comm/mask_sync.py). Bytes, and why the result equals dense data parallel followed by
masking: docs/sparsity.md, "Sparse-aware data parallel".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from loomtrain.comm.meter import wire_bytes


def check_masks(masks: dict | None, params: list[nn.Parameter],
                shapes: list | None = None) -> list[torch.Tensor | None]:
    """The masks aligned with `params` (None where unmasked). ValueError for a mask whose key
    is not one of the engine's parameters, or that is not a bool tensor of its parameter's
    shape (`shapes`, where the parameters do not show it: ZeRO-3's are empty between uses)."""
    if not masks:
        return [None] * len(params)
    known = {p: i for i, p in enumerate(params)}
    shapes = [tuple(p.shape) for p in params] if shapes is None else [tuple(s) for s in shapes]
    aligned: list[torch.Tensor | None] = [None] * len(params)
    for p, mask in masks.items():
        if p not in known:
            raise ValueError(f"set_gradient_masks: a mask for a parameter of shape "
                             f"{tuple(p.shape)} that this data-parallel engine does not reduce "
                             f"(not in its module, or requires_grad=False)")
        shape = shapes[known[p]]
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool \
                or tuple(mask.shape) != shape:
            got = (f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor)
                   else type(mask).__name__)
            raise ValueError(f"set_gradient_masks: the mask of a parameter of shape "
                             f"{shape} must be a bool tensor of that shape, got {got}")
        aligned[known[p]] = mask
    return aligned


def bucket_keep(params: list[nn.Parameter], masks: list[torch.Tensor | None],
                buffer: torch.Tensor) -> torch.Tensor | None:
    """One bool per element of a bucket's `buffer` (its `params`' `masks`, all True for an
    unmasked one, in bucket order), or None when no parameter of the bucket is masked."""
    if all(m is None for m in masks):
        return None
    keep = torch.ones(buffer.numel(), dtype=torch.bool, device=buffer.device)
    offset = 0
    for p, mask in zip(params, masks):
        if mask is not None:
            keep[offset:offset + p.numel()] = mask.reshape(-1).to(buffer.device)
        offset += p.numel()
    return keep


def bucket_keeps(buckets, masks: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """`bucket_keep` of each bucket, `masks` aligned with the buckets' parameters in order."""
    keeps, start = [], 0
    for bucket in buckets:
        end = start + len(bucket.params)
        keeps.append(bucket_keep(bucket.params, masks[start:end], bucket.buffer))
        start = end
    return keeps


def values_wire_bytes(kept: list[int], n: int, value_bytes: int = 4) -> int:
    """What one rank sends per step: a ring all-reduce of kept_b values per bucket."""
    return sum(wire_bytes("ring_all_reduce", k * value_bytes, n) for k in kept)


@dataclass
class SparseCommWindow:
    """Sparse-aware DP figures since the last record: the gradient wire bytes sent, those the
    dense all-reduce of the same buckets would have sent, and the mask syncs' wire bytes."""

    wire: int = 0
    dense_wire: int = 0
    mask_sync_wire: int = 0

    def add(self, sent_bytes: int, dense_bytes: int, n: int) -> None:
        """One ring all-reduce of `sent_bytes` in place of one of `dense_bytes`."""
        self.add_wire(wire_bytes("ring_all_reduce", sent_bytes, n),
                      wire_bytes("ring_all_reduce", dense_bytes, n))

    def add_wire(self, wire: int, dense_wire: int) -> None:
        self.wire += wire
        self.dense_wire += dense_wire

    def take(self) -> dict:
        """{sparse_comm_wire_bytes, sparse_comm_ratio (dense / sent), mask_sync_wire_bytes};
        resets the window."""
        rec = {"sparse_comm_wire_bytes": self.wire,
               "sparse_comm_ratio": round(self.dense_wire / self.wire, 3) if self.wire else None,
               "mask_sync_wire_bytes": self.mask_sync_wire}
        self.__init__()
        return rec


__all__ = ["SparseCommWindow", "bucket_keep", "bucket_keeps", "check_masks", "values_wire_bytes"]
