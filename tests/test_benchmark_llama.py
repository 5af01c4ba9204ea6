"""Smoke test of benchmarks/llama.py (--small: a tiny Llama, one round of one step per engine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "llama.py"
PAIRS = {"ddp": ("loomtrain_ddp", "torch_ddp"), "zero3": ("loomtrain_zero3", "torch_fsdp2"),
         "tp": ("loomtrain_tp", "torch_tp")}


def test_benchmark_llama_small():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--small", "--rounds", "1", "--steps", "1",
                           "--warmup", "1"], capture_output=True, text=True, timeout=40,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"date", "cpu_count", "load_avg", "targets", "config"} <= out.keys()
    assert out["config"]["small"] and out["rounds"] == 1
    for name, engines in PAIRS.items():
        assert out[f"{name}_ratio"] > 0 and out[f"{name}_mem_ratio"] > 0
        for e in engines:
            assert out[f"{e}_tokens_per_s"] > 0 and out[f"{e}_peak_mem_bytes"] > 0, e
        # same model, seed and batch, before any update: only the order of fp32 sums differs
        # (tp's partial products, dp's mean of two halves), a few ulps, far below 1e-4
        first = [out[f"{e}_first_step_loss"] for e in engines]
        assert abs(first[0] - first[1]) <= 1e-4 * abs(first[1]), (name, first)
