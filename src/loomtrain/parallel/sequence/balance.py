"""Dynamic hybrid data x context parallelism, the dealing part (the ByteScale idea, arXiv
2502.21231): each sequence goes whole to one rank or, if heavier than a rank's fair share, is
split across several, so that attention work is even. Pure: lengths in, a plan out. The rule:
docs/sequence.md, "Dealing documents".
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    sequence: int  # index into the lengths given
    part: int  # which of `parts` pieces (0 when whole)
    parts: int  # ranks the sequence is split over (1: whole)
    work: float


@dataclass(frozen=True)
class Plan:
    ranks: tuple[tuple[Piece, ...], ...]  # each rank's pieces
    work: tuple[float, ...]  # each rank's total work

    @property
    def imbalance(self) -> float:
        """max / mean - 1 of the ranks' work (0: perfectly even)."""
        mean = sum(self.work) / len(self.work)
        return max(self.work) / mean - 1.0 if mean > 0 else 0.0


def work_of(length: int, attention: str) -> float:
    if attention == "softmax":
        return float(length) ** 2
    if attention == "linear":
        return float(length)
    raise ValueError(f"attention must be 'softmax' or 'linear', got {attention!r}")


def deal(lengths: list[int], ranks: int, attention: str = "softmax",
         tolerance: float = 0.02) -> Plan:
    """Every sequence of `lengths` to one rank or, split in equal-work pieces, to several, so
    that the ranks' attention work is even. Deterministic (ties go to the lower rank)."""
    if ranks < 1:
        raise ValueError(f"need at least one rank, got {ranks}")
    if any(n < 1 for n in lengths):
        raise ValueError("every sequence needs a length of at least 1")
    works = [work_of(n, attention) for n in lengths]
    share = sum(works) / ranks if works else 0.0
    splits = [min(ranks, max(1, math.ceil(w / share - 1e-9))) if share else 1 for w in works]
    best = _deal(works, splits, ranks)
    plan = best
    for _ in range(4 * len(works)):
        if plan.imbalance <= tolerance:
            break
        busiest = max(range(ranks), key=lambda r: (plan.work[r], -r))
        splittable = [p for p in plan.ranks[busiest] if splits[p.sequence] < ranks]
        if not splittable:
            break  # everything there is split over every rank already
        heaviest = max(splittable, key=lambda p: (p.work, -p.sequence))
        splits[heaviest.sequence] += 1
        plan = _deal(works, splits, ranks)
        if plan.imbalance < best.imbalance:
            best = plan
    return best


def _deal(works: list[float], splits: list[int], ranks: int) -> Plan:
    """Longest-processing-time dealing of the pieces (sequence i in splits[i] pieces)."""
    pieces = [Piece(i, p, k, w / k) for i, (w, k) in enumerate(zip(works, splits)) for p in range(k)]
    pieces.sort(key=lambda p: (-p.work, p.sequence, p.part))
    load = [(0.0, r) for r in range(ranks)]  # a heap of (work, rank)
    assigned: list[list[Piece]] = [[] for _ in range(ranks)]
    i = 0
    while i < len(pieces):
        group = pieces[i:i + pieces[i].parts]  # one sequence's pieces: the same work, adjacent
        taken = [heapq.heappop(load) for _ in group]  # the least-loaded, distinct ranks
        for piece, (w, r) in zip(group, taken):
            assigned[r].append(piece)
            heapq.heappush(load, (w + piece.work, r))
        i += len(group)
    totals = tuple(sum(p.work for p in rank) for rank in assigned)
    return Plan(tuple(map(tuple, assigned)), totals)
