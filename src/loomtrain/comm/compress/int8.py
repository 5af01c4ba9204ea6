"""int8 quantization with one fp32 scale per chunk of 64 values, exchanged by
`comm.quantized.quantized_all_reduce` (one all-gather, summed in rank order).

Error bound, wire bytes and the error-feedback default: docs/compression.md, "Reference: the
compressors".
"""

from __future__ import annotations

import torch

from loomtrain.comm.compress.base import Compressor, gather_wire_bytes
from loomtrain.comm.quantized import (
    CHUNK,
    dequantize_int8,
    quantize_int8,
    quantized_all_reduce,
)


class Int8(Compressor):
    name = "int8"

    def __init__(self, error_feedback: bool = False, chunk: int = CHUNK):
        super().__init__(error_feedback)
        self.chunk = chunk

    def _encode(self, key: str, x: torch.Tensor, shapes) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int8(x, self.chunk)

    def decompress(self, payload, like: torch.Tensor) -> torch.Tensor:
        q, scales = payload
        values = dequantize_int8(q, scales).view(-1)[:like.numel()]
        return values.to(like.dtype).view_as(like)

    def _send(self, x, payload, flat, mesh, axis: str):
        n = mesh.size(axis)
        # alone, quantized_all_reduce leaves its input exact: the sum must be the contribution
        # the residual was kept against, or EF would count the rounding twice
        flat.copy_(self.decompress(payload, flat) if n == 1 else x)
        pending = quantized_all_reduce(flat, mesh, axis, self.chunk, async_op=True)
        q, scales = payload
        sent = gather_wire_bytes(n * (q.numel() + scales.numel() * scales.element_size()), n)

        def finish() -> int:
            pending.wait()
            return sent
        return finish
