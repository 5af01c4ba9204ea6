"""The asynchronous parameter server (asyncsgd/server.py, worker.py): one worker is plain SGD
bitwise, three workers with a straggler converge with stale gradients (and the bounded policy
bounds them), and a dead and a hung worker are dropped without stopping the run.

The problem: least squares in D dimensions, each worker drawing its own fixed batch per step
(seeded by worker and step), so every gradient is reproducible in any process."""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch
from harness import run_world

from loomtrain import comm
from loomtrain.asyncsgd import build_policy, run_worker, serve
from loomtrain.mesh import build_mesh

D, BATCH, LR = 16, 8, 0.05
HEADER_BYTES = 32  # protocol.HEADER_WORDS int64 words
TARGET = torch.randn(D, generator=torch.Generator().manual_seed(0))


def _batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + step)
    x = torch.randn(BATCH, D, generator=g)
    return x, x @ TARGET + 0.1 * torch.randn(BATCH, generator=g)


def _loss(params: torch.Tensor) -> float:
    x, y = _batch(999, 0)
    return float((x @ params - y).square().mean())


class LeastSquares:
    """grad_fn of one worker: 2/B x^T (x w - y) on its batch of `step`; optionally slow
    (`delay_s` per step), dead (os._exit at step `exit_at`) or hung (`hang_s` at `hang_at`)."""

    def __init__(self, worker: int, delay_s: float = 0.0, exit_at: int | None = None,
                 hang_at: int | None = None, hang_s: float = 0.0):
        self.worker, self.delay_s = worker, delay_s
        self.exit_at, self.hang_at, self.hang_s = exit_at, hang_at, hang_s

    def __call__(self, params: torch.Tensor, step: int) -> torch.Tensor:
        if step == self.exit_at:
            os._exit(0)  # no cleanup, no result: the process is simply gone
        time.sleep(self.delay_s + (self.hang_s if step == self.hang_at else 0.0))
        x, y = _batch(self.worker, step)
        return 2.0 / BATCH * x.T @ (x @ params - y)


def _sends(mesh) -> tuple[int, int]:
    count = mesh.meter.counts[("world", "send")]
    return count.calls, count.wire_bytes


def _one_worker(rank, world, steps):
    mesh = build_mesh({"dp": world})
    if rank == 1:
        out = run_worker(mesh, LeastSquares(0), D)
        return out.params, out.version, out.steps, _sends(mesh)
    out = serve(mesh, torch.zeros(D), build_policy("plain", 1, 0), lr=LR, total_updates=steps)
    reference = torch.zeros(D)  # the single-process SGD loop, in the same process and threads
    grad_fn = LeastSquares(0)
    for step in range(steps):
        reference.add_(grad_fn(reference, step), alpha=-LR)
    return out, reference, _sends(mesh)


def test_one_worker_is_sgd_bitwise():
    steps = 20
    (out, reference, server_sends), worker = run_world(_one_worker, 2, steps, timeout_s=60)
    worker_params, worker_version, worker_steps, worker_sends = worker
    # bitwise: the worker computes the same gradient of the same parameters, and the server
    # applies it with the same add_ as the reference loop
    assert torch.equal(out.params, reference)
    assert torch.equal(worker_params, reference)  # the stop carries the final parameters
    assert out.version == worker_version == worker_steps == steps
    assert [(a.worker, a.pulled_version, a.version, a.applied) for a in out.staleness.arrivals] \
        == [(0, v, v, True) for v in range(steps)]
    assert _loss(out.params) < 0.2 * _loss(torch.zeros(D))
    message_bytes = HEADER_BYTES + 4 * D
    # server: a PARAMS per step plus the stop; worker: the PULL plus a PUSH per step
    assert server_sends == (steps + 1, (steps + 1) * message_bytes)
    assert worker_sends == (steps + 1, HEADER_BYTES + steps * message_bytes)


