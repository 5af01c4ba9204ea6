"""Top-k sparsification with error feedback (Stich et al., "Sparsified SGD with Memory",
arXiv 1809.07599; Lin et al., "Deep Gradient Compression", arXiv 1712.01887).

Each rank sends its k largest |g + e| with their indices, summed by the sparse all-reduce
(comm/sparse.py). Wire bytes and ratios: docs/compression.md, "Reference: the compressors".
"""

from __future__ import annotations

import torch

from loomtrain.comm.compress.base import (
    Compressor,
    SparsePayload,
    check_ratio,
    densify,
    kept,
)
from loomtrain.comm.sparse import SCHEMES, sparse_all_reduce


def top_k_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """The sorted indices of the k largest |x| (x 1-D); of values tied at the k-th magnitude,
    those with the lowest indices, so the choice is deterministic (`torch.topk`'s is not)."""
    magnitude = x.abs()
    threshold = torch.topk(magnitude, k, sorted=False).values.min()
    above = (magnitude > threshold).nonzero().view(-1)
    tied = (magnitude == threshold).nonzero().view(-1)[:k - above.numel()]
    return torch.cat([above, tied]).sort().values


class TopK(Compressor):
    """Top-k of x = g + e; EF on by default (without it, the dropped values are lost)."""

    name = "topk"

    def __init__(self, ratio: float, error_feedback: bool = True, scheme: str = "auto"):
        super().__init__(error_feedback)
        if scheme not in SCHEMES:
            raise ValueError(f"top-k sparse exchange scheme={scheme!r} is not one of {SCHEMES}")
        self.ratio, self.scheme = check_ratio(self.name, ratio), scheme

    def _encode(self, key: str, x: torch.Tensor, shapes) -> SparsePayload:
        flat = x.reshape(-1)
        indices = top_k_indices(flat, kept(self.ratio, flat.numel()))
        return SparsePayload(indices, flat[indices])

    def decompress(self, payload: SparsePayload, like: torch.Tensor) -> torch.Tensor:
        return densify(payload, like)

    def _send(self, x, payload: SparsePayload, flat, mesh, axis: str):
        pending = sparse_all_reduce(payload.indices, payload.values, flat.view(-1), mesh, axis,
                                    scheme=self.scheme, async_op=True)
        return lambda: pending.wait().wire_bytes
