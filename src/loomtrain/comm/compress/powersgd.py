"""PowerSGD: rank-r compression by one step of power iteration with a warm start (Vogels,
Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", arXiv 1905.13727, Algorithm 1).

The algorithm, which tensors go uncompressed, wire bytes and what overlaps: docs/compression.md,
"Reference: the compressors".
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from loomtrain.comm.collectives import all_reduce
from loomtrain.comm.compress.base import (
    Compressor,
    Exchange,
    exchange_stats,
    ring_wire_bytes,
)


@dataclass(frozen=True)
class Layout:
    """Where a bucket's tensors lie in its flat buffer and how each is sent: `low_rank` as
    (offset, n, m) per compressed matrix, `dense` as (offset, numel) per tensor sent as is."""

    rank: int
    low_rank: tuple[tuple[int, int, int], ...]
    dense: tuple[tuple[int, int], ...]

    @property
    def q_numel(self) -> int:
        return sum(m * self.rank for _, _, m in self.low_rank)


def plan_layout(shapes, rank: int) -> Layout:
    """Which tensors of `shapes` (back to back) are compressed at rank `rank`; pure. A matrix
    is its rows by the rest of its values (a 4-D tensor: (d0, d1 d2 d3)), except a 3-D tensor,
    which is a stack of matrices (a mixture of experts' experts, (E, n, m)): each is factored
    on its own, as the same experts held as E separate weights would be, not one rank-r
    approximation across the experts."""
    low_rank, dense, offset = [], [], 0
    for shape in shapes:
        numel = math.prod(shape)
        stack, matrix = (shape[0], tuple(shape[1:])) if len(shape) == 3 else (1, tuple(shape))
        size = numel // stack if numel else 0
        n, m = (matrix[0], size // matrix[0]) if len(matrix) >= 2 and size else (0, 0)
        if len(matrix) >= 2 and (n + m) * rank < n * m:
            low_rank.extend((offset + e * size, n, m) for e in range(stack))
        else:
            dense.append((offset, numel))
        offset += numel
    return Layout(rank, tuple(low_rank), tuple(dense))


def warm_start(seed: int, key: str, numel: int, device=None) -> torch.Tensor:
    """The first Q of bucket `key`: standard normal, a pure function of (seed, key)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{key}".encode()))
    return torch.randn(numel, generator=generator).to(device)


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning those of p (n x r, r < n or full rank): the Q of a reduced
    QR; deterministic for a given input, so every rank gets the same bits from the same P."""
    return torch.linalg.qr(p, mode="reduced").Q


def _matrices(layout: Layout, x: torch.Tensor):
    flat = x.reshape(-1)
    return [flat[o:o + n * m].view(n, m) for o, n, m in layout.low_rank]


def _factors(layout: Layout, buffer: torch.Tensor, side: str) -> list[torch.Tensor]:
    """A batched buffer split into its matrices: side "p" (n x r each) or "q" (m x r each)."""
    rows = [n if side == "p" else m for _, n, m in layout.low_rank]
    parts = buffer.split([k * layout.rank for k in rows])
    return [part.view(k, layout.rank) for part, k in zip(parts, rows)]


def _flat(matrices, like: torch.Tensor) -> torch.Tensor:
    """The matrices flattened back to back (empty, of `like`'s dtype and device, if none)."""
    return torch.cat([t.reshape(-1) for t in matrices]) if matrices else like.new_zeros(0)


def project(layout: Layout, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The batched P buffer: M Q for every compressed matrix of `x`."""
    return _flat([mat @ qi for mat, qi in zip(_matrices(layout, x), _factors(layout, q, "q"))], x)


def orthonormalize_all(layout: Layout, p: torch.Tensor) -> torch.Tensor:
    return _flat([orthonormalize(pi) for pi in _factors(layout, p, "p")], p)


def back_project(layout: Layout, x: torch.Tensor, p_hat: torch.Tensor) -> torch.Tensor:
    """The batched Q buffer: M^T P^ for every compressed matrix of `x`."""
    pairs = zip(_matrices(layout, x), _factors(layout, p_hat, "p"))
    return _flat([mat.T @ pi for mat, pi in pairs], x)


def dense_values(layout: Layout, x: torch.Tensor) -> torch.Tensor:
    """The uncompressed tensors of `x`, concatenated (a new tensor)."""
    flat = x.reshape(-1)
    return torch.cat([flat[o:o + k] for o, k in layout.dense]) if layout.dense else flat[:0].clone()


@dataclass(frozen=True)
class PowerSGDPayload:
    layout: Layout
    p_hat: torch.Tensor  # batched orthonormal P^ (shared after the P all-reduce)
    q: torch.Tensor  # batched Q: this rank's Q_i, or the all-reduced sum
    dense: torch.Tensor  # the uncompressed tensors, concatenated


class PowerSGD(Compressor):
    """Rank-`rank` PowerSGD with warm start; EF on by default (as in the paper)."""

    name = "powersgd"
    slots = ("residual", "q")

    def __init__(self, rank: int, error_feedback: bool = True, seed: int = 0):
        super().__init__(error_feedback)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"powersgd rank={rank!r} must be an integer >= 1")
        self.rank, self.seed = rank, int(seed)

    def decompress(self, payload: PowerSGDPayload, like: torch.Tensor) -> torch.Tensor:
        layout, out = payload.layout, torch.empty_like(like).view(-1)
        for (o, k), part in zip(layout.dense, payload.dense.split([k for _, k in layout.dense])):
            out[o:o + k] = part
        pairs = zip(layout.low_rank, _factors(layout, payload.p_hat, "p"),
                    _factors(layout, payload.q, "q"))
        for (o, n, m), p_hat, q in pairs:
            out[o:o + n * m] = (p_hat @ q.T).view(-1)
        return out.view_as(like)

    def _q(self, key: str, layout: Layout, x: torch.Tensor) -> torch.Tensor:
        """The warm-start Q of bucket `key`: the last all-reduced Q, or the seeded first one."""
        q = self._state["q"].get(key)
        if q is None:
            return warm_start(self.seed, key, layout.q_numel, x.device)
        if q.numel() != layout.q_numel:
            raise ValueError(f"powersgd bucket {key!r} needs a warm-start Q of {layout.q_numel} "
                             f"values at rank {self.rank}, the state holds {q.numel()}: the "
                             f"buckets or the rank changed since the state was saved")
        return q.to(x.device)

    def compress(self, key, flat: torch.Tensor, shapes) -> PowerSGDPayload:
        """The payload over a group of one (P = M Q, Q = M^T P^); updates residual and Q."""
        key, layout = str(key), self._layout(shapes, flat)
        x = self._input(key, flat)
        p = project(layout, x, self._q(key, layout, x))
        p_hat, q, _ = self._contribution(key, layout, x, p)
        self._state["q"][key] = q
        return PowerSGDPayload(layout, p_hat, q, dense_values(layout, x))

    def _contribution(self, key: str, layout: Layout, x: torch.Tensor, p: torch.Tensor):
        """From the summed P: (P^, this rank's Q_i, local error); keeps the residual."""
        p_hat = orthonormalize_all(layout, p)
        q = back_project(layout, x, p_hat)
        mine = PowerSGDPayload(layout, p_hat, q, dense_values(layout, x))
        return p_hat, q, self._settle(key, x, self.decompress(mine, x))

    def start(self, key, flat: torch.Tensor, shapes, mesh, axis: str) -> Exchange:
        key, layout, n = str(key), self._layout(shapes, flat), mesh.size(axis)
        x = self._input(key, flat)
        p = project(layout, x, self._q(key, layout, x))
        dense = dense_values(layout, x)
        p_pending = all_reduce(p, mesh, axis, async_op=True) if p.numel() else None
        dense_pending = all_reduce(dense, mesh, axis, async_op=True) if dense.numel() else None

        def complete() -> dict:
            if p_pending is not None:
                p_pending.wait()
            p_hat, q, local_error = self._contribution(key, layout, x, p)
            if q.numel():
                all_reduce(q, mesh, axis)
            self._state["q"][key] = q
            if dense_pending is not None:
                dense_pending.wait()
            flat.copy_(self.decompress(PowerSGDPayload(layout, p_hat, q, dense), flat))
            sent = sum(ring_wire_bytes(t.numel() * t.element_size(), n) for t in (p, q, dense))
            return exchange_stats(flat, n, sent, local_error)
        return Exchange(complete)

    def _layout(self, shapes, flat: torch.Tensor) -> Layout:
        layout = plan_layout(shapes, self.rank)
        numel = sum(math.prod(shape) for shape in shapes)
        if numel != flat.numel():
            raise ValueError(f"powersgd: the shapes {list(shapes)} hold {numel} values, the "
                             f"bucket {flat.numel()}")
        return layout
