"""Checksums of checkpoint files: recorded at publish, checked before any load; a damaged
newest checkpoint is refused, or skipped with --skip-damaged, never silently.

Runs here are one rank, in this process (fast), as in test_checkpoint.py."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from loomtrain import cli
from loomtrain.errors import CheckpointError
from loomtrain.train import checkpoint
from loomtrain.train.export import export_safetensors
from loomtrain.train.metrics import read_metrics
from test_checkpoint import _resume, _snapshot, _train, one_thread  # noqa: F401 (fixture)


@pytest.fixture
def two_checkpoints(tiny):
    """A finished 1-rank run with checkpoints at steps 2 and 4."""
    return _train(tiny(train={"steps": 4}, checkpoint={"every": 2}))


def _flip_tensor_byte(folder: Path) -> str:
    """Flips one bit in the middle of the model's first weight in its data file (the length
    stays the same); returns the file's name."""
    metadata = checkpoint.read_metadata(folder)
    index, info = next((i, s) for i, s in metadata.storage_data.items()
                       if i.fqn.startswith("model.") and i.fqn.endswith(".weight"))
    file = folder / info.relative_path
    data = bytearray(file.read_bytes())
    data[info.offset + info.length // 2] ^= 0x10
    file.write_bytes(bytes(data))
    return info.relative_path


def test_publish_records_every_file_with_its_sha256(two_checkpoints):
    latest = checkpoint.list_checkpoints(two_checkpoints)[-1]
    meta = json.loads((latest / "loom.json").read_text())
    on_disk = sorted(p.name for p in latest.iterdir() if p.name != "loom.json")
    assert sorted(meta["files"]) == on_disk and ".metadata" in on_disk and "__0_0.distcp" in on_disk
    for name, entry in meta["files"].items():  # what `sha256sum` prints
        data = (latest / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_flipped_tensor_byte_is_refused_naming_the_file(two_checkpoints):
    run_dir = two_checkpoints
    latest = run_dir / "checkpoints" / "step_00000004"
    name = _flip_tensor_byte(latest)

    # the hazard is real: DCP alone loads the changed tensor without a word
    metadata = checkpoint.read_metadata(latest)
    key = next(k for k in metadata.state_dict_metadata if k.startswith("model.") and k.endswith(".weight"))
    state = {key: torch.empty(metadata.state_dict_metadata[key].size)}
    dcp.load(state, checkpoint_id=latest, no_dist=True)

    for load in (checkpoint.verify, checkpoint.load_model_state):
        with pytest.raises(CheckpointError, match=f"step_00000004' is damaged: {name} has other bytes"):
            load(latest)
    with pytest.raises(CheckpointError, match="newest intact checkpoint is step_00000002"):
        export_safetensors(run_dir)

    before = _snapshot(run_dir)
    proc = _resume(run_dir)
    assert proc.returncode == 2, proc.stderr
    assert f"is damaged: {name} has other bytes than were saved" in proc.stderr
    assert "newest intact checkpoint is step_00000002" in proc.stderr and "--skip-damaged" in proc.stderr
    assert "Traceback" not in proc.stderr and _snapshot(run_dir) == before


def test_missing_metadata_refused_then_skipped_with_the_flag(two_checkpoints):
    run_dir = two_checkpoints
    losses = [r["loss"] for r in read_metrics(run_dir)]
    (run_dir / "checkpoints" / "step_00000004" / ".metadata").unlink()
    assert [p.name for p in checkpoint.list_checkpoints(run_dir)] == ["step_00000002", "step_00000004"]

    before = _snapshot(run_dir)
    proc = _resume(run_dir)
    assert proc.returncode == 2, proc.stderr
    assert "step_00000004' is damaged: .metadata is missing" in proc.stderr
    assert f"--resume {run_dir} --skip-damaged" in proc.stderr and _snapshot(run_dir) == before

    proc = _resume(run_dir, "--skip-damaged")
    assert proc.returncode == 0, proc.stderr
    assert ("warning: --skip-damaged: skipped: checkpoint "
            f"'{run_dir / 'checkpoints' / 'step_00000004'}' is damaged: .metadata is missing; "
            "using step_00000002") in proc.stderr
    assert "at step 2" in proc.stderr
    assert [r["loss"] for r in read_metrics(run_dir)] == losses  # bitwise: == on floats
    checkpoint.verify(run_dir / "checkpoints" / "step_00000004")  # written again, whole


def test_changed_loom_json_and_missing_manifest_entries(two_checkpoints):
    latest = two_checkpoints / "checkpoints" / "step_00000004"
    meta_file = latest / "loom.json"
    sealed = json.loads(meta_file.read_text())

    meta_file.write_text(json.dumps({**sealed, "step": 5}))
    with pytest.raises(CheckpointError, match="loom.json differs from its checksum"):
        checkpoint.verify(latest)
    files = {k: v for k, v in sealed["files"].items() if k != "__0_0.distcp"}
    meta_file.write_text(json.dumps({**sealed, "files": files}))  # manifest shortened: seal breaks
    with pytest.raises(CheckpointError, match="loom.json differs from its checksum"):
        checkpoint.verify(latest)
    meta_file.unlink()
    with pytest.raises(CheckpointError, match="is damaged: loom.json is missing"):
        checkpoint.newest(two_checkpoints)


def test_checkpoint_without_checksums_loads_with_one_warning(two_checkpoints, capsys):
    """Written before checksums existed: accepted, saying once that its bytes are unverified."""
    latest = two_checkpoints / "checkpoints" / "step_00000004"
    meta = json.loads((latest / "loom.json").read_text())
    old = {k: v for k, v in meta.items() if k not in ("files", "sha256")}
    (latest / "loom.json").write_text(json.dumps(old))
    for _ in range(2):
        assert checkpoint.newest(two_checkpoints) == (latest, [])
        checkpoint.verify(latest)
    err = capsys.readouterr().err
    assert err.count("has no checksums") == 1 and str(latest) in err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert checkpoint.load_model_state(latest)


def test_skip_damaged_needs_resume(capsys):
    assert cli.main(["train", "--skip-damaged"]) == 2
    assert "--skip-damaged goes with --resume" in capsys.readouterr().err
