"""Smoke test of benchmarks/async_adaptive.py --small (two 7-second runs on a tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "async_adaptive.py"
RUN_KEYS = {"windows", "slow_from_elapsed_s", "tokens", "updates", "tokens_per_s",
            "fast_tokens_per_s", "slow_tokens_per_s", "fast_k_mean", "slow_k_mean",
            "fast_link_utilization", "slow_link_utilization", "final_val_loss", "wall_s"}
WINDOW_KEYS = {"from_s", "to_s", "link_gbps", "k_mean", "updates", "loss", "link_utilization",
               "tokens_per_s"}


def test_benchmark_async_adaptive_small():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(SCRIPT.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--small"], capture_output=True,
                          text=True, timeout=120, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "async_adaptive" and out["small"] is True
    assert set(out["runs"]) == {"adaptive", "fixed_k1"}
    for name, run in out["runs"].items():
        assert RUN_KEYS <= run.keys(), (name, RUN_KEYS - run.keys())
        assert run["windows"] and all(WINDOW_KEYS <= w.keys() for w in run["windows"]), name
        assert run["slow_from_elapsed_s"] is not None and run["slow_tokens_per_s"] > 0, name
    assert all(w["k_mean"] == 1.0 for w in out["runs"]["fixed_k1"]["windows"])
    adaptive = out["runs"]["adaptive"]
    # the link drops 100x (1 -> 0.01 Gbit/s): the workers' round trips grow and k with them
    assert adaptive["slow_k_mean"] > adaptive["fast_k_mean"], adaptive
    assert out["adaptive_vs_fixed"]["slow_tokens_per_s"] > 1.0, out["adaptive_vs_fixed"]