def _three_workers(rank, world, runs):
    mesh = build_mesh({"dp": world})
    out = []
    for policy, max_staleness, total_updates in runs:  # one run after the other, same group
        if rank == 0:
            policy = build_policy(policy, world - 1, max_staleness)
            out.append(serve(mesh, torch.zeros(D), policy, lr=LR, total_updates=total_updates,
                             worker_timeout_s=20))
        else:  # the last worker is the straggler: 10x the others' step time
            delay_s = 0.04 if rank == world - 1 else 0.004
            out.append(run_worker(mesh, LeastSquares(rank - 1, delay_s), D).steps)
    return out


def test_three_workers_with_a_straggler():
    runs = [("plain", 0, 45), ("bounded", 1, 45)]
    server, *workers = run_world(_three_workers, 4, runs, timeout_s=60)
    for i, (out, (name, max_staleness, total_updates)) in enumerate(zip(server, runs)):
        arrivals = out.staleness.arrivals
        assert out.version == total_updates and not out.lost, name
        # every gradient a worker pushed arrived: the ones after the last update unapplied
        assert [sum(a.worker == w for a in arrivals) for w in range(3)] \
            == [steps[i] for steps in workers], name
        assert sum(a.applied for a in arrivals) == total_updates, name
        assert not any(a.applied for a in arrivals[total_updates:]), name
        assert _loss(out.params) < 0.2 * _loss(torch.zeros(D)), name
    plain, bounded = (out.staleness.summary()["max_staleness"] for out in server)
    # plain: the straggler's gradients miss the ~10 updates the others make meanwhile;
    # bounded (s = 1): at most s + n - 1 = 3 (policies.BoundedStaleness), the others wait
    assert plain > 3, server[0].staleness.histogram()
    assert 0 < bounded <= 3, server[1].staleness.histogram()
    straggler_steps = workers[2]  # (plain, bounded): held back, the others let it catch up
    assert straggler_steps[1] > straggler_steps[0], workers


def _faults(rank, world, root):
    mesh = build_mesh({"dp": world})
    started = time.perf_counter()
    if rank == 0:
        out = serve(mesh, torch.zeros(D), build_policy("plain", world - 1, 0), lr=LR,
                    total_updates=40, worker_timeout_s=1.0)
        result = (out, time.perf_counter() - started)
    else:  # worker 1 dies after 3 pushes; worker 2 hangs for 4 s in its third step
        grad_fn = LeastSquares(rank - 1, delay_s=0.01, exit_at=3 if rank == 2 else None,
                               hang_at=2 if rank == 3 else None, hang_s=4.0)
        try:
            result = run_worker(mesh, grad_fn, D).steps
        except comm.CollectiveError as err:  # the hung worker, dropped: back after the run's
            # end (its 4 s against ~0.3 s for 40 updates), it gets no reply: fails, not hangs
            result = err
    (root / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def test_dead_and_hung_workers_are_dropped(tmp_path):
    # the dead rank returns nothing, so run_world reports it once the others have finished;
    # what the others saw comes back through files
    with pytest.raises(RuntimeError, match=r"ranks \[2\] exited without a result"):
        run_world(_faults, 4, tmp_path, timeout_s=60, collective_timeout_s=20)
    out, server_s = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    assert out.version == 40
    assert sorted(out.lost) == [1, 2]
    assert "Connection closed by peer" in out.lost[1]  # gloo reports the dead peer at once
    assert "worker_timeout_s=1.0" in out.lost[2]  # the hung one: silent, dropped by deadline
    assert sum(a.worker == 1 for a in out.staleness.arrivals) == 3
    assert server_s < 10  # not the 20 s process-group timeout
    assert pickle.loads((tmp_path / "rank1.pkl").read_bytes()) > 0
    hung = pickle.loads((tmp_path / "rank3.pkl").read_bytes())
    assert isinstance(hung, comm.CollectiveError), hung
    assert not (tmp_path / "rank2.pkl").exists()
