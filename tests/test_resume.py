"""Resume: an interrupted run, resumed from its newest checkpoint, logs the same per-step
losses as an uninterrupted run, bitwise (fp32 on CPU: same ops in the same order on the same
data), and each step exactly once in metrics.jsonl.

Interruptions: a SIGTERM to one rank and a crash (in-process, 2 ranks), a SIGKILL of the
whole `loom train` process group, and SIGTERM/SIGINT to the launcher (CLI, 2 ranks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_tree
from harness import run_world
from loomtrain.train import checkpoint, run, trainer
from loomtrain.train.config import config_from_dict, config_to_toml
from loomtrain.train.metrics import read_metrics

LOOM = [sys.executable, "-m", "loomtrain"]
# in-process scenario: 12 steps, checkpoints at 4 and 8; dropout makes the RNG state matter
SHORT = {"train": {"steps": 12}, "checkpoint": {"every": 4}, "model": {"dropout": 0.1},
         "parallel": {"nproc": 2}}
# CLI scenarios: long enough that a signal lands mid-run (a step takes 25 ms on an idle
# 2-core machine, so steps 7..40 leave the test's 20 ms polling loop ~0.8 s)
LONG = {"train": {"steps": 40}, "checkpoint": {"every": 5}, "model": {"dropout": 0.1},
        "parallel": {"nproc": 2}}


def _cfg(tmp_path, corpus, sections, name):
    tree = tiny_tree(tmp_path, corpus, **sections)
    tree["run"]["name"] = name
    return config_from_dict(tree)


def _losses(run_dir) -> list[float]:
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)), "each step once"
    return [r["loss"] for r in records]


def _keep_group(mesh) -> None:
    """Stands in for run.shutdown so consecutive runs in one world share the harness's
    process group: a re-initialized group on the same port can race (a rank reaching the
    old store before it closes), which timed out gloo's connect here."""


def _uninterrupted(rank, world, configs):
    run.shutdown = _keep_group
    for cfg in configs:
        run.run(cfg, Path(cfg.run.dir) / cfg.run.name, None)
    return [_losses(Path(c.run.dir) / c.run.name) for c in configs] if rank == 0 else None


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """Per-step losses of the uninterrupted SHORT and LONG runs (one 2-rank world)."""
    root = tmp_path_factory.mktemp("reference")
    configs = [_cfg(root, corpus, SHORT, "short"), _cfg(root, corpus, LONG, "long")]
    short, long = run_world(_uninterrupted, 2, configs, timeout_s=240)[0]
    return {"short": short, "long": long}


def _interrupt_and_resume(rank, world, sigterm_cfg, crash_cfg):
    run.shutdown = _keep_group
    real_save, real_step = trainer.save, trainer.step

    def save_then_sigterm(built, run_dir, step, *args):  # only rank 0 is signalled
        real_save(built, run_dir, step, *args)
        if step == 8 and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    calls = []

    def crash_at_step_10(*args):  # both ranks: a crash after step 9's record, past step 8's checkpoint
        calls.append(1)
        if len(calls) == 10:
            raise RuntimeError("injected crash")
        return real_step(*args)

    out = {}
    for name, cfg, patch in (("sigterm", sigterm_cfg, ("save", save_then_sigterm)),
                             ("crash", crash_cfg, ("step", crash_at_step_10))):
        run_dir = Path(cfg.run.dir) / cfg.run.name
        setattr(trainer, *patch)
        try:
            run.run(cfg, run_dir, None)
        except RuntimeError as err:
            assert "injected crash" in str(err)
        finally:
            trainer.save, trainer.step = real_save, real_step
        before = [r["step"] for r in read_metrics(run_dir)]
        latest = checkpoint.list_checkpoints(run_dir)[-1]
        run.run(cfg, run_dir, latest)
        out[name] = (before, latest.name, _losses(run_dir))
    return out if rank == 0 else None


