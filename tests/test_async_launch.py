"""`loom train --nproc N` with `[async] mode = "ps"` under its own launcher
(train/launch.py launch_tolerant): a worker's death does not stop the run.

Each test runs `python -m loomtrain train` as a subprocess (the tiny GPT, 3 ranks: the server
and two workers), reads the ranks' pids from the launcher's first line on stderr and kills or
signals processes mid-run; every wait is bounded, and the subprocess is killed if the test
fails. Measured: 5-30 s each on 2 shared cores (idle to loaded)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w
from conftest import tiny_tree
from test_async_rejoin import _records

from loomtrain.asyncsgd.rejoin import ADDRESS_FILE
from loomtrain.train import checkpoint

pytestmark = pytest.mark.timeout(120)  # each test; its own waits are shorter
LOOM = [sys.executable, "-m", "loomtrain", "train"]
STEPS = 200  # ~3 s of updates with both workers (~80 per s, measured)


class Run:
    """A `loom train` process with its stderr in a file, and its run folder."""

    def __init__(self, tmp_path: Path, corpus: Path, steps: int = STEPS, log_every: int = 5,
                 **asgd):
        tree = tiny_tree(tmp_path, corpus, parallel={"nproc": 3, "timeout_s": 20},
                         run={"log_every": log_every, "eval_every": 10**6}, train={"steps": steps},
                         **{"async": {"mode": "ps", "worker_timeout_s": 20, **asgd}})
        config = tmp_path / "ps.toml"
        config.write_text(tomli_w.dumps(tree))
        self.run_dir = tmp_path / "runs" / "t"
        self.stderr_path = tmp_path / "stderr.txt"
        with self.stderr_path.open("w") as err:  # its own session: signals reach it alone
            self.proc = subprocess.Popen([*LOOM, str(config)], stdout=err, stderr=err,
                                         start_new_session=True)

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def records(self) -> list[dict]:
        return _records(self.run_dir)

    def wait_for(self, what: str, done, timeout_s: float = 60):
        deadline = time.monotonic() + timeout_s
        while not (value := done()):
            assert self.proc.poll() is None, f"exited {self.proc.returncode} before {what}: " \
                                             f"{self.stderr()[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
            time.sleep(0.05)
        return value

    def pids(self) -> list[int]:
        """[server, worker 0, worker 1], from the launcher's first line."""
        found = self.wait_for("pids", lambda: re.search(r"ranks started as pids \[([\d, ]+)\]",
                                                        self.stderr()))
        return [int(pid) for pid in found.group(1).split(",")]

    def finish(self, timeout_s: float = 60) -> int:
        self.proc.wait(timeout_s)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def launched(tmp_path, corpus):
    runs = []

    def start(**kwargs) -> Run:
        runs.append(Run(tmp_path, corpus, **kwargs))
        return runs[-1]
    yield start
    for run in runs:  # a failed test leaves no process behind
        run.kill()


