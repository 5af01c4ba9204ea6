"""The planner's step simulator (planner/simulate.py) on hand-made StepCosts: each expected
step time is worked out by hand in the test (p = pp, m = microbatches, f, b: a stage's
forward and backward seconds), and the bubbles are schedules.bubble_theory's closed forms."""

from __future__ import annotations

import json

import pytest

from loomtrain.parallel.pipeline.schedules import F, I, W, bubble_theory
from loomtrain.planner.plan import StageCosts, StepCosts
from loomtrain.planner.simulate import (
    bubble_fraction, draw_timeline, simulate_step, timeline_json, write_timeline_json)

# Every time here is a sum of small multiples of 1/4 or 1/10: exact up to float rounding.
EXACT = 1e-9


def stage(f=1.0, bi=1.0, bw=1.0, recompute=0.0, f_comm=0.0, b_comm=0.0, send=0.0, sync=0.0,
          gather=0.0, offload=0.0) -> StageCosts:
    return StageCosts(forward_s=f, backward_input_s=bi, backward_weight_s=bw,
                      recompute_s=recompute, forward_comm_s=f_comm, backward_comm_s=b_comm,
                      send_s=send, grad_sync_s=sync, param_gather_s=gather, offload_s=offload,
                      activation_bytes=0)


def costs(pp=1, m=1, schedule="1f1b", v=1, optimizer=0.0, overlaps=True, stages=None,
          **per_stage) -> StepCosts:
    stages = tuple(stages or [stage(**per_stage)] * (pp * v))
    return StepCosts(stages, pp, m, schedule, v, optimizer, overlaps)


def step_s(c: StepCosts, **kw) -> float:
    return simulate_step(c, **kw).step_time_s


def test_single_rank_is_gradient_accumulation_plus_exposed_sync_and_optimizer():
    # f = 1, b = 1.2 + 0.8 = 2: m(f+b) = 12; buckets of the last backward (2 s) hide a sync <= 2
    f_b = dict(f=1.0, bi=1.2, bw=0.8)
    assert step_s(costs(m=4, optimizer=0.5, sync=1.5, **f_b)) == pytest.approx(12.5, abs=EXACT)
    # a 3 s sync: 4 buckets of 0.75 s, each released every 0.5 s, end 3 s after the last B
    # starts: 1 s exposed
    assert step_s(costs(m=4, optimizer=0.5, sync=3.0, **f_b)) == pytest.approx(13.5, abs=EXACT)
    assert step_s(costs(m=4, optimizer=0.5, sync=1.5, overlaps=False, **f_b)) == pytest.approx(
        14.0, abs=EXACT)
    sim = simulate_step(costs(m=4, optimizer=0.5, **f_b))
    assert sim.busy_s == (pytest.approx(12.5, abs=EXACT),) and bubble_fraction(sim) == 0


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_uniform_pipeline_meets_megatrons_formula(name):
    # (m + p - 1)(f + b) + optimizer, with b = 1 + 1 + recompute 0.5 = 2.5
    sim = simulate_step(costs(pp=4, m=8, schedule=name, optimizer=0.25, recompute=0.5))
    assert sim.step_time_s == pytest.approx(11 * 3.5 + 0.25, abs=EXACT)
    assert sim.busy_s == tuple(pytest.approx(8 * 3.5 + 0.25, abs=EXACT) for _ in range(4))
    without = simulate_step(costs(pp=4, m=8, schedule=name, recompute=0.5))
    assert bubble_fraction(without) == pytest.approx(bubble_theory(name, 4, 8), abs=EXACT)


def test_interleaved_bubble_is_the_closed_form():
    for pp, m, v in ((4, 8, 2), (2, 4, 3)):
        sim = simulate_step(costs(pp=pp, m=m, schedule="interleaved", v=v, f=0.5, bi=0.5, bw=0.5))
        assert sim.bubble == pytest.approx(bubble_theory("interleaved", pp, m, v), abs=EXACT)


