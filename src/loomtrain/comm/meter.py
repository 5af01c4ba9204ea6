"""Byte accounting for every collective, per mesh axis and op (DESIGN.md principle 3).

Each op records its payload bytes, the wire bytes this rank sends under the algorithm that
ran, and, with a simulated slow link, its simulated seconds. The formulas and their check
against socket bytes: docs/comm.md, "Wire bytes".
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


def wire_bytes(algorithm: str, payload_bytes: int, n: int, *, from_root: int = 0) -> int:
    """Bytes one rank sends for `algorithm` over `n` ranks covering `payload_bytes`."""
    if n <= 1:
        return 0
    if algorithm == "ring_all_reduce":
        return 2 * (n - 1) * payload_bytes // n
    if algorithm in ("ring_all_gather", "ring_reduce_scatter", "all_to_all"):
        return (n - 1) * payload_bytes // n
    if algorithm == "send":
        return payload_bytes
    if algorithm == "tree_broadcast":  # from_root: (my index - root index) mod N
        children = 0
        k = from_root.bit_length()
        while from_root + (1 << k) < n:
            children, k = children + 1, k + 1
        return children * payload_bytes
    raise ValueError(f"unknown algorithm {algorithm!r}")


@dataclass
class OpCount:
    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0
    simulated_s: float = 0.0


@dataclass
class CommMeter:
    """Cumulative counts keyed by (axis, op); `take()` returns and resets a window of wire
    bytes, `take_simulated()` one of simulated link seconds."""

    counts: dict = field(default_factory=lambda: defaultdict(OpCount))
    window: dict = field(default_factory=lambda: defaultdict(OpCount))
    simulated_window: dict = field(default_factory=lambda: defaultdict(float))
    last_op: str = "none"
    # seconds this rank waited on the simulated link after the real op had completed (the
    # simulated time that no computation hid): cumulative, and a window for `take_link_wait`
    link_wait_s: float = 0.0
    link_wait_window: float = 0.0
    # wire bytes of the ops whose group spans several nodes of the simulated link (cumulative;
    # counted only when a link is simulated)
    inter_node_bytes: int = 0

    def record(self, axis: str, op: str, payload_bytes: int, wire: int,
               simulated_s: float = 0.0) -> None:
        for table in (self.counts, self.window):
            c = table[(axis, op)]
            c.calls += 1
            c.payload_bytes += payload_bytes
            c.wire_bytes += wire
        if simulated_s:
            self.record_simulated(axis, op, simulated_s)

    def record_simulated(self, axis: str, op: str, seconds: float) -> None:
        """Simulated link seconds alone, for an op that sends no bytes of its own (`recv`):
        its calls and bytes are not counted, and `take()` does not list it."""
        self.counts[(axis, op)].simulated_s += seconds
        self.simulated_window[(axis, op)] += seconds

    def record_link_wait(self, seconds: float) -> None:
        self.link_wait_s += seconds
        self.link_wait_window += seconds

    def take_link_wait(self) -> float:
        """Seconds waited on the simulated link since the last call."""
        out, self.link_wait_window = self.link_wait_window, 0.0
        return out

    def total(self, field_name: str = "wire_bytes", op: str | None = None,
              axis: str | None = None) -> int | float:
        return sum(
            getattr(c, field_name)
            for (a, o), c in self.counts.items()
            if (op is None or o == op) and (axis is None or a == axis)
        )

    def take(self) -> dict[str, int]:
        """Wire bytes per op since the last call, as {op: bytes} plus "total"."""
        out = _by_op((key, c.wire_bytes) for key, c in self.window.items())
        self.window.clear()
        return out

    def take_simulated(self) -> dict[str, float]:
        """Simulated link seconds per op since the last call, as {op: s} plus "total"."""
        out = _by_op(self.simulated_window.items())
        self.simulated_window.clear()
        return out


def _by_op(values) -> dict:
    """((axis, op), value) pairs summed per op, sorted by op, plus "total": the algorithm's
    traffic, without the diagnostic ops (named "..._diagnostic", listed on their own)."""
    by_op: dict = defaultdict(int)
    for (_axis, op), value in values:
        by_op[op] += value
    out = dict(sorted(by_op.items()))
    out["total"] = sum(v for op, v in by_op.items() if not op.endswith("_diagnostic"))
    return out