def _dies(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def test_a_killed_worker_does_not_stop_the_run(launched):
    run = launched()
    _, _, worker_1 = run.pids()
    killed_at = run.wait_for("records", lambda: len(run.records()) >= 2 and run.records()[-1])
    _dies(worker_1)
    assert run.finish() == 0, run.stderr()[-3000:]
    assert killed_at["step"] < STEPS  # mid-run
    err = run.stderr()
    assert (f"loom: worker 1 (rank 2, pid {worker_1}) was killed by signal SIGKILL; the "
            f"parameter server and the other workers go on") in err
    assert "Traceback" not in err and "error:" not in err
    records = run.records()
    last = records[-1]
    assert last["step"] == STEPS and last["workers_lost"] == 1
    # worker 0 made every update after the server counted worker 1 lost. Not "after the
    # record seen before the kill": worker 1 still applied updates between that record and
    # the SIGKILL (4 of them once, 2026-12-07), which made that bound race the kill
    lost = next(r for r in records if r.get("workers_lost") == 1)
    assert killed_at["step"] <= lost["step"] < STEPS
    assert last["applied_by_worker"][0] >= STEPS - lost["step"]
    assert checkpoint.list_checkpoints(run.run_dir)[-1].name == f"step_{STEPS:08d}"
    assert not (run.run_dir / ADDRESS_FILE).exists()  # withdrawn when the server ended


def test_a_killed_worker_rejoins_and_the_run_finishes(launched):
    # worker 0 is slowed 200x (by its measured compute time), so that after worker 1 is killed
    # the run waits for the rejoined worker 1, whose process took 1.4-7 s to start and connect
    # (measured, 2 cores idle to loaded), while worker 0 alone would need 40-90 s for the rest
    # (2-4 ms of compute per gradient); its worker_timeout_s covers a step at 10x that
    steps = 120
    run = launched(steps=steps, worker_slowdown=[200.0, 1.0], worker_timeout_s=60)
    _, _, worker_1 = run.pids()
    run.wait_for("records", lambda: len(run.records()) >= 2)
    _dies(worker_1)
    lost = int(run.wait_for("the loss", lambda: re.search(
        r"worker 1 \(rank 2\) lost at version (\d+)", run.stderr())).group(1))
    rejoin = subprocess.Popen([*LOOM, "--rejoin", str(run.run_dir), "--worker", "1"],
                              stderr=subprocess.PIPE, text=True)
    try:
        assert run.finish(timeout_s=90) == 0, run.stderr()[-3000:]
        stderr = rejoin.communicate(timeout=30)[1]
    finally:
        if rejoin.poll() is None:
            rejoin.kill()
    assert rejoin.returncode == 0, stderr[-3000:]
    pushed = re.search(r"worker 1 stopped by the server at update \d+ after (\d+) gradients",
                       stderr)
    assert pushed and int(pushed.group(1)) > 0, stderr[-3000:]
    last = run.records()[-1]
    assert last["step"] == steps and lost < steps
    assert last["workers_lost"] == 1 and last["workers_rejoined"] == 1
    # the rejoined process's gradients were applied: at the loss, at most `lost` updates were
    # worker 1's (measured: the rejoined process then pushed 50-100 gradients, all applied)
    assert sum(last["applied_by_worker"]) == steps  # plain applies every arrival
    assert last["applied_by_worker"][1] > lost
    assert checkpoint.list_checkpoints(run.run_dir)[-1].name == f"step_{steps:08d}"


def test_sigterm_to_loom_train_stops_a_ps_run_with_a_checkpoint(launched):
    run = launched(steps=10**6)
    run.pids()
    run.wait_for("records", lambda: len(run.records()) >= 2)
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)  # the launcher alone, as `kill PID` does
    assert run.finish() == 0, run.stderr()[-3000:]
    assert time.monotonic() - sent < 20, "the ranks were not stopped by the forwarded signal"
    err = run.stderr()
    assert "stopped by SIGTERM before step" in err and "Traceback" not in err  # as every mode
    assert "loom: worker" not in err  # every worker ended normally
    meta = checkpoint.read_meta(checkpoint.list_checkpoints(run.run_dir)[-1])
    assert meta["stopped_by"] == "SIGTERM" and meta["step"] == run.records()[-1]["step"]


def test_a_dead_server_stops_the_workers_and_fails_the_run(launched):
    run = launched(steps=10**6)
    server, *workers = run.pids()
    run.wait_for("records", lambda: len(run.records()) >= 1)
    _dies(server)
    assert run.finish() == 1, run.stderr()[-3000:]
    err = run.stderr()
    assert "error: the parameter server (rank 0) failed (exit codes [-9])" in err
    assert "loom: worker" not in err  # the workers' ends are not news
    for pid in workers:  # killed by the launcher, and reaped
        assert not Path(f"/proc/{pid}").exists()


def test_losing_every_worker_saves_the_server_and_fails_the_run(launched):
    # a record at every update: the last update before the losses always has its record
    # already, so the final record repeats it with the losses counted (CI once caught the
    # workers dying right after a record, and the last record then said no worker was lost)
    run = launched(steps=10**6, log_every=1)
    _, *workers = run.pids()
    run.wait_for("records", lambda: len(run.records()) >= 1)
    for pid in workers:
        _dies(pid)
    assert run.finish() == 4, run.stderr()[-3000:]  # a communication failure
    err = run.stderr()
    version = run.records()[-1]["step"]
    assert run.records()[-1]["workers_lost"] == 2
    assert re.search(rf"every worker was lost, after {version} of 1000000 updates; the "
                     rf"server's state at update {version} is saved", err), err[-3000:]
    # the server's own message, printed once by the launcher (through the errors folder,
    # train/messages.py), not by the server and then summed up by the launcher
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err[-3000:]
    assert errors[0].startswith("error: async SGD: every worker was lost"), err[-3000:]
    assert "Traceback" not in err
    assert checkpoint.list_checkpoints(run.run_dir)[-1].name == f"step_{version:08d}"
