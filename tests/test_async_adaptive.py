"""Adaptive communication load (asyncsgd/adaptive.py): the pure controller raises the
accumulation k when the round trip grows and lowers it when the link recovers, within its
bounds and without flapping; a worker that averages k gradients per push is SGD on their mean,
bitwise; and `loom train` on a simulated link that slows mid-run (comm.link_changes) records
a larger k after the change."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest
import torch
from conftest import tiny_tree
from harness import run_world
from test_async_runtime import HEADER_BYTES, LR, D, LeastSquares

from loomtrain.asyncsgd import build_policy, run_worker, serve
from loomtrain.asyncsgd.adaptive import AdaptiveAccumulation
from loomtrain.errors import ConfigError
from loomtrain.mesh import build_mesh
from loomtrain.train import trainer
from loomtrain.train.config import config_from_dict
from loomtrain.train.launch import init_distributed
from loomtrain.train.metrics import read_metrics
from loomtrain.train.run import train_loop

# --- the controller, pure -------------------------------------------------------------------


def _feed(controller, rtts_s, compute_s=0.010, message_bytes=500_000) -> list[int]:
    """k after each of the scripted round trips (the PUSH send taken as a third of each)."""
    return [controller.observe(compute_s, rtt / 3, rtt, message_bytes) for rtt in rtts_s]


def test_k_rises_when_the_link_slows_and_falls_when_it_recovers():
    controller = AdaptiveAccumulation(max_accumulation=8, comm_fraction=0.25)
    # 10 ms per gradient; a fast link (1.5 ms round trip: share 1.5 / 11.5 < 0.25 at k = 1),
    # then a slow one (60 ms: k >= 60 x 0.75 / (0.25 x 10) = 18, clipped to 8), then fast again
    # (k = 1 is back within the hysteresis band, share <= 0.25 / 1.5, below r = 2 ms)
    fast, slow, recovered = (_feed(controller, [rtt] * 30) for rtt in (0.0015, 0.060, 0.0015))
    assert fast == [1] * 30
    assert slow[-1] == 8 and slow[0] > 1  # the first slow sample already raises k
    assert slow == sorted(slow)  # rising only, while the link stays slow
    assert recovered[-1] == 1 and recovered == sorted(recovered, reverse=True)
    assert all(1 <= k <= 8 for k in fast + slow + recovered)
    # a mid-way link: k at the smallest value that keeps the share at most 0.25
    controller = AdaptiveAccumulation(max_accumulation=8, comm_fraction=0.25)
    k = _feed(controller, [0.012] * 20)[-1]
    assert k == 4 and controller.comm_share(k) <= 0.25 < controller.comm_share(k - 1)


def test_hysteresis_keeps_k_from_flapping_on_a_noisy_round_trip():
    # round trips alternating 8 and 12 ms at 10 ms per gradient, unsmoothed: the k that keeps
    # the share <= 0.25 alternates between 3 and 4
    noisy = [0.008, 0.012] * 50

    def changes(hysteresis: float) -> int:
        ks = _feed(AdaptiveAccumulation(8, 0.25, smoothing=1.0, hysteresis=hysteresis), noisy)
        return sum(a != b for a, b in zip(ks, ks[1:]))

    assert changes(0.0) >= 90  # without hysteresis: k changes at almost every push
    assert changes(0.5) <= 1  # with it: settles at 4 (lowering to 3 needs r below ~6.7 ms)


def test_estimates_of_the_link_and_the_server():
    controller = AdaptiveAccumulation()
    assert controller.link_gbps is None and controller.server_s is None
    controller.observe_latency(0.001)
    # a 500 kB push took 5 ms: 4 ms of transfer after the 1 ms latency -> 1 Gbit/s; the round
    # trip of 20 ms less both messages' 10 ms: 10 ms at the server
    controller.observe(0.010, 0.005, 0.020, 500_000)
    assert controller.link_gbps == pytest.approx(1.0)
    assert controller.server_s == pytest.approx(0.010)


@pytest.mark.parametrize("kwargs", [{"max_accumulation": 0}, {"comm_fraction": 1.0},
                                    {"comm_fraction": 0.0}, {"smoothing": 0.0}])
def test_bad_controller_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        AdaptiveAccumulation(**kwargs)


# --- a worker that accumulates: SGD on the mean, bitwise --------------------------------------


def _accumulating_worker(rank, world, updates, k):
    mesh = build_mesh({"dp": world})
    if rank == 1:
        out = run_worker(mesh, LeastSquares(0), D, accumulation=k)
        sends = mesh.meter.counts[("world", "send")]
        return out.params, out.steps, (sends.calls, sends.wire_bytes)
    out = serve(mesh, torch.zeros(D), build_policy("plain", 1, 0), lr=LR, total_updates=updates)
    reference = torch.zeros(D)  # SGD on the mean of each k gradients, in the same process
    grad_fn = LeastSquares(0)
    for update in range(updates):
        mean = grad_fn(reference, k * update).clone()
        for i in range(1, k):
            mean.add_(grad_fn(reference, k * update + i))
        reference.add_(mean.div_(k), alpha=-LR)
    return out, reference


def test_accumulating_k_gradients_is_sgd_on_their_mean_bitwise():
    updates, k = 12, 3
    (out, reference), (worker_params, worker_steps, worker_sends) = run_world(
        _accumulating_worker, 2, updates, k, timeout_s=60)
    # bitwise: the same k gradients of the same parameters, summed in the same order, / k
    assert torch.equal(out.params, reference) and torch.equal(worker_params, reference)
    assert out.version == updates and worker_steps == k * updates  # steps: batches consumed
    assert out.accumulation == [k] * updates  # the header's count word reached the server
    # one PUSH per k gradients: the PULL plus `updates` messages
    assert worker_sends == (updates + 1, HEADER_BYTES + updates * (HEADER_BYTES + 4 * D))


# --- loom train on a link that slows mid-run ---------------------------------------------------


def _train_for(rank, world, tree, run_dir, seconds):
    """The trainer's loop, stopped (as by SIGTERM, at the server's next update) after
    `seconds`: the run's length is wall time, whatever the machine's load."""
    cfg = config_from_dict(tree)
    mesh = init_distributed(cfg)  # the simulated link is made here: its changes count from now
    stop = trainer.StopFlag()
    timer = threading.Timer(seconds, setattr, (stop, "signum", signal.SIGTERM))
    if rank == 0:
        timer.start()
    try:
        train_loop(cfg, Path(run_dir), None, mesh, stop)
    finally:
        timer.cancel()
    return read_metrics(Path(run_dir)) if rank == 0 else None


def test_accumulation_rises_when_the_simulated_link_slows(tmp_path, corpus):
    # the server and 2 workers on 3 simulated nodes; the tiny GPT's 30k parameters make a
    # 120 kB message: ~1 ms at 1 Gbit/s, ~97 ms at 0.01 Gbit/s from 2 s on. With ~5-20 ms per
    # gradient and a share of at most 0.5, k stays small on the fast link and must reach
    # ~200 ms / c > 8 (clipped to 8) on the slow one
    slow_from_s, gbps, slow_gbps = 2.0, 1.0, 0.01
    tree = tiny_tree(tmp_path, corpus, parallel={"nproc": 3, "ranks_per_node": 1},
                     comm={"inter_node_gbps": gbps, "link_changes": [[slow_from_s, slow_gbps]]},
                     run={"log_every": 4, "eval_every": 10 ** 6},
                     train={"steps": 10 ** 6, "global_batch": 8, "micro_batch": 2},
                     **{"async": {"mode": "ps", "worker_timeout_s": 30, "adaptive": True,
                                  "max_accumulation": 8, "comm_fraction": 0.5}})
    records = run_world(_train_for, 3, tree, str(tmp_path / "run"), slow_from_s + 5.0,
                        timeout_s=120)[0]
    fast = [r for r in records if r["link_gbps"] == gbps]
    slow = [r for r in records if r["link_gbps"] == slow_gbps]
    assert fast and len(slow) >= 4, [(r["step"], r["link_gbps"]) for r in records]
    fast_k = sum(r["accumulation_mean"] for r in fast) / len(fast)
    settled_k = [r["accumulation_mean"] for r in slow[-3:]]  # after the controllers adapted
    assert min(settled_k) >= 6 and min(settled_k) >= 2 * fast_k, (fast_k, settled_k)
    # tokens count every gradient of an arrival: k x 4 rows x 32 tokens per arrival
    assert all(r["tokens_per_s"] > 0 and 0 <= r["link_utilization"] for r in records)
    assert "val_loss" in records[-1]  # the stop evaluates and saves, as SIGTERM does


# --- config --------------------------------------------------------------------------------


@pytest.mark.parametrize("sections, match", [
    ({"async": {"adaptive": True}}, r"async.adaptive is a setting .*\(async.mode=\"none\"\)"),
    ({"async": {"mode": "ps", "max_accumulation": 4}, "parallel": {"nproc": 3}},
     r"async.max_accumulation=4 belongs to the adaptive .* set async.adaptive=true"),
    ({"async": {"mode": "ps", "comm_fraction": 0.5}, "parallel": {"nproc": 3}},
     r"async.comm_fraction=0.5 belongs to the adaptive"),
    ({"async": {"mode": "ps", "adaptive": True, "policy": "bounded"}, "parallel": {"nproc": 3}},
     r"async.adaptive=true with async.policy=\"bounded\" is not supported"),
    ({"async": {"mode": "ps", "adaptive": True, "comm_fraction": 1.0}, "parallel": {"nproc": 3}},
     r"async.comm_fraction"),
    ({"async": {"mode": "ps", "adaptive": True, "max_accumulation": 0}, "parallel": {"nproc": 3}},
     r"async.max_accumulation"),
    ({"comm": {"link_changes": [[1.0, 0.1]]}, "parallel": {"nproc": 2}},
     r"comm.link_changes=\[\[1.0, 0.1\]\] changes the simulated inter-node link, which is off"),
    ({"comm": {"inter_node_gbps": 1.0, "link_changes": [[2.0, 0.1], [1.0, 0.5]]},
      "parallel": {"nproc": 2, "ranks_per_node": 1}}, r"strictly increasing"),
    ({"comm": {"inter_node_gbps": 1.0, "link_changes": [[0.0, 0.1]]},
      "parallel": {"nproc": 2, "ranks_per_node": 1}}, r"each entry is \[after_s, gbps\]"),
    ({"comm": {"inter_node_gbps": 1.0, "link_changes": [[1.0, 0.0]]},
      "parallel": {"nproc": 2, "ranks_per_node": 1}}, r"each entry is \[after_s, gbps\]"),
])
def test_refused_combinations(tmp_path, corpus, sections, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(tiny_tree(tmp_path, corpus, **sections))


def test_adaptive_on_a_parameter_server_across_simulated_nodes_is_accepted(tmp_path, corpus):
    cfg = config_from_dict(tiny_tree(
        tmp_path, corpus, parallel={"nproc": 5, "ranks_per_node": 1},
        comm={"inter_node_gbps": 1.0, "link_changes": [[30, 0.05], [60, 1.0]]},
        **{"async": {"mode": "ps", "adaptive": True, "max_accumulation": 16}}))
    assert cfg.asgd.adaptive and cfg.asgd.max_accumulation == 16
    assert cfg.comm.link_changes == [(30.0, 0.05), (60.0, 1.0)]
