"""Sparse-aware data parallel: with fixed masks, only the kept gradient entries travel.

A model trained with sparsity masks (sparsity/) has gradients that are zero, or discarded,
wherever a mask is False; the dense all-reduce sends them anyway. With
`DataParallel.set_gradient_masks(masks)` each bucket whose parameters carry a mask instead
all-reduces a compact buffer: its masked parameters' gradient values at the kept positions
and its unmasked parameters' whole gradients, in bucket order (`bucket_keep`, one bool per
bucket element). The hook launches it where the dense all-reduce would have been, so it
overlaps backward the same way; the end of backward scatters the reduced values back and
sets every masked-out entry to zero. Indices travel once per mask change, not per step:
`set_gradient_masks` broadcasts the axis member 0's masks, packed (comm/mask_sync.py), and
every rank uses those, so ranks that computed their masks separately still agree.

Bytes per rank, N ranks, fp32 (b_v = 4), kept_b the entries bucket b keeps, nnz = their sum
(the kept entries of the masked parameters plus every entry of the unmasked ones):
- per step: one ring all-reduce per bucket of its compact buffer, 2(N-1)/N x 4 x kept_b
  (floored per bucket, `values_wire_bytes`), about 2(N-1)/N x 4 x nnz: the dense all-reduce's
  bytes times the density nnz / numel;
- per mask change: the mask sync of comm/mask_sync.py, from member 0 ceil(log2 N) x S with
  S = 16 P + sum over masked parameters of min(4 nnz_p, ceil(numel_p / 8)).

The result equals dense data parallel followed by masking the reduced gradient: every kept
entry is the same sum of the same N values. On 2 ranks it is the same bits (a + b is
commutative in IEEE arithmetic); on more, gloo's ring adds an entry's N values starting at
the rank its chunk of the buffer begins with, and the compact buffer's chunks cut elsewhere
than the dense buffer's, so an entry's sum may be rounded in another order (differences of
an ulp or so; tests/test_sparse_dp.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from loomtrain.comm.meter import wire_bytes


def check_masks(masks: dict | None, params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    """The masks aligned with `params` (None where unmasked). ValueError for a mask whose key
    is not one of the engine's parameters, or that is not a bool tensor of its parameter's
    shape."""
    if not masks:
        return [None] * len(params)
    known = {p: i for i, p in enumerate(params)}
    aligned: list[torch.Tensor | None] = [None] * len(params)
    for p, mask in masks.items():
        if p not in known:
            raise ValueError(f"set_gradient_masks: a mask for a parameter of shape "
                             f"{tuple(p.shape)} that this DataParallel does not reduce (not "
                             f"in its module, or requires_grad=False)")
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool \
                or mask.shape != p.shape:
            got = (f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor)
                   else type(mask).__name__)
            raise ValueError(f"set_gradient_masks: the mask of a parameter of shape "
                             f"{tuple(p.shape)} must be a bool tensor of that shape, got {got}")
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
        self.wire += wire_bytes("ring_all_reduce", sent_bytes, n)
        self.dense_wire += wire_bytes("ring_all_reduce", dense_bytes, n)

    def take(self) -> dict:
        """{sparse_comm_wire_bytes, sparse_comm_ratio (dense / sent), mask_sync_wire_bytes};
        resets the window."""
        rec = {"sparse_comm_wire_bytes": self.wire,
               "sparse_comm_ratio": round(self.dense_wire / self.wire, 3) if self.wire else None,
               "mask_sync_wire_bytes": self.mask_sync_wire}
        self.__init__()
        return rec


__all__ = ["SparseCommWindow", "bucket_keep", "bucket_keeps", "check_masks", "values_wire_bytes"]
