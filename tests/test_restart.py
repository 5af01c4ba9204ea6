"""Automatic restarts (`loom train --max-restarts N`, train/restart.py): a rank SIGKILLed from
outside brings every rank back from the newest checkpoint, and the run ends with the losses of
an uninterrupted one, each step logged once; with no checkpoint yet it starts over with its
metrics emptied; the (N+1)-th death ends the run; a bad-input error is never restarted; the
restarted ranks hold the run folder's lock and end with their launcher; `torchrun
--max-restarts` restarts resume the same way. The restart rule itself is checked without
processes.

The kills wait for what they need (a checkpoint published, a step logged), never for a time:
at ~25-150 ms a step (2 loaded cores), STEPS leaves seconds of margin after the step a test
waits for. Every subprocess has a timeout and is killed, with its ranks, if the test fails."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import tiny_tree
from harness import alive, free_port, wait_until

from loomtrain.train import checkpoint
from loomtrain.train.config import config_from_dict, config_to_toml
from loomtrain.train.metrics import read_metrics
from loomtrain.train.restart import Restarts, rank_pids
from loomtrain.train.runlock import LOCK_NAME

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not Path("/proc/self/comm").exists(),
                                 reason="finds the ranks in /proc")]
LOOM = [sys.executable, "-m", "loomtrain", "train"]
STEPS, EVERY = 30, 3


def _config(tmp_path: Path, corpus: Path, every: int = EVERY) -> Path:
    tree = tiny_tree(tmp_path, corpus, parallel={"nproc": 2}, train={"steps": STEPS},
                     checkpoint={"every": every, "keep": 2}, run={"eval_every": 10**6})
    path = tmp_path / "t.toml"
    path.write_text(config_to_toml(config_from_dict(tree)))
    return path


def _losses(run_dir: Path) -> dict[int, float]:
    records = read_metrics(run_dir)
    steps = [r["step"] for r in records]
    assert steps == list(range(1, STEPS + 1)), steps  # each step logged once
    return {r["step"]: r["loss"] for r in records}


class _Run:
    """`loom train ARGS` in its own session, its stderr in a file; `end` kills what is left."""

    def __init__(self, tmp_path: Path, args: list[str], env: dict | None = None):
        self.log = tmp_path / "loom.txt"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=out, start_new_session=True,
                                         env=None if env is None else {**os.environ, **env})
        self.ranks: set[int] = set()  # every rank pid seen, to be sure none is left

    def rank_pids(self) -> dict[int, int]:
        ranks = rank_pids(self.proc.pid)
        self.ranks.update(ranks.values())
        return ranks

    def text(self) -> str:
        return self.log.read_text()

    def wait(self, timeout_s: float = 180) -> int:
        return self.proc.wait(timeout_s)

    def end(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in self.ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _kill_rank(run: _Run, rank: int, restarts_before: int) -> int:
    """SIGKILL `rank` of the attempt after `restarts_before` restarts; its pid."""
    pid = wait_until(f"rank {rank} of attempt {restarts_before + 1}",
                     lambda: run.rank_pids().get(rank), 60)
    os.kill(pid, signal.SIGKILL)
    return pid


def _stepped_after_resume(run: _Run, run_dir: Path) -> bool:
    """Whether the restarted ranks logged a step: rank 0 says "resumed from ... at step S" once
    it has cut metrics.jsonl back to S (train/loop.py resume_run), so a record past S is new."""
    found = re.search(r"resumed from \S+ at step (\d+)", run.text())
    return found is not None and any(r["step"] > int(found[1]) for r in read_metrics(run_dir))


def _locked(run_dir: Path) -> bool:
    """Whether someone holds the run folder's lock (runlock.py: an flock on loom.lock)."""
    fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> dict[int, float]:
    """The per-step losses of the uninterrupted run."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = subprocess.run([*LOOM, str(_config(tmp, corpus))], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _losses(tmp / "runs" / "t")


@pytest.fixture(scope="module")
def restarted(tmp_path_factory, corpus) -> SimpleNamespace:
    """A run with --max-restarts 2 whose rank 1 is SIGKILLed once a checkpoint is published."""
    tmp = tmp_path_factory.mktemp("restarted")
    run_dir = tmp / "runs" / "t"
    run = _Run(tmp, [*LOOM, str(_config(tmp, corpus)), "--max-restarts", "2"])
    try:
        wait_until("a checkpoint", lambda: checkpoint.list_checkpoints(run_dir), 120)
        pid = _kill_rank(run, 1, 0)
        killed = time.monotonic()
        wait_until("the restart", lambda: "restart 1 of 2" in run.text(), 60)
        restarted_s = time.monotonic() - killed
        wait_until("a step of the restarted run", lambda: _stepped_after_resume(run, run_dir), 60)
        print(f"rank killed -> restart line {restarted_s:.2f} s, -> next step logged "
              f"{time.monotonic() - killed:.2f} s (polled every 20 ms)")
        code = run.wait()
        return SimpleNamespace(code=code, text=run.text(), pid=pid, run_dir=run_dir,
                               ranks=set(run.ranks))
    finally:
        run.end()


def test_a_killed_rank_is_restarted_and_ends_with_the_losses_of_an_uninterrupted_run(
        restarted, reference):
    assert restarted.code == 0, restarted.text[-3000:]
    lines = [line for line in restarted.text.splitlines() if line.startswith("loom: ")]
    assert len(lines) == 1, restarted.text
    prefix = f"loom: rank 1 (pid {restarted.pid}) was killed by signal SIGKILL; restart 1 of 2: "
    assert lines[0].startswith(prefix + "resuming from checkpoint step "), lines
    step = int(lines[0].rsplit(" ", 1)[1])
    assert step % EVERY == 0 and 0 < step < STEPS
    assert (f"resumed from {checkpoint.step_dir(restarted.run_dir, step)} at step {step}"
            in restarted.text)
    assert "Traceback" not in restarted.text and "error" not in restarted.text
    # fp32 on CPU: a resume is bitwise (docs/checkpoints.md, "Resume"), so equal, not close
    assert _losses(restarted.run_dir) == reference
    assert not (restarted.run_dir / LOCK_NAME).exists()  # a normal end removes the lock
    assert not any(alive(pid) for pid in restarted.ranks)


def test_a_bad_input_error_in_the_ranks_is_not_restarted(restarted):
    """Each rank fails to load the checkpoint into a wider model (exit 2): a restart would fail
    alike, so there is none, and the message is printed once."""
    proc = subprocess.run([*LOOM, "--resume", str(restarted.run_dir), "--set", "model.d_model=64",
                           "--set", f"train.steps={STEPS + 3}", "--max-restarts", "3"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "could not be loaded" in errors[0], proc.stderr
    assert lines == [f"run folder: {restarted.run_dir}", errors[0]], proc.stderr  # no restart


def test_without_a_checkpoint_a_restart_starts_over_and_one_death_too_many_fails(tmp_path, corpus):
    run_dir = tmp_path / "runs" / "t"
    run = _Run(tmp_path, [*LOOM, str(_config(tmp_path, corpus, every=0)), "--max-restarts", "1"])
    try:
        wait_until("step 2", lambda: len(read_metrics(run_dir)) >= 2, 120)
        first = _kill_rank(run, 0, 0)
        wait_until("the restart", lambda: "restart 1 of 1" in run.text(), 60)
        assert (f"loom: rank 0 (pid {first}) was killed by signal SIGKILL; restart 1 of 1: no "
                "checkpoint yet: starting the run over") in run.text()
        # the lost attempt's records are gone: the new attempt logs from step 1
        steps = wait_until("2 steps of the new attempt",
                           lambda: (s := [r["step"] for r in read_metrics(run_dir)])[1:] and s, 60)
        assert steps == list(range(1, len(steps) + 1)), steps
        assert not checkpoint.list_checkpoints(run_dir)
        # the restarted ranks and the launcher hold the lock, and it still names the launcher
        assert _locked(run_dir) and (run_dir / LOCK_NAME).read_text() == f"{run.proc.pid}\n"
        second = _kill_rank(run, 1, 1)
        assert run.wait() == 1, run.text()[-3000:]
        text = run.text()
        assert (f"loom: rank 1 (pid {second}) was killed by signal SIGKILL; no restart left "
                "(run.max_restarts=1)") in text
        # the error names the dead rank: the survivor's heartbeat (comm/heartbeat.py) or the
        # launcher's note of the first rank to end
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and ("rank 1 (host " in errors[0] and f"pid {second})" in errors[0]
                                     or f"rank 1 (pid {second})" in errors[0]), text
        assert text.count("restart 1 of 1") == 1 and "Traceback" not in text
        assert not (run_dir / LOCK_NAME).exists()
        assert not any(alive(pid) for pid in run.ranks)
    finally:
        run.end()


def test_restarted_ranks_end_with_their_launcher_and_save(tmp_path, corpus):
    """The orphan rule across a restart (train/orphan.py): restarted ranks are children of the
    same launcher thread, so its SIGKILL reaches them as a stop; they save and end."""
    run_dir = tmp_path / "runs" / "t"
    run = _Run(tmp_path, [*LOOM, str(_config(tmp_path, corpus)), "--max-restarts", "1"])
    try:
        wait_until("a checkpoint", lambda: checkpoint.list_checkpoints(run_dir), 120)
        _kill_rank(run, 0, 0)
        wait_until("the restart", lambda: "restart 1 of 1" in run.text(), 60)
        wait_until("a step of the restarted run", lambda: _stepped_after_resume(run, run_dir), 60)
        ranks = run.rank_pids()
        assert len(ranks) == 2, ranks
        run.proc.kill()
        run.proc.wait(30)
        wait_until("the restarted ranks' end", lambda: not any(alive(p) for p in ranks.values()), 20)
        # the stop saved its step (unless a periodic checkpoint already held it)
        stop = re.search(r"stopped by SIGTERM before step (\d+); checkpoint step (\d+) is saved",
                         run.text())
        assert stop is not None and int(stop[2]) == int(stop[1]) - 1, run.text()[-3000:]
        assert checkpoint.list_checkpoints(run_dir)[-1] == checkpoint.step_dir(run_dir, int(stop[2]))
        # the kernel drops the lock with its last holder; a rank's main thread shows as ended
        # (a zombie) while its other threads, which share its files, may still be exiting
        wait_until("the lock's release", lambda: not _locked(run_dir), 20)
    finally:
        run.end()


def test_a_torchrun_restart_resumes_from_the_newest_checkpoint(tmp_path, corpus, reference):
    """`torchrun --max-restarts 1`: torchrun restarts the ranks; each `loom` process sees the
    restart count and resumes the run folder's newest checkpoint. With torchrun's rendezvous
    store shared with the ranks (its default), restarted ranks were handed the previous
    attempt's gloo addresses and failed to connect in 1 of 5 runs (pytorch/pytorch#135712;
    0 of 7 with the store not shared): docs/checkpoints.md, "Restarts", says to set it."""
    run_dir = tmp_path / "runs" / "t"
    run = _Run(tmp_path, [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                          f"127.0.0.1:{free_port()}", "-m", "loomtrain", "train",
                          str(_config(tmp_path, corpus))],
               env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    try:
        wait_until("a checkpoint", lambda: checkpoint.list_checkpoints(run_dir), 120)
        victim = wait_until("torchrun's rank 1", lambda: _torchrun_rank(run.proc.pid, 1), 30)
        run.ranks.add(victim)
        os.kill(victim, signal.SIGKILL)
        assert run.wait() == 0, run.text()[-3000:]
        assert "loom: restarted by torchrun (restart 1 of 1): resuming from checkpoint step " \
            in run.text()
        assert _losses(run_dir) == reference
    finally:
        run.end()


def _torchrun_rank(agent: int, rank: int) -> int | None:
    """The pid of torchrun's worker `rank` (its RANK is in the environment it was started with)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
            if (int(stat.read_text().rsplit(")", 1)[1].split()[1]) == agent
                    and f"RANK={rank}".encode() in environ):
                return int(stat.parent.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


def _failure(pid: int, exitcode: int) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, exitcode=exitcode)  # what Restarts reads of a ProcessFailure


