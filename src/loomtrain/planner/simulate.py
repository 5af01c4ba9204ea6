"""An event-level simulation of one training step, to check the analytic cost model (cost.py)
against and to draw the step (`loom plan --timeline`): compute, comm and copy streams per pp
rank, the pipeline schedule's order, gradient buckets and ZeRO-3 gathers on the comm stream.
The model, stream by stream: docs/planner.md, "The event simulator".
"""

from __future__ import annotations

import heapq
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from loomtrain.parallel.pipeline import schedules as S
from loomtrain.parallel.pipeline.schedules import B, COMPUTE, F, I, W, Action
from loomtrain.planner.plan import StageCosts, StepCosts

BUCKETS = 4  # gradient buckets of a stage's sync (DDP's default 25 MB buckets, coarsened)
_SEND, _GATHER, _SYNC = 0, 1, 2  # order on the comm stream at equal release times
STREAMS = ("compute", "comm", "p2p", "copy")


@dataclass(frozen=True)
class Span:
    """One thing a rank's `stream` ran: compute kinds forward, recompute, backward,
    backward_input, backward_weight, optimizer; comm kinds send, gather, grad_sync, tp_cp;
    p2p (with p2p_stream) send; copy kinds offload, reload."""
    name: str
    start_s: float
    end_s: float
    kind: str
    stream: str


@dataclass(frozen=True)
class SimulatedStep:
    """`busy_s[r]`: pp rank r's compute-stream seconds; `spans[r]`: its spans, by stream then
    start (zero-length ones left out)."""
    step_time_s: float
    busy_s: tuple[float, ...]
    spans: tuple[tuple[Span, ...], ...]
    schedule: str
    microbatches: int
    virtual_stages: int

    @property
    def pp(self) -> int:
        return len(self.busy_s)

    @property
    def bubble(self) -> float:
        return bubble_fraction(self)


def bubble_fraction(sim: SimulatedStep) -> float:
    """Idle share of the compute streams over the step: 1 - sum(busy) / (pp * step time)."""
    if sim.step_time_s <= 0:
        return 0.0
    return 1 - sum(sim.busy_s) / (sim.pp * sim.step_time_s)


def simulate_step(costs: StepCosts, buckets: int = BUCKETS,
                  p2p_stream: bool = True) -> SimulatedStep:
    """Times one step of `costs` event by event (docs/planner.md states the model).
    `p2p_stream`: the pipeline's sends get a stream of their own instead of queueing on the
    comm stream with the gathers and gradient buckets."""
    _check(costs, buckets)
    schedule = _schedule(costs)
    if any(st.offload_s > 0 for st in costs.stages):
        schedule = S.with_offload(schedule, 1.0)
    duration = _durations(costs.stages)
    comm = _CommStreams(costs, schedule, duration, buckets, p2p_stream)
    timed = S.simulate(schedule, duration, start_at=comm.start_at)
    comm.drain()
    ranks, busy, step_s = [], [], 0.0
    for r, actions in enumerate(timed.spans):
        spans = [x for a, start, end in actions for x in _spans(a, start, end, costs.stages[a.stage])]
        computed_s = max((end for a, _, end in actions if a.kind in COMPUTE), default=0.0)
        optimizer_start = max(computed_s, comm.synced_s[r])
        optimizer_end = optimizer_start + costs.optimizer_s
        spans += comm.spans[r] + [Span("optimizer", optimizer_start, optimizer_end, "optimizer",
                                       "compute")]
        spans = [x for x in spans if x.end_s > x.start_s]
        ranks.append(tuple(sorted(spans, key=lambda x: (STREAMS.index(x.stream), x.start_s,
                                                        x.end_s))))
        busy.append(timed.busy[r] + costs.optimizer_s)
        step_s = max(step_s, optimizer_end)
    return SimulatedStep(step_s, tuple(busy), tuple(ranks), schedule.name, costs.microbatches,
                         costs.virtual_stages)


