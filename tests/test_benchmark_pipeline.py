"""benchmarks/pipeline.py: its bubble figures on a step whose timing is known (no processes),
and a smoke run (--small: a tiny GPT, one round, pp = 2)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from loomtrain.parallel.pipeline import schedules

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # scripts, no package
import pipeline as bench

SCRIPT = Path(bench.__file__)
FIGURES = {"tokens_per_s", "torch_tokens_per_s", "ratio", "bubble_measured", "bubble_theory",
           "bubble_theory_measured_times", "bubble_simulated", "compute_ms", "step_ms",
           "peak_activation_bytes", "first_step_loss", "torch_first_step_loss", "torch_schedule",
           "virtual_stages", "bounds"}


def _spans_of(schedule: schedules.Schedule, times: dict) -> list[dict]:
    """The runtime's gathered spans of a step that ran exactly as `simulate` times it."""
    sim = schedules.simulate(schedule, times)
    return [{"rank": r, "spans": [{"lane": "compute", "kind": a.kind, "name": str(a),
                                   "start_s": start, "end_s": end}
                                  for a, start, end in sim.spans[r] if a.kind in schedules.COMPUTE]}
            for r in range(schedule.pp)]


@pytest.mark.parametrize("name, pp, m, v", [("1f1b", 2, 8, 1), ("gpipe", 4, 8, 1),
                                            ("interleaved", 2, 8, 2), ("zb-h1", 4, 8, 1)])
def test_bubble_figures_of_an_ideal_step_equal_the_theory(name, pp, m, v):
    # F = 1, B = 2 (I = W = 1) seconds, free communication: the papers' setting, in which the
    # simulator meets the closed forms exactly (schedules.bubble_theory's docstring)
    schedule = schedules.build(name, pp, m, v)
    times = {schedules.F: 1.0, schedules.B: 2.0, schedules.I: 1.0, schedules.W: 1.0}
    f = bench.bubble_figures(schedule, _spans_of(schedule, times))
    theory = schedules.bubble_theory(name, pp, m, v)
    for key in ("bubble_measured", "bubble_theory", "bubble_theory_measured_times", "bubble_simulated"):
        assert f[key] == pytest.approx(theory, abs=1e-12), key
    assert f["compute_ms"][schedules.F] == pytest.approx(1e3)
    assert sum(f["step_ms"]["idle"]) == pytest.approx(theory * pp * f["step_ms"]["phase"])


def test_benchmark_pipeline_small():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--small"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["schedules"]) == set(bench.SCHEDULES) and out["config"]["small"]
    for name, f in out["schedules"].items():
        assert FIGURES <= f.keys(), (name, FIGURES - f.keys())
        peer = name != "optimal"  # torch has no memory-budgeted planner
        for key in ("tokens_per_s", "torch_tokens_per_s", "ratio", "peak_activation_bytes"):
            if peer or key in ("tokens_per_s", "peak_activation_bytes"):
                assert math.isfinite(f[key]) and f[key] > 0, (name, key, f[key])
            else:
                assert f[key] is None, (name, key)
        for key in ("bubble_measured", "bubble_theory", "bubble_theory_measured_times", "bubble_simulated"):
            assert 0 <= f[key] < 1, (name, key, f[key])
        # both engines train the same tied GPT from the same seed on the same batch: the first
        # step's loss is the same but for the order of fp32 sums (~1e-7 relative)
        if peer:
            assert abs(f["first_step_loss"] / f["torch_first_step_loss"] - 1) < 1e-5, (name, f)
    planned = out["optimal_vs_zb_h1"]["planned"]  # the plan's model, the same budget
    assert planned["optimal"]["makespan"] <= planned["zb-h1"]["makespan"] + 1e-9, planned
    half = planned["half_budget"]
    assert half["optimal"]["peak_bytes"] <= half["budget_bytes"] + 1e-6, half
    assert half["optimal"]["makespan"] <= half["1f1b"]["makespan"] + 1e-9, half
    assert out["schedules"]["optimal"]["peak_activation_bytes"] <= \
        1.05 * out["optimal_vs_zb_h1"]["memory_budget_bytes"]
    memory = out["peak_activation_bytes"]
    assert memory["schedule"] == bench.OFFLOAD_SCHEDULE
    assert 0 < memory["recompute_full"] < memory["no_offload"]
    assert 0 < memory["offload"] < memory["no_offload"]
