"""A simulated slow link between nodes, so geo-distributed training can be studied on one machine.

`parallel.ranks_per_node` makes the ranks of one machine pretend to be several nodes (mesh.py);
`SlowLink` makes the wire between those pretend nodes slow. The collectives of comm/ ask it how
long an op would take on that wire and do not report the op complete before then; model code
never sees it.

The model is the bandwidth-latency (alpha-beta) model of Hockney ("The communication challenge
for MPP: Intel Paragon and Meiko CS-2", Parallel Computing 20(3), 1994): an op that moves
w bytes takes alpha + w / beta. Here

    delay_s = inter_node_latency_ms / 1e3 + wire_bytes * 8 / (inter_node_gbps * 1e9)

for an op whose group spans more than one node, and 0 for a group inside one node (which costs
what it really costs on this machine). `wire_bytes` is what one rank sends under the op's
algorithm (comm/meter.py). Why the whole of it crosses the slow link:
a ring whose ranks span nodes has at least one inter-node hop, and a ring moves at the pace of
its slowest hop, each of its steps forwarding one chunk over every hop at once; so the op's
per-rank wire bytes take as long as if they all crossed the slow link. A binomial-tree broadcast
is paced by its root, which sends to one child per level: comm/ passes the root's bytes.

Limits, on purpose:
- alpha counts once per op, though a real ring pays it at each of its N-1 or 2(N-1) steps;
- `inter_node_gbps` is each rank's own link: the ranks of a node do not share it;
- the delay of an op is counted from the moment this rank starts it, so waiting for a late peer
  overlaps the delay instead of adding to it (a recv posted well before its send, as pipeline
  runtimes post them, hides its delay that way);
- the real op is hidden under the delay, not added to it: the real transfer stands for the
  link's own, so an op takes max(real time, delay);
- node-local ops are not slowed, and do not occupy the slow link.

Ops in flight on one rank share its link: their bytes cross it one op after the other, in the
order they were started (`due`), while each op's latency runs alongside the queue. Without this,
k buckets all-reduced asynchronously would cost one bucket's delay instead of k. Small ops (at
most SMALL_OP_BYTES on the wire: the trainer's control and loss all-reduces) do not queue: on a
real link their few packets interleave with a bulk transfer's instead of waiting for all of it,
so one costs its own delay from its start, and adds nothing to the queue. Without this a
low-communication method that keeps a model-sized sync in flight over the next steps would
see each step's 16-byte control all-reduce wait for the whole sync, and its overlap vanish.
"""

from __future__ import annotations

import threading

SMALL_OP_BYTES = 64 * 1024  # wire bytes up to which an op interleaves instead of queueing


class SlowLink:
    """The simulated inter-node wire of one rank: `gbps` Gbit/s (10^9 bits/s) and `latency_ms`
    per op, between nodes of `ranks_per_node` consecutive ranks."""

    def __init__(self, gbps: float, latency_ms: float, ranks_per_node: int):
        if not gbps > 0:
            raise ValueError(f"SlowLink gbps={gbps!r} must be > 0")
        if not latency_ms >= 0:
            raise ValueError(f"SlowLink latency_ms={latency_ms!r} must be >= 0")
        if ranks_per_node < 1:
            raise ValueError(f"SlowLink ranks_per_node={ranks_per_node!r} must be >= 1")
        self.gbps, self.latency_ms, self.ranks_per_node = gbps, latency_ms, ranks_per_node
        self._free_at = 0.0  # perf_counter time at which the bytes already queued have crossed
        self._lock = threading.Lock()

    def crosses_nodes(self, group_ranks) -> bool:
        return len({r // self.ranks_per_node for r in group_ranks}) > 1

    def transfer_s(self, wire_bytes: int) -> float:
        """Seconds for `wire_bytes` to cross the link, latency aside."""
        return wire_bytes * 8 / (self.gbps * 1e9)

    def delay_s(self, group_ranks, wire_bytes: int) -> float:
        """Simulated seconds of an op over `group_ranks` (global ranks) in which this rank sends
        `wire_bytes`: 0 inside one node, else latency + wire bytes / bandwidth. Pure."""
        if not self.crosses_nodes(group_ranks):
            return 0.0
        return self.latency_ms / 1e3 + self.transfer_s(wire_bytes)

    def due(self, start_s: float, group_ranks, wire_bytes: int) -> float | None:
        """The perf_counter time before which an op started at `start_s` is not complete, or
        None for a node-local op. Its bytes queue behind those of this rank's earlier ops still
        on the link; with an idle link, or for a small op, this is `start_s + delay_s(...)`."""
        if not self.crosses_nodes(group_ranks):
            return None
        if wire_bytes <= SMALL_OP_BYTES:
            return start_s + self.delay_s(group_ranks, wire_bytes)
        with self._lock:
            begin = max(start_s, self._free_at)
            self._free_at = begin + self.transfer_s(wire_bytes)
            return self._free_at + self.latency_ms / 1e3

    def describe(self) -> str:
        return (f"simulated inter-node link: {self.gbps:g} Gbit/s per rank, "
                f"{self.latency_ms:g} ms per op, nodes of {self.ranks_per_node} ranks")
