"""Mask synchronization: the axis member 0's sparsity masks to every rank, packed.

Sparse-aware data parallel (parallel/sparse_dp.py) needs the same masks on every rank:
`broadcast_masks` sends member 0's, each as indices or a bitmap, whichever is smaller, in two
broadcasts counted as op "mask_sync". Formats and bytes: docs/sparsity.md, "Sparse-aware
data parallel".
"""

from __future__ import annotations

import math

import torch

from loomtrain.comm.collectives import broadcast
from loomtrain.comm.meter import wire_bytes
from loomtrain.comm.sparse_plan import (
    best_format,
    index_wire_dtype,
    pack_bits,
    true_positions,
    unpack_bits,
)

MASK_FORMATS = ("none", "indices", "bitmap")  # header codes 0, 1, 2
_PLAN_FORMAT = {"pairs": "indices", "bitmap": "bitmap"}  # sparse_plan's names for them


def mask_format(nnz: int, numel: int) -> str:
    """"indices" or "bitmap", whichever packs a mask of `nnz` kept entries in fewer bytes."""
    index_bytes = index_wire_dtype(numel).itemsize
    return _PLAN_FORMAT[best_format(nnz, numel, index_bytes, 0, ("pairs", "bitmap"))]


def mask_bytes(nnz: int, numel: int) -> int:
    """The packed bytes of a mask: min(b_i nnz, ceil(numel / 8))."""
    if mask_format(nnz, numel) == "indices":
        return nnz * index_wire_dtype(numel).itemsize
    return math.ceil(numel / 8)


def mask_sync_payload_bytes(masked: list[tuple[int, int] | None]) -> int:
    """S, the bytes one sync covers (header and packed masks): `masked` holds (nnz, numel)
    per slot, None for an unmasked one."""
    return 16 * len(masked) + sum(mask_bytes(*m) for m in masked if m is not None)


def pack_mask(mask: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(format, uint8 bytes) of a bool mask, flattened in memory order."""
    flat = mask.contiguous().view(-1)
    numel = flat.numel()
    fmt = mask_format(int(flat.count_nonzero()), numel)
    if fmt == "indices":
        return fmt, true_positions(flat).to(index_wire_dtype(numel)).view(torch.uint8)
    return fmt, pack_bits(flat)


def unpack_mask(fmt: str, packed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The bool mask shaped like `like` (on its device) that `pack_mask` packed."""
    numel = like.numel()
    if fmt == "bitmap":
        return unpack_bits(packed, numel).view(like.shape).to(like.device)
    positions = packed.clone().view(index_wire_dtype(numel))  # the clone aligns the bytes
    mask = torch.zeros(numel, dtype=torch.bool, device=like.device)
    mask[positions.long().to(like.device)] = True
    return mask.view(like.shape)


def broadcast_masks(masks: list[torch.Tensor | None], likes: list[torch.Tensor], mesh,
                    axis: str) -> tuple[list[torch.Tensor | None], int]:
    """(member 0's masks, this rank's wire bytes): slot i is None (unmasked) or a bool tensor
    shaped like `likes[i]`, as member 0 gave it. Collective: every member calls it with the
    same `likes`; only member 0's `masks` are read. On member 0 the masks returned are its
    own tensors (made contiguous)."""
    n, me = mesh.size(axis), mesh.local_rank(axis)
    if n == 1:
        return [None if m is None else m.contiguous() for m in masks], 0
    header = torch.zeros(len(likes), 2, dtype=torch.int64)
    packed: list[torch.Tensor] = []
    if me == 0:
        for i, mask in enumerate(masks):
            if mask is not None:
                fmt, data = pack_mask(mask)
                header[i] = torch.tensor([MASK_FORMATS.index(fmt), data.numel()])
                packed.append(data.cpu())
    header = header.to(mesh.device)
    broadcast(header, mesh, axis, name="mask_sync")
    header = header.cpu()
    total = int(header[:, 1].sum())
    if total:
        payload = torch.cat(packed) if me == 0 else torch.empty(total, dtype=torch.uint8)
        payload = payload.to(mesh.device)
        broadcast(payload, mesh, axis, name="mask_sync")
        payload = payload.cpu()
    sent = sum(wire_bytes("tree_broadcast", nbytes, n, from_root=me)
               for nbytes in (header.numel() * 8, total) if nbytes)
    if me == 0:
        return [None if m is None else m.contiguous() for m in masks], sent
    out, offset = [], 0
    for (code, nbytes), like in zip(header.tolist(), likes):
        fmt = MASK_FORMATS[code]
        out.append(None if fmt == "none" else unpack_mask(fmt, payload[offset:offset + nbytes], like))
        offset += nbytes
    return out, sent


__all__ = ["MASK_FORMATS", "broadcast_masks", "mask_bytes", "mask_format",
           "mask_sync_payload_bytes", "pack_mask", "unpack_mask"]
