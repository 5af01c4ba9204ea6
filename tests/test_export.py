"""`loom export RUN_DIR`: a 2-rank sharded checkpoint becomes one safetensors file that
plain `safetensors` reads, equal to the checkpoint's model weights, tied weights explicit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from loomtrain.models import build_model
from loomtrain.train import checkpoint, export
from loomtrain.train.config import config_to_toml, load_config

LOOM = [sys.executable, "-m", "loomtrain"]

# runs in a fresh interpreter: the file must be usable without loomtrain installed or imported
_PLAIN_READER = """
import json, sys
from safetensors import safe_open
from safetensors.torch import load_file
tensors = load_file(sys.argv[1])
with safe_open(sys.argv[1], "pt") as f:
    metadata = f.metadata()
assert not any(m.startswith("loomtrain") for m in sys.modules), "loomtrain was imported"
print(json.dumps({"keys": sorted(tensors), "metadata": metadata,
                  "tied_equal": bool((tensors["head.weight"] == tensors["tok_emb.weight"]).all())}))
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, corpus) -> Path:
    """A 2-rank CLI run of 4 steps, checkpoints at 2 and 4."""
    from conftest import tiny_tree
    from loomtrain.train.config import config_from_dict

    root = tmp_path_factory.mktemp("export")
    config = root / "run.toml"
    config.write_text(config_to_toml(config_from_dict(tiny_tree(
        root, corpus, train={"steps": 4}, checkpoint={"every": 2}, parallel={"nproc": 2}))))
    proc = subprocess.run([*LOOM, "train", str(config)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return root / "runs" / "t"


def _checkpoint_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's model tensors read with torch's own DCP (single process)."""
    model = build_model(load_config(run_dir / "config.toml").model)
    state = {"model": {k: torch.empty_like(v) for k, v in model.state_dict().items()}}
    path = checkpoint.list_checkpoints(run_dir)[-1]
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["model"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_is_one_plain_safetensors_file_equal_to_the_checkpoint(run_dir, tmp_path):
    (run_dir / "model.safetensors").write_bytes(b"an older export")  # replaced, not appended to
    proc = subprocess.run([*LOOM, "export", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = Path(proc.stdout.strip())
    assert out == run_dir / "model.safetensors" and not list(run_dir.glob("*.tmp"))
    # both ranks wrote a shard: the export gathered both
    assert sorted(p.name for p in checkpoint.list_checkpoints(run_dir)[-1].glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]

    plain = subprocess.run([sys.executable, "-c", _PLAIN_READER, str(out)], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert plain.returncode == 0, plain.stderr
    seen = json.loads(plain.stdout)
    assert seen["metadata"]["tied"] == json.dumps({"head.weight": "tok_emb.weight"})
    assert seen["metadata"]["loomtrain.step"] == "4" and seen["tied_equal"]

    from safetensors.torch import load_file
    exported, expected = load_file(out), _checkpoint_weights(run_dir)
    assert sorted(exported) == sorted(expected) == seen["keys"]
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    # a model built from the exported [model] config loads it strictly and computes the same
    model_cfg = load_config(run_dir / "config.toml").model
    assert json.loads(seen["metadata"]["loomtrain.model_config"]) == model_cfg.model_dump()
    a, b = build_model(model_cfg), build_model(model_cfg)
    a.load_state_dict(exported, strict=True)
    checkpoint.load_model_weights(checkpoint.list_checkpoints(run_dir)[-1], b)
    x = torch.randint(0, model_cfg.vocab_size, (2, model_cfg.seq_len))
    assert torch.equal(a.eval()(x), b.eval()(x))


def test_interrupted_export_keeps_the_previous_file(run_dir, tmp_path, monkeypatch):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"previous export")

    def dies_halfway(tensors, path, metadata):
        Path(path).write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "save_file", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        export.export_safetensors(run_dir, target)
    assert target.read_bytes() == b"previous export"


def test_export_without_a_checkpoint_exits_2(tmp_path):
    proc = subprocess.run([*LOOM, "export", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no complete checkpoint" in proc.stderr
