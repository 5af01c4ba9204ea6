"""The simulated slow inter-node link (comm/link.py): its formula, pure; then, on 4 ranks as 2
nodes of 2, that a cross-node all-reduce takes bytes / bandwidth + latency within 10% while a
node-local one is not slowed, that an asynchronous op overlaps its delay with compute, that ops
in flight share the link, and that the trainer writes the simulated seconds to metrics.jsonl.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_tree
from harness import run_world
from loomtrain import comm
from loomtrain.comm.link import SMALL_OP_BYTES, SlowLink
from loomtrain.comm.meter import CommMeter
from loomtrain.mesh import build_mesh
from loomtrain.train.metrics import read_metrics

# 50 Mbit/s and 20 ms: a 256 KiB all-reduce over 4 ranks sends 1.5 x 256 KiB = 393216 bytes per
# rank, 62.9 ms on the wire + 20 ms, against the 1-10 ms the real op takes on loopback here
GBPS, LATENCY_MS, RANKS_PER_NODE = 0.05, 20.0, 2
NUMEL = 1 << 16
WIRE = 393216
REPS = 5


def _formula(wire: int) -> float:
    return LATENCY_MS / 1e3 + wire * 8 / (GBPS * 1e9)


# --- pure ------------------------------------------------------------------------------------


def test_delay_is_zero_inside_a_node_and_the_formula_across():
    link = SlowLink(GBPS, LATENCY_MS, RANKS_PER_NODE)
    assert link.delay_s([0, 1], 10**6) == 0.0 and link.delay_s([2, 3], 10**6) == 0.0
    assert link.delay_s([0, 2], WIRE) == _formula(WIRE) == pytest.approx(0.0829146, rel=1e-6)
    assert link.delay_s([0, 1, 2, 3], 0) == LATENCY_MS / 1e3
    assert SlowLink(1.0, 0.0, 4).delay_s([3, 4], 125_000_000) == pytest.approx(1.0)


def test_ops_in_flight_queue_on_the_link_and_node_local_ops_do_not():
    link = SlowLink(GBPS, LATENCY_MS, RANKS_PER_NODE)
    transfer = WIRE * 8 / (GBPS * 1e9)
    assert link.due(10.0, [0, 1], WIRE) is None
    assert link.due(10.0, [0, 2], WIRE) == pytest.approx(10.0 + transfer + 0.02)
    # started at the same moment: its bytes cross after the first op's; latencies overlap
    assert link.due(10.0, [0, 3], WIRE) == pytest.approx(10.0 + 2 * transfer + 0.02)
    assert link.due(100.0, [0, 2], WIRE) == pytest.approx(100.0 + transfer + 0.02)  # idle again
    # a small op (a control all-reduce) interleaves with the queue instead of waiting for it,
    # and does not lengthen it
    small = SMALL_OP_BYTES
    assert link.due(100.0, [0, 2], small) == pytest.approx(100.0 + small * 8 / (GBPS * 1e9) + 0.02)
    assert link.due(100.0, [0, 2], WIRE) == pytest.approx(100.0 + 2 * transfer + 0.02)


def test_a_link_whose_bandwidth_changes_integrates_each_transfer_over_the_schedule():
    # 1 Gbit/s, 0.5 from 10 s after it was made, 2 from 20 s; made at perf_counter time 100
    link = SlowLink(1.0, 5.0, 1, changes=[(10, 0.5), (20, 2.0)], made_at=100.0)
    assert [link.gbps_at(t) for t in (105, 110, 119.9, 120, 500)] == [1.0, 0.5, 0.5, 2.0, 2.0]
    gbit = 125_000_000  # bytes
    assert link.transfer_s(gbit, at_s=105) == pytest.approx(1.0)  # before the change
    # from 109.5: half a Gbit at 1 Gbit/s, the other half at 0.5 Gbit/s -> 0.5 + 1.0 s
    assert link.transfer_s(gbit, at_s=109.5) == pytest.approx(1.5)
    # from 109: 1 s at 1, 10 s at 0.5 (5 Gbit), then 1 Gbit at 2 -> 11.5 s for 7 Gbit
    assert link.transfer_s(7 * gbit, at_s=109) == pytest.approx(11.5)
    assert link.delay_s([0, 1], gbit, at_s=109.5) == pytest.approx(1.505)
    # the queue: an op started behind one that crosses the change pays the new rate
    assert link.due(109.5, [0, 1], gbit) == pytest.approx(111.005)
    assert link.due(109.5, [0, 1], gbit) == pytest.approx(113.005)  # 1 Gbit at 0.5 after 111
    assert link.capacity_bytes(109, 121) == pytest.approx(gbit * (1 + 5 + 2))
    assert "0.5 Gbit/s after 10 s" in link.describe()


@pytest.mark.parametrize("changes", [[(0, 1.0)], [(2, 1.0), (1, 1.0)], [(1, 1.0), (1, 2.0)],
                                     [(1, 0.0)]])
def test_bad_link_changes_are_refused(changes):
    with pytest.raises(ValueError, match="SlowLink changes"):
        SlowLink(1.0, 0.0, 1, changes=changes)


@pytest.mark.parametrize("args", [(0.0, 1.0, 2), (1.0, -1.0, 2), (1.0, 1.0, 0)])
def test_bad_link_arguments_are_refused(args):
    with pytest.raises(ValueError, match="SlowLink"):
        SlowLink(*args)


def test_meter_keeps_simulated_seconds_in_a_window_of_their_own():
    meter = CommMeter()
    meter.record("dp", "all_reduce", 100, 150, simulated_s=0.5)
    meter.record("dp.local", "all_reduce", 100, 100)
    meter.record_simulated("pp", "recv", 0.25)  # a recv sends nothing: no calls, no bytes
    assert meter.take() == {"all_reduce": 250, "total": 250}  # the format other code reads
    assert meter.take_simulated() == {"all_reduce": 0.5, "recv": 0.25, "total": 0.75}
    assert meter.take_simulated() == {"total": 0}
    assert meter.total("simulated_s") == 0.75 and meter.total("calls", op="recv") == 0


# --- 4 ranks, 2 simulated nodes -----------------------------------------------------------------


def _synced(mesh) -> None:
    """A barrier off the simulated link, so that every rank starts the next op together."""
    link, mesh.link = mesh.link, None
    comm.barrier(mesh)
    mesh.link = link


def _timed(mesh, op, reps: int = REPS) -> tuple[float, list[float]]:
    """(median wall seconds of `op()`, the simulated seconds the meter recorded for each call)."""
    walls, simulated = [], []
    for _ in range(reps):
        _synced(mesh)
        mesh.meter.take_simulated()
        t0 = time.perf_counter()
        op()
        walls.append(time.perf_counter() - t0)
        simulated.append(mesh.meter.take_simulated()["total"])
    return statistics.median(walls), simulated


def _without_link(mesh, op) -> float:
    link, mesh.link = mesh.link, None
    try:
        return _timed(mesh, op)[0]
    finally:
        mesh.link = link


def _overlapped(mesh, compute_s: float) -> float:
    """An async all-reduce, `compute_s` of compute (a sleep), then wait: total wall seconds."""
    x = torch.ones(NUMEL)
    _synced(mesh)
    t0 = time.perf_counter()
    pending = comm.all_reduce(x, mesh, "dp", async_op=True)
    time.sleep(compute_s)
    pending.wait()
    return time.perf_counter() - t0


def _two_in_flight(mesh) -> None:
    pending = [comm.all_reduce(torch.ones(NUMEL), mesh, "dp", async_op=True) for _ in range(2)]
    for p in pending:
        p.wait()


def _pair(mesh, rank: int):
    """Ranks 0 and 1 (node 0) send 64 KiB to ranks 2 and 3 (node 1)."""
    buf = torch.ones(NUMEL // 4)

    def op():
        if rank < 2:
            comm.send(buf, mesh, "dp", rank + 2)
        else:
            comm.recv(buf, mesh, "dp", rank - 2)
    return op


def _exercise(rank, world, tree):
    link = SlowLink(GBPS, LATENCY_MS, RANKS_PER_NODE)
    mesh = build_mesh({"dp": world}, ranks_per_node=RANKS_PER_NODE, link=link)
    x = torch.ones(NUMEL)
    out = {}
    for axis in ("dp", "dp.local"):
        def op(axis=axis):
            comm.all_reduce(x, mesh, axis)
        out[f"{axis} real"] = _without_link(mesh, op)
        out[axis] = _timed(mesh, op)
    out["ring reduce_scatter"] = _timed(mesh, lambda: comm.reduce_scatter(
        torch.empty(NUMEL // world), x, mesh, "dp", impl="ring"), reps=1)
    out["p2p"] = _timed(mesh, _pair(mesh, rank), reps=3)
    out["overlap"] = statistics.median(_overlapped(mesh, _formula(WIRE)) for _ in range(3))
    out["two in flight"] = _timed(mesh, lambda: _two_in_flight(mesh), reps=3)[0]
    out["ops"] = sorted(key for key, c in mesh.meter.counts.items() if c.simulated_s)
    # the trainer joins this world (as under torchrun), builds its own linked mesh from [comm],
    # and tears the process group down at the end: it runs last
    from loomtrain.train.config import config_from_dict
    from loomtrain.train.run import run
    assert run(config_from_dict(tree), Path(tree["run"]["dir"]) / "t", None) == 0
    return out


@pytest.fixture(scope="module")
def measured(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("link")
    tree = tiny_tree(tmp, corpus, run={"log_every": 2}, train={"steps": 4},
                     parallel={"nproc": 4, "ranks_per_node": RANKS_PER_NODE},
                     comm={"inter_node_gbps": GBPS, "inter_node_latency_ms": LATENCY_MS})
    return run_world(_exercise, 4, tree, timeout_s=90), tmp / "runs" / "t"


def test_cross_node_all_reduce_takes_bytes_over_bandwidth_plus_latency(measured):
    results, _ = measured
    delay = _formula(WIRE)
    for rank, r in enumerate(results):
        wall, simulated = r["dp"]
        assert simulated == [delay] * REPS, rank  # the meter holds the formula, exactly
        # the test: within 10% (the sleep's overshoot and scheduling on 2 shared cores;
        # the real op is hidden under the delay, so it must be shorter than the delay)
        assert r["dp real"] < 0.5 * delay, (rank, r["dp real"])
        assert abs(wall - delay) <= 0.1 * delay, (rank, wall, delay)


def test_node_local_all_reduce_is_not_slowed(measured):
    results, _ = measured
    delay = _formula(WIRE)
    for rank, r in enumerate(results):
        wall, simulated = r["dp.local"]
        assert simulated == [0] * REPS, rank
        assert wall < r["dp.local real"] + 0.1 * delay, (rank, wall, r["dp.local real"])


def test_ring_ops_and_point_to_point_pay_the_delay_across_nodes(measured):
    results, _ = measured
    scatter = _formula(3 * NUMEL * 4 // 4)  # the ring reduce-scatter sends (N-1)/N x S
    message = _formula(NUMEL // 4 * 4)
    for rank, r in enumerate(results):
        wall, simulated = r["ring reduce_scatter"]
        assert simulated == [scatter] and wall >= scatter, (rank, wall)
        wall, simulated = r["p2p"]
        assert simulated == [message] * 3, rank  # the sender's send, the receiver's recv
        # at least the delay; the upper side is left open: a receive posted before its peer's
        # send also waits for the peer (the delay counts from this rank's own start), which a
        # loaded machine stretches
        assert wall >= 0.9 * message, (rank, wall, message)
        assert ("dp", "recv" if rank >= 2 else "send") in r["ops"]


def test_async_op_overlaps_its_delay_with_compute(measured):
    results, _ = measured
    delay = _formula(WIRE)
    for rank, r in enumerate(results):
        # compute as long as the delay, then wait: ~1x the delay if they overlap, 2x if not
        assert delay <= r["overlap"] < 1.25 * delay, (rank, r["overlap"], delay)


def test_ops_in_flight_together_share_the_link(measured):
    results, _ = measured
    expected = LATENCY_MS / 1e3 + 2 * WIRE * 8 / (GBPS * 1e9)  # 146 ms, not one op's 83
    for rank, r in enumerate(results):
        assert abs(r["two in flight"] - expected) <= 0.1 * expected, (rank, r["two in flight"])


def test_trainer_records_the_simulated_seconds(measured):
    _, run_dir = measured
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        # at least the control all-reduce over the world and one gradient bucket per step
        assert r["comm_simulated_s"] >= 2 * 2 * LATENCY_MS / 1e3, r
