"""Checkpoint files: atomic publication, damaged files, and loading that never runs code.

Runs here are one rank, in this process (fast); the 2-rank paths are in test_resume.py."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from loomtrain.errors import CheckpointError
from loomtrain.models import build_model
from loomtrain.optim import build_optimizer
from loomtrain.train import checkpoint, checksums, run
from loomtrain.train.config import config_to_toml

LOOM = [sys.executable, "-m", "loomtrain"]
# OpenMP threads that spin-wait for each other on a shared 2-core machine made 1-rank steps
# up to 100x slower here (40 tok/s instead of 24k); passive waiting avoids it
QUIET_OMP = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """In-process runs: the launcher gives a lone rank every core (cpu_count // ranks); one
    intra-op thread here, for the reason above (OMP_WAIT_POLICY is read when torch loads)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 1)


def _run_dir(cfg) -> Path:
    return Path(cfg.run.dir) / cfg.run.name


def _train(cfg, resume=None) -> Path:
    """One rank in this process; run.run installs SIGINT/SIGTERM handlers, put back after."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        run.run(cfg, _run_dir(cfg), resume)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    (_run_dir(cfg) / "config.toml").write_text(config_to_toml(cfg))  # what the CLI writes
    return _run_dir(cfg)


def _resume(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*LOOM, "train", "--resume", str(run_dir), *args], capture_output=True,
                          text=True, timeout=120, env=QUIET_OMP)


def _snapshot(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture
def two_checkpoints(tiny):
    """A finished 1-rank run with checkpoints at steps 2 and 4."""
    return _train(tiny(train={"steps": 4}, checkpoint={"every": 2}))


def test_only_published_folders_are_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step_00000004", "step_00000008.partial", "step_00000006.trash", "step_12", "notes"):
        (root / name).mkdir(parents=True)
        (root / name / "loom.json").write_text('{"step": 1, "world": 1}')
        (root / name / ".metadata").write_bytes(b"")
    (root / "step_00000010").mkdir()  # no loom.json: damaged after its rename, still listed
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000004", "step_00000010"]


def test_crash_mid_save_leaves_only_a_partial_that_resume_ignores_and_next_save_removes(tiny, monkeypatch):
    cfg = tiny(train={"steps": 12}, checkpoint={"every": 4, "keep": 3})
    real_save = dcp.save

    def crash_after_writing_step_8(state, storage_writer, **kwargs):
        real_save(state, storage_writer=storage_writer, **kwargs)  # every file of step 8 is on disk...
        if Path(storage_writer.path).name.startswith("step_00000008"):
            raise KeyboardInterrupt("crash before publishing")  # ...but it is never renamed

    monkeypatch.setattr(dcp, "save", crash_after_writing_step_8)
    with pytest.raises(KeyboardInterrupt):
        _train(cfg)
    monkeypatch.undo()
    run_dir = _run_dir(cfg)
    (run_dir / "config.toml").write_text(config_to_toml(cfg))
    partial = run_dir / "checkpoints" / "step_00000008.partial"
    assert (partial / ".metadata").is_file()  # complete-looking, yet not a checkpoint
    assert [p.name for p in checkpoint.list_checkpoints(run_dir)] == ["step_00000004"]
    stale = run_dir / "checkpoints" / "step_00000002.partial"  # from some older crash
    shutil.copytree(partial, stale)

    resumed = _resume(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 4" in resumed.stderr
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step_00000004", "step_00000008", "step_00000012"]
    assert json.loads((run_dir / "checkpoints" / "step_00000008" / "loom.json").read_text())["step"] == 8


def test_damaged_checkpoint_exits_2_and_the_run_folder_is_kept(two_checkpoints):
    run_dir = two_checkpoints
    data = run_dir / "checkpoints" / "step_00000004" / "__0_0.distcp"
    original = data.read_bytes()

    data.write_bytes(original[: len(original) // 2])  # truncated: caught before any process starts
    before = _snapshot(run_dir)
    proc = _resume(run_dir)
    assert proc.returncode == 2, proc.stderr
    assert f"__0_0.distcp has {len(original) // 2} of its" in proc.stderr
    assert "newest intact checkpoint is step_00000002" in proc.stderr
    assert "Traceback" not in proc.stderr and _snapshot(run_dir) == before

    # same length, first record's zip header overwritten: its checksum differs; with loom.json
    # rewritten to match (no checksums to go by), caught while loading
    data.write_bytes(b"\0" * 64 + original[64:])
    latest = run_dir / "checkpoints" / "step_00000004"
    for expected in ("__0_0.distcp has other bytes than were saved", "could not be loaded"):
        before = _snapshot(run_dir)
        proc = _resume(run_dir)
        assert proc.returncode == 2, proc.stderr
        assert expected in proc.stderr and "Traceback" not in proc.stderr
        assert _snapshot(run_dir) == before  # metrics.jsonl not truncated, nothing removed
        _reseal(latest)

    data.write_bytes(original)
    (run_dir / "checkpoints" / "step_00000004" / ".metadata").write_bytes(os.urandom(300))
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        checkpoint.verify(run_dir / "checkpoints" / "step_00000004")


def _reseal(path: Path) -> None:
    """loom.json's checksums recomputed over `path`'s files as they are now, as someone who
    meant to change them would: the checks behind the checksums must still hold."""
    meta = json.loads((path / "loom.json").read_text())
    meta = {k: v for k, v in meta.items() if k not in (checksums.FILES, checksums.SEAL)}
    files = checksums.manifest(path, skip="loom.json")
    (path / "loom.json").write_text(json.dumps(checksums.sealed(meta, files)))


def test_resume_that_does_not_fit_exits_2_and_keeps_the_config(two_checkpoints):
    # (another rank count or layout fits: tests/test_checkpoint_layouts.py)
    before = _snapshot(two_checkpoints)
    proc = _resume(two_checkpoints, "--set", "model.d_model=64")  # refused while loading
    assert proc.returncode == 2
    assert "Size mismatch" in proc.stderr and "Traceback" not in proc.stderr
    assert _snapshot(two_checkpoints) == before  # config.toml still says d_model=32


class _RunsCode:
    """Pickles as a call to os.system: what a malicious checkpoint would carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _global_pickle(module: str, name: str, arg: str) -> bytes:
    """Protocol-4 pickle calling module.name(arg); a dotted name walks attributes."""
    def text(s):
        return b"\x8c" + bytes([len(s)]) + s.encode()
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(arg) + b"\x85R."