def test_the_restart_rule(tmp_path, tiny, capsys):
    """No processes: which failures are restarted, how often, and what is said."""
    errors = tmp_path / "errors"
    errors.mkdir()
    cfg = tiny(run={"max_restarts": 2})
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True)
    payload = ({}, str(run_dir), "old", 1, None, str(errors))
    with Restarts(cfg, run_dir, [], errors) as rule:
        (errors / "12-4.txt").write_text("a peer is gone")  # a consequence: no reason to stop
        assert rule.after({1: _failure(11, -9)}, payload) == ({}, str(run_dir), None, 1, None,
                                                              str(errors))
        assert not list(errors.iterdir())  # the lost attempt's messages go with it
        assert "loom: rank 1 (pid 11) was killed by signal SIGKILL; restart 1 of 2: no " \
            "checkpoint yet: starting the run over" in capsys.readouterr().err
        assert rule.after({0: _failure(21, 1)}, payload) is not None
        assert rule.after({0: _failure(31, 1)}, payload) is None  # the third failure: no more
        assert "loom: rank 0 (pid 31) exited with code 1; no restart left (run.max_restarts=2)" \
            in capsys.readouterr().err
    for deterministic in (2, 3):  # bad input, the non-finite abort: a restart repeats them
        with Restarts(cfg, run_dir, [], errors) as rule:
            assert rule.after({0: _failure(41, deterministic)}, payload) is None
            (errors / f"52-{deterministic}.txt").write_text("why")  # told by a rank, torch saw 4
            assert rule.after({0: _failure(51, 4)}, payload) is None
            (errors / f"52-{deterministic}.txt").unlink()
    with Restarts(cfg, run_dir, [signal.SIGTERM], errors) as rule:  # a stop is not a fault
        assert rule.after({0: _failure(61, -9)}, payload) is None
    with Restarts(tiny(), run_dir, [], errors) as rule:  # max_restarts = 0: as before, silent
        assert rule.after({0: _failure(71, -9)}, payload) is None
    assert capsys.readouterr().err == ""
