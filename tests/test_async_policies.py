"""The parameter server's staleness policies, pure: scripted arrivals and a small event
simulation of workers with fixed compute times (no processes)."""

from __future__ import annotations

import heapq
import itertools

import pytest
import torch

from loomtrain.asyncsgd.policies import StalenessLog, build_policy
from loomtrain.errors import CheckpointError


def unit(i: int, n: int) -> torch.Tensor:
    return torch.eye(n)[i]


def simulate(policy, durations, arrivals, grad=lambda worker, pulled: torch.ones(1)):
    """A parameter server driven by `policy`: worker w needs durations[w] seconds per gradient
    and pulls again as soon as it has pushed (or, if refused, after each later arrival).
    Simultaneous events go by worker id. Returns (log, applied directions, largest spread of
    versions pulled by the workers computing at once)."""
    version, pulled, events, waiting = 0, {}, [], []
    log, applied, spread = StalenessLog(), [], 0

    def start(worker, now):
        others = {w: p for w, p in pulled.items() if w != worker}
        if not policy.may_start(worker, version, others):
            return False
        pulled[worker] = version
        heapq.heappush(events, (now + durations[worker], worker))
        return True

    waiting = [w for w in range(len(durations)) if not start(w, 0.0)]
    while len(log.arrivals) < arrivals:
        assert events, f"deadlock: workers {waiting} wait and nobody computes"
        now, worker = heapq.heappop(events)
        p = pulled.pop(worker)
        out = policy.on_gradient(worker, grad(worker, p), p, version)
        log.record(worker, p, version, out is not None)
        if out is not None:
            applied.append(out)
            version += 1
        waiting = [w for w in sorted(waiting + [worker]) if not start(w, now)]
        if pulled:
            spread = max(spread, max(pulled.values()) - min(pulled.values()))
    return log, applied, spread


def test_plain_with_one_worker_is_sgd():
    policy = build_policy("plain", workers=1, max_staleness=0)
    for version in range(5):
        g = torch.randn(3)
        direction, scale = policy.on_gradient(0, g, version, version)
        assert direction is g and scale == 1.0
    log, applied, _ = simulate(policy, [1.0], 10)
    assert all(a.staleness == 0 and a.applied for a in log.arrivals) and len(applied) == 10


def test_plain_staleness_matches_hand_computed_table():
    # speeds 1, 1, 3: durations 1, 1, 3; all pull version 0 at t=0.
    # t=1: w0 (pulled 0, server 0), w1 (0, 1)        t=2: w0 (1, 2), w1 (2, 3)
    # t=3: w0 (3, 4), w1 (4, 5), w2 (0, 6)           t=4: w0 (5, 7), w1 (6, 8)
    # t=5: w0 (8, 9), w1 (9, 10)                     t=6: w0 (10, 11), w1 (11, 12), w2 (7, 13)
    expected = [(0, 0, 0), (1, 0, 1), (0, 1, 2), (1, 2, 3), (0, 3, 4), (1, 4, 5), (2, 0, 6),
                (0, 5, 7), (1, 6, 8), (0, 8, 9), (1, 9, 10), (0, 10, 11), (1, 11, 12),
                (2, 7, 13)]
    log, _, _ = simulate(build_policy("plain", 3, 0), [1.0, 1.0, 3.0], len(expected))
    assert [(a.worker, a.pulled_version, a.version) for a in log.arrivals] == expected
    assert [a.staleness for a in log.arrivals] == [v - p for _, p, v in expected]
    assert log.histogram() == {0: 1, 1: 9, 2: 2, 6: 2}
    assert log.summary()["max_staleness"] == 6


def test_drop_stale_discards_exactly_what_is_too_stale():
    policy = build_policy("drop_stale", 3, max_staleness=2)
    log, applied, _ = simulate(policy, [1.0, 1.0, 3.0], 30)
    dropped = [a for a in log.arrivals if not a.applied]
    assert dropped and all(a.staleness > 2 for a in dropped)
    assert all(a.staleness <= 2 for a in log.arrivals if a.applied)
    assert len(applied) == sum(a.applied for a in log.arrivals)
    # the version moves only on applied gradients
    assert log.arrivals[-1].version == sum(a.applied for a in log.arrivals[:-1])
    assert max(log.histogram()) <= 2
    assert policy.on_gradient(0, torch.ones(1), 0, 3) is None
    assert policy.last_outcome == "discarded"


