"""1-bit compression: the sign of each value and one scale per chunk (signSGD with error
feedback, Karimireddy et al., arXiv 1901.09847; 1-bit Adam, Tang et al., arXiv 2102.02888).

The scale, the packing and the wire bytes: docs/compression.md, "Reference: the compressors".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loomtrain.comm.collectives import all_gather
from loomtrain.comm.compress.base import Compressor, gather_wire_bytes

CHUNK = 256
_BIT_WEIGHTS = [128, 64, 32, 16, 8, 4, 2, 1]


def pack_signs(x: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed sign bits, uint8 (ceil(numel / chunk) x chunk / 8,); fp32 scales, the mean |x|
    over each chunk's real values (padding excluded)) of `x` flattened. Bit 1: x >= 0."""
    flat = x.reshape(-1).float()
    numel = flat.numel()
    padded = F.pad(flat, (0, (-numel) % chunk))
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.int32, device=flat.device)
    bits = (padded >= 0).to(torch.int32).view(-1, 8)
    packed = (bits * weights).sum(1).to(torch.uint8)
    sums = padded.abs().view(-1, chunk).sum(1)
    counts = torch.full_like(sums, chunk)
    counts[-1] = numel - (sums.numel() - 1) * chunk
    return packed, sums / counts


def unpack_signs(packed: torch.Tensor, scales: torch.Tensor, numel: int,
                 chunk: int = CHUNK) -> torch.Tensor:
    """The fp32 values scale x (+1 or -1) of the first `numel` positions."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    bits = (packed[:, None] >> shifts) & 1
    signs = bits.view(-1).float() * 2 - 1
    return (signs.view(-1, chunk) * scales[:, None]).view(-1)[:numel]


class Sign(Compressor):
    name = "sign"

    def __init__(self, error_feedback: bool = True, chunk: int = CHUNK):
        super().__init__(error_feedback)
        if chunk < 8 or chunk % 8:
            raise ValueError(f"sign compression chunk={chunk} must be a positive multiple of 8")
        self.chunk = chunk

    def _encode(self, key: str, x: torch.Tensor, shapes) -> tuple[torch.Tensor, torch.Tensor]:
        return pack_signs(x, self.chunk)

    def decompress(self, payload, like: torch.Tensor) -> torch.Tensor:
        packed, scales = payload
        values = unpack_signs(packed, scales, like.numel(), self.chunk)
        return values.to(like.dtype).view_as(like)

    def _send(self, x, payload, flat, mesh, axis: str):
        packed, scales = payload
        mine = torch.cat([packed, scales.view(torch.uint8)])
        n = mesh.size(axis)
        gathered = torch.empty(n * mine.numel(), dtype=torch.uint8, device=flat.device)
        pending = all_gather(gathered, mine, mesh, axis, async_op=True)

        def finish() -> int:
            pending.wait()
            total = torch.zeros_like(flat)
            for part in gathered.view(n, -1):  # rank order: the same additions everywhere
                # the clone aligns the scale bytes for the fp32 view
                scales_r = part[packed.numel():].clone().view(torch.float32)
                total += self.decompress((part[:packed.numel()], scales_r), flat)
            flat.copy_(total)
            return gather_wire_bytes(gathered.numel(), n)
        return finish
