"""A measured timeline of one training step: spans of compute and communication on lanes.

Engines record what they do (`begin`/`end` around compute, `track` for an asynchronous
collective: from the moment it is issued to the moment it completes, reported by the comm
layer's completion callback on whatever thread finishes it). The trainer writes one step's
spans to RUN_DIR/timeline.json and `loom report` draws them (report.py), so overlap of
communication with compute can be seen rather than assumed.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path


class Timeline:
    def __init__(self):
        self.origin = time.perf_counter()
        self.spans: list[dict] = []
        self._lock = threading.Lock()  # completion callbacks arrive on communication threads
        self._open: dict[tuple[str, str], float] = {}

    def span(self, lane: str, name: str, start: float, end: float) -> None:
        with self._lock:
            self.spans.append({"lane": lane, "name": name, "start_s": start - self.origin,
                               "end_s": end - self.origin})

    def begin(self, lane: str, name: str) -> None:
        self._open[(lane, name)] = time.perf_counter()

    def end(self, lane: str, name: str) -> None:
        start = self._open.pop((lane, name), None)
        if start is not None:
            self.span(lane, name, start, time.perf_counter())

    def track(self, pending, lane: str, name: str, issued: float) -> None:
        """A collective from `issued` until the comm layer reports it complete."""
        pending.when_done(lambda done: self.span(lane, name, issued, done))

    def sorted_spans(self) -> list[dict]:
        with self._lock:
            return sorted(self.spans, key=lambda s: s["start_s"])

    def write(self, path: Path, **meta) -> None:
        Path(path).write_text(json.dumps({**meta, "spans": self.sorted_spans()}, indent=1))


def overlap_s(spans: list[dict], lane: str, other: str) -> float:
    """Seconds during which some span of `lane` and some span of `other` both run."""
    def merged(name):
        out = []
        for s in sorted((s for s in spans if s["lane"] == name), key=lambda s: s["start_s"]):
            if out and s["start_s"] <= out[-1][1]:
                out[-1][1] = max(out[-1][1], s["end_s"])
            else:
                out.append([s["start_s"], s["end_s"]])
        return out
    total = 0.0
    for a0, a1 in merged(lane):
        for b0, b1 in merged(other):
            total += max(0.0, min(a1, b1) - max(a0, b0))
    return total


def hidden_s(spans: list[dict], lane: str) -> float:
    """Seconds of `lane` (communication) that overlap computation. Waiting for a gather is
    recorded on the compute lane ("wait gather UNIT": the compute thread is blocked there) but
    computes nothing, so it hides nothing and is left out."""
    working = [s for s in spans if not (s["lane"] == "compute" and s["name"].startswith("wait"))]
    return overlap_s(working, lane, "compute")