@pytest.mark.parametrize("staleness, scale", [(0, 1.0), (1, 1.0), (2, 0.5), (5, 0.2)])
def test_staleness_scaled_divides_the_rate_by_staleness(staleness, scale):
    policy = build_policy("staleness_scaled", 2, 0)
    g = torch.ones(2)
    direction, got = policy.on_gradient(1, g, 10, 10 + staleness)
    assert direction is g and got == pytest.approx(scale)


def test_bounded_refuses_exactly_when_an_inflight_worker_is_too_far_behind():
    policy = build_policy("bounded", 3, max_staleness=2)
    for version, p1, p2 in itertools.product(range(6), repeat=3):
        pulled = {w: p for w, p in ((1, p1), (2, p2)) if p <= version}
        expected = all(version - p <= 2 for p in pulled.values())
        assert policy.may_start(0, version, pulled) == expected
    assert policy.may_start(0, 9, {0: 0}) is True  # its own old pull never blocks it
    assert policy.may_start(0, 9, {}) is True  # nobody computing: never refused


def test_bounded_makes_fast_workers_wait_without_deadlock():
    workers, s = 3, 1
    log, _, spread = simulate(build_policy("bounded", workers, s), [1.0, 1.0, 4.0], 200)
    assert spread <= s
    stalest = log.summary()["max_staleness"]
    assert stalest == s + workers - 1  # the documented bound, and it is reached
    plain, _, _ = simulate(build_policy("plain", workers, s), [1.0, 1.0, 4.0], 200)
    assert plain.summary()["max_staleness"] > 2 * stalest
    slow = [a for a in log.arrivals if a.worker == 2]
    assert len(slow) >= 200 // 4  # the straggler keeps the pace: the fast ones waited for it


def test_ringleader_rounds_by_hand():
    policy = build_policy("ringleader", 3, 0)
    e = [unit(i, 3) for i in range(3)]
    # Phase 1: nothing applied until every worker has a gradient in the table
    assert policy.on_gradient(0, e[0], 0, 0) is None and policy.last_outcome == "held"
    assert policy.on_gradient(0, 3 * e[0], 0, 0) is None
    assert policy.on_gradient(1, e[1], 0, 0) is None
    direction, scale = policy.on_gradient(2, e[2], 0, 0)  # fills the table: update 1 of 3
    assert scale == 1.0 and torch.allclose(direction, torch.tensor([2.0, 1.0, 1.0]) / 3)
    # Phase 2: worker 0 is served (its entry now averages 1, 3, 5), then buffered
    direction, _ = policy.on_gradient(0, 5 * e[0], 0, 1)
    assert torch.allclose(direction, torch.tensor([3.0, 1.0, 1.0]) / 3)
    assert policy.on_gradient(0, 7 * e[0], 2, 2) is None  # already served: next round's
    assert policy.on_gradient(2, e[2], 1, 2) is None  # served first this round: next round's
    direction, _ = policy.on_gradient(1, 3 * e[1], 0, 2)  # last to serve: round ends
    assert torch.allclose(direction, torch.tensor([3.0, 2.0, 1.0]) / 3)
    assert policy.table.rounds == 1 and policy.table.phase == 1
    # round 2 starts from the buffered gradients of workers 0 and 2; worker 1 fills it
    direction, _ = policy.on_gradient(1, e[1], 3, 3)
    assert torch.allclose(direction, torch.tensor([7.0, 1.0, 1.0]) / 3)


def test_ringleader_with_one_worker_is_sgd():
    policy = build_policy("ringleader", 1, 0)
    for version in range(4):
        g = torch.randn(3)
        direction, scale = policy.on_gradient(0, g, version, version)
        assert torch.equal(direction, g) and scale == 1.0


