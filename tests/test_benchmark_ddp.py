"""Smoke test of benchmarks/ddp.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ddp.py"
KEYS = {"loomtrain_tokens_per_s", "torch_ddp_tokens_per_s", "ratio", "loomtrain_peak_mem_bytes",
        "torch_ddp_peak_mem_bytes", "world", "steps", "rounds", "config",
        "loomtrain_first_step_loss", "torch_ddp_first_step_loss", "first_step_loss_equal",
        "last_step_loss_max_rel_diff"}


def test_benchmark_ddp_smallest_run():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--rounds", "1", "--steps", "1", "--warmup", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert KEYS <= out.keys(), KEYS - out.keys()
    assert out["world"] == 2 and out["rounds"] == 1 and out["steps"] == 1
    assert out["loomtrain_tokens_per_s"] > 0 and out["torch_ddp_tokens_per_s"] > 0
    assert out["loomtrain_peak_mem_bytes"] > 0 and out["torch_ddp_peak_mem_bytes"] > 0
    assert out["first_step_loss_equal"]
    assert out["loomtrain_first_step_loss"] == out["torch_ddp_first_step_loss"]
    # same init, batches and gradient (world 2: DDP's loss x2 then /2 is exact in fp32), so
    # the runs agree to the bit; 1e-6 leaves room only for a reordered fp32 sum
    assert out["last_step_loss_max_rel_diff"] < 1e-6