def test_zero_bubble_h1_bubble_is_the_closed_form():
    # W <= min(F, I) and m >= p: bubble_theory's zb-h1 case is exact
    sim = simulate_step(costs(pp=4, m=8, schedule="zb-h1", f=1.0, bi=1.0, bw=0.5))
    theory = bubble_theory("zb-h1", 4, 8, times={F: 1.0, I: 1.0, W: 0.5})
    assert sim.bubble == pytest.approx(theory, abs=EXACT)
    kinds = {x.kind for x in sim.spans[0]}
    assert {"backward_input", "backward_weight"} <= kinds and "backward" not in kinds


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_overlapped_sync_no_longer_than_the_last_backward_is_hidden(name):
    # the last backward is B (2 s) or zb-h1's W (1 s): a 1 s sync hides under either
    plain = step_s(costs(pp=4, m=8, schedule=name, optimizer=0.5))
    assert step_s(costs(pp=4, m=8, schedule=name, optimizer=0.5, sync=1.0)) == pytest.approx(
        plain, abs=EXACT)
    # after the last backward: rank 0 ends last, and its sync adds exactly its length
    assert step_s(costs(pp=4, m=8, schedule=name, optimizer=0.5, sync=1.0,
                        overlaps=False)) == pytest.approx(plain + 1.0, abs=EXACT)


def test_slow_stage_dominates():
    # GPipe with stage k slowest: sum_j (f_j + b_j) + (m - 1)(f_k + b_k) (the flow-shop
    # makespan with one bottleneck): 3 * 3 + 6 + 7 * 6 = 57
    stages = [stage()] * 4
    stages[2] = stage(f=2.0, bi=2.0, bw=2.0)
    sim = simulate_step(costs(pp=4, m=8, schedule="gpipe", stages=stages))
    assert sim.step_time_s == pytest.approx(57.0, abs=EXACT)
    for name in ("1f1b", "zb-h1"):
        sim = simulate_step(costs(pp=4, m=8, schedule=name, stages=stages))
        assert max(range(4), key=lambda r: sim.busy_s[r]) == 2
        # the slow rank's 48 s of work starts after stages 0-1's first forwards (2 s); with
        # 1F1B its last B precedes theirs (4 s), zb-h1 may end on its own W's
        assert sim.step_time_s >= 2 + 48 + (4 if name == "1f1b" else 0) - EXACT


def test_zero3_gathers_hide_behind_compute_and_expose_when_longer():
    # gathers of g/2 = 1 before each F (1 s) and B (2 s): only the first one shows
    assert step_s(costs(m=4, gather=2.0, optimizer=0.5)) == pytest.approx(1 + 12 + 0.5, abs=EXACT)
    assert step_s(costs(pp=4, m=8, gather=2.0)) == pytest.approx(1 + 33, abs=EXACT)
    # g/2 = 3 > f, b: each compute waits for its gather, which runs back to back: 2m gathers
    # then the last B: 6m + 2
    assert step_s(costs(m=2, gather=6.0)) == pytest.approx(14.0, abs=EXACT)
    sim = simulate_step(costs(m=2, gather=6.0))
    gathers = [x for x in sim.spans[0] if x.kind == "gather"]
    assert [(x.start_s, x.end_s) for x in gathers] == [(0, 3), (3, 6), (6, 9), (9, 12)]


def test_sends_add_latency_on_the_fill_and_drain():
    # GPipe, send s <= f, b: microbatch 0 reaches the last rank after (p-1)(f+s), the last
    # gradient reaches rank 0 after (p-1)(b+s): (m+p-1)(f+b) + 2(p-1)s
    sim = simulate_step(costs(pp=4, m=8, schedule="gpipe", send=0.25))
    assert sim.step_time_s == pytest.approx(33 + 6 * 0.25, abs=EXACT)
    first_b = min(x.start_s for x in sim.spans[3] if x.kind == "backward")
    assert first_b == pytest.approx(3 * 1.25 + 8, abs=EXACT)  # the fill, then its 8 forwards