def test_ringleader_is_unbiased_under_heterogeneous_data_and_plain_is_not():
    # worker i only ever sees its own data: its "gradient" is e_i. Worker 0 is 4x faster.
    workers, arrivals = 3, 300
    durations = [1.0, 4.0, 4.0]
    ring = build_policy("ringleader", workers, 0)
    log, applied, _ = simulate(ring, durations, arrivals, grad=lambda w, p: unit(w, workers))
    uniform = torch.full((workers,), 1.0 / workers)
    assert all(torch.allclose(d, uniform) for d, _ in applied)  # every update, not on average
    # rounds: each block of n updates is triggered by every worker exactly once
    triggers = [a.worker for a in log.arrivals if a.applied]
    full = len(triggers) // workers * workers
    assert all(sorted(triggers[i:i + workers]) == list(range(workers))
               for i in range(0, full, workers))
    plain_log, plain_applied, _ = simulate(build_policy("plain", workers, 0), durations,
                                           arrivals, grad=lambda w, p: unit(w, workers))
    plain_mean = torch.stack([d for d, _ in plain_applied]).mean(0)
    assert plain_mean[0] > 0.6  # 4 / (4 + 1 + 1) of the updates come from the fast worker


def test_ringleader_uses_every_gradient_once_and_bounds_delay_by_2n_minus_2():
    torch.manual_seed(0)
    workers = 4
    durations = (torch.rand(workers) * 9 + 1).tolist()  # up to 10x apart
    ring = build_policy("ringleader", workers, 0)
    table, delays, outcomes, used = ring.table, [], [], [0]
    original = ring.on_gradient

    def watched(worker, grad, pulled_version, version):
        in_main, rounds = sum(table.main.counts), table.rounds
        out = original(worker, grad, pulled_version, version)
        outcomes.append(ring.last_outcome)
        if table.rounds > rounds:  # a round closed: its table held in_main + this arrival
            used[0] += in_main + 1
        if out is not None:
            delays.append(version - table.served_oldest)
        return out

    ring.on_gradient = watched
    log, applied, _ = simulate(ring, durations, 400)
    assert "discarded" not in outcomes and table.rounds >= 10
    this_round = 0 if table.unserved is None else workers - len(table.unserved)
    assert len(applied) == workers * table.rounds + this_round  # n updates per round
    # conservation: every arrival sits in exactly one round's table (closed, open or next)
    assert used[0] + sum(table.main.counts) + sum(table.buffer.counts) == len(log.arrivals)
    assert max(delays) == 2 * workers - 2  # the paper's bound, reached here


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(1)
    script = [(w, torch.randn(4)) for w in [0, 0, 1, 2, 0, 2, 0, 1, 1, 0, 2, 2, 1, 0]]
    for name in ("plain", "bounded", "drop_stale", "staleness_scaled", "ringleader"):
        first = build_policy(name, 3, 1)
        version = 0
        for w, g in script[:7]:
            version += first.on_gradient(w, g, max(0, version - 1), version) is not None
        second = build_policy(name, 3, 1)
        second.load_state_dict(first.state_dict())
        for w, g in script[7:]:
            a = first.on_gradient(w, g, max(0, version - 1), version)
            b = second.on_gradient(w, g, max(0, version - 1), version)
            assert (a is None) == (b is None), name
            if a is not None:
                assert torch.equal(a[0], b[0]) and a[1] == b[1], name
                version += 1
    with pytest.raises(CheckpointError, match="ringleader.*3 workers.*plain.*2 workers"):
        build_policy("plain", 2, 0).load_state_dict(build_policy("ringleader", 3, 0).state_dict())


@pytest.mark.parametrize("args, message", [
    (("sync", 2, 1), "async.policy must be one of plain, bounded, drop_stale"),
    (("plain", 0, 1), "at least one worker.*workers=0"),
    (("bounded", 2, -1), "async.max_staleness.*-1"),
    (("bounded", 2, 1.5), "async.max_staleness.*1.5"),
])
def test_build_policy_names_the_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        build_policy(*args)


# A lost worker (`on_lost`): Ringleader drops it from its table and closes rounds without it;
# the other policies keep no per-worker state


