"""Sharded parameter servers (asyncsgd/shard.py): the layout rule, pure; two servers and one
worker are single-process SGD bitwise, with each server's bytes exact; two servers and two
workers under Ringleader each make their own rounds (one worker accumulating adaptively, with
one k per push for both servers); `loom train` with two servers trains, evaluates and saves
the whole final model; what sharded servers cannot do is refused.

The least-squares problem and its workers are tests/test_async_runtime.py's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import tiny_tree
from harness import StopBefore, run_world
from test_async_runtime import D, HEADER_BYTES, LR, LeastSquares, _loss, _sends

from loomtrain.asyncsgd import build_policy, run_worker, serve
from loomtrain.asyncsgd.adaptive import AdaptiveAccumulation
from loomtrain.asyncsgd.shard import owned_parameters, shard_bounds
from loomtrain.errors import CheckpointError, ConfigError
from loomtrain.mesh import build_mesh
from loomtrain.train import checkpoint, trainer
from loomtrain.train.config import config_from_dict
from loomtrain.train.launch import init_distributed
from loomtrain.train.metrics import read_metrics
from loomtrain.train.run import train_loop

SIZES = [6, 4, 6]  # three "parameters" of the D = 16 vector: cut at the tie 6 | 10 -> 6
BOUNDS = shard_bounds(SIZES, 2)


def test_layout_cuts_at_the_closest_parameter_boundary():
    assert BOUNDS == [(0, 6), (6, 16)]  # target 8: ends 6 and 10 are as close; the earlier
    assert shard_bounds([10, 10, 10, 10], 2) == [(0, 20), (20, 40)]
    assert shard_bounds([100, 1, 1, 1], 2) == [(0, 100), (100, 103)]
    assert shard_bounds([1, 1, 1, 100], 2) == [(0, 3), (3, 103)]  # the big one stays whole
    # every server gets a parameter, even where the closest boundary would leave one empty
    assert shard_bounds([1, 1, 100], 3) == [(0, 1), (1, 2), (2, 102)]
    assert shard_bounds([5, 7], 1) == [(0, 12)]
    with pytest.raises(ValueError, match="only 2 parameter tensors"):
        shard_bounds([5, 7], 3)


def test_layout_is_balanced_contiguous_and_at_parameter_boundaries():
    rng = random.Random(0)
    for _ in range(300):
        sizes = [rng.randint(1, 50) for _ in range(rng.randint(40, 80))]
        servers = rng.randint(1, 6)
        bounds = shard_bounds(sizes, servers)
        ends = {0}
        for n in sizes:
            ends.add(max(ends) + n)
        total = sum(sizes)
        assert bounds[0][0] == 0 and bounds[-1][1] == total and len(bounds) == servers
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous
        assert all(lo < hi and lo in ends for lo, hi in bounds)
        for s, (lo, _) in enumerate(bounds[1:], start=1):  # the closest boundary to s N / S
            target = s * total / servers
            assert abs(lo - target) == min(abs(e - target) for e in ends), (sizes, servers)
        # so each slice is N / S give or take the largest parameter
        assert max(hi - lo for lo, hi in bounds) <= total / servers + max(sizes)


def test_owned_parameters_follow_the_flat_order():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))  # 12 4 8 2
    params = list(model.parameters())
    bounds = shard_bounds([p.numel() for p in params], 2)
    assert bounds == [(0, 12), (12, 26)]  # target 13: the end of the first weight, 12
    assert owned_parameters(params, bounds[0]) == params[:1]
    assert owned_parameters(params, bounds[1]) == params[1:]


def _two_servers_one_worker(rank, world, steps):
    mesh = build_mesh({"dp": world})
    if rank == 2:
        out = run_worker(mesh, LeastSquares(0), D, shards=[hi - lo for lo, hi in BOUNDS])
        return out, _sends(mesh)
    lo, hi = BOUNDS[rank]
    out = serve(mesh, torch.zeros(hi - lo), build_policy("plain", 1, 0), lr=LR,
                total_updates=steps, servers=2)
    return out, _sends(mesh)


def test_two_servers_and_one_worker_are_sgd_bitwise():
    steps = 20
    (first, first_sends), (second, second_sends), (worker, worker_sends) = run_world(
        _two_servers_one_worker, 3, steps, timeout_s=60)
    reference = torch.zeros(D)  # single-process SGD on the whole vector
    grad_fn = LeastSquares(0)
    for step in range(steps):
        reference.add_(grad_fn(reference, step), alpha=-LR)
    # bitwise: the worker computes the gradient of the same assembled parameters, and each
    # server's add_ is elementwise, so its slice of the update is the whole update's
    assert torch.equal(first.params, reference[:6]) and torch.equal(second.params, reference[6:])
    assert torch.equal(worker.params, reference)  # assembled from the two stops
    assert worker.versions == [steps, steps] and worker.steps == steps
    for out in (first, second):
        assert [(a.pulled_version, a.version, a.applied) for a in out.staleness.arrivals] \
            == [(v, v, True) for v in range(steps)]
    assert _loss(reference) < 0.2 * _loss(torch.zeros(D))
    # server s: a PARAMS of its slice per step plus the stop; the worker: a PULL to each
    # server, then per step a PUSH of each slice
    assert first_sends == (steps + 1, (steps + 1) * (HEADER_BYTES + 4 * 6))
    assert second_sends == (steps + 1, (steps + 1) * (HEADER_BYTES + 4 * 10))
    assert worker_sends == (2 + 2 * steps, 2 * HEADER_BYTES + steps * (2 * HEADER_BYTES + 4 * D))


def _two_servers_two_workers(rank, world, updates):
    mesh = build_mesh({"dp": world})
    shards = [hi - lo for lo, hi in BOUNDS]
    if rank == 2:  # fast, and accumulating: its round trip is large next to its 5 ms gradient
        return run_worker(mesh, LeastSquares(0, delay_s=0.005), D, shards=shards,
                          accumulation=AdaptiveAccumulation(4, comm_fraction=0.05)), None
    if rank == 3:  # 6x as slow per gradient, one gradient per push
        return run_worker(mesh, LeastSquares(1, delay_s=0.03), D, shards=shards), None
    lo, hi = BOUNDS[rank]
    out = serve(mesh, torch.zeros(hi - lo), build_policy("ringleader", 2, 0), lr=LR,
                total_updates=updates, worker_timeout_s=20, servers=2)
    return out, _sends(mesh)


def test_two_servers_two_workers_make_their_own_ringleader_rounds():
    updates = 30
    *servers, (fast, _), (slow, _) = run_world(_two_servers_two_workers, 4, updates,
                                               timeout_s=60)
    pushed, gradients = [], []  # per server: the fast worker's pushes' k; gradients per worker
    for (lo, hi), (out, (calls, wire_bytes)) in zip(BOUNDS, servers):
        arrivals = out.staleness.arrivals
        assert out.version == updates and not out.lost
        # rounds of one update per worker on each server, whatever their speeds
        assert [sum(a.applied and a.worker == w for a in arrivals) for w in (0, 1)] == [15, 15]
        assert sum(a.applied for a in arrivals) == updates
        # every pull and every push got one reply (the last one a stop), each of the slice
        assert calls == 2 + len(arrivals) and wire_bytes == calls * (HEADER_BYTES + 4 * (hi - lo))
        # gradients of either worker that reached this server (a push of k counts k)
        gradients.append([sum(k for a, k in zip(arrivals, out.accumulation) if a.worker == w)
                          for w in (0, 1)])
        pushed.append([k for a, k in zip(arrivals, out.accumulation) if a.worker == 0])
    # the servers reach their last update at their own times (arrival orders differ): a worker
    # stopped by one server pushes on to the other only, so the server that stopped it last got
    # every gradient it computed, the other a prefix of its pushes
    assert [max(g[w] for g in gradients) for w in (0, 1)] == [fast.steps, slow.steps]
    shorter, longer = sorted(pushed, key=len)
    assert shorter == longer[:len(shorter)] and max(longer) > 1  # one k per push, sent to both
    assert fast.steps > slow.steps  # the fast worker's extra gradients are held, averaged in
    assert fast.versions == slow.versions == [updates, updates]
    assert torch.equal(fast.params, slow.params)  # both stops carry each server's final slice
    assert _loss(fast.params) < 0.2 * _loss(torch.zeros(D))


def _bounded_run(servers: int, workers: int, max_staleness: int, updates: int, rng) -> bool:
    """One run of a model of the sharded protocol under `bounded` (each server's waiting list
    and `may_start` as server.py keeps them, the real policy), with messages delivered and
    gradients finished in a random order. True if every worker gets all its stops; False at a
    deadlock: nothing in flight, nobody computing, a worker still waiting for a reply."""
    policies = [build_policy("bounded", workers, max_staleness) for _ in range(servers)]
    version, pulled = [0] * servers, [{} for _ in range(servers)]
    waiting: list[list[int]] = [[] for _ in range(servers)]
    awaited = [set(range(servers)) for _ in range(workers)]  # replies a worker waits for
    live = [set(range(servers)) for _ in range(workers)]  # servers that have not stopped it
    in_flight = [(w, srv) for w in range(workers) for srv in range(servers)]  # the PULLs
    pushing, computing, done = set(), set(), 0
    while done < workers:
        events = in_flight + sorted(computing)
        if not events:
            return False
        event = rng.choice(events)
        if isinstance(event, int):  # a gradient is done: a PUSH to every server still live
            computing.remove(event)
            awaited[event] = set(live[event])
            in_flight += [(event, srv) for srv in live[event]]
            continue
        in_flight.remove(event)
        w, srv = event
        if (w, srv) in pushing and version[srv] < updates:
            version[srv] += 1
        pushing.add((w, srv))
        pulled[srv].pop(w, None)
        waiting[srv].append(w)
        stop = version[srv] >= updates
        for u in list(waiting[srv]):
            if stop or policies[srv].may_start(u, version[srv], dict(pulled[srv])):
                waiting[srv].remove(u)
                awaited[u].discard(srv)
                if stop:
                    live[u].discard(srv)
                else:
                    pulled[srv][u] = version[srv]
                if not awaited[u] and live[u]:
                    computing.add(u)
                elif not awaited[u]:  # every server has stopped it
                    done += 1
    return True


def test_bounded_staleness_can_deadlock_sharded_servers():
    # why config.py refuses async.servers > 1 with policy "bounded": server A holds v back for
    # u, answered by A but held by B, which holds u back for v, answered by B but held by A
    rng = random.Random(0)
    # one server never deadlocks (policies.BoundedStaleness: the workers it waits for compute)
    assert all(_bounded_run(1, 4, s, 20, rng) for s in (0, 1, 2) for _ in range(100))
    deadlocked = sum(not _bounded_run(2, 3, 1, 20, rng) for _ in range(200))
    assert deadlocked > 20, deadlocked  # measured: 117 of 200 with this seed


def _train_then_stop(rank, world, tree, root):
    """The run to its end, then the same run stopped as SIGINT/SIGTERM stops it (the flag set
    after the first update, on every rank as the local launcher forwards it)."""
    out = []
    for name in ("full", "stopped"):
        cfg = config_from_dict(tree)
        stop = StopBefore(1) if name == "stopped" else trainer.StopFlag()
        train_loop(cfg, Path(root) / name, None, init_distributed(cfg), stop)
        out.append(read_metrics(Path(root) / name) if rank == 0 else None)
    return out


def test_loom_train_with_two_servers_saves_the_whole_model(tmp_path, corpus):
    from loomtrain.asyncsgd.state import check_resume
    from loomtrain.models import build_model

    tree = tiny_tree(tmp_path, corpus, parallel={"nproc": 4},
                     run={"log_every": 5, "eval_every": 10},
                     train={"steps": 20, "global_batch": 8, "micro_batch": 2},
                     **{"async": {"mode": "ps", "servers": 2, "worker_timeout_s": 20}})
    records, stopped = run_world(_train_then_stop, 4, tree, str(tmp_path), timeout_s=150)[0]
    assert [r["step"] for r in records] == [5, 10, 15, 20]
    # only the final model is whole on one rank: evaluated there, at the end only
    assert ["val_loss" in r for r in records] == [False, False, False, True]
    assert records[-1]["val_loss"] < 5.0  # from ~ln(256) = 5.5 per byte
    assert records[-1]["server_versions"] == [20, 20]  # plain: each server applied every push
    by_worker = records[-1]["applied_by_worker"]  # server 0's counts
    assert len(by_worker) == 2 and sum(by_worker) == 20
    [saved] = checkpoint.list_checkpoints(tmp_path / "full")
    meta = json.loads((saved / "loom.json").read_text())
    assert saved.name == "step_00000020" and meta["servers"] == 2 and meta["workers"] == 2
    cfg = config_from_dict(tree)
    torch.manual_seed(cfg.run.seed)
    initial = build_model(cfg.model)
    model = build_model(cfg.model)
    checkpoint.load_model_weights(saved, model)  # what `loom export` and `loom generate` do
    params = list(model.parameters())
    bounds = shard_bounds([p.numel() for p in params], 2)
    for s in (0, 1):  # both servers' trained slices made it into the saved model
        mine = {id(p) for p in owned_parameters(params, bounds[s])}
        changed = [not torch.equal(p, q) for p, q in zip(params, initial.parameters())
                   if id(p) in mine]
        assert all(changed), (s, changed)
    with pytest.raises(CheckpointError, match=r"async.servers=2: sharded parameter servers "
                                              r"cannot resume"):
        check_resume(cfg, saved)
    # stopped: every server stops before its second update (as every mode stops before the
    # next step); the model is gathered and saved at update 1, with the run's summary record
    assert [(r["step"], r["server_versions"], "val_loss" in r) for r in stopped] \
        == [(1, [1, 1], True)]
    [saved] = checkpoint.list_checkpoints(tmp_path / "stopped")
    meta = json.loads((saved / "loom.json").read_text())
    assert (saved.name, meta["stopped_by"]) == ("step_00000001", "SIGTERM")


def _cfg(tmp_path, corpus, **sections):
    return config_from_dict(tiny_tree(tmp_path, corpus, **sections))


@pytest.mark.parametrize("asgd, nproc, more, match", [
    ({"servers": 0}, 3, {}, r"async.servers"),
    ({"servers": 3}, 3, {}, r"ranks 0..2 \(async.servers=3\) .* parallel.nproc >= 4 \(got 3\)"),
    ({"servers": 2, "policy": "bounded"}, 4, {}, r"async.servers=2 with async.policy=\"bounded\""),
    ({"servers": 2}, 4, {"checkpoint": {"every": 10}},
     r"async.servers=2 with checkpoint.every=10 is not supported.* checkpoint.every=0"),
    ({"servers": 2, "worker_slowdown": [1.0, 2.0]}, 5, {"train": {"global_batch": 6}},
     r"one factor per worker: parallel.nproc=5 gives 3 \(ranks 2..4; ranks 0..1 are servers\)"),
    ({"servers": 2}, 5, {}, r"divisible by workers\*micro_batch = 3\*2 = 6"),
])
def test_refused(tmp_path, corpus, asgd, nproc, more, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(tmp_path, corpus, parallel={"nproc": nproc}, **more,
             **{"async": {"mode": "ps", **asgd}})


def test_servers_need_mode_ps_and_count_as_non_workers(tmp_path, corpus):
    with pytest.raises(ConfigError, match=r"async.servers is a setting .*async.mode=\"none\""):
        _cfg(tmp_path, corpus, parallel={"nproc": 4}, **{"async": {"servers": 2}})
    cfg = _cfg(tmp_path, corpus, parallel={"nproc": 4}, **{"async": {"mode": "ps", "servers": 2}})
    assert cfg.batch_ranks == 2 and cfg.accumulation_steps == 2  # 8 rows / 2 workers / 2


def test_a_rejoin_into_sharded_servers_is_refused(tmp_path, corpus):
    from loomtrain.asyncsgd.train import rejoin_async

    cfg = _cfg(tmp_path, corpus, parallel={"nproc": 4}, **{"async": {"mode": "ps", "servers": 2}})
    with pytest.raises(ConfigError, match=r"async.servers=2; .* rejoining needs async.servers=1"):
        rejoin_async(cfg, tmp_path, 0)