def test_metadata_that_runs_code_is_refused(two_checkpoints, tmp_path):
    genuine = run_dir = two_checkpoints
    latest = run_dir / "checkpoints" / "step_00000004"
    assert len(checkpoint.read_metadata(latest).state_dict_metadata) > 10  # a genuine one loads
    marker = tmp_path / "ran"
    for payload in (pickle.dumps(_RunsCode(marker)),
                    # a module DCP owns, reaching os.system through an attribute path
                    _global_pickle("torch.distributed.checkpoint.filesystem", "os.system", f"touch {marker}")):
        (latest / ".metadata").write_bytes(payload)
        _reseal(latest)  # else refused for its checksum before anything unpickles it
        with pytest.raises(CheckpointError, match="refused to load .metadata"):
            checkpoint.read_metadata(latest)
        proc = _resume(genuine)
        assert proc.returncode == 2 and "refused to load .metadata" in proc.stderr, proc.stderr
        assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_value_that_runs_code_is_refused(tiny, tmp_path):
    """Non-tensor values (optimizer param groups) are pickles too; DCP's stock planner loads
    them with weights_only=False."""
    cfg = tiny()
    marker = tmp_path / "ran"
    model = build_model(cfg.model)
    state = checkpoint.training_state(model, build_optimizer(model, cfg.train))
    state["optim"]["param_groups"][0]["lr"] = _RunsCode(marker)
    state["rng.rank0.cpu"] = torch.get_rng_state()
    path = checkpoint.step_dir(_run_dir(cfg), 1)
    dcp.save(state, checkpoint_id=path, no_dist=True)
    (path / "loom.json").write_text(json.dumps({"step": 1, "world": 1}))
    (_run_dir(cfg) / "config.toml").write_text(config_to_toml(cfg))

    proc = _resume(_run_dir(cfg))
    assert proc.returncode == 2, proc.stderr
    assert "refused to load value 'optim.param_groups.0.lr'" in proc.stderr
    assert not marker.exists()
    # the hazard is real: torch's own loader runs the code
    dcp.load({"optim": {"param_groups": [{"lr": 0.0}]}}, checkpoint_id=path, no_dist=True)
    assert marker.exists()
