"""benchmarks/planner.py --small: three plans measured by `loom train` against the cost
model and the simulator, and the 175B search timed; one JSON line with the fields the docs'
table reads (about 30 s idle: the runs' start-up)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(400)
SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "planner.py"


def test_benchmark_planner_small(tmp_path, calibration):
    # the session's quick calibration (conftest.py): the benchmark calibrates only where the
    # cache has none, which benchmarks/planner.py's cpu_here does before anything else
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(calibration[0])}
    out = subprocess.run([sys.executable, str(SCRIPT), "--small"], capture_output=True, text=True,
                         timeout=380, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(doc["configs"]) == 3
    for row in doc["configs"]:
        assert row["predicted_step_s"] > 0 and row["measured_step_s"] > 0
        assert row["simulated_step_s"] > 0
    assert 0 <= doc["median_rel_error"] and -1 <= doc["spearman"] <= 1
    assert 0 < doc["search_s_175b_1024"] < 10
