"""Smoke test of benchmarks/compile.py: its three engines train the same steps and print their
figures (with the "aot_eager" backend: the same traced graphs, none of inductor's code
generation, which takes minutes on two busy cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compile.py"
ENGINES = ("loomtrain_eager", "loomtrain_compiled", "torch_compiled")


def test_benchmark_compile_smallest_run():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--rounds", "1", "--steps", "1", "--warmup", "1",
         "--backend", "aot_eager"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for engine in ENGINES:
        assert out[f"{engine}_tokens_per_s"] > 0, engine
        # same init, batches and sums: a compiled block computes what the eager one does
        assert out[f"{engine}_first_step_loss"] == out["loomtrain_eager_first_step_loss"]
        assert out[f"{engine}_last_step_loss_max_rel_diff"] < 1e-6, engine
    assert out["compiled_over_eager"] > 0 and out["loomtrain_over_torch_compiled"] > 0
    assert out["world"] == 2 and out["backend"] == "aot_eager"