def _check(costs: StepCosts, buckets: int) -> None:
    """Refuses costs the simulation cannot mean: the stage count, counts below 1, negative
    times. (Unknown schedules and interleaving's constraints: schedules.build says.)"""
    if min(costs.pp, costs.microbatches, costs.virtual_stages, buckets) < 1:
        raise ValueError(f"simulate_step needs pp, microbatches, virtual_stages and buckets >= 1, "
                         f"got {costs.pp}, {costs.microbatches}, {costs.virtual_stages}, {buckets}")
    if len(costs.stages) != costs.pp * costs.virtual_stages:
        raise ValueError(f"StepCosts.stages has {len(costs.stages)} entries; it needs pp x "
                         f"virtual_stages = {costs.pp} x {costs.virtual_stages}")
    if costs.schedule not in S.SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {costs.schedule!r}; choose one of "
                         f"{sorted(S.SCHEDULES)}")
    for s, st in enumerate(costs.stages):
        bad = {k: v for k, v in st.__dict__.items() if v < 0}
        if bad:
            raise ValueError(f"stage {s}: negative costs {bad}; times and bytes are >= 0")
    if costs.optimizer_s < 0:
        raise ValueError(f"optimizer_s is {costs.optimizer_s}; it must be >= 0")


def _schedule(costs: StepCosts) -> S.Schedule:
    if costs.pp > 1:
        return S.build(costs.schedule, costs.pp, costs.microbatches, costs.virtual_stages)
    stages = list(range(costs.virtual_stages))
    order = []
    for m in range(costs.microbatches):  # gradient accumulation: forward, then backward
        order += [Action(F, m, s) for s in stages] + [Action(B, m, s) for s in reversed(stages)]
    return S.from_compute_orders("accumulation", 1, costs.microbatches, costs.virtual_stages,
                                 [order])


def _durations(stages: tuple[StageCosts, ...]):
    """schedules.simulate's `times`: seconds of each action on its stage."""
    def duration(a: Action) -> float:
        st = stages[a.stage]
        if a.kind == F:
            return st.forward_s
        if a.kind == B:
            return st.recompute_s + st.backward_input_s + st.backward_weight_s
        if a.kind == I:
            return st.recompute_s + st.backward_input_s
        if a.kind == W:
            return st.backward_weight_s
        if a.kind in (S.SEND_F, S.SEND_B):
            return st.send_s
        if a.kind in (S.OFFLOAD, S.RELOAD):
            return st.offload_s
        return 0.0  # receives: the message's time is its send's
    return duration


def _spans(a: Action, start: float, end: float, st: StageCosts) -> list[Span]:
    """The compute-stream and copy-stream spans of one timed action, and its tp/cp block on
    the comm lane (sends are _CommStreams')."""
    name = str(a)
    if a.kind == F:
        return [Span(name, start, end, "forward", "compute"),
                Span(f"tp/cp {name}", start, start + min(st.forward_comm_s, end - start),
                     "tp_cp", "comm")]
    if a.kind in (B, I):
        run = start + min(st.recompute_s, end - start)
        return [Span(f"recompute {name}", start, run, "recompute", "compute"),
                Span(name, run, end, "backward" if a.kind == B else "backward_input", "compute"),
                Span(f"tp/cp {name}", run, run + min(st.backward_comm_s, end - run), "tp_cp",
                     "comm")]
    if a.kind == W:
        return [Span(name, start, end, "backward_weight", "compute")]
    if a.kind in (S.OFFLOAD, S.RELOAD):
        return [Span(name, start, end, a.kind.lower(), "copy")]
    return []


