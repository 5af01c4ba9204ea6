"""Adaptive communication load: each worker chooses how many gradients it averages into one push.

Keuper & Pfreundt (arXiv 1510.01155) let every ASGD worker adapt how often it communicates to
the load it measures on the network, so that the exchange follows changing bandwidths and
latencies instead of saturating them. Here the worker (worker.py) accumulates k gradients at
the parameters it pulled, on its next k batches, and pushes their mean: one message each way
per k gradients. This class is the worker's pure decision: it is fed one measurement per push
and returns the k of the next one; no process, clock or communication of its own.

Per push it sees the compute time per gradient c, the round trip r (the PUSH's send started ->
the next PARAMS received: the worker's own link, the server's queue and apply, the reply's
crossing; time the worker does not compute), the PUSH send alone s (its own link: one message
of b bytes, alpha + 8b / beta in the alpha-beta model of comm/link.py) and b. It keeps
exponentially weighted moving averages (weight `smoothing` on the newest) of c, r and s, the
latency alpha from the PULL (a header-only message: alpha and nothing else), and derives

    bandwidth  beta = 8b / (s - alpha)                         (the link, as this worker sees it)
    server_s        = max(0, r - 2s)                           (queueing and apply at the server:
                                                               the reply is as large as the push)
    comm_share(k)   = r / (k c + r)                            (the cycle's share not computing)

and chooses k so that comm_share(k) <= f (`comm_fraction`):

    needed(f) = ceil(r (1 - f) / (f c)),  clipped to [1, max_accumulation].

Why this keeps the server link below saturation: W workers at cycle k c + r send W PARAMS of
b bytes per cycle through the server's link, which carry them in W x 8b / beta <= W r / 2
seconds, so the link's utilisation is at most (W / 2) x comm_share; and once the link does
saturate, the reply queue behind it lengthens every worker's r, which raises their k until the
load falls again. With W workers a share f <= 2 / W bounds it below 1 even before queueing.

Hysteresis, so measurement noise does not flap k: k rises to needed(f) as soon as the share
at k exceeds f (saturation is the costly side), and falls only once k exceeds
needed(f / (1 + hysteresis)), to that value: lowering needs r to drop by about (1 + hysteresis)x
below what raised it, and after lowering the share is still at most f / (1 + hysteresis).

Not built: a compressed payload once even max_accumulation is not enough (the paper's other
knob, message size). A PUSH of varying size needs its size announced before the server posts
the receive (gloo matches a receive to a send of the same size); this controller would then
pick the payload from the estimated alpha and beta. See docs/async.md.
"""

from __future__ import annotations

import math


class AdaptiveAccumulation:
    """The accumulation length k of a worker's next push, from the exchange it measures.

    `observe(...)` after every round trip returns the new k (also `.accumulation`); the
    estimates are attributes (None until measured). Costs: O(1) per push."""

    def __init__(self, max_accumulation: int = 8, comm_fraction: float = 0.25, *,
                 smoothing: float = 0.3, hysteresis: float = 0.5):
        if max_accumulation < 1:
            raise ValueError(f"max_accumulation={max_accumulation} must be >= 1")
        if not 0.0 < comm_fraction < 1.0:
            raise ValueError(f"comm_fraction={comm_fraction} must be in (0, 1)")
        if not 0.0 < smoothing <= 1.0 or not hysteresis >= 0.0:
            raise ValueError(f"smoothing={smoothing} must be in (0, 1], "
                             f"hysteresis={hysteresis} >= 0")
        self.max_accumulation, self.comm_fraction = max_accumulation, comm_fraction
        self.smoothing, self.hysteresis = smoothing, hysteresis
        self.accumulation = 1  # k of the next push
        self.compute_s: float | None = None  # per gradient
        self.rtt_s: float | None = None
        self.send_s: float | None = None  # one PUSH across the worker's own link
        self.latency_s: float | None = None  # alpha, from the header-only PULL
        self.message_bytes = 0

    def observe_latency(self, seconds: float) -> None:
        """The send time of a header-only message (the PULL): the link's latency alpha."""
        self.latency_s = seconds

    def observe(self, compute_s: float, send_s: float, rtt_s: float, message_bytes: int) -> int:
        """One push's measurements: compute seconds per gradient, the PUSH's send seconds, the
        round trip (send started -> reply received) and the PUSH's bytes; returns the next k."""
        self.compute_s = self._smooth(self.compute_s, compute_s)
        self.send_s = self._smooth(self.send_s, send_s)
        self.rtt_s = self._smooth(self.rtt_s, rtt_s)
        self.message_bytes = message_bytes
        k, f = self.accumulation, self.comm_fraction
        if self.comm_share(k) > f:
            self.accumulation = max(k, self.needed(f))
        elif k > (lower := self.needed(f / (1.0 + self.hysteresis))):
            self.accumulation = lower
        return self.accumulation

    def needed(self, fraction: float) -> int:
        """The smallest k in [1, max_accumulation] with comm_share(k) <= fraction (the largest
        if none is)."""
        c = max(self.compute_s or 0.0, 1e-9)
        k = math.ceil((self.rtt_s or 0.0) * (1.0 - fraction) / (fraction * c) - 1e-9)
        return min(self.max_accumulation, max(1, k))

    def comm_share(self, k: int) -> float:
        """r / (k c + r): the share of a cycle of k gradients and one round trip spent not
        computing, at the current estimates."""
        r = self.rtt_s or 0.0
        return r / (k * (self.compute_s or 0.0) + r) if r > 0 else 0.0

    @property
    def server_s(self) -> float | None:
        """The round trip less both messages' own crossings: the server's queue and apply."""
        if self.rtt_s is None:
            return None
        return max(0.0, self.rtt_s - 2.0 * self.send_s)

    @property
    def link_gbps(self) -> float | None:
        """beta = 8b / (s - alpha) in Gbit/s; None until measured, or when the send took no
        longer than the latency (a link too fast to tell)."""
        if self.send_s is None:
            return None
        transfer = self.send_s - (self.latency_s or 0.0)
        return self.message_bytes * 8 / transfer / 1e9 if transfer > 0 else None

    def _smooth(self, average: float | None, sample: float) -> float:
        return sample if average is None else average + self.smoothing * (sample - average)
