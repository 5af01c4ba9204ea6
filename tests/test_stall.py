"""A stalled, dead or mismatched rank is named (issue 26, point 3): the judging of heartbeat
records without processes (comm/stall.py), a mismatch named in-process, and `loom train`
runs in which a rank is SIGSTOPped or SIGKILLed. Every process has a timeout; wall-clock
bounds are generous (measured times are 10-100x below them: docs/training.md)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import refused, tiny_tree
from harness import ranks_of, run_world
from loomtrain.comm.activity import Waiting
from loomtrain.comm.stall import Finding, Peer, behind, judge, ranks_text
from loomtrain.train.config import config_from_dict, config_to_toml
from loomtrain.train.metrics import read_metrics

pytestmark = pytest.mark.timeout(300)
LOOM = [sys.executable, "-m", "loomtrain", "train"]
QUIET_OMP = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}  # see test_checkpoint.py


def _record(rank, seq=5, op="all_reduce", waiting=True, left=None):
    return {"rank": rank, "host": "h1", "pid": 100 + rank, "pid_ns": "", "beat": 7, "wall": 0.0,
            "last": ["dp", op, seq], "entered": {"dp": [seq, op]}, "left": left,
            "waiting": waiting and {"axis": "dp", "op": op, "seq": seq, "ranks": "[0, 1, 2]"}}


def _waiting(seq=5, op="all_reduce"):
    return Waiting("dp", op, seq, [0, 1, 2], 0.0)


def _fresh(record):
    return Peer(record, age_s=0.4, watched_s=0.4)


# --- judging, without processes ---

def test_a_stale_peer_is_named_alike_by_every_rank_that_waits_for_it():
    stopped = Peer(_record(2), age_s=31.0, watched_s=29.0)
    by_0 = judge(0, _waiting(6), {1: _fresh(_record(1, 6)), 2: stopped}, 30.0, 2.0)
    by_1 = judge(1, _waiting(6), {0: _fresh(_record(0, 6)), 2: stopped}, 30.0, 2.0)
    assert by_0 == by_1 and by_0.code == 4 and by_0.cause
    assert by_0.text.startswith("rank 2 (host h1, pid 102) stopped answering: its heartbeat is "
                                "over 30 s old (parallel.heartbeat_timeout_s)")
    assert "waiting in all_reduce #5 on mesh axis 'dp' (ranks [0, 1, 2])" in by_0.text


def test_a_peer_is_stale_only_once_this_rank_has_seen_its_beat_unchanged():
    # its clock behind by more than the timeout: old by wall time, but it keeps beating
    skewed = Peer(_record(2, 6), age_s=45.0, watched_s=0.9)
    assert judge(0, _waiting(6), {2: skewed}, 30.0, 2.0) is None
    # no record at all: stale once watched for the timeout
    silent = Peer(None, age_s=30.0, watched_s=30.0)
    assert judge(0, _waiting(6), {2: silent}, 30.0, 2.0).text.startswith(
        "rank 2 stopped answering")


def test_a_gone_process_is_named_dead_and_a_left_message_is_adopted():
    dead = Peer(_record(2, waiting=False), age_s=0.5, watched_s=0.0, gone=True)
    found = judge(0, _waiting(6), {1: _fresh(_record(1, 6)), 2: dead}, 30.0, 0.0)
    assert found.text.startswith("rank 2 (host h1, pid 102) ended without a message")
    assert "the last it had entered was all_reduce #5 on mesh axis 'dp'" in found.text
    assert found.code == 1  # the job's code for a crash; the rank itself exits 4 (run.py)
    # one reading is not enough while the watchdog probes (min_watch_s)
    assert judge(0, _waiting(6), {2: dead}, 30.0, 2.0) is None
    # a peer that left on a cause: every rank ends on its text and code
    told = Peer(_record(1, left={"text": "bad checkpoint", "code": 2}), 0.1, 0.1)
    assert judge(0, _waiting(6), {1: told, 2: dead}, 30.0, 0.0) == Finding("bad checkpoint", 2)


def test_peers_gone_after_their_own_failed_collective_are_not_taken_for_the_dead_one():
    # rank 3 of 4 SIGKILLed; ranks 0 and 2 saw their all-reduce fail and ended on that (no
    # cause found yet): rank 1, judging last, finds three processes gone. It named rank 0,
    # the lowest, in 7 of 32 rounds of benchmarks/faults.py (2026-12-06)
    failed = {"text": "collective all_reduce ... failed", "code": 4, "cause": False}
    peers = {r: Peer(_record(r, 6, left=failed), 0.1, 0.1, gone=True) for r in (0, 2)}
    peers[3] = Peer(_record(3), age_s=0.3, watched_s=0.3, gone=True)
    found = judge(1, _waiting(6), peers, 30.0, 0.0)
    assert found.text.startswith("rank 3 (host h1, pid 103) ended without a message")
    assert "So did" not in found.text and found.code == 1
    # only a cause is adopted; a consequence alone names nothing
    assert judge(1, _waiting(6), {0: peers[0], 2: peers[2]}, 30.0, 0.0) is None


def test_a_different_collective_as_the_same_op_is_a_mismatch_named_alike():
    by_0 = judge(0, _waiting(5, "all_reduce"), {2: _fresh(_record(2, 5, "broadcast"))}, 30.0, 2.0)
    by_2 = judge(2, _waiting(5, "broadcast"), {0: _fresh(_record(0, 5, "all_reduce"))}, 30.0, 2.0)
    assert by_0 == by_2 and by_0.code == 4
    assert by_0.text.startswith("ranks 0 and 2 issued different collectives as op #5 on mesh "
                                "axis 'dp' (ranks [0, 1, 2]): rank 0 all_reduce, rank 2 broadcast")
    # a peer behind (op #4) or past it (#6) is no mismatch; nor are a send's two ends
    for seq in (4, 6):
        assert judge(0, _waiting(5), {2: _fresh(_record(2, seq, "broadcast"))}, 30.0, 2.0) is None
    assert judge(0, _waiting(5, "recv"), {2: _fresh(_record(2, 5, "send"))}, 30.0, 2.0) is None


def test_behind_notes_the_peers_that_have_not_reached_the_op():
    note = behind(_waiting(6), {1: _fresh(_record(1, 6)), 2: _fresh(_record(2, 5, waiting=False))})
    assert note.startswith("rank 2 (host h1, pid 102), heartbeat 0.4 s old, had not reached it: "
                           "at its last heartbeat it was outside any collective")
    assert "rank 1" not in note


def test_ranks_text_is_short_at_any_size():
    assert ranks_text([0, 1, 2]) == "[0, 1, 2]"
    assert ranks_text(list(range(0, 1024, 8))) == "[0, 8, ..., 1016] (128 ranks)"


def test_heartbeat_timeout_is_validated(capsys):
    message = refused(capsys, ["train", "--dry-run", "--set", "parallel.heartbeat_timeout_s=0.5"])
    assert "parallel.heartbeat_timeout_s=0.5 is too short" in message
    assert "give 0 (no heartbeat) or at least 1" in message


# --- a mismatch, in-process: the heartbeat's finding becomes the timeout's message ---

def _mismatched(rank, world):
    import torch

    from loomtrain import comm
    from loomtrain.comm.heartbeat import start_heartbeat
    from loomtrain.mesh import build_mesh

    mesh = build_mesh({"dp": world})
    beat = start_heartbeat(mesh, 2.0)  # no on_cause: the op's own timeout reports
    comm.all_reduce(torch.ones(3), mesh, "dp")
    try:
        if rank == 0:
            comm.all_reduce(torch.ones(1000), mesh, "dp")
        else:
            comm.broadcast(torch.ones(1000), mesh, "dp")
        return None
    except comm.CollectiveError as err:
        return err.named, err.code, str(err)
    finally:
        beat.stop()


def test_a_mismatch_is_named_in_the_timeout_message():
    results = run_world(_mismatched, 2, timeout_s=120, collective_timeout_s=5)
    expected = ("ranks 0 and 1 issued different collectives as op #2 on mesh axis 'dp' (ranks "
                "[0, 1]): rank 0 all_reduce, rank 1 broadcast.")
    for named, code, text in results:
        assert named and code == 4 and text.startswith(expected), results


# --- `loom train` with a rank stopped or killed ---

def _launch(tmp_path, corpus, nproc: int, steps: int, **parallel):
    tree = tiny_tree(tmp_path, corpus, train={"steps": steps, "global_batch": 12},
                     parallel={"nproc": nproc, **parallel}, run={"eval_every": 10**6})
    config = tmp_path / "t.toml"
    config.write_text(config_to_toml(config_from_dict(tree)))
    err = (tmp_path / "err.txt").open("w")
    proc = subprocess.Popen([*LOOM, str(config)], stdout=err, stderr=err, env=QUIET_OMP,
                            start_new_session=True)
    return proc, tmp_path / "runs" / "t", tmp_path / "err.txt"


def _after_step(proc, run_dir: Path, step: int) -> list[int]:
    deadline = time.monotonic() + 120
    while not ((run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= step):
        assert time.monotonic() < deadline and proc.poll() is None, "the run did not get going"
        time.sleep(0.05)
    return ranks_of(proc.pid)


def _ended(proc, err: Path) -> tuple[int, list[str]]:
    code = proc.wait(120)
    lines = [line for line in err.read_text().splitlines() if line.startswith("error:")]
    assert "Traceback" not in err.read_text() and len(lines) == 1, err.read_text()[-3000:]
    return code, lines


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks in /proc")
def test_a_stopped_rank_is_named_and_ends_the_job(tmp_path, corpus):
    # heartbeat 3 s, collective timeout 30 s: an end well before 30 s is the heartbeat's
    proc, run_dir, err = _launch(tmp_path, corpus, 3, 10**6, heartbeat_timeout_s=3, timeout_s=30)
    ranks = []
    try:
        ranks = _after_step(proc, run_dir, 3)
        assert len(ranks) == 3, ranks
        time.sleep(2)  # a heartbeat after the first collectives: the message names an op
        stopped = ranks[1]
        os.kill(stopped, signal.SIGSTOP)
        sent = time.monotonic()
        code, [line] = _ended(proc, err)
        took = time.monotonic() - sent
        assert code == 4 and took < 25, (code, took)  # measured 4.6 s
        host = re.escape(socket.gethostname())
        assert re.match(rf"error: rank \d \(host {host}, pid {stopped}\) stopped answering: its "
                        rf"heartbeat is over 3 s old", line), line
        assert re.search(r"(all_reduce|broadcast|all_gather|reduce_scatter) #\d+ on mesh axis "
                         r"'(dp|world)'", line), line
        assert not Path(f"/proc/{stopped}").exists()  # the launcher killed it, and reaped it
        print(f"stopped rank named and the job ended {took:.1f} s after the SIGSTOP")
    finally:
        _clean(proc, ranks)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks in /proc")
def test_a_killed_rank_ends_the_job_at_once_naming_it(tmp_path, corpus):
    proc, run_dir, err = _launch(tmp_path, corpus, 3, 10**6)
    ranks = []
    try:
        ranks = _after_step(proc, run_dir, 3)
        killed = ranks[0]  # the first started: rank 0 where pids rise; any rank would do
        os.kill(killed, signal.SIGKILL)
        sent = time.monotonic()
        code, [line] = _ended(proc, err)
        took = time.monotonic() - sent
        assert code == 1 and took < 20, (code, took)  # measured 0.1-0.3 s
        # whichever the launcher saw end first: the killed rank, or a rank that named it
        assert (re.match(rf"error: rank \d \(pid {killed}\) was killed by signal SIGKILL", line)
                or re.match(rf"error: rank \d \(host \S+, pid {killed}\) ended without a message",
                            line)), line
        print(f"the job ended {took:.2f} s after the SIGKILL")
    finally:
        _clean(proc, ranks)


def test_a_run_with_a_short_heartbeat_ends_normally(tmp_path, corpus):
    proc, run_dir, err = _launch(tmp_path, corpus, 2, 12, heartbeat_timeout_s=3)
    try:
        assert proc.wait(180) == 0, err.read_text()[-3000:]
        assert "error" not in err.read_text()
        assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 13))
    finally:
        _clean(proc, [])


def _clean(proc, ranks: list[int]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
