"""A run folder holds one writer (train/runlock.py), and ranks never outlive their `loom train`
(train/orphan.py). One CLI run of 2 ranks carries every check, to save launches:

(b) while it runs (frozen by SIGSTOP, so that its folder cannot change meanwhile), a second
    `loom train --resume` of its folder exits 2 naming the folder and the holder's pid, and
    changes nothing in it;
(a) the launcher is SIGKILLed (its ranks frozen first, so that the resume below surely finds
    them alive): once they run again, both ranks save the stop's checkpoint and are gone within
    20 s (measured: 0.1-0.4 s, by the kernel's parent-death signal);
(c) a resume started right after the kill waits for those ranks (they hold the lock), then
    takes the lock and continues from the stop's checkpoint to the end.

Every subprocess has a timeout, and every process is killed if the test fails."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_tree
from harness import alive, ranks_of, wait_until
from loomtrain.train import checkpoint
from loomtrain.train.config import config_from_dict, config_to_toml
from loomtrain.train.metrics import read_metrics
from loomtrain.train.runlock import LOCK_NAME

pytestmark = pytest.mark.timeout(300)
LOOM = [sys.executable, "-m", "loomtrain", "train"]
STEPS = 80  # ~25-100 ms a step: seconds of margin after the step the test waits for


def _snapshot(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks in /proc")
def test_one_writer_per_folder_and_no_rank_outlives_its_launcher(tmp_path, corpus):
    tree = tiny_tree(tmp_path, corpus, parallel={"nproc": 2}, train={"steps": STEPS},
                     run={"eval_every": 10**6})
    config = tmp_path / "t.toml"
    config.write_text(config_to_toml(config_from_dict(tree)))
    run_dir = tmp_path / "runs" / "t"
    err_first, err_resume = tmp_path / "first.txt", tmp_path / "resume.txt"
    with err_first.open("w") as err:  # its own session: signalled without pytest
        first = subprocess.Popen([*LOOM, str(config)], stdout=err, stderr=err, start_new_session=True)
    resumed, ranks = None, []
    try:
        wait_until("step 3", lambda: (run_dir / "metrics.jsonl").exists()
              and len(read_metrics(run_dir)) >= 3, 120)
        ranks = ranks_of(first.pid)
        assert len(ranks) == 2, ranks
        assert (run_dir / LOCK_NAME).read_text() == f"{first.pid}\n"

        # (b) a second run of the folder while the first runs (frozen: the folder stays still)
        os.killpg(first.pid, signal.SIGSTOP)
        before = _snapshot(run_dir)
        second = subprocess.run([*LOOM, "--resume", str(run_dir)], capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        assert f"run folder '{run_dir}' is in use: pid {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr and second.stderr.count("\n") == 1, second.stderr
        assert _snapshot(run_dir) == before

        # (a) the launcher SIGKILLed, its ranks still frozen: a resume must wait for them
        first.kill()
        first.wait(30)
        with err_resume.open("w") as err:
            resumed = subprocess.Popen([*LOOM, "--resume", str(run_dir)], stdout=err, stderr=err,
                                       start_new_session=True)
        wait_until("the resume waiting", lambda: "waiting for the ranks" in err_resume.read_text(), 60)
        assert resumed.poll() is None and all(alive(pid) for pid in ranks)
        os.killpg(first.pid, signal.SIGCONT)  # the ranks' group is the launcher's session
        thawed = time.monotonic()
        wait_until("the ranks' end", lambda: not any(alive(pid) for pid in ranks), 20)
        ended_s = time.monotonic() - thawed
        stop = checkpoint.list_checkpoints(run_dir)[-1]
        meta = checkpoint.read_meta(stop)
        assert meta["stopped_by"] == "SIGTERM", meta  # the parent-death signal, as a stop
        assert "stopped by SIGTERM before step" in err_first.read_text()

        # (c) the lock was freed by their end: the resume continues from the stop's checkpoint
        assert resumed.wait(180) == 0, err_resume.read_text()[-3000:]
        out = err_resume.read_text()
        assert f"resumed from {stop} at step {meta['step']}" in out and "Traceback" not in out
        steps = [r["step"] for r in read_metrics(run_dir)]
        assert steps == list(range(1, STEPS + 1))  # each step once
        assert not (run_dir / LOCK_NAME).exists()  # a normal end removes the lock file
        print(f"ranks ended {ended_s:.2f} s after they could run; stop saved at step {meta['step']}")
    finally:
        for proc in (first, resumed):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pid in ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
