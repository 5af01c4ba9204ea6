"""Workers rejoining the parameter server (asyncsgd/server.py, rejoin.py, comm/pair.py): a
worker dropped as hung that comes back is readmitted; a worker process that died is replaced
by a new process over a pair channel, which resumes its data where it stopped; Ringleader gives
a returning worker its table entry back; `loom train --rejoin` replaces a killed worker of a
running `loom train` server, and refuses bad input with exit 2.

The problem and the workers' gradients are tests/test_async_runtime.py's least squares. Each
run ends a few updates after the rejoin (the `_end_after_rejoin` hook lowers total_updates),
so its length does not depend on the machine's speed; CAP only bounds a run whose rejoin never
comes (the test then fails on its assertions, not on the harness timeout)."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import tiny_tree
from harness import free_port, run_world
from test_async_runtime import D, HEADER_BYTES, LR, LeastSquares, _loss

from loomtrain import comm
from loomtrain.asyncsgd import build_policy, rejoin_worker, run_worker, serve
from loomtrain.asyncsgd.rejoin import ADDRESS_FILE, publish_address
from loomtrain.cli import main
from loomtrain.mesh import build_mesh
from loomtrain.train import trainer
from loomtrain.train.config import config_from_dict
from loomtrain.train.launch import init_distributed
from loomtrain.train.run import train_loop
from loomtrain.train.trainer import write_config

CAP = 1000  # updates; a run that reaches it never saw its rejoin through
AFTER = 5  # gradients of the rejoined worker applied before the run ends


def _rejoined_applied(server, worker: int) -> int:
    """Applied gradients of `worker` since its latest rejoin (0 before any)."""
    rejoins = [m for m in server.membership if m.worker == worker and m.event != "lost"]
    if not rejoins:
        return 0
    return sum(a.worker == worker and a.applied
               for a in server.staleness.arrivals[rejoins[-1].arrivals:])


def _end_after_rejoin(server) -> None:
    if _rejoined_applied(server, 1) >= AFTER:
        server.total_updates = server.version


def _returned(rank, world):
    mesh = build_mesh({"dp": world})
    if rank == 0:
        return serve(mesh, torch.zeros(D), build_policy("plain", world - 1, 0), lr=LR,
                     total_updates=CAP, worker_timeout_s=1.5, on_update=_end_after_rejoin)
    # worker 1 hangs 3.5 s in its step 2: dropped after 1.5 s, then its late push arrives
    grad_fn = LeastSquares(rank - 1, delay_s=0.02, hang_at=2 if rank == 2 else None, hang_s=3.5)
    return run_worker(mesh, grad_fn, D).steps


def test_a_hung_worker_that_comes_back_is_readmitted():
    out, *steps = run_world(_returned, 3, timeout_s=60, collective_timeout_s=30)
    assert [(m.worker, m.event) for m in out.membership] == [(1, "lost"), (1, "returned")]
    lost, returned = out.membership
    assert "worker_timeout_s=1.5" in out.lost[1]
    assert returned.version > lost.version  # worker 0 went on meanwhile
    after = [a for a in out.staleness.arrivals[returned.arrivals:] if a.worker == 1]
    # the late gradient (its step 2, pulled before the drop) is applied by plain at its
    # staleness, then the worker goes on with fresh parameters
    assert after[0].pulled_version <= lost.version < after[0].version and after[0].applied
    assert sum(a.applied for a in after) >= AFTER
    assert out.version < CAP
    # every push of both processes arrived, and the run stopped both
    assert [sum(a.worker == w for a in out.staleness.arrivals) for w in range(2)] == steps
    assert _loss(out.params) < 0.2 * _loss(torch.zeros(D))


def _restarted(rank, world, root):
    mesh = build_mesh({"dp": world})
    if rank == 0:
        host = comm.PairHost(timeout_s=20, host="127.0.0.1")
        (root / "address.partial").write_text(host.address)
        (root / "address.partial").rename(root / "address")
        result = serve(mesh, torch.zeros(D), build_policy("plain", world - 1, 0), lr=LR,
                       total_updates=CAP, worker_timeout_s=20, on_update=_end_after_rejoin,
                       rejoin=host)
    else:  # worker 1's process exits at its step 3, after 3 pushes
        grad_fn = LeastSquares(rank - 1, delay_s=0.03, exit_at=3 if rank == 2 else None)
        result = run_worker(mesh, grad_fn, D).steps
    (root / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


class Recording(LeastSquares):
    """LeastSquares that remembers the steps it was asked for."""

    def __init__(self, worker: int):
        super().__init__(worker, delay_s=0.03)
        self.steps: list[int] = []

    def __call__(self, params, step):
        self.steps.append(step)
        return super().__call__(params, step)


def _rejoiner(root):
    """The restarted process: not in the world; finds the server through the address file.
    First asks for worker 0's place (alive: refused), then for worker 1's until the server has
    noticed its death (it may ask before the server has)."""
    deadline = time.monotonic() + 30
    while not (root / "address").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    address = (root / "address").read_text()
    torch.set_num_threads(1)
    try:
        rejoin_worker(address, 0, Recording(0), D, timeout_s=20)
        refusal = None
    except comm.PairRefused as err:
        refusal = str(err)
    grad_fn, meter, attempts = Recording(1), comm.CommMeter(), 0
    while True:
        attempts += 1
        try:
            result = rejoin_worker(address, 1, grad_fn, D, timeout_s=20, meter=meter)
            break
        except comm.PairRefused as err:
            if "is alive" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    sends = meter.counts[("world", "send")]
    (root / "rejoiner.pkl").write_bytes(pickle.dumps(
        (refusal, attempts, grad_fn.steps, result.steps, (sends.calls, sends.wire_bytes))))


def test_a_restarted_worker_process_rejoins_over_a_pair_channel(tmp_path):
    rejoiner = mp.get_context("spawn").Process(target=_rejoiner, args=(tmp_path,))
    rejoiner.start()
    try:
        # the dead rank returns nothing, so run_world reports it once the others have finished
        with pytest.raises(RuntimeError, match=r"ranks \[2\] exited without a result"):
            run_world(_restarted, 3, tmp_path, timeout_s=60, collective_timeout_s=30)
        rejoiner.join(30)
        assert rejoiner.exitcode == 0
    finally:
        if rejoiner.is_alive():
            rejoiner.kill()
    out = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    refusal, _attempts, steps_seen, pushed, (send_calls, send_bytes) = pickle.loads(
        (tmp_path / "rejoiner.pkl").read_bytes())
    assert "worker 0 is alive" in refusal
    assert [(m.worker, m.event) for m in out.membership] == [(1, "lost"), (1, "restarted")]
    restarted = out.membership[1]
    ones = [a for a in out.staleness.arrivals if a.worker == 1]
    before = ones[:len(ones) - pushed]
    after = out.staleness.arrivals[restarted.arrivals:]
    assert len(before) == 3  # the dead process's pushes, steps 0..2
    # the new process resumes the dead one's data at its step 3, and every push it made
    # arrived and (plain) was applied, bar any after the last update
    assert steps_seen[:pushed] == list(range(3, 3 + pushed))
    assert sum(a.worker == 1 for a in after) == pushed
    assert sum(a.worker == 1 and a.applied for a in after) >= AFTER
    assert out.version < CAP
    # the pair channel counts its bytes as comm.send does: the PULL, then one PUSH per step
    assert (send_calls, send_bytes) == (1 + pushed, HEADER_BYTES + pushed * (HEADER_BYTES + 4 * D))
    assert list(out.lost) == [1] and "Connection" in out.lost[1]
    # worker 0 never stopped, and the run ended with everyone stopped (the loop's condition)
    assert pickle.loads((tmp_path / "rank1.pkl").read_bytes()) == sum(
        a.worker == 0 for a in out.staleness.arrivals)


# Ringleader: a rejoining worker gets its table entry back


def unit(i: int, n: int) -> torch.Tensor:
    return torch.eye(n)[i]


def test_ringleader_readmits_in_phase_1_at_once():
    policy = build_policy("ringleader", 3, 0)
    e = [unit(i, 3) for i in range(3)]
    assert policy.on_gradient(0, e[0], 0, 0) is None
    policy.on_lost(2)
    policy.on_rejoin(2)  # back before the round's first update: the round waits for it again
    assert policy.on_gradient(1, e[1], 0, 0) is None
    direction, _ = policy.on_gradient(2, 3 * e[2], 0, 0)
    assert torch.allclose(direction, torch.tensor([1.0, 1.0, 3.0]) / 3)


def test_ringleader_readmits_in_phase_2_from_the_next_round():
    policy = build_policy("ringleader", 3, 0)
    e = [unit(i, 3) for i in range(3)]
    policy.on_lost(2)
    policy.on_gradient(0, e[0], 0, 0)
    direction, _ = policy.on_gradient(1, e[1], 0, 0)  # Phase 1 full over {0, 1}: update
    assert torch.allclose(direction, torch.tensor([0.5, 0.5, 0.0]))
    policy.on_rejoin(2)  # in Phase 2: its entry would be empty, so it waits for round 2
    assert policy.table.members == {0, 1} and policy.table.joining == {2}
    assert policy.on_gradient(2, 4 * e[2], 1, 1) is None and policy.last_outcome == "held"
    direction, _ = policy.on_gradient(0, 2 * e[0], 1, 1)  # serves worker 0: round 1 closes
    assert torch.allclose(direction, torch.tensor([1.5, 1.0, 0.0]) / 2)
    assert policy.table.rounds == 1 and policy.table.members == {0, 1, 2}
    # round 2 started from the buffer, which holds worker 2's gradient: the table fills with
    # workers 0 and 1, and every update averages all three again
    assert policy.on_gradient(0, e[0], 2, 2) is None
    direction, _ = policy.on_gradient(1, e[1], 2, 2)
    assert torch.allclose(direction, torch.tensor([1.0, 1.0, 4.0]) / 3)
    second = build_policy("ringleader", 3, 0)  # the joining set is part of the state
    policy.on_lost(2)
    policy.on_rejoin(2)  # round 2 is in Phase 2 (worker 0 not served yet): deferred again
    second.load_state_dict(policy.state_dict())
    assert second.table.joining == {2}


@pytest.mark.parametrize("name", ["plain", "bounded", "drop_stale", "staleness_scaled"])
def test_on_rejoin_changes_nothing_for_stateless_policies(name):
    policy = build_policy(name, 3, 1)
    policy.on_lost(1)
    policy.on_rejoin(1)
    assert policy.on_gradient(1, torch.ones(1), 0, 0) is not None


# `loom train --rejoin RUN_DIR --worker W`: bad input exits 2 with the reason, before any
# computing


def _run_dir(tmp_path, corpus, **sections):
    tree = tiny_tree(tmp_path, corpus, **sections)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(run_dir, config_from_dict(tree))
    return run_dir


def test_rejoin_refuses_bad_input(tmp_path, corpus, capsys):
    def rejoin(*argv):
        assert main(["train", *argv]) == 2
        return capsys.readouterr().err

    ps = {"parallel": {"nproc": 3, "timeout_s": 5}, "async": {"mode": "ps"}}
    assert "no config.toml" in rejoin("--rejoin", str(tmp_path / "nowhere"), "--worker", "0")
    assert "go together" in rejoin("--rejoin", str(tmp_path))
    run_dir = _run_dir(tmp_path, corpus, **ps)
    assert "as it is" in rejoin("--rejoin", str(run_dir), "--worker", "0", "--nproc", "2")
    assert "workers, numbered 0..1" in rejoin("--rejoin", str(run_dir), "--worker", "2")
    assert "has finished, or not started" in rejoin("--rejoin", str(run_dir), "--worker", "1")
    # an address left by a server that was killed: nothing listens there any more
    publish_address(run_dir, f"127.0.0.1:{free_port()}", 2, 1)
    assert (run_dir / ADDRESS_FILE).exists()
    assert "does not answer" in rejoin("--rejoin", str(run_dir), "--worker", "1")
    sync_dir = tmp_path / "sync"
    sync_dir.mkdir()
    write_config(sync_dir, config_from_dict(tiny_tree(tmp_path, corpus, parallel={"nproc": 2})))
    assert 'async.mode="ps"' in rejoin("--rejoin", str(sync_dir), "--worker", "0")


def _train_noting_pids(rank, world, tree, run_dir):
    (Path(run_dir) / f"rank{rank}.pid").write_text(str(os.getpid()))
    cfg = config_from_dict(tree)
    train_loop(cfg, Path(run_dir), None, init_distributed(cfg), trainer.StopFlag())
    return rank


def _records(run_dir: Path) -> list[dict]:
    """metrics.jsonl as far as it is written (the server may be writing its last line)."""
    path = run_dir / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def test_loom_train_rejoin_replaces_a_killed_worker(tmp_path, corpus):
    # the world runs the trainer's [async] mode="ps" without end; worker 1's process is killed,
    # `loom train --rejoin` takes its place, and SIGTERM to the server then ends the run
    tree = tiny_tree(tmp_path, corpus, parallel={"nproc": 3, "timeout_s": 20},
                     run={"log_every": 10, "eval_every": 10**6}, train={"steps": 10**6},
                     **{"async": {"mode": "ps", "worker_timeout_s": 20}})
    run_dir = tmp_path / "ps"
    run_dir.mkdir()
    write_config(run_dir, config_from_dict(tree))
    outcome: dict = {}

    def world():
        try:
            run_world(_train_noting_pids, 3, tree, str(run_dir), timeout_s=90,
                      collective_timeout_s=20)
        except RuntimeError as err:
            outcome["error"] = str(err)
    thread = threading.Thread(target=world)
    thread.start()

    def wait_for(what: str, done) -> None:
        deadline = time.monotonic() + 60
        while not done():
            assert thread.is_alive() and time.monotonic() < deadline, f"no {what}: {outcome}"
            time.sleep(0.1)

    rejoin = None
    try:
        wait_for("records", lambda: len(_records(run_dir)) >= 2)
        assert (run_dir / ADDRESS_FILE).exists()
        os.kill(int((run_dir / "rank2.pid").read_text()), signal.SIGKILL)
        wait_for("loss", lambda: _records(run_dir)[-1]["workers_lost"] == 1)
        rejoin = subprocess.Popen([sys.executable, "-m", "loomtrain", "train", "--rejoin",
                                   str(run_dir), "--worker", "1"], stderr=subprocess.PIPE,
                                  text=True)
        wait_for("rejoin", lambda: _records(run_dir)[-1]["workers_rejoined"] == 1)
        seen = len(_records(run_dir))
        wait_for("updates after the rejoin", lambda: len(_records(run_dir)) >= seen + 3)
        os.kill(int((run_dir / "rank0.pid").read_text()), signal.SIGTERM)
        stderr = rejoin.communicate(timeout=60)[1]
        thread.join(60)
    finally:
        if rejoin is not None and rejoin.poll() is None:
            rejoin.kill()
    assert rejoin.returncode == 0, stderr[-3000:]
    pushed = re.search(r"worker 1 stopped by the server at update \d+ after (\d+) gradients",
                       stderr)
    assert pushed and int(pushed.group(1)) > 0, stderr[-3000:]
    assert "ranks [2] exited without a result" in outcome["error"]  # the killed one
    last = _records(run_dir)[-1]
    assert last["workers_lost"] == 1 and last["workers_rejoined"] == 1
    # its pushes, bar one after the last update, and the dead process's
    assert last["applied_by_worker"][1] >= int(pushed.group(1)) - 1
    assert not (run_dir / ADDRESS_FILE).exists()  # withdrawn when the server ended
