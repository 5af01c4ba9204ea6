"""A write that fails during a run (a full disk, a quota, a file-size limit...) ends `loom train`
with exit code 2 and one paragraph naming the file and the OS error, no traceback and no
SIGABRT; the newest checkpoint stays complete and resumes; nothing of the failed checkpoint is
left; metrics.jsonl keeps whole lines (issue 26, point 6).

The real fault: RLIMIT_FSIZE in the `loom train` subprocess (inherited by its ranks; Python
ignores SIGXFSZ, so a write past the limit fails with EFBIG, as a full disk fails with ENOSPC).
It is a per-file limit, so a run that saved its first checkpoint unlimited is resumed under a
limit its next checkpoint (or metrics.jsonl) does not fit. ENOSPC itself is injected in-process
(monkeypatched writes): it needs no root. Measured: ~2-10 s per `loom train` on 2 loaded cores.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_tree
from torch.distributed.checkpoint import filesystem

from loomtrain.errors import WriteError
from loomtrain.train import checkpoint, messages, run
from loomtrain.train.config import config_from_dict, config_to_toml
from loomtrain.train.metrics import RunLog, read_metrics

pytestmark = pytest.mark.timeout(300)
LOOM = [sys.executable, "-m", "loomtrain", "train"]
QUIET_OMP = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}  # see test_checkpoint.py
# the tiny GPT's files: a checkpoint's data file ~320-660 KB, .metadata ~36 KB, config.toml
# ~2 KB, a metrics record ~250 bytes
CHECKPOINT_DOES_NOT_FIT = 100_000


def _loom(args: list[str], fsize: int | None = None) -> subprocess.CompletedProcess:
    def limit():  # in the child, before exec: its ranks inherit the limit
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return subprocess.run([*LOOM, *args], capture_output=True, text=True, timeout=180,
                          env=QUIET_OMP, preexec_fn=limit if fsize else None)


def _one_paragraph(proc: subprocess.CompletedProcess, also: tuple[str, ...] = ()) -> str:
    """The exit-2 contract: the one `error:` line, no traceback, nothing a rank or torch adds
    (`also`: more lines of the run that may come first)."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "exit codes" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    ours = ("run folder:", "resumed from", "step ", "error:", "loom: ranks started", *also)
    assert all(line.startswith(ours) for line in lines), proc.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def first_checkpoint(tmp_path_factory, corpus):
    """`(nproc, folder)` -> a copy, at `folder`, of a finished run with one checkpoint,
    step_00000002 (each nproc's run is made once)."""
    made = {}

    def copy(nproc: int, folder: Path) -> Path:
        if nproc not in made:
            root = tmp_path_factory.mktemp(f"nproc{nproc}")
            config = root / "c.toml"
            config.write_text(config_to_toml(config_from_dict(tiny_tree(
                root, corpus, train={"steps": 2}, parallel={"nproc": nproc},
                checkpoint={"every": 2, "keep": 5}))))
            first = _loom([str(config)])
            assert first.returncode == 0, first.stderr[-3000:]
            made[nproc] = root / "runs" / "t"
        return Path(shutil.copytree(made[nproc], folder))
    return copy


