"""A measured timeline of one training step: spans of compute and communication on lanes, so
that overlap can be seen rather than assumed. The trainer writes one step's spans to
RUN_DIR/timeline.json; the pipeline runtime writes every pp rank's, on a common clock, to
RUN_DIR/pipeline_timeline.json (`measured_bubble`: their idle fraction). How spans are
recorded and drawn (`loom report`): docs/training.md, "Report".
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

from loomtrain.errors import UserError
from loomtrain.writes import write_atomic


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

    @staticmethod
    def bubble_of(ranks: list[dict]) -> float:
        return measured_bubble(ranks)

    @staticmethod
    def write_pipeline(path: Path, ranks: list[dict], **meta) -> float:
        """`write_pipeline_timeline` of the ranks' spans, with their `measured_bubble` in the
        meta; returns that bubble (engines write through the loop's Timeline, without
        importing this module)."""
        bubble = measured_bubble(ranks)
        write_pipeline_timeline(path, ranks, **meta, bubble_measured=bubble)
        return bubble

    PIPELINE_JSON = "pipeline_timeline.json"  # = PIPELINE_TIMELINE_JSON, for the engines

    def write(self, path: Path, **meta) -> None:
        write_atomic(path, json.dumps({**meta, "spans": self.sorted_spans()}, indent=1))


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


# --- the pipeline's timeline: every pp rank's spans of one step ---------------------------------

PIPELINE_TIMELINE_JSON = "pipeline_timeline.json"
PIPELINE_LANES = ("compute", "comm", "copy")
# the compute kinds of parallel/pipeline/schedules.py (not imported: that package imports torch,
# and `loom report` does not); "WAIT", "OPT" and "SYNC" spans also sit on the compute lane
WORK_KINDS = ("F", "B", "I", "W")


class TimelineError(UserError):
    """A timeline file that cannot be read."""


def measured_bubble(ranks: list[dict]) -> float:
    """The pipeline's idle fraction over its forward/backward phase: 1 - (work of all ranks) /
    (ranks x the phase), where work is the time in F, B, I and W spans and the phase runs from
    the first such span's start to the last one's end on any rank. Waits, the optimizer step
    and the gradient sync are not work and lie outside the phase. The measured counterpart of
    the schedule's (pp - 1) / (microbatches + pp - 1) (GPipe, 1F1B). NaN when nothing computed."""
    work = [s for r in ranks for s in r["spans"] if s["kind"] in WORK_KINDS]
    if not work:
        return math.nan
    phase_s = max(s["end_s"] for s in work) - min(s["start_s"] for s in work)
    busy_s = sum(s["end_s"] - s["start_s"] for s in work)
    return 1.0 - busy_s / (len(ranks) * phase_s) if phase_s > 0 else math.nan


def write_pipeline_timeline(path: str | Path, ranks: list[dict], **meta) -> None:
    """Write {**meta, "ranks": ranks} to `path` (the runtime's meta: step, pp, schedule,
    microbatches, bubble_measured, bubble_theory), through a temporary file and a rename so a
    reader never sees half a file. `ranks`: [{"rank", "spans": [{"lane", "kind", "name",
    "start_s", "end_s"}]}], times in seconds from one origin common to all ranks."""
    write_atomic(path, json.dumps({**meta, "ranks": ranks}, indent=1))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# the optional fields of the runtime's meta; a bubble may be NaN (`measured_bubble` of no work)
META_CHECKS = {"step": (_count, "a count"), "pp": (_count, "a count"),
               "microbatches": (_count, "a count"), "schedule": (lambda v: isinstance(v, str), "a name"),
               "bubble_measured": (_number, "a number"), "bubble_theory": (_number, "a number")}


def _check_span(span, where: str) -> None:
    ok = (isinstance(span, dict) and span.get("lane") in PIPELINE_LANES
          and isinstance(span.get("kind"), str) and isinstance(span.get("name"), str)
          and all(_number(span.get(k)) and math.isfinite(span[k]) for k in ("start_s", "end_s")))
    if not ok or span["end_s"] < span["start_s"]:
        raise TimelineError(f"{where} ({span!r}) is not a lane ({', '.join(PIPELINE_LANES)}), "
                            "a kind, a name and finite start_s <= end_s")


def read_pipeline_timeline(path: str | Path) -> dict:
    """The validated contents of a file `write_pipeline_timeline` wrote, ranks sorted by rank.
    Damage raises `TimelineError`, one paragraph naming the file and the first bad part."""
    path = Path(path)
    shape = ('{"step", "pp", "schedule", "microbatches", "bubble_measured", "bubble_theory", '
             '"ranks": [{"rank", "spans": [{"lane", "kind", "name", "start_s", "end_s"}]}]}')
    try:
        doc = json.loads(path.read_text(errors="replace"))
    except OSError as err:
        raise TimelineError(f"cannot read {str(path)!r} ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise TimelineError(f"{str(path)!r} is not valid JSON ({err.msg} at line {err.lineno}); "
                            "delete it to report the rest of the run") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("ranks"), list) or not doc["ranks"]:
        raise TimelineError(f"{str(path)!r} has no list of \"ranks\"; a pipeline timeline is {shape}")
    for key, (valid, what) in META_CHECKS.items():
        if key in doc and not valid(doc[key]):
            raise TimelineError(f"{str(path)!r}: {key}={doc[key]!r} is not {what}; "
                                f"a pipeline timeline is {shape}")
    seen = set()
    for i, rank in enumerate(doc["ranks"]):
        if not (isinstance(rank, dict) and _count(rank.get("rank")) and isinstance(rank.get("spans"), list)):
            raise TimelineError(f"{str(path)!r}: ranks[{i}] ({str(rank)[:80]}) is not "
                                '{"rank": a count, "spans": [...]}')
        if rank["rank"] in seen:
            raise TimelineError(f"{str(path)!r}: rank {rank['rank']} appears twice in \"ranks\"")
        seen.add(rank["rank"])
        for j, span in enumerate(rank["spans"]):
            _check_span(span, f"{str(path)!r}: rank {rank['rank']} span {j}")
    doc["ranks"] = sorted(doc["ranks"], key=lambda r: r["rank"])
    return doc
