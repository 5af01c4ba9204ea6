"""Adaptive communication load: each worker chooses how many gradients it averages into one push.

Keuper & Pfreundt (arXiv 1510.01155): every ASGD worker adapts how often it communicates to the
load it measures on the network. This class is the worker's pure decision, one measurement per
push in, the next k out. Its estimates, the rule, why it keeps the server's link below
saturation, the hysteresis and what is not built: docs/async.md, "Adaptive communication load".
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
