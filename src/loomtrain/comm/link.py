"""A simulated slow link between nodes, so geo-distributed training can be studied on one machine.

Hockney's alpha-beta model ("The communication challenge for MPP: Intel Paragon and Meiko
CS-2", Parallel Computing 20(3), 1994): an op across nodes takes latency + wire bytes /
bandwidth, queued behind this rank's earlier ops, at a bandwidth that may change mid-run. The
formula, the queue and the limits: docs/comm.md, "The simulated slow link".
"""

from __future__ import annotations

import bisect
import threading
import time

SMALL_OP_BYTES = 64 * 1024  # wire bytes up to which an op interleaves instead of queueing


class SlowLink:
    """The simulated inter-node wire of one rank: `gbps` Gbit/s (10^9 bits/s) and `latency_ms`
    per op, between nodes of `ranks_per_node` consecutive ranks; `changes`: (after_s, gbps)
    pairs, after_s strictly increasing and > 0, each setting the bandwidth from `after_s`
    seconds after the link was made (`made_at`, a perf_counter time)."""

    def __init__(self, gbps: float, latency_ms: float, ranks_per_node: int,
                 changes=(), made_at: float | None = None):
        if not gbps > 0:
            raise ValueError(f"SlowLink gbps={gbps!r} must be > 0")
        if not latency_ms >= 0:
            raise ValueError(f"SlowLink latency_ms={latency_ms!r} must be >= 0")
        if ranks_per_node < 1:
            raise ValueError(f"SlowLink ranks_per_node={ranks_per_node!r} must be >= 1")
        times = [after for after, _ in changes]
        if any(not after > 0 for after in times) or times != sorted(set(times)) \
                or any(not rate > 0 for _, rate in changes):
            raise ValueError(f"SlowLink changes={list(changes)!r}: each (after_s, gbps) needs "
                             "after_s > 0, strictly increasing, and gbps > 0")
        self.gbps, self.latency_ms, self.ranks_per_node = gbps, latency_ms, ranks_per_node
        self.changes = [(float(after), float(rate)) for after, rate in changes]
        self.made_at = time.perf_counter() if made_at is None else made_at
        # the schedule in perf_counter time: _rates[0] until _starts[0], _rates[i + 1] from
        # _starts[i] on
        self._starts = [self.made_at + after for after in times]
        self._rates = [gbps] + [rate for _, rate in self.changes]
        self._free_at = 0.0  # perf_counter time at which the bytes already queued have crossed
        self._lock = threading.Lock()

    def crosses_nodes(self, group_ranks) -> bool:
        return len({r // self.ranks_per_node for r in group_ranks}) > 1

    def gbps_at(self, t: float | None = None) -> float:
        """The bandwidth at perf_counter time `t` (None: now)."""
        t = time.perf_counter() if t is None else t
        return self._rates[bisect.bisect_right(self._starts, t)]

    def transfer_s(self, wire_bytes: int, at_s: float | None = None) -> float:
        """Seconds for `wire_bytes` starting to cross at perf_counter time `at_s` (None: now)
        to have crossed the link, latency aside, at the rates in force while they cross."""
        if not self.changes:
            return wire_bytes * 8 / (self.gbps * 1e9)
        start = time.perf_counter() if at_s is None else at_s
        t, bits = start, wire_bytes * 8.0
        i = bisect.bisect_right(self._starts, t)  # _rates[i] holds until _starts[i]
        while i < len(self._starts) and bits > (self._starts[i] - t) * self._rates[i] * 1e9:
            bits -= (self._starts[i] - t) * self._rates[i] * 1e9
            t, i = self._starts[i], i + 1
        return t + bits / (self._rates[i] * 1e9) - start

    def capacity_bytes(self, t0: float, t1: float) -> float:
        """Bytes the link can carry between perf_counter times t0 <= t1."""
        edges = [t0] + [s for s in self._starts if t0 < s < t1] + [t1]
        return sum((b - a) * self.gbps_at(a) * 1e9 / 8 for a, b in zip(edges, edges[1:]))

    def delay_s(self, group_ranks, wire_bytes: int, at_s: float | None = None) -> float:
        """Simulated seconds of an op over `group_ranks` (global ranks) in which this rank sends
        `wire_bytes`, started at perf_counter time `at_s` (None: now): 0 inside one node, else
        latency + wire bytes / bandwidth (the bandwidths in force while they cross). Pure for
        a link without changes."""
        if not self.crosses_nodes(group_ranks):
            return 0.0
        return self.latency_ms / 1e3 + self.transfer_s(wire_bytes, at_s)

    def due(self, start_s: float, group_ranks, wire_bytes: int) -> float | None:
        """The perf_counter time before which an op started at `start_s` is not complete, or
        None for a node-local op. Its bytes queue behind those of this rank's earlier ops still
        on the link; with an idle link, or for a small op, this is `start_s + delay_s(...)`."""
        if not self.crosses_nodes(group_ranks):
            return None
        if wire_bytes <= SMALL_OP_BYTES:
            return start_s + self.delay_s(group_ranks, wire_bytes, start_s)
        with self._lock:
            begin = max(start_s, self._free_at)
            self._free_at = begin + self.transfer_s(wire_bytes, begin)
            return self._free_at + self.latency_ms / 1e3

    def describe(self) -> str:
        changes = "".join(f", {rate:g} Gbit/s after {after:g} s" for after, rate in self.changes)
        return (f"simulated inter-node link: {self.gbps:g} Gbit/s per rank{changes}, "
                f"{self.latency_ms:g} ms per op, nodes of {self.ranks_per_node} ranks")
