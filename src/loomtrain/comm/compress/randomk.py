"""Random-k sparsification (Stich et al., arXiv 1809.07599; Wangni et al., "Gradient
Sparsification for Communication-Efficient Distributed Optimization", arXiv 1710.09854).

Every rank keeps the same k positions, drawn from a shared seed, so only their values travel,
in one dense all-reduce. Scaling without error feedback and the cost of the draw:
docs/compression.md, "Reference: the compressors".
"""

from __future__ import annotations

import zlib

import torch

from loomtrain.comm.collectives import all_reduce
from loomtrain.comm.compress.base import (
    Compressor,
    SparsePayload,
    check_ratio,
    densify,
    kept,
    ring_wire_bytes,
)


def random_k_indices(numel: int, k: int, seed: int, key: str, call: int) -> torch.Tensor:
    """k distinct sorted indices in [0, numel), a pure function of (seed, key, call) (CPU)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{key}/{call}".encode()))
    return torch.randperm(numel, generator=generator)[:k].sort().values


class RandomK(Compressor):
    """Random-k with indices shared by seed; EF on by default."""

    name = "randomk"
    slots = ("residual", "calls")

    def __init__(self, ratio: float, error_feedback: bool = True, seed: int = 0):
        super().__init__(error_feedback)
        self.ratio, self.seed = check_ratio(self.name, ratio), int(seed)

    def _next_call(self, key: str) -> int:
        """This key's call counter before the call; advances it."""
        calls = int(self._state["calls"].get(key, torch.zeros((), dtype=torch.int64)))
        self._state["calls"][key] = torch.tensor(calls + 1)
        return calls

    def _encode(self, key: str, x: torch.Tensor, shapes) -> SparsePayload:
        flat = x.reshape(-1)
        k = kept(self.ratio, flat.numel())
        indices = random_k_indices(flat.numel(), k, self.seed, key, self._next_call(key))
        indices = indices.to(flat.device)
        values = flat[indices]
        if not self.error_feedback:
            values = values * (flat.numel() / k)
        return SparsePayload(indices, values)

    def decompress(self, payload: SparsePayload, like: torch.Tensor) -> torch.Tensor:
        return densify(payload, like)

    def _send(self, x, payload: SparsePayload, flat, mesh, axis: str):
        summed = payload.values.clone()
        pending = all_reduce(summed, mesh, axis, async_op=True)

        def finish() -> int:
            pending.wait()
            flat.view(-1).copy_(densify(SparsePayload(payload.indices, summed), flat.view(-1)))
            return ring_wire_bytes(summed.numel() * summed.element_size(), mesh.size(axis))
        return finish