def test_interrupted_then_resumed_runs_match_bitwise(reference, tmp_path, corpus):
    result = run_world(_interrupt_and_resume, 2, _cfg(tmp_path, corpus, SHORT, "sigterm"),
                       _cfg(tmp_path, corpus, SHORT, "crash"), timeout_s=240)[0]
    before, latest, losses = result["sigterm"]
    assert before == list(range(1, 9)) and latest == "step_00000008"
    assert losses == reference["short"]  # bitwise: == on floats
    before, latest, losses = result["crash"]
    assert before == list(range(1, 10)) and latest == "step_00000008"  # step 9 was logged...
    assert losses == reference["short"]  # ...then truncated and logged once more


def _write_config(tmp_path, corpus, name, every: int = LONG["checkpoint"]["every"]) -> Path:
    """LONG as a TOML file; `checkpoint.every` changes no loss, so the reference holds."""
    path = tmp_path / f"{name}.toml"
    path.write_text(config_to_toml(_cfg(tmp_path, corpus, {**LONG, "checkpoint": {"every": every}}, name)))
    return path


def _start(config: Path) -> subprocess.Popen:
    # its own session: the test can signal the launcher alone or the whole group, as a
    # terminal's Ctrl-C does, without hitting pytest
    return subprocess.Popen([*LOOM, "train", str(config)], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(proc, run_dir: Path, step: int, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        if records and records[-1]["step"] >= step:
            return records[-1]["step"]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"no step {step} within {timeout_s}s")


def _resume(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*LOOM, "train", "--resume", str(run_dir)], capture_output=True,
                          text=True, timeout=180)


def test_sigkill_of_the_process_group_then_resume(reference, tmp_path, corpus):
    run_dir = tmp_path / "runs" / "killed"
    proc = _start(_write_config(tmp_path, corpus, "killed"))
    seen = _wait_for_step(proc, run_dir, 7)  # past the checkpoint at step 5
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    latest = checkpoint.list_checkpoints(run_dir)[-1]
    last_logged = read_metrics(run_dir)[-1]["step"]
    step = checkpoint.read_meta(latest)["step"]
    assert 5 <= step < last_logged < LONG["train"]["steps"], (seen, step, last_logged)  # mid-run
    resumed = _resume(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {latest} at step {step}" in resumed.stderr
    assert _losses(run_dir) == reference["long"]


def _stop(proc, run_dir: Path, after_step: int, signum: int, to_group: bool) -> int:
    """Waits for `after_step`, sends `signum`, checks the clean stop; returns the saved step."""
    _wait_for_step(proc, run_dir, after_step)
    sent = time.monotonic()
    if to_group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    name = signal.Signals(signum).name
    assert proc.returncode == 0, stderr
    assert time.monotonic() - sent < 20, "the workers were not stopped by the forwarded signal"
    assert f"stopped by {name} before step" in stderr and "Traceback" not in stderr
    meta = checkpoint.read_meta(checkpoint.list_checkpoints(run_dir)[-1])
    assert meta["stopped_by"] == name
    assert meta["step"] == read_metrics(run_dir)[-1]["step"] < LONG["train"]["steps"]
    return meta["step"]


def test_stop_signals_save_exit_0_and_resume(reference, tmp_path, corpus):
    """SIGTERM to the launcher alone (as `kill PID` or a container runtime sends it), resume,
    then SIGINT to the whole group (a terminal's Ctrl-C), resume to the end. Each stop: the
    workers save at the next step boundary and the launcher exits 0, well before torch's
    30 s SIGKILL grace period. One run carries both stops to save a launch (~10 s each)."""
    run_dir = tmp_path / "runs" / "stopped"
    config = _write_config(tmp_path, corpus, "stopped", every=0)  # the signals' are the only ones
    first = _stop(_start(config), run_dir, 3, signal.SIGTERM, to_group=False)
    resumed = subprocess.Popen([*LOOM, "train", "--resume", str(run_dir)], start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = _stop(resumed, run_dir, first + 3, signal.SIGINT, to_group=True)
    assert first < second
    finished = _resume(run_dir)
    assert finished.returncode == 0, finished.stderr
    assert _losses(run_dir) == reference["long"]
