"""Pipeline schedules and their simulator (pure, no processes): every schedule on a grid of
pp x microbatches is complete, in dependency order, FIFO-safe and deadlock-free, and its
bubble and peak stash match the closed forms of the papers."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from loomtrain.parallel.pipeline.schedules import (
    B, COMPUTE, F, I, OFFLOAD, RECV_B, RECV_F, RELOAD, SEND_B, SEND_F, W, Action, DeadlockError,
    Schedule, bubble_theory, build, from_compute_orders, simulate, stage_rank, validate,
    with_offload)

# Bubble fractions are sums and ratios of small integers and halves: exact up to rounding.
EXACT = 1e-9


def grid():
    for pp in (1, 2, 3, 4):
        for m in (1, 2, 4, 8):
            for name in ("gpipe", "1f1b", "zb-h1"):
                yield name, pp, m, 1
        for m in (1, 2, 4, 6, 8):  # interleaved needs m % pp == 0: pp = 3 runs m = 6
            if m % pp == 0:
                yield from (("interleaved", pp, m, v) for v in (2, 3))


GRID = list(grid())


def actions(text: str) -> tuple[Action, ...]:
    """'F0.1 SEND_F0.1' -> (Action(F, 0, 1), Action(SEND_F, 0, 1))."""
    found = re.findall(r"([A-Z_]+)(\d+)\.(\d+)", text)
    return tuple(Action(kind, int(m), int(s)) for kind, m, s in found)


def hand_made(pp: int, microbatches: int, *ranks: str) -> Schedule:
    return Schedule("hand", pp, microbatches, 1, tuple(actions(t) for t in ranks))


@pytest.mark.parametrize("name,pp,m,v", GRID)
def test_schedule_runs_to_the_end_in_dependency_order(name, pp, m, v):
    schedule = build(name, pp, m, v)
    validate(schedule)
    res = simulate(schedule)  # raises DeadlockError if it cannot finish
    stages = pp * v
    kinds = (F, I, W) if name == "zb-h1" else (F, B)
    ran = Counter(a for spans in res.spans for a, _, _ in spans if a.kind in COMPUTE)
    assert ran == Counter(Action(k, mb, s) for k in kinds for mb in range(m) for s in range(stages))
    start = {a: t0 for spans in res.spans for a, t0, _ in spans}
    end = {a: t1 for spans in res.spans for a, _, t1 in spans}
    backward = I if name == "zb-h1" else B
    for mb in range(m):  # timed order, checked here apart from validate(): the data flow holds
        for s in range(stages):
            assert end[Action(F, mb, s)] <= start[Action(backward, mb, s)]
            if s > 0:
                assert end[Action(F, mb, s - 1)] <= start[Action(F, mb, s)]
            if s + 1 < stages:
                assert end[Action(backward, mb, s + 1)] <= start[Action(backward, mb, s)]
            if name == "zb-h1":
                assert end[Action(I, mb, s)] <= start[Action(W, mb, s)]
    for r, spans in enumerate(res.spans):
        assert all(stage_rank(a.stage, pp) == r for a, _, _ in spans)
        compute = sorted((t0, t1) for a, t0, t1 in spans if a.kind in COMPUTE)
        assert all(prev[1] <= nxt[0] for prev, nxt in zip(compute, compute[1:]))  # one at a time
    # a message per stage boundary that crosses ranks, each way, per microbatch; none if pp == 1
    comm = Counter(a.kind for acts in schedule.actions for a in acts if a.kind not in COMPUTE)
    crossing = stages - 1 if pp > 1 else 0
    assert comm == Counter({k: m * crossing for k in (SEND_F, RECV_F, SEND_B, RECV_B) if crossing})


@pytest.mark.parametrize("name,pp,m,v", [g for g in GRID if g[1] > 1])
def test_fifo_each_pair_of_ranks_receives_in_the_order_sent(name, pp, m, v):
    schedule = build(name, pp, m, v)
    sent, received = {}, {}
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            if a.kind in (SEND_F, SEND_B):
                to = a.stage + 1 if a.kind == SEND_F else a.stage - 1
                sent.setdefault((r, stage_rank(to, pp)), []).append((a.kind[-1], a.microbatch, to))
            elif a.kind in (RECV_F, RECV_B):
                frm = a.stage - 1 if a.kind == RECV_F else a.stage + 1
                message = (a.kind[-1], a.microbatch, a.stage)
                received.setdefault((stage_rank(frm, pp), r), []).append(message)
    assert sent == received


@pytest.mark.parametrize("name,pp,m,v", GRID)
def test_peak_stash(name, pp, m, v):
    peak = simulate(build(name, pp, m, v)).peak_stash
    if name == "gpipe":
        assert peak == (m,) * pp
    elif name == "1f1b":
        assert peak == tuple(min(pp - r, m) for r in range(pp))
    elif name == "zb-h1":
        # Qi et al. sec. 2.1: every rank keeps as many microbatches in flight (F to W) as 1F1B's
        # first rank, so the pipeline's peak is 1F1B's; later ranks hold more than under 1F1B.
        assert peak == (min(pp, m),) * pp
        assert max(peak) == max(simulate(build("1f1b", pp, m)).peak_stash)
    else:  # Megatron: warm-up forwards 2(p-r-1) + (V-1)p, plus the one of the first 1F1B step
        assert peak == tuple(min(2 * (pp - r - 1) + (v - 1) * pp + 1, m * v) for r in range(pp))


@pytest.mark.parametrize("times", [{F: 1, B: 2}, {F: 1, B: 3}, {F: 2, B: 1}])
@pytest.mark.parametrize("name,pp,m,v", [g for g in GRID if g[0] != "zb-h1"])
def test_bubble_matches_the_closed_form(name, pp, m, v, times):
    assert simulate(build(name, pp, m, v), times).bubble == pytest.approx(
        bubble_theory(name, pp, m, v, times), abs=EXACT)


@pytest.mark.parametrize("times", [{F: 1, I: 1, W: 1}, {F: 1.5, I: 1, W: 0.5}, {F: 1, I: 2, W: 1}])
@pytest.mark.parametrize("pp,m", [(pp, m) for pp in (2, 3, 4) for m in (1, 2, 4, 8)])
def test_zb_h1_bubble(pp, m, times):
    res, theory = simulate(build("zb-h1", pp, m), times), bubble_theory("zb-h1", pp, m, times=times)
    if m >= pp:  # the paper's regime (W <= min(F, I) here): the closed form is exact
        assert res.bubble == pytest.approx(theory, abs=EXACT)
    else:  # too few W's to fill the tail: worse than the formula
        assert res.bubble > theory


def idle_time(res) -> float:
    return len(res.busy) * res.makespan - sum(res.busy)


@pytest.mark.parametrize("pp,m", [(pp, m) for pp in (2, 3, 4) for m in (1, 2, 4, 8)])
def test_zb_h1_idles_a_third_of_1f1b(pp, m):
    # Same work per microbatch (F + B = F + I + W = 3). 1F1B idles (p-1)(F+B) = 3(p-1) per rank;
    # ZB-H1 idles (p-1)(F+I-W) = p-1 once m >= p. With m = 1 nothing fills the tail: it idles
    # (p-1)(F+I) = 2(p-1), two thirds of 1F1B's.
    ratio = idle_time(simulate(build("zb-h1", pp, m), {F: 1, I: 1, W: 1})) / idle_time(
        simulate(build("1f1b", pp, m), {F: 1, B: 2}))
    if m >= pp:
        assert ratio == pytest.approx(1 / 3, abs=EXACT)
    else:
        assert 1 / 3 < ratio <= 2 / 3 + EXACT


@pytest.mark.parametrize("name,pp,m,v", [g for g in GRID if g[0] == "interleaved" and g[1] > 1])
def test_interleaved_bubble_below_1f1b(name, pp, m, v):
    # Narayanan et al.: V chunks per rank shrink the bubble V times, for V times the messages
    assert simulate(build(name, pp, m, v)).bubble < simulate(build("1f1b", pp, m)).bubble
    assert bubble_theory(name, pp, m, v) < bubble_theory("1f1b", pp, m)


def test_times_callable_and_latency():
    pp, m = 3, 4
    base = simulate(build("gpipe", pp, m))
    # a send latency L lies 2(p-1) times on GPipe's critical path (down and back up)
    late = simulate(build("gpipe", pp, m), {SEND_F: 0.25, SEND_B: 0.25})
    assert late.makespan == pytest.approx(base.makespan + 2 * (pp - 1) * 0.25, abs=EXACT)
    # per-stage costs: the last stage twice as slow never waits once its first input is in:
    # 2 forwards above it, its 24, then 2 backwards above it
    def cost(a: Action) -> float:
        return {F: 1, B: 2}.get(a.kind, 0) * (2 if a.stage == pp - 1 else 1)

    slow = simulate(build("1f1b", pp, m), cost)
    assert slow.busy == (12, 12, 24)
    assert slow.makespan == 2 + 24 + 4


def test_build_rejects_what_it_cannot_build():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'"):
        build("pipedream", 2, 4)
    with pytest.raises(ValueError, match="virtual_stages must be 1"):
        build("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="virtual_stages must be 1"):
        build("gpipe", 2, 4, 2)
    with pytest.raises(ValueError, match="divisible by pp"):
        build("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="virtual_stages >= 2"):
        build("interleaved", 2, 4, 1)
    with pytest.raises(ValueError, match="needs pp, microbatches and virtual_stages >= 1"):
        build("1f1b", 2, 0)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        bubble_theory("pipedream", 2, 4)


@pytest.mark.parametrize("name,pp,m,fraction,peak", [
    ("gpipe", 4, 8, 0.5, 5), ("gpipe", 4, 8, 1.0, 2), ("gpipe", 1, 8, 0.75, 3),
    ("1f1b", 4, 8, 1.0, 2), ("interleaved", 4, 8, 0.5, 6)])
def test_offload_lowers_peak_stash_and_reloads_before_use(name, pp, m, fraction, peak):
    v = 2 if name == "interleaved" else 1
    plain = build(name, pp, m, v)
    schedule = with_offload(plain, fraction)
    res, before = simulate(schedule), simulate(plain)
    assert max(res.peak_stash) == peak < max(before.peak_stash)
    assert all(a <= b for a, b in zip(res.peak_stash, before.peak_stash))
    if name == "gpipe":  # every copy hides behind compute: a forward lasts 1, a copy 0.5
        assert res.makespan == before.makespan
    start = {a: t0 for spans in res.spans for a, t0, _ in spans}
    end = {a: t1 for spans in res.spans for a, _, t1 in spans}
    for acts in schedule.actions:
        offloaded = [a for a in acts if a.kind == OFFLOAD]
        assert len(offloaded) == round(fraction * m * v)
        for o in offloaded:
            mb, s = o.microbatch, o.stage
            assert end[Action(F, mb, s)] <= start[o] < end[o] <= start[Action(RELOAD, mb, s)]
            assert end[Action(RELOAD, mb, s)] <= start[Action(B, mb, s)]
        for i, a in enumerate(acts):  # just in time: a reload starts with the compute after it
            then = next((c for c in acts[i:] if c.kind in COMPUTE), None)
            if a.kind == RELOAD and then != Action(B, a.microbatch, a.stage):
                assert start[a] >= start[then]
    assert with_offload(plain, 0.0) == plain


def test_offload_picks_the_longest_waits():
    # 1F1B rank 0 of pp=4, m=8: forward and backward stand 2p-1 = 7 computes apart in the
    # steady state (microbatches 3 and 4), fewer in warm-up and cool-down
    schedule = with_offload(build("1f1b", 4, 8), 0.25)
    assert {a.microbatch for a in schedule.actions[0] if a.kind == OFFLOAD} == {3, 4}
    with pytest.raises(ValueError, match="fraction must be in"):
        with_offload(build("1f1b", 4, 8), 1.5)


def test_deadlock_is_reported_with_the_stuck_ranks():
    # rank 0 waits for the gradient before sending the activation rank 1 needs to produce it
    schedule = hand_made(2, 1, "F0.0 RECV_B0.0 B0.0 SEND_F0.0", "RECV_F0.1 F0.1 B0.1 SEND_B0.1")
    validate(schedule)  # each list is in order by itself
    stuck = "rank 0: B0.0 waits for SEND_B0.1; rank 1: F0.1 waits for SEND_F0.0"
    with pytest.raises(DeadlockError, match=stuck):
        simulate(schedule)


GOOD = ("F0.0 SEND_F0.0 RECV_B0.0 B0.0", "RECV_F0.1 F0.1 B0.1 SEND_B0.1")


@pytest.mark.parametrize("ranks,error", [
    (GOOD, None),
    (("F0.0 SEND_F0.0 RECV_B0.0 B0.0", "RECV_F0.1 B0.1 F0.1 SEND_B0.1"), "B0.1 comes before F0.1"),
    (("SEND_F0.0 F0.0 RECV_B0.0 B0.0", GOOD[1]), "SEND_F0.0 comes before F0.0"),
    ((GOOD[0], "F0.1 RECV_F0.1 B0.1 SEND_B0.1"), "F0.1 comes before RECV_F0.1"),
    (("F0.0 SEND_F0.0 RECV_B0.0 B0.0 F0.1", GOOD[1]), "F0.1 belongs on rank 1"),
    (("F0.0 SEND_F0.0 RECV_B0.0 B0.0 B0.0", GOOD[1]), "B0.0 appears twice"),
    (("F0.0 SEND_F0.0 RECV_B0.0", GOOD[1]), r"missing \['B0.0'\]"),
    (("F0.0 SEND_F0.0 RECV_B0.0 B0.0 W0.0", GOOD[1]), "missing .'I0.0'."),
    ((GOOD[0], "RECV_F0.1 F0.1 W0.1 I0.1 SEND_B0.1"), "W0.1 comes before I0.1"),
    ((GOOD[0], "RECV_F0.1 F0.1 I0.1 SEND_B0.1 B0.1 W0.1"), r"unexpected \['B0.1'\]"),
    (("F0.0 SEND_F0.0 OFFLOAD0.0 RECV_B0.0 B0.0", GOOD[1]), r"missing \['RELOAD0.0'\]"),
    (("F0.0 SEND_F0.0 OFFLOAD0.0 RECV_B0.0 B0.0 RELOAD0.0", GOOD[1]),
     "B0.0 comes before RELOAD0.0"),
    (("RELOAD0.0 F0.0 SEND_F0.0 OFFLOAD0.0 RECV_B0.0 B0.0", GOOD[1]),
     "RELOAD0.0 comes before OFFLOAD0.0"),
])
def test_validate_rejects_broken_order(ranks, error):
    schedule = hand_made(2, 1, *ranks)
    if error is None:
        assert simulate(schedule).makespan == 6
        return
    with pytest.raises(ValueError, match=error):
        validate(schedule)
    with pytest.raises(ValueError, match=error):
        simulate(schedule)


def test_validate_rejects_receives_out_of_send_order():
    # both receives come before their forwards, but rank 1 takes microbatch 1 first: a FIFO
    # transport (NCCL) would hand it microbatch 0's activation
    schedule = hand_made(2, 2, "F0.0 SEND_F0.0 F1.0 SEND_F1.0 RECV_B0.0 B0.0 RECV_B1.0 B1.0",
                         "RECV_F1.1 RECV_F0.1 F0.1 F1.1 B0.1 SEND_B0.1 B1.1 SEND_B1.1")
    with pytest.raises(ValueError, match="FIFO: rank 0 sends rank 1"):
        validate(schedule)


def test_receives_follow_the_senders_order():
    # rank 1 consumes microbatch 1 before 0, rank 0 the gradients of 0 before 1: each receive
    # is posted early enough that both sides of every pair agree on the message order
    schedule = from_compute_orders("hand", 2, 2, 1, [actions("F0.0 F1.0 B0.0 B1.0"),
                                                     actions("F1.1 F0.1 B1.1 B0.1")])
    assert schedule.actions == (
        actions("F0.0 SEND_F0.0 F1.0 SEND_F1.0 RECV_B1.0 RECV_B0.0 B0.0 B1.0"),
        actions("RECV_F0.1 RECV_F1.1 F1.1 F0.1 B1.1 SEND_B1.1 B0.1 SEND_B0.1"))
    assert simulate(schedule).makespan == 12  # rank 0 waits for B0.1, which rank 1 runs last


@pytest.mark.parametrize("name,pp,m,v", [("gpipe", 3, 4, 1), ("1f1b", 4, 8, 1), ("zb-h1", 4, 2, 1),
                                         ("interleaved", 2, 4, 3), ("interleaved", 4, 8, 2)])
@pytest.mark.parametrize("lookahead", [1, 2, 100])
def test_receives_posted_early_keep_the_schedule_valid(name, pp, m, v, lookahead):
    """The runtime posts receives ahead of where the schedule puts them (runtime.posted_early):
    the result must still validate (the receives' order per pair is kept) and run."""
    from loomtrain.parallel.pipeline.runtime import posted_early

    s = build(name, pp, m, v)
    early = Schedule(s.name, s.pp, s.microbatches, s.virtual_stages,
                     tuple(posted_early(a, lookahead) for a in s.actions))
    validate(early)
    simulate(early)
    for before, after in zip(s.actions, early.actions):
        assert sorted(map(str, before)) == sorted(map(str, after))
        assert [a for a in after if a.kind not in (RECV_F, RECV_B)] == \
            [a for a in before if a.kind not in (RECV_F, RECV_B)]
        firsts = [i for i, a in enumerate(after) if a.kind in (RECV_F, RECV_B)]
        if lookahead == 100 and firsts:
            assert firsts == list(range(len(firsts)))  # every receive first
