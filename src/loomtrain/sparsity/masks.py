"""Sparsity masks as pure functions of shapes, weights and seeds (no state, no processes): layer
densities (uniform, ERK), random and magnitude masks, N:M, the cubic pruning schedule, packing.

ERK: Evci et al., arXiv 1911.11134, Appendix; N:M: Mishra et al., arXiv 2104.08378; the cubic
schedule: Zhu & Gupta, arXiv 1710.01878, eq. 1. Formulas and tie-breaking: docs/sparsity.md,
"What is sparse" and "Methods".
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def uniform_densities(shapes: Sequence[Sequence[int]], density: float) -> list[float]:
    return [float(density)] * len(shapes)


def erk_densities(shapes: Sequence[Sequence[int]], density: float) -> list[float]:
    """ERK densities (above), one per shape; their size-weighted mean is `density` up to the
    layers made dense."""
    assert 0.0 < density <= 1.0, density
    numel = [math.prod(s) for s in shapes]
    raw = [sum(s) / n for s, n in zip(shapes, numel)]
    dense: set[int] = set()
    while True:
        budget = sum(density * n if i not in dense else -(1 - density) * n
                     for i, n in enumerate(numel))
        divisor = sum(raw[i] * numel[i] for i in range(len(shapes)) if i not in dense)
        if divisor == 0:  # every layer dense (density 1)
            return [1.0] * len(shapes)
        eps = budget / divisor
        peak = max(raw[i] for i in range(len(shapes)) if i not in dense)
        if peak * eps <= 1.0:
            return [1.0 if i in dense else eps * raw[i] for i in range(len(shapes))]
        dense |= {i for i in range(len(shapes)) if i not in dense and raw[i] == peak}


def active_count(numel: int, density: float) -> int:
    """The weights a layer of `numel` keeps at `density`: round(density x numel), at least 1."""
    return min(numel, max(1, round(density * numel)))


def ranked(score: torch.Tensor, k: int, largest: bool) -> torch.Tensor:
    """Flat indices of the k largest (or smallest) entries of `score`; ties to the lower index."""
    order = torch.sort(score.flatten(), descending=largest, stable=True).indices
    return order[:k]


def _from_indices(shape, indices: torch.Tensor, device) -> torch.Tensor:
    mask = torch.zeros(math.prod(shape), dtype=torch.bool, device=device)
    mask[indices] = True
    return mask.view(shape)


def random_mask(shape: Sequence[int], count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` positions chosen uniformly at random (a random permutation's first `count`),
    on the generator's device."""
    n = math.prod(shape)
    chosen = torch.randperm(n, generator=generator, device=generator.device)[:count]
    return _from_indices(tuple(shape), chosen, generator.device)


def magnitude_mask(weight: torch.Tensor, count: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The `count` largest |weight| among the `allowed` positions (default: all). With the
    current mask as `allowed`, a mask that only shrinks (gradual pruning)."""
    score = weight.detach().abs().float()
    if allowed is not None:
        assert count <= int(allowed.sum()), (count, int(allowed.sum()))
        score = score.masked_fill(~allowed, -1.0)  # below every magnitude
    return _from_indices(weight.shape, ranked(score, count, largest=True), weight.device)


def nm_mask(weight: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """N:M: per row, the n largest |w| of each group of m consecutive inputs (ties to the
    lower index). `weight` is (n_out, n_in) with n_in divisible by m."""
    assert weight.dim() == 2 and weight.shape[1] % m == 0 and 0 < n <= m, (weight.shape, n, m)
    groups = weight.detach().abs().float().reshape(-1, m)
    order = torch.sort(groups, dim=1, descending=True, stable=True).indices[:, :n]
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, order, True)
    return mask.view(weight.shape)


def nm_group_counts(mask: torch.Tensor, m: int) -> torch.Tensor:
    """The kept weights in each group of m consecutive inputs of every row (N:M checks)."""
    return mask.reshape(-1, m).sum(dim=1)


def cubic_density(t: int, final: float, start: int, end: int) -> float:
    """Zhu & Gupta's cubic schedule (above) at step t: 1 up to `start`, `final` from `end`."""
    progress = min(1.0, max(0.0, (t - start) / (end - start)))
    return final + (1.0 - final) * (1.0 - progress) ** 3


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as uint8 bits, 8 per byte, first element in the lowest bit (padded with
    zeros): 1/32 of an fp32 weight's bytes in a checkpoint."""
    flat = mask.flatten().to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % 8)).view(-1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (flat * weights).sum(dim=1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """`pack_mask` undone into a bool tensor of `shape`."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.to(torch.uint8)[:, None] >> shifts) & 1
    return bits.flatten()[:math.prod(shape)].view(tuple(shape)).bool()
