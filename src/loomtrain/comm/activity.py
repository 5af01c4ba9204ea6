"""This rank's place in its collectives, kept in memory: per mesh axis the number and name of
the last collective it entered, and the op it is blocked in, if any.

comm/collectives.py updates it on the training thread (a few assignments per op, no I/O); the
heartbeat thread (comm/heartbeat.py) publishes it to its peers, and, when this rank is stuck,
compares it with theirs. Sequence numbers count per axis: every rank of a group issues the same
collectives on it in the same order (the precondition of any collective), so "all_reduce #57
on dp" names one op instance on every member. Point-to-point ops are counted apart (their
two ends issue different ops) and never compared.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

P2P = ("send", "recv")


class Waiting(NamedTuple):
    """The op a rank is blocked in: its axis, name and sequence number, the ranks it waits
    for (the group; the other end of a send or receive) and since when (time.monotonic())."""

    axis: str
    op: str
    seq: int
    peers: list[int]
    since: float


@dataclass
class Activity:
    # axis (or "axis/send", "axis/recv") -> (sequence number, op) of the last op entered
    entered: dict[str, tuple[int, str]] = field(default_factory=dict)
    last: tuple[str, str, int] | None = None  # (axis, op, seq) of the last op entered on any axis
    waiting: Waiting | None = None
    # set by the heartbeat while it runs: why a failed op on an axis failed, when it knows
    # (a peer that stopped answering, died, or left with a message): `explain(axis)` -> the
    # cause's text and exit code, or None
    explain: Callable[[str], tuple[str, int] | None] | None = None

    def enter(self, axis: str, op: str) -> int:
        """Count an op this rank issues on `axis`; returns its sequence number there."""
        key = f"{axis}/{op}" if op in P2P else axis
        seq = self.entered.get(key, (0, ""))[0] + 1
        self.entered[key] = (seq, op)
        self.last = (axis, op, seq)
        return seq

    def block(self, axis: str, op: str, seq: int, peers: list[int]) -> None:
        self.waiting = Waiting(axis, op, seq, peers, time.monotonic())

    def unblock(self) -> None:
        self.waiting = None
