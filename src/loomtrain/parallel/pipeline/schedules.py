"""Pipeline schedules as pure functions: who computes what, in which order.

gpipe, one_f_one_b, interleaved, zb_h1 (or build by config name) make schedules; with_offload
adds activation offload; validate checks one; simulate times it; bubble_theory gives the
papers' closed-form bubble fractions. Placement and messages: docs/pipeline.md, "Schedules".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# compute
F, B, I, W = "F", "B", "I", "W"  # forward; full backward; backward for input; for weights
# communication (point to point, between the ranks of adjacent stages)
SEND_F, RECV_F = "SEND_F", "RECV_F"  # stage s's output -> stage s+1's input
SEND_B, RECV_B = "SEND_B", "RECV_B"  # gradient of stage s's input -> stage s-1's output
# host memory
OFFLOAD, RELOAD = "OFFLOAD", "RELOAD"  # stashed activations of (microbatch, stage) out / in
COMPUTE = (F, B, I, W)
KINDS = (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, OFFLOAD, RELOAD)


@dataclass(frozen=True)
class Action:
    kind: str
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.stage}"


@dataclass(frozen=True)
class Schedule:
    """`actions[r]`: rank r's actions in execution order. `recompute`: the (microbatch, stage)
    pairs whose forward keeps only the stage input and is recomputed before its backward."""
    name: str
    pp: int
    microbatches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]
    recompute: frozenset = field(default_factory=frozenset)

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages


def stage_rank(stage: int, pp: int) -> int:
    return stage % pp


class DeadlockError(RuntimeError):
    """No rank can make progress: every unfinished rank waits on a send that never comes."""


@dataclass(frozen=True)
class SimResult:
    """`busy[r]`: rank r's compute time; `peak_stash[r]`: the most (microbatch, stage) pairs
    whose activations were on rank r's device at once; `spans[r]`: (action, start, end)."""
    makespan: float
    busy: tuple[float, ...]
    bubble: float
    peak_stash: tuple[int, ...]
    spans: tuple[tuple[tuple[Action, float, float], ...], ...]


# --- the schedules: each builds every rank's compute order; from_compute_orders adds messages ---

def _check_single_chunk(name: str, virtual_stages: int) -> None:
    if virtual_stages != 1:
        raise ValueError(f"{name} runs one stage per rank: virtual_stages must be 1, got "
                         f"{virtual_stages} (use 'interleaved' for virtual stages)")


