"""Dynamic hybrid data x context parallelism, the planning part (ByteScale, arXiv 2502.21231):
a micro-batch's documents, dealt by `balance.deal`, as each pool rank's token positions
(whole sequences, or zig-zag chunks of a split one). Pure: document ids in, shares out.
Details: docs/sequence.md, "Dealing documents".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loomtrain.parallel.sequence.balance import Plan, deal, work_of


@dataclass(frozen=True)
class Segment:
    row: int
    start: int  # first position in the row
    end: int  # one past the last

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Share:
    """One rank's part of one sequence."""

    segment: int  # index into the micro-batch's segments
    positions: tuple[int, ...]  # my positions in the sequence (0 = its first token)
    members: tuple[int, ...]  # pool ranks sharing it, in ring order; (me,) when whole
    padded: int  # tokens every member holds after padding (= len(positions) when whole)


def segments(docs: torch.Tensor) -> list[Segment]:
    """The documents of each row of `docs` (rows, T), cut at the row edges, in row order."""
    out = []
    for row, ids in enumerate(docs.tolist()):
        start = 0
        for t in range(1, len(ids) + 1):
            if t == len(ids) or ids[t] != ids[t - 1]:
                out.append(Segment(row, start, t))
                start = t
    return out


def zigzag_split(length: int, members: int, member: int) -> list[int]:
    """Positions of `member` among `members` sharing a sequence of `length` tokens: chunks
    m and 2n-1-m of the 2n nearly equal chunks (sizes differ by at most one)."""
    cuts = [length * i // (2 * members) for i in range(2 * members + 1)]
    first, second = member, 2 * members - 1 - member
    return [*range(cuts[first], cuts[first + 1]), *range(cuts[second], cuts[second + 1])]


def plan_shares(docs: torch.Tensor, pool: int, attention: str = "softmax",
                tolerance: float = 0.02) -> tuple[list[Segment], list[list[Share]], Plan]:
    """(segments, each pool rank's shares in segment order, the dealing plan)."""
    segs = segments(docs)
    plan = deal([s.length for s in segs], pool, attention, tolerance)
    holders: dict[int, list[tuple[int, int]]] = {}  # segment -> [(part, rank)]
    for rank, pieces in enumerate(plan.ranks):
        for piece in pieces:
            holders.setdefault(piece.sequence, []).append((piece.part, rank))
    shares: list[list[Share]] = [[] for _ in range(pool)]
    for seg in sorted(holders):
        members = tuple(rank for _, rank in sorted(holders[seg]))
        n, length = len(members), segs[seg].length
        parts = [zigzag_split(length, n, m) for m in range(n)]
        padded = max(len(p) for p in parts)
        for member, rank in enumerate(members):
            shares[rank].append(Share(seg, tuple(parts[member]), members, padded))
    return segs, shares, plan


def dp_imbalance(docs: torch.Tensor, dp: int, attention: str = "softmax") -> float:
    """The work imbalance of plain data parallelism on the same rows (row r to rank r * dp //
    rows, whole), for the log's comparison: max / mean - 1."""
    rows = docs.shape[0]
    work = [0.0] * dp
    for seg in segments(docs):
        work[seg.row * dp // rows] += work_of(seg.length, attention)
    mean = sum(work) / dp
    return max(work) / mean - 1.0 if mean > 0 else 0.0