def test_sends_queue_on_the_senders_comm_stream():
    # pp=2 GPipe, f = b = 1, s = 2 > f: rank 0's sends run back to back (end 3, 5, 7, 9), so
    # rank 1's last forward ends at 10; its backward sends end at 13, 15, 17, 19 and rank 0's
    # last backward ends at 20 (latency alone, without the queue, would give 14)
    c = costs(pp=2, m=4, schedule="gpipe", bi=0.5, bw=0.5, send=2.0)
    sim = simulate_step(c)
    assert sim.step_time_s == pytest.approx(20.0, abs=EXACT)
    sends = [(x.start_s, x.end_s) for x in sim.spans[0] if x.kind == "send"]
    assert sends == [(1, 3), (3, 5), (5, 7), (7, 9)]


def test_a_long_bucket_holds_the_send_unless_p2p_has_its_stream():
    # pp=2 1F1B, m=2, f=1, b=2, sync 4 on stage 1: rank 1 runs F0 [1,2] B0 [2,4] F1 [4,5]
    # B1 [5,7]; 1 s buckets released every 0.5 s from 5 end at 6, 7, 8, 9, and B1's send (0 s)
    # waits for them: rank 0's last B starts at 9, not at 7
    stages = [stage(), stage(sync=4.0)]
    one_stream = simulate_step(costs(pp=2, m=2, stages=stages), p2p_stream=False)
    own_stream = simulate_step(costs(pp=2, m=2, stages=stages), p2p_stream=True)
    last_b = [max(x.start_s for x in s.spans[0] if x.kind == "backward")
              for s in (one_stream, own_stream)]
    assert last_b == [pytest.approx(9.0, abs=EXACT), pytest.approx(7.0, abs=EXACT)]
    timed = simulate_step(costs(pp=2, m=2, stages=[stage(send=0.1)] * 2), p2p_stream=True)
    assert {x.stream for x in timed.spans[1] if x.kind == "send"} == {"p2p"}


def test_activation_offload_runs_on_the_copy_stream():
    # one rank: each backward follows its forward, so its reload (after the offload) shows:
    # m(f + 2 * offload + b)
    sim = simulate_step(costs(m=4, offload=0.25))
    assert sim.step_time_s == pytest.approx(4 * 3.5, abs=EXACT)
    copies = [x for x in sim.spans[0] if x.stream == "copy"]
    assert sorted({x.kind for x in copies}) == ["offload", "reload"] and len(copies) == 8


def test_tp_cp_collectives_are_shown_but_not_counted_twice():
    plain = simulate_step(costs(pp=2, m=4, recompute=0.5))
    shown = simulate_step(costs(pp=2, m=4, recompute=0.5, f_comm=0.25, b_comm=0.5))
    assert shown.step_time_s == plain.step_time_s
    tp = [x for x in shown.spans[1] if x.kind == "tp_cp"]
    assert len(tp) == 8 and {round(x.end_s - x.start_s, 9) for x in tp} == {0.25, 0.5}
    b0 = next(x for x in shown.spans[1] if x.name == "B0.1")
    assert any(x.start_s == b0.start_s and x.name == "tp/cp B0.1" for x in tp)  # after recompute


def test_refuses_costs_it_cannot_mean():
    with pytest.raises(ValueError, match="pp x virtual_stages"):
        simulate_step(costs(pp=2, m=2, stages=[stage()] * 3))
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        simulate_step(costs(pp=2, m=2, schedule="pipedream"))
    with pytest.raises(ValueError, match="negative"):
        simulate_step(costs(m=2, f=-1.0))


def test_timeline_json_and_picture(tmp_path):
    sim = simulate_step(costs(pp=16, m=64, schedule="1f1b", optimizer=1.0, sync=3.0, gather=0.5,
                              send=0.1, f_comm=0.2, b_comm=0.3, recompute=0.3))
    data = json.loads(write_timeline_json(sim, tmp_path / "t.json").read_text())
    assert data == json.loads(json.dumps(timeline_json(sim)))
    assert data["step_time_s"] == sim.step_time_s and len(data["ranks"]) == 16
    assert sum(len(r["spans"]) for r in data["ranks"]) == sum(map(len, sim.spans))
    big = draw_timeline(sim, tmp_path / "big.png", "pp=16, 64 microbatches")
    small = draw_timeline(simulate_step(costs(pp=2, m=2, offload=0.1)), tmp_path / "small.png")
    for png in (big, small):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