def gpipe(pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward; each rank stashes all M."""
    _check_single_chunk("gpipe", virtual_stages)
    orders = [[Action(F, m, r) for m in range(microbatches)]
              + [Action(B, m, r) for m in range(microbatches)] for r in range(pp)]
    return from_compute_orders("gpipe", pp, microbatches, 1, orders)


def _one_f_one_b_order(r: int, pp: int, microbatches: int, backward: str) -> list[Action]:
    """PipeDream-flush / Megatron 1F1B on rank r: pp-r-1 warm-up forwards, then one forward
    and one backward in turn, then the remaining backwards: at most pp-r microbatches in flight."""
    warmup = min(pp - r - 1, microbatches)
    order = [Action(F, m, r) for m in range(warmup)]
    for k in range(microbatches - warmup):
        order += [Action(F, warmup + k, r), Action(backward, k, r)]
    return order + [Action(backward, m, r) for m in range(microbatches - warmup, microbatches)]


def one_f_one_b(pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    _check_single_chunk("1f1b", virtual_stages)
    orders = [_one_f_one_b_order(r, pp, microbatches, B) for r in range(pp)]
    return from_compute_orders("1f1b", pp, microbatches, 1, orders)


def interleaved(pp: int, microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021, sec. 2.2): rank r holds stages
    r, r+pp, ...; microbatches go through in groups of pp, one model chunk after the other,
    and the backwards take the chunks in reverse. Warm-up forwards as Megatron-LM counts them:
    2*(pp-r-1) + (V-1)*pp."""
    if virtual_stages < 2:
        raise ValueError(f"interleaved needs virtual_stages >= 2, got {virtual_stages}")
    if microbatches % pp:
        raise ValueError(f"interleaved needs microbatches divisible by pp: {microbatches} "
                         f"microbatches, pp={pp}")
    v, total = virtual_stages, microbatches * virtual_stages

    def unit(k: int, kind: str, r: int) -> Action:  # the k-th forward (or backward) of rank r
        chunk = (k // pp) % v
        stage = (v - 1 - chunk if kind == B else chunk) * pp + r
        return Action(kind, k // (pp * v) * pp + k % pp, stage)

    orders = []
    for r in range(pp):
        warmup = min(2 * (pp - r - 1) + (v - 1) * pp, total)
        order = [unit(k, F, r) for k in range(warmup)]
        for k in range(total - warmup):
            order += [unit(warmup + k, F, r), unit(k, B, r)]
        orders.append(order + [unit(k, B, r) for k in range(total - warmup, total)])
    return from_compute_orders("interleaved", pp, microbatches, v, orders)


def zb_h1(pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2024, arXiv 2401.10241, sec. 2.1): 1F1B with the backward split into
    I (input gradient, on the critical path) and W (weight gradient, free to move). Rank r
    delays its W's by r microbatches, so every rank has min(pp, m) microbatches in flight
    (F to W), as 1F1B's first rank: the I's reach rank 0 sooner and the W's fill the tail."""
    _check_single_chunk("zb-h1", virtual_stages)
    orders = []
    for r in range(pp):
        order, weights = [], [Action(W, m, r) for m in range(microbatches)]
        for a in _one_f_one_b_order(r, pp, microbatches, I):
            order.append(a)
            if a.kind == I and a.microbatch >= r:
                order.append(weights.pop(0))
        orders.append(order + weights)
    return from_compute_orders("zb-h1", pp, microbatches, 1, orders)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1}


def build(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if min(pp, microbatches, virtual_stages) < 1:
        raise ValueError(f"pipeline schedule {name!r} needs pp, microbatches and virtual_stages "
                         f">= 1, got {pp}, {microbatches}, {virtual_stages}")
    return SCHEDULES[name](pp, microbatches, virtual_stages)


def from_compute_orders(name: str, pp: int, microbatches: int, virtual_stages: int,
                        orders: list[list[Action]]) -> Schedule:
    """The schedule that runs each rank's compute actions in the given order (a planner's, or
    the schedules' above): a send after each compute whose result leaves the rank, and each
    receive right before the compute that needs it, or earlier where the sender's order
    demands: every (sender, receiver) pair receives in the order it sends, as NCCL matches
    point-to-point messages in order."""
    stages = pp * virtual_stages
    ranks = [stage_rank(s, pp) for s in range(stages)]
    lists = []
    for order in orders:
        out = []
        for a in order:
            send = _send_after(a, ranks)
            out += [a] if send is None else [a, send]
        lists.append(out)
    sent_at = {a: i for out in lists for i, a in enumerate(out) if a.kind in (SEND_F, SEND_B)}
    actions = []
    for out in lists:
        needs = []  # (sender, position of the send there, position of the consumer here, recv)
        for i, a in enumerate(out):
            recv = _receive_for(a, ranks)
            if recv is not None:
                send = _peer(recv)
                needs.append((ranks[send.stage], sent_at[send], i, recv))
        post_before: dict[int, list[Action]] = {}
        deadline, sender = len(out), None
        for src, _, consumer, recv in reversed(sorted(needs)):  # each sender's messages, last first
            deadline = consumer if src != sender else min(deadline, consumer)
            sender = src
            post_before.setdefault(deadline, []).insert(0, recv)
        actions.append(tuple(x for i, a in enumerate(out) for x in (*post_before.get(i, ()), a)))
    return Schedule(name, pp, microbatches, virtual_stages, tuple(actions))


def _send_after(a: Action, ranks: list[int]) -> Action | None:
    """The send that follows compute `a`, if its result goes to another rank."""
    m, s = a.microbatch, a.stage
    if a.kind == F and s + 1 < len(ranks) and ranks[s + 1] != ranks[s]:
        return Action(SEND_F, m, s)
    if a.kind in (B, I) and s > 0 and ranks[s - 1] != ranks[s]:
        return Action(SEND_B, m, s)
    return None


def _receive_for(a: Action, ranks: list[int]) -> Action | None:
    """The receive whose data compute `a` consumes, if that data comes from another rank."""
    m, s = a.microbatch, a.stage
    if a.kind == F and s > 0 and ranks[s - 1] != ranks[s]:
        return Action(RECV_F, m, s)
    if a.kind in (B, I) and s + 1 < len(ranks) and ranks[s + 1] != ranks[s]:
        return Action(RECV_B, m, s)
    return None


def _peer(a: Action) -> Action:
    """The other end of a message: SEND_F(m,s) <-> RECV_F(m,s+1), SEND_B(m,s) <-> RECV_B(m,s-1)."""
    kind, shift = {SEND_F: (RECV_F, 1), RECV_F: (SEND_F, -1),
                   SEND_B: (RECV_B, -1), RECV_B: (SEND_B, 1)}[a.kind]
    return Action(kind, a.microbatch, a.stage + shift)


def with_offload(schedule: Schedule, fraction: float, lookahead: int = 1) -> Schedule:
    """Offloads the stashed activations of round(fraction * n) of each rank's n (microbatch,
    stage) pairs: those that wait longest (in compute actions) between their forward and their
    backward, later forwards first on ties (they stay off through the end of a forward phase).
    The PipeOffload idea (Wan et al. 2025, arXiv 2503.01328): offload what waits longest,
    reload just in time.
    OFFLOAD follows the forward and its send; RELOAD goes before the compute `lookahead`
    actions ahead of the backward, and the simulator starts it with that compute. A pair whose
    backward comes within `lookahead` computes of its forward saves nothing: it only adds
    copy time, which simulate() shows."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"offload fraction must be in [0, 1], got {fraction}")
    if any(a.kind in (OFFLOAD, RELOAD) for acts in schedule.actions for a in acts):
        raise ValueError(f"schedule {schedule.name!r} already offloads")
    actions = []
    for acts in schedule.actions:
        acts = list(acts)
        compute = [a for a in acts if a.kind in COMPUTE]
        at = {a: i for i, a in enumerate(compute)}
        backward = {(a.microbatch, a.stage): a for a in compute if a.kind in (B, I)}
        forwards = [a for a in compute if a.kind == F]
        forwards.sort(key=lambda f: (at[f] - at[backward[f.microbatch, f.stage]], -at[f]))
        for f in forwards[:round(fraction * len(forwards))]:
            m, s = f.microbatch, f.stage
            send = Action(SEND_F, m, s)
            off = acts.index(send if send in acts else f) + 1
            acts.insert(off, Action(OFFLOAD, m, s))
            k = at[backward[m, s]] - lookahead  # the compute the reload goes before
            reload_at = acts.index(compute[k]) if k > at[f] else 0
            acts.insert(max(reload_at, off + 1), Action(RELOAD, m, s))
        actions.append(tuple(acts))
    return replace(schedule, actions=tuple(actions))


def _backward(m: int, s: int, present: set[Action]) -> Action:
    return Action(B, m, s) if Action(B, m, s) in present else Action(I, m, s)


def _deps(a: Action, present: set[Action], ranks: list[int]) -> list[Action]:
    """The actions whose end gates the start of `a`: local ones precede it in its rank's list;
    a remote one is the peer's send (its end is the arrival of the message)."""
    m, s = a.microbatch, a.stage
    if a.kind == F:
        if s == 0:
            return []
        return [Action(F, m, s - 1) if ranks[s - 1] == ranks[s] else Action(SEND_F, m, s - 1)]
    if a.kind in (B, I):
        deps = [Action(F, m, s)]
        if Action(OFFLOAD, m, s) in present:
            deps.append(Action(RELOAD, m, s))
        if s + 1 < len(ranks):
            local = ranks[s + 1] == ranks[s]
            deps.append(_backward(m, s + 1, present) if local else Action(SEND_B, m, s + 1))
        return deps
    return {W: [Action(I, m, s)], SEND_F: [Action(F, m, s)], OFFLOAD: [Action(F, m, s)],
            SEND_B: [_backward(m, s, present)], RELOAD: [Action(OFFLOAD, m, s)]}.get(a.kind, [])


def validate(schedule: Schedule) -> None:
    """Raises ValueError unless every rank's list is complete and in dependency order: each
    forward and backward (B, or I then W) once, on its stage's rank; each send after the compute
    it sends and each receive before the compute that consumes it; OFFLOAD after the forward,
    RELOAD between it and the backward; and the FIFO invariant: what rank a sends to rank b, in
    order, is what b receives from a, in order."""
    microbatches, stages = schedule.microbatches, schedule.stages
    if len(schedule.actions) != schedule.pp:
        raise ValueError(f"schedule {schedule.name!r} has {len(schedule.actions)} action lists "
                         f"for pp={schedule.pp}")
    ranks = [stage_rank(s, schedule.pp) for s in range(stages)]
    where: dict[Action, int] = {}
    for r, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            in_range = 0 <= a.microbatch < microbatches and 0 <= a.stage < stages
            if a.kind not in KINDS or not in_range:
                raise ValueError(f"rank {r}: {a} is not an action of {microbatches} microbatches "
                                 f"x {stages} stages (kinds {KINDS})")
            if a in where:
                raise ValueError(f"rank {r}: {a} appears twice")
            if ranks[a.stage] != r:
                raise ValueError(f"rank {r}: {a} belongs on rank {ranks[a.stage]}, its stage's")
            where[a] = i
    expected = set()
    for m in range(microbatches):
        for s in range(stages):
            split = Action(I, m, s) in where or Action(W, m, s) in where
            computes = [Action(k, m, s) for k in ((F, I, W) if split else (F, B))]
            if Action(OFFLOAD, m, s) in where or Action(RELOAD, m, s) in where:
                expected.update((Action(OFFLOAD, m, s), Action(RELOAD, m, s)))
            expected.update(computes)
            for c in computes:
                expected.update(x for x in (_send_after(c, ranks), _receive_for(c, ranks)) if x)
    missing, extra = expected - where.keys(), where.keys() - expected
    if missing or extra:
        raise ValueError(f"schedule {schedule.name!r}: missing {sorted(map(str, missing))[:8]}, "
                         f"unexpected {sorted(map(str, extra))[:8]}")
    for a, i in where.items():
        for d in _deps(a, expected, ranks) + [x for x in (_receive_for(a, ranks),) if x]:
            if ranks[d.stage] == ranks[a.stage] and where[d] > i:
                raise ValueError(f"rank {ranks[a.stage]}: {a} comes before {d}, which it needs")
    sent: dict[tuple[int, int], list[str]] = {}
    received: dict[tuple[int, int], list[str]] = {}
    for r, acts in enumerate(schedule.actions):
        for a in acts:  # a message is named by its receive
            if a.kind in (SEND_F, SEND_B):
                sent.setdefault((r, ranks[_peer(a).stage]), []).append(str(_peer(a)))
            elif a.kind in (RECV_F, RECV_B):
                received.setdefault((ranks[_peer(a).stage], r), []).append(str(a))
    for src, dst in sorted(sent.keys() | received.keys()):
        if sent.get((src, dst)) != received.get((src, dst)):
            raise ValueError(f"FIFO: rank {src} sends rank {dst} {sent.get((src, dst))}, "
                             f"rank {dst} receives {received.get((src, dst))}")


DEFAULT_TIMES = {F: 1.0, B: 2.0, I: 1.0, W: 1.0, SEND_F: 0.0, SEND_B: 0.0,
                 OFFLOAD: 0.5, RELOAD: 0.5}


def simulate(schedule: Schedule, times=None, start_at=None) -> SimResult:
    """Validates `schedule`, then runs every rank's list in order and times it.

    `times`: a dict kind -> duration (kinds left out take DEFAULT_TIMES), or a callable
    (action) -> duration, e.g. for per-stage costs. A send's duration is its latency, from its
    post to its arrival; receives take no time. Each rank runs its computes one at a time in
    list order; a compute waits for its local inputs, for the peer's send to arrive (its receive
    is posted before it, validate() checks), and a backward for its RELOAD. OFFLOAD and RELOAD
    run in list order on the rank's copy engine, beside the compute: OFFLOAD once its forward
    has ended, RELOAD when the next compute in the list can start (so it overlaps it).

    peak_stash counts a pair from the end of its forward (its stash is complete; Megatron's
    count of microbatches in flight) to the end of its B (or W), less the time from its
    OFFLOAD's end to its RELOAD's start; at equal times releases count first.
    `start_at(action, rank, ready_s)`, if given, returns when the action really starts (at
    least ready_s, the time the rules above allow): a caller's model of resources a schedule
    does not know, such as the planner's comm stream (planner/simulate.py), where sends queue
    behind ZeRO-3 gathers and gradient buckets. It is called once per action, in list order.
    Raises DeadlockError, naming each stuck rank's action and what it waits for."""
    validate(schedule)
    table = None if callable(times) else {**DEFAULT_TIMES, **(times or {})}
    duration = times if table is None else (lambda a: table.get(a.kind, 0.0))
    pp, ranks = schedule.pp, [stage_rank(s, schedule.pp) for s in range(schedule.stages)]
    present = {a for acts in schedule.actions for a in acts}
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    clock, copy, nxt = [0.0] * pp, [0.0] * pp, [0] * pp
    progressed = True
    while progressed:
        progressed, stuck = False, {}
        for r, acts in enumerate(schedule.actions):
            while nxt[r] < len(acts):
                a = acts[nxt[r]]
                deps = _deps(a, present, ranks)
                if a.kind == RELOAD:
                    then = next(c for c in acts[nxt[r]:] if c.kind in COMPUTE)
                    deps += [d for d in _deps(then, present, ranks) if d.kind != RELOAD]
                if any(d not in end for d in deps):  # only a remote send can be missing
                    stuck[r] = f"{a} waits for {', '.join(str(d) for d in deps if d not in end)}"
                    break
                on_copy = a.kind in (OFFLOAD, RELOAD)
                start[a] = max([clock[r]] + [copy[r]] * on_copy + [end[d] for d in deps])
                if start_at is not None:
                    start[a] = start_at(a, r, start[a])
                end[a] = start[a] + (0.0 if a.kind in (RECV_F, RECV_B) else duration(a))
                if a.kind in COMPUTE:
                    clock[r] = end[a]
                elif on_copy:
                    copy[r] = end[a]
                nxt[r], progressed = nxt[r] + 1, True
    if stuck:
        raise DeadlockError("; ".join(f"rank {r}: {why}" for r, why in sorted(stuck.items())))
    busy = tuple(sum(end[a] - start[a] for a in acts if a.kind in COMPUTE)
                 for acts in schedule.actions)
    makespan = max(clock)
    return SimResult(makespan, busy, 1 - sum(busy) / (pp * makespan) if makespan else 0.0,
                     tuple(live_peak(((a, start[a], end[a]) for a in acts), _stash_change)
                           for acts in schedule.actions),
                     tuple(tuple((a, start[a], end[a]) for a in acts) for acts in schedule.actions))


def _stash_change(a: Action) -> tuple[int, int]:
    """A pair's stash, counted in pairs (simulate's peak_stash)."""
    if a.kind == F:
        return 0, 1
    if a.kind == RELOAD:
        return 1, 0
    return (0, -1) if a.kind in (B, W, OFFLOAD) else (0, 0)


def live_peak(spans, change) -> float:
    """The peak of what a rank holds over its timed actions `spans` ((action, start, end), as
    SimResult.spans gives them), where `change(action)` is (added at its start, added at its
    end); at equal times what is freed counts first. peak_stash is this with one per pair;
    the dry run weighs each action with bytes (pipeline/estimate.py)."""
    events = []
    for a, start, end in spans:
        at_start, at_end = change(a)
        events += [(start, at_start)] * bool(at_start) + [(end, at_end)] * bool(at_end)
    level = peak = 0
    for _, delta in sorted(events):
        level += delta
        peak = max(peak, level)
    return peak


def bubble_theory(name: str, pp: int, microbatches: int, virtual_stages: int = 1,
                  times=None) -> float:
    """The closed-form bubble fraction, idle / (idle + compute) of a rank, p = pp, m = microbatches,
    with uniform stages and free communication (`times`: a dict as simulate() takes):
    - gpipe, 1f1b: (p-1) / (m+p-1), for any uniform F and B (Huang et al. 2019; Narayanan et al.
      2021, sec. 2.2.1: bubble time (p-1)(tf+tb) against m(tf+tb) of compute);
    - interleaved: (p-1) / (V*m+p-1) (Narayanan et al. 2021, sec. 2.2.2: the bubble shrinks by V);
    - zb-h1: idle (p-1)(F+I-W) against m(F+I+W) of compute (Qi et al. 2024, arXiv 2401.10241,
      sec. 2.1; F = I = W gives a third of 1F1B's (p-1)(F+B) idle time). simulate() meets it
      exactly for m >= p and W <= min(F, I); with fewer microbatches too few W's remain to fill
      the tail, and the bubble is larger.
    The other three are exact in simulate() for every m (interleaved: equal time per chunk)."""
    t = {**DEFAULT_TIMES, **(times or {})}
    p, m = pp, microbatches
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (virtual_stages * m + p - 1)
    if name == "zb-h1":
        idle = (p - 1) * (t[F] + t[I] - t[W])
        return idle / (idle + m * (t[F] + t[I] + t[W]))
    raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
