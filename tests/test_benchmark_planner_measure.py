"""benchmarks/planner_measure.py: its grid covers the axes of issue 12's point 7, every plan
of it is one `loom train` runs, and step times are read from metrics.jsonl as documented.
(The measurement itself trains for tens of seconds per plan: run the script.)"""

from __future__ import annotations

import sys
from pathlib import Path

from loomtrain.planner.apply import runnable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # scripts, no package
import planner_measure as bench


def test_grid_covers_the_axes_and_runs():
    grid = bench.GRID
    assert len(grid) >= 14
    assert {p.devices for p in grid} == {1, 2, 4}
    assert any(p.dp > 1 for p in grid) and any(p.tp > 1 for p in grid) and any(p.cp > 1 for p in grid)
    assert {p.schedule for p in grid if p.pp > 1} >= {"1f1b", "gpipe", "interleaved"}
    assert {p.zero_stage for p in grid} >= {0, 1, 2, 3}
    assert len({p.microbatches for p in grid}) >= 3 and any(p.recompute != "none" for p in grid)
    assert len(set(grid)) == len(grid)
    for plan in grid:
        assert plan.dp * plan.microbatches * plan.micro_batch == bench.BATCH
        assert runnable(plan, bench.SHAPE, bench.BATCH, bench._base(Path("."), 1)) is None, plan


def test_step_times_are_differences_of_elapsed():
    records = [{"step": 1, "elapsed_s": 2.5}, {"step": 2, "elapsed_s": 3.0}, {"step": 3, "elapsed_s": 3.75}]
    assert bench.step_times(records) == [2.5, 0.5, 0.75]