class _CommStreams:
    """Each rank's comm stream, fed by schedules.simulate's start_at hook, which calls it in
    each rank's list order. Items are queued when their release time is known (a gather when
    the compute before its own starts, buckets when the last backward starts, a send when its
    compute has ended) and timed, in release order, when something needs their times: a
    compute its gather's end, a send its start, the optimizer (drain) the syncs' ends. Every
    item queued later is released no earlier, so the order is the queue's."""

    def __init__(self, costs: StepCosts, schedule: S.Schedule, duration, buckets: int,
                 p2p_stream: bool):
        self.costs, self.duration, self.buckets = costs, duration, buckets
        self.next: dict[Action, Action | None] = {}  # each compute -> the rank's next compute
        self.first: set[Action] = set()
        self.last_backward: set[Action] = set()  # each stage's last B, I or W on its rank
        for actions in schedule.actions:
            computes = [a for a in actions if a.kind in COMPUTE]
            self.next.update(zip(computes, computes[1:] + [None]))
            self.first.update(computes[:1])
            self.last_backward.update({a.stage: a for a in computes if a.kind != F}.values())
        self.send_stream = "p2p" if p2p_stream else "comm"
        self.queue: dict[tuple[int, str], list] = defaultdict(list)  # (rank, stream) -> heap
        self.free_s: dict[tuple[int, str], float] = defaultdict(float)
        self.synced_s = [0.0] * schedule.pp
        self.spans: list[list[Span]] = [[] for _ in range(schedule.pp)]
        self.gather_key: dict[Action, tuple] = {}
        self.timed: dict[tuple, tuple[float, float]] = {}  # queue key -> (start, end)
        self.seq = 0

    def start_at(self, a: Action, r: int, ready_s: float) -> float:
        if a.kind in (S.SEND_F, S.SEND_B):
            lane = (r, self.send_stream)
            key = self._push(lane, ready_s, _SEND, self.duration(a), str(a), "send")
            return self._run(lane, key)[0]
        if a.kind not in COMPUTE:
            return ready_s
        if a in self.first:
            self._gather(r, a, 0.0)
        key = self.gather_key.pop(a, None)
        start = ready_s if key is None else max(ready_s, self._run((r, "comm"), key)[1])
        if self.next[a] is not None:
            self._gather(r, self.next[a], start)
        if a in self.last_backward:
            self._sync(r, a, start)
        return start

    def drain(self) -> None:
        for lane in list(self.queue):
            self._run(lane, None)

    def _gather(self, r: int, a: Action, release_s: float) -> None:
        seconds = self.costs.stages[a.stage].param_gather_s / 2 if a.kind in (F, B, I) else 0.0
        if seconds > 0:
            self.gather_key[a] = self._push((r, "comm"), release_s, _GATHER, seconds, f"gather {a}", "gather")

    def _sync(self, r: int, a: Action, start: float) -> None:
        sync_s, backward_s = self.costs.stages[a.stage].grad_sync_s, self.duration(a)
        if sync_s <= 0:
            return
        if not self.costs.grad_sync_overlaps:
            self._push((r, "comm"), start + backward_s, _SYNC, sync_s, f"grad sync {a.stage}", "grad_sync")
            return
        n = self.buckets
        for i in range(n):
            self._push((r, "comm"), start + i * backward_s / n, _SYNC, sync_s / n,
                       f"grad sync {a.stage} {i + 1}/{n}", "grad_sync")

    def _push(self, lane: tuple[int, str], release_s: float, priority: int, seconds: float, name: str,
              kind: str) -> tuple:
        self.seq += 1
        key = (release_s, priority, self.seq)
        heapq.heappush(self.queue[lane], (key, seconds, name, kind))
        return key

    def _run(self, lane: tuple[int, str], until: tuple | None) -> tuple[float, float] | None:
        """Times the items queued on `lane` (rank, stream) in release order up to and
        including `until` (all with None); returns `until`'s (start, end), timed now or before."""
        (r, stream), queue = lane, self.queue[lane]
        while queue and (until is None or queue[0][0] <= until):
            key, seconds, name, kind = heapq.heappop(queue)
            start = max(key[0], self.free_s[lane])
            self.free_s[lane] = start + seconds
            self.timed[key] = (start, start + seconds)
            self.spans[r].append(Span(name, start, start + seconds, kind, stream))
            if kind == "grad_sync":
                self.synced_s[r] = max(self.synced_s[r], start + seconds)
        return self.timed.get(until)


def timeline_json(sim: SimulatedStep) -> dict:
    """The simulated step as plain JSON data: totals, then each rank's spans."""
    return {"step_time_s": sim.step_time_s, "bubble_fraction": sim.bubble, "pp": sim.pp,
            "microbatches": sim.microbatches, "schedule": sim.schedule,
            "virtual_stages": sim.virtual_stages, "busy_s": list(sim.busy_s),
            "ranks": [{"rank": r, "spans": [{"name": x.name, "stream": x.stream, "kind": x.kind,
                                             "start_s": x.start_s, "end_s": x.end_s}
                                            for x in spans]}
                      for r, spans in enumerate(sim.spans)]}


def write_timeline_json(sim: SimulatedStep, path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(timeline_json(sim)) + "\n")
    return path


def draw_timeline(sim: SimulatedStep, path, title: str = "") -> Path:
    """Writes the step's picture as a PNG (simulate_draw.py)."""
    from loomtrain.planner.simulate_draw import draw
    return draw(sim, path, title)