def _resumes_from_step_2(run_dir: Path) -> None:
    """The newest checkpoint is step 2, verified, with nothing else in checkpoints/; a resume
    without the limit goes on from it to step 4, each step logged once."""
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002"]
    assert checkpoint.newest(run_dir)[0].name == "step_00000002"  # sizes and SHA-256 checked
    resumed = _loom(["--resume", str(run_dir), "--set", "train.steps=4"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_00000002 at step 2" in resumed.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_checkpoint_that_does_not_fit_exits_2_and_the_previous_one_resumes(
        tmp_path, first_checkpoint, nproc):
    run_dir = first_checkpoint(nproc, tmp_path / "run")
    proc = _loom(["--resume", str(run_dir), "--set", "train.steps=4"], CHECKPOINT_DOES_NOT_FIT)
    error = _one_paragraph(proc)
    partial = run_dir / "checkpoints" / "step_00000004.partial"
    # every rank's file is named (a tensor's failed write is named too: dcp_write.py)
    for rank in range(nproc):
        assert f"cannot write '{partial}/__{rank}_0.distcp': File too large (EFBIG)" in error
    assert error.startswith("error: checkpoint step_00000004 was not saved (")
    assert (f"The newest checkpoint, step_00000002, is complete and untouched: make room (or "
            f"fix the folder), then continue with: loom train --resume {run_dir}") in error
    _resumes_from_step_2(run_dir)


def test_a_metrics_write_that_fails_leaves_whole_lines_and_exits_2(tmp_path, first_checkpoint):
    """Rank 0 alone writes metrics.jsonl: its failure ends the 2-rank run with its message,
    not with rank 1's failed collective (which follows it), and the record being written is
    cut off again, not left torn."""
    run_dir = first_checkpoint(2, tmp_path / "run")
    metrics = run_dir / "metrics.jsonl"
    # room for config.toml (rewritten at the resume) and a few more records, not for 30
    fsize = max(metrics.stat().st_size + 1200, (run_dir / "config.toml").stat().st_size + 200)
    proc = _loom(["--resume", str(run_dir), "--set", "train.steps=30", "--set",
                  "checkpoint.every=0"], fsize)
    error = _one_paragraph(proc)
    assert error.startswith(f"error: cannot write '{metrics}': File too large (EFBIG). The "
                            "newest checkpoint, step_00000002, is complete"), error
    text = metrics.read_text()
    assert text.endswith("\n") and len(text) < fsize
    steps = [json.loads(line)["step"] for line in text.splitlines()]  # every line whole
    assert steps == list(range(1, len(steps) + 1)) and 3 < len(steps) < 30
    _resumes_from_step_2(run_dir)


def test_a_parameter_server_that_cannot_save_exits_2_with_its_message_once(tmp_path, corpus):
    """The server's error comes back through the errors folder (train/messages.py), printed
    once by the launcher, as in the elastic path (issue 26, point 7a)."""
    config = tmp_path / "ps.toml"
    config.write_text(config_to_toml(config_from_dict(tiny_tree(
        tmp_path, corpus, train={"steps": 12}, parallel={"nproc": 3, "timeout_s": 20},
        run={"log_every": 4}, **{"async": {"mode": "ps", "worker_timeout_s": 20}}))))
    proc = _loom([str(config)], CHECKPOINT_DOES_NOT_FIT)
    error = _one_paragraph(proc, also=(f"{corpus}: bytes",))
    assert error.startswith("error: checkpoint step_00000012 was not saved (cannot write ")
    assert "File too large (EFBIG)" in error and error.endswith("No checkpoint had been saved")
    assert "loom: worker" not in proc.stderr  # the workers' ends are not news
    assert not any((tmp_path / "runs" / "t" / "checkpoints").iterdir())


# --- ENOSPC, in this process -------------------------------------------------------------

class _FullAfter:
    """A file whose writes fail with ENOSPC once `room` more bytes were written: the first
    write that crosses it writes what fits (a short write, as a nearly full disk does)."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = self.file.write(bytes(data)[:self.room])
        self.room -= written
        return written

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_a_record_that_does_not_fit_is_cut_off_again(tmp_path):
    log = RunLog(tmp_path, 10, 0, enabled=True, progress=False)
    record = {"step": 1, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 1.0,
              "peak_mem_bytes": 0, "comm_bytes": {"total": 0}}
    log.record(record)
    whole = (tmp_path / "metrics.jsonl").read_text()
    log.file = _FullAfter(log.file, room=20)
    with pytest.raises(WriteError) as raised:
        log.record({**record, "step": 2})
    log.close()
    assert str(raised.value) == (f"cannot write '{tmp_path / 'metrics.jsonl'}': No space left "
                                 "on device (ENOSPC)")
    assert (tmp_path / "metrics.jsonl").read_text() == whole  # the 20 bytes are gone again


def _train(cfg, resume=None) -> None:
    """One rank in this process (run.run installs SIGINT/SIGTERM handlers: put back after)."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        run.run(cfg, Path(cfg.run.dir) / cfg.run.name, resume)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


@pytest.mark.parametrize("where", ["__0_0.distcp", "loom.json"])
def test_enospc_while_saving_keeps_the_previous_checkpoint(tiny, monkeypatch, where):
    """The disk fills up while step 4 is saved, in a tensor file (written through torch.save,
    which drops the OS error: dcp_write.py names it anyway) or in loom.json (published last)."""
    cfg = tiny(train={"steps": 4}, checkpoint={"every": 2, "keep": 5})
    run_dir = Path(cfg.run.dir) / cfg.run.name
    full = run_dir / "checkpoints" / "step_00000004.partial" / where
    open_dcp, write_text = filesystem.FileSystem.create_stream, Path.write_text

    def dcp_stream(self, path, mode):  # DCP's files: a generator-based context manager
        with open_dcp(self, path, mode) as stream:
            yield _FullAfter(stream, 5000) if Path(path) == full else stream

    def loom_json(path, *args, **kwargs):
        if path == full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_text(path, *args, **kwargs)

    from contextlib import contextmanager
    monkeypatch.setattr(filesystem.FileSystem, "create_stream", contextmanager(dcp_stream))
    monkeypatch.setattr(Path, "write_text", loom_json)
    with pytest.raises(WriteError) as raised:
        _train(cfg)
    monkeypatch.undo()
    assert str(raised.value) == (f"checkpoint step_00000004 was not saved (cannot write "
                                 f"'{full}': No space left on device (ENOSPC); what was written "
                                 "of it is removed)")
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000002"]
    _train(config_from_dict({**cfg.model_dump(), "train": {**cfg.train.model_dump(), "steps": 6}}),
           checkpoint.newest(run_dir)[0])
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]


def test_a_failed_collective_does_not_hide_the_error_that_caused_it(tmp_path, capsys):
    """Rank 0 left on a write error; rank 1's collective failed because of it. The launcher
    prints the cause only; a message a launcher already said (`take`) is not repeated."""
    (tmp_path / "11-2.txt").write_text("cannot write 'metrics.jsonl': No space left on device")
    (tmp_path / "12-4-after.txt").write_text("all_reduce failed: Connection closed by peer")
    (tmp_path / "13-2.said").write_text("the data of worker 1 is bad")
    (tmp_path / "14-2.txt").write_text("the data of worker 1 is bad")
    assert messages.take(tmp_path, 99) is None
    assert messages.report(tmp_path) == 2
    assert capsys.readouterr().err == ("error: cannot write 'metrics.jsonl': No space left on "
                                       "device\n")
    for name in ("11-2.txt", "13-2.said", "14-2.txt"):
        (tmp_path / name).unlink()
    assert messages.report(tmp_path) == 4  # alone, the failed collective is the news
    assert "Connection closed by peer" in capsys.readouterr().err
