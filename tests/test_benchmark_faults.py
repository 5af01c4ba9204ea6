"""Smoke test of benchmarks/faults.py: its smallest variant, one round of rank 1 of 2
SIGKILLed under each tool (~25 s on 2 cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "faults.py"
ROUND_KEYS = {"start_s", "first_error_s", "named_s", "exit_s", "exit_code", "timed_out",
              "named_rank", "names_rank"}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks in /proc")
def test_benchmark_faults_smallest_run():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--case", "dead", "--world", "2", "--kill-ranks", "1",
         "--rounds", "1"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"date", "cpu_count", "load_avg", "rounds", "cases"} <= out.keys()
    assert len(out["load_avg"]) == 3 and list(out["cases"]) == ["dead_rank1"]
    case = out["cases"]["dead_rank1"]
    assert (case["signal"], case["rank"], case["world"]) == ("SIGKILL", 1, 2)
    for tool in ("loomtrain", "torch"):
        [got] = case[tool]["rounds"]
        assert ROUND_KEYS == got.keys(), got
        assert not got["timed_out"] and got["exit_s"] > 0 and got["exit_code"] != 0, (tool, got)
        assert case[tool]["median"]["exit_s"] == got["exit_s"]
    loom = case["loomtrain"]["rounds"][0]
    # the dead rank is named (by the launcher or by rank 0) and the job's code is a crash's
    assert loom["named_rank"] == 1 and loom["names_rank"] and loom["exit_code"] == 1, loom
    assert loom["named_s"] is not None and loom["named_s"] <= loom["exit_s"]
    assert case["loomtrain"]["named_rounds"] == 1
    assert case["exit_s_ratio"] == round(case["torch"]["median"]["exit_s"] / loom["exit_s"], 2)
