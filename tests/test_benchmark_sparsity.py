"""Smoke test of benchmarks/sparsity.py --small (tiny GPT, 20 steps, every run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sparsity.py"
RUN_KEYS = {"val_loss", "bytes_per_step", "checkpoint_bytes"}


def test_benchmark_sparsity_small():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--small"], capture_output=True,
                          text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = out["runs"]
    names = {"dense", "rigl_0.1_sam", "rigl_0.1_zosam"} | {
        f"{m}_{d}" for m in ("static", "prune", "set", "rigl") for d in (0.5, 0.2, 0.1)}
    assert names <= runs.keys(), names - runs.keys()
    dense = runs["dense"]
    for name in names:
        r = runs[name]
        assert RUN_KEYS <= r.keys(), (name, RUN_KEYS - r.keys())
        assert 0 < r["val_loss"] < 10 and r["bytes_per_step"] > 0, (name, r)
        # the checkpoint holds the dense weights and moments either way; masks add 1 bit each
        assert dense["checkpoint_bytes"] <= r["checkpoint_bytes"] < 1.1 * dense["checkpoint_bytes"]
        if name != "dense":
            assert abs(r["density"] - r["sparsity"]["density"]) < 0.01, (name, r["density"])
    for method in ("static", "prune", "set", "rigl"):  # sparse-aware DP sends fewer bytes
        assert runs[f"{method}_0.1"]["bytes_per_step"] < dense["bytes_per_step"], method
    assert runs["static_0.1"]["bytes_per_step"] < runs["static_0.5"]["bytes_per_step"]
    assert [runs[n]["backward_per_step"] for n in ("rigl_0.1", "rigl_0.1_sam", "rigl_0.1_zosam")] \
        == [1, 2, 1]
    assert runs["rigl_0.1_zosam"]["forward_per_step"] == 3
    assert set(out["targets"]) == {"rigl_0.2_val_within_5pct_of_dense",
                                   "zosam_0.1_at_least_rigl_0.1", "zosam_one_backward_per_step"}
