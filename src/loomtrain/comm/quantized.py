"""An all-reduce that sends int8 values with one fp32 scale per chunk, for decoding.

The int8 communication of ZeRO++'s qgZ (Wang et al., arXiv 2306.10209) and of EQuARX (arXiv
2506.17615) in its one-collective form: one all-gather, then every rank adds the N dequantized
contributions in rank order. Error bound and wire bytes: docs/generate.md, "Cutting the
communication of tensor-parallel decoding".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loomtrain.comm.collectives import Pending, all_gather

CHUNK = 64


def quantize_int8(x: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values as (chunks, chunk), fp32 scales (chunks,)) of `x` flattened, zero-padded
    to whole chunks."""
    flat = x.reshape(-1).float()
    if flat.numel() % chunk:
        flat = F.pad(flat, (0, (-flat.numel()) % chunk))
    blocks = flat.view(-1, chunk)
    scales = blocks.abs().amax(dim=1) / 127.0
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero chunk
    q = torch.round(blocks / divisor[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales[..., None]


class PendingQuantized:
    """The all-gather in flight; `wait()` completes it and writes the sum into the tensor."""

    def __init__(self, pending: Pending | None, finish):
        self._pending, self._finish = pending, finish

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        if self._finish is not None:
            self._finish()
            self._finish = None


def quantized_all_reduce(tensor: torch.Tensor, mesh, axis: str, chunk: int = CHUNK,
                         async_op: bool = False):
    """In-place sum of `tensor` over `axis` through int8 with per-chunk scales (one
    all-gather, metered as such). The same on every rank, bit for bit; within the bound
    above of the exact sum. On a group of one rank it returns at once, exact."""
    n = mesh.size(axis)
    if n == 1:
        return PendingQuantized(None, None) if async_op else None
    q, scales = quantize_int8(tensor, chunk)
    values = q.numel()
    payload = torch.cat([q.view(-1), scales.view(torch.int8)])
    gathered = torch.empty(n * payload.numel(), dtype=torch.int8, device=tensor.device)
    pending = all_gather(gathered, payload, mesh, axis, async_op=True)

    def finish() -> None:
        parts = gathered.view(n, -1)
        qs = parts[:, :values].view(n, -1, chunk)
        ss = parts[:, values:].contiguous().view(torch.float32).view(n, -1)
        contributions = dequantize_int8(qs, ss).view(n, -1)
        total = contributions[0].clone()
        for r in range(1, n):  # fixed order: every rank adds the same numbers the same way
            total += contributions[r]
        tensor.copy_(total[:tensor.numel()].view(tensor.shape))

    done = PendingQuantized(pending, finish)
    if async_op:
        return done
    done.wait()
    return None


def quantized_wire_ratio(n: int, chunk: int = CHUNK) -> float:
    """Wire bytes of `quantized_all_reduce` over the ring all-reduce's, fp32, whole chunks."""
    return n * (1 + 4 / chunk) / 8


__all__ = ["CHUNK", "PendingQuantized", "dequantize_int8", "quantize_int8",
           "quantized_all_reduce", "quantized_wire_ratio"]
