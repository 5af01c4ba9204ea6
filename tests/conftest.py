"""Shared fixtures: a small corpus file and tiny configs, so every test runs in seconds."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from loomtrain.cli import main
from loomtrain.train.config import config_from_dict

_CORPUS_MODULES = ["textwrap.py", "string.py", "bisect.py", "heapq.py", "colorsys.py", "fnmatch.py"]


def tiny_tree(tmp_path: Path, corpus: Path, **sections) -> dict:
    """A config tree for a ~30k-parameter GPT; `sections` override per section, e.g.
    tiny_tree(p, c, parallel={"nproc": 2})."""
    tree = {
        "run": {"dir": str(tmp_path / "runs"), "name": "t", "log_every": 1, "eval_every": 1000,
                "eval_batches": 2, "progress": False, "seed": 1},
        "model": {"name": "gpt", "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
        "data": {"source": str(corpus), "val_fraction": 0.1},
        "train": {"steps": 20, "global_batch": 8, "micro_batch": 2, "lr": 3e-3, "warmup_steps": 2},
        "parallel": {"nproc": 1, "bucket_mb": 0.01, "timeout_s": 30},
        "checkpoint": {"every": 0, "keep": 2},
    }
    for section, values in sections.items():
        tree.setdefault(section, {}).update(values)
    return tree


def refused(capsys, argv: list[str]) -> str:
    """Run `loom argv` in-process; assert the user-error contract (exit 2, one paragraph on
    stderr starting with "error:", no traceback, nothing on stdout); return the message."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: "), err
    assert len(err.strip().splitlines()) == 1, err  # one paragraph, on one line
    assert "Traceback" not in out + err and out == ""
    return err


@pytest.fixture(scope="session")
def calibration(tmp_path_factory) -> tuple[Path, str]:
    """One real quick calibration of this machine through the CLI (~25 s: four processes
    spawned, each figure a median of 3 repetitions), saved where `loom bench calibrate` saves
    it under a fresh cache folder: (that folder, for XDG_CACHE_HOME; the command's stdout).
    Shared by the calibration's tests and the planner benchmark's, which measure with it."""
    import os
    import subprocess
    import sys

    cache = tmp_path_factory.mktemp("cache")
    out = cache / "loomtrain" / "cpu-here.toml"
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "loomtrain", "bench", "calibrate", "--quick", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return cache, done.stdout


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """~60 KB of real Python source from the stdlib, as one text file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(b"\n".join((root / m).read_bytes() for m in _CORPUS_MODULES))
    return path


@pytest.fixture
def tiny(tmp_path, corpus):
    def make(**sections):
        return config_from_dict(tiny_tree(tmp_path, corpus, **sections))
    return make


@pytest.fixture(scope="session")
def doc_corpus(tmp_path_factory, corpus) -> Path:
    """The corpus cut into ~1,200 small documents (a folder of files) with heavy-tailed
    lengths (Pareto(1.2) x 8 bytes, at most 300): packed rows of 32 tokens cross several
    document boundaries, and some documents span several rows."""
    import numpy as np

    text = corpus.read_bytes()
    folder = tmp_path_factory.mktemp("documents")
    rng = np.random.default_rng(0)
    start, i = 0, 0
    while start < len(text):
        length = int(min(300, 8 * (1 + rng.pareto(1.2))))
        (folder / f"doc{i:05d}.txt").write_bytes(text[start:start + length])
        start, i = start + length, i + 1
    return folder