def test_ringleader_lost_in_phase_1_rounds_close_over_the_others():
    policy = build_policy("ringleader", 3, 0)
    e = [unit(i, 3) for i in range(3)]
    assert policy.on_gradient(0, e[0], 0, 0) is None
    assert policy.on_gradient(2, 5 * e[2], 0, 0) is None  # worker 2's gathered gradient...
    policy.on_lost(2)  # ...goes with it; worker 1 alone fills the table now
    direction, _ = policy.on_gradient(1, e[1], 0, 0)
    assert torch.allclose(direction, torch.tensor([0.5, 0.5, 0.0]))  # mean of the two left
    direction, _ = policy.on_gradient(0, 3 * e[0], 0, 1)  # round 1 closes after 2 updates
    assert torch.allclose(direction, torch.tensor([1.0, 0.5, 0.0]))  # worker 0's entry: (1+3)/2
    assert policy.table.rounds == 1 and policy.table.phase == 1
    # round 2: two updates, each the mean of the latest gradients of workers 0 and 1
    assert policy.on_gradient(0, 2 * e[0], 2, 2) is None
    direction, _ = policy.on_gradient(1, 4 * e[1], 2, 2)
    assert torch.allclose(direction, torch.tensor([1.0, 2.0, 0.0]))
    direction, _ = policy.on_gradient(0, 6 * e[0], 3, 3)
    assert torch.allclose(direction, torch.tensor([2.0, 2.0, 0.0]))
    assert policy.table.rounds == 2


def test_ringleader_lost_last_to_serve_closes_the_round_at_once():
    policy = build_policy("ringleader", 3, 0)
    e = [unit(i, 3) for i in range(3)]
    for w in range(3):
        policy.on_gradient(w, e[w], 0, 0)  # the third arrival serves worker 2
    policy.on_gradient(0, e[0], 0, 1)  # serves worker 0
    assert policy.on_gradient(0, 3 * e[0], 2, 2) is None  # served: buffered for round 2
    assert policy.on_gradient(2, 5 * e[2], 2, 2) is None
    policy.on_lost(1)  # the only one left to serve: the round closes without an update
    assert policy.table.rounds == 1 and policy.table.phase == 1
    # round 2 started from the buffer (workers 0 and 2): the next arrival fills nothing new
    # but finds the table full over the remaining workers, and updates
    direction, _ = policy.on_gradient(0, e[0], 2, 2)
    assert torch.allclose(direction, torch.tensor([2.0, 0.0, 5.0]) / 2)


def test_ringleader_discards_a_lost_workers_late_gradient():
    policy = build_policy("ringleader", 2, 0)
    assert policy.on_gradient(0, torch.ones(2), 0, 0) is None
    policy.on_lost(1)
    assert policy.on_gradient(1, torch.ones(2), 0, 0) is None
    assert policy.last_outcome == "discarded"
    assert policy.table.main.counts == [1, 0] and policy.table.buffer.counts == [0, 0]
    direction, _ = policy.on_gradient(0, 3 * torch.ones(2), 0, 0)  # one worker left: SGD-like
    assert torch.allclose(direction, 2 * torch.ones(2)) and policy.last_outcome == "applied"


def test_ringleader_keeps_going_after_a_loss_in_simulation():
    # worker 2 (of 4) is lost after 20 arrivals: every later update is the mean of the three
    # others' unit gradients, and the rounds keep closing (n - 1 updates each)
    workers = 4
    ring = build_policy("ringleader", workers, 0)
    simulate(ring, [1.0, 2.0, 3.0, 1.5], 20, grad=lambda w, p: unit(w, workers))
    ring.on_lost(2)
    rounds = ring.table.rounds
    durations = [1.0, 2.0, 1e9, 1.5]  # the lost worker never arrives again
    log, applied, _ = simulate(ring, durations, 60, grad=lambda w, p: unit(w, workers))
    assert applied and all(torch.allclose(d, torch.tensor([1.0, 1.0, 0.0, 1.0]) / 3)
                           for d, _ in applied)
    assert ring.table.rounds >= rounds + 5
    assert sum(a.applied for a in log.arrivals) <= 3 * (ring.table.rounds - rounds + 1)


def test_ringleader_state_keeps_the_lost_worker_out():
    first = build_policy("ringleader", 3, 0)
    first.on_lost(1)
    second = build_policy("ringleader", 3, 0)
    second.load_state_dict(first.state_dict())
    assert second.table.members == {0, 2}
    assert second.on_gradient(1, torch.ones(1), 0, 0) is None
    assert second.last_outcome == "discarded"


@pytest.mark.parametrize("name", ["plain", "bounded", "drop_stale", "staleness_scaled"])
def test_on_lost_changes_nothing_for_stateless_policies(name):
    policy = build_policy(name, 3, 1)
    policy.on_lost(1)
    assert policy.on_gradient(0, torch.ones(1), 0, 0) is not None
    # bounded: the server passes only live workers in `pulled`, so a lost one holds none back
    assert policy.may_start(0, 5, {2: 5})
