"""`loom train` end to end: the elastic launcher path and the torchrun path write a run folder."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import tomli_w

from conftest import tiny_tree
from harness import free_port
from loomtrain.train.metrics import read_metrics

BIN = Path(sys.executable).parent
REQUIRED = {"step", "loss", "lr", "tokens_per_s", "comm_bytes", "peak_mem_bytes", "grad_norm"}


def _config(tmp_path, corpus, **sections) -> Path:
    tree = tiny_tree(tmp_path, corpus, **sections)
    path = tmp_path / "cfg.toml"
    path.write_text(tomli_w.dumps(tree))
    return path


def _check_run(run_dir: Path, steps: int, world: int):
    assert (run_dir / "config.toml").is_file()
    resolved = tomllib.loads((run_dir / "config.toml").read_text())
    assert resolved["parallel"]["nproc"] == world and resolved["train"]["steps"] == steps
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(REQUIRED <= r.keys() for r in records)
    assert "val_loss" in records[-1]
    # rank 0 sends the ring share of the gradient all-reduce every step
    assert all(r["comm_bytes"]["all_reduce"] > 0 for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    assert (run_dir / "checkpoints" / f"step_{steps:08d}").is_dir()


def test_loom_train_elastic_launch(tmp_path, corpus):
    cfg = _config(tmp_path, corpus, train={"steps": 6}, run={"eval_every": 3})
    out = subprocess.run([str(BIN / "loom"), "train", str(cfg), "--nproc", "2"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    _check_run(tmp_path / "runs" / "t", 6, 2)
    assert "val" in out.stderr and "mesh pp=1 dp=2" in out.stderr
    # a second run with the same name gets a new folder: the first is never overwritten
    again = subprocess.run([str(BIN / "loom"), "train", str(cfg), "--nproc", "2",
                            "--set", "train.steps=2"], capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(read_metrics(tmp_path / "runs" / "t")) == 6
    assert len(read_metrics(tmp_path / "runs" / "t-2")) == 2


def test_torchrun_joins_the_job(tmp_path, corpus):
    cfg = _config(tmp_path, corpus, train={"steps": 4}, parallel={"nproc": 2})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "loomtrain", "train", str(cfg)],
        capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    _check_run(tmp_path / "runs" / "t", 4, 2)
    # the same command again would write into the finished run: refused, the run kept
    again = subprocess.run([sys.executable, "-m", "loomtrain", "train", str(cfg)],
                           capture_output=True, text=True, timeout=120,
                           env={**env, "TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"})
    assert again.returncode == 2 and "already holds a run" in again.stderr, again.stderr[-2000:]
    _check_run(tmp_path / "runs" / "t", 4, 2)
