"""The planner's predictions against `loom train` on this machine (issue 12, point 7), and the
search's speed on a 175B model over 1024 GPUs (point 3).

    .venv/bin/python benchmarks/planner.py [--rounds 2] [--steps 12] [--small]   # ~10 min

What is compared: every plan of `planner_measure.GRID` (the default GPT on 1, 2 and 4 CPU
processes: dp, tp, pp under three schedules, cp, ZeRO 1-3, microbatch counts, recompute) is
predicted by the cost model (`cost.estimate`) and by the event simulator (`simulate_step`)
with the calibrated `cpu-here` spec (`loom bench calibrate`; a quick calibration is run and
saved first if there is none), and measured by running it with `loom train`
(`planner_measure.measure`: the median step time after the warm-up steps). The grid is
measured `--rounds` times, in an order reversed every round, so a drift of the machine's load
falls on all plans alike; a plan's measured step time is the median over its rounds.

Reported: per plan its settings, predicted, simulated and measured step time and the relative
error; `median_rel_error` (|predicted - measured| / measured, median over the grid);
`spearman` (rank correlation of predicted and measured step times over the whole grid) and
`spearman_by_procs` (within each process count, where the plans compete for the same
machine); `predicted_best_within_5pct` (per process count: is the plan the model ranks first
measured within 5% of the fastest measured?); `search_s_175b_1024` (one `search` of gpt3-175b
on 1024 h100-80g, global batch 1536, top 10). The last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_measure import GRID, measure  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from loomtrain.planner.calibrate import cpu_here  # noqa: E402
from loomtrain.planner.cost import estimate, step_costs  # noqa: E402
from loomtrain.planner.presets import preset  # noqa: E402
from loomtrain.planner.search import search  # noqa: E402
from loomtrain.planner.simulate import simulate_step  # noqa: E402
from loomtrain.planner.specs import BUILTIN, ClusterSpec  # noqa: E402


def predict(device, plan) -> tuple[float, float]:
    """(cost model, simulator) step time of `plan` on `plan.devices` processes of this machine."""
    shape, cluster = preset("default"), ClusterSpec(device, plan.devices, plan.devices)
    return (estimate(shape, cluster, plan).step_time_s,
            simulate_step(step_costs(shape, cluster, plan)).step_time_s)


def search_time_175b() -> float:
    cluster = ClusterSpec(BUILTIN["h100-80g"], 1024, 8)
    t0 = time.perf_counter()
    result = search(preset("gpt3-175b"), cluster, 1536, top=10)
    assert result.ranked, "no plan of gpt3-175b fits 1024 h100-80g"
    return time.perf_counter() - t0


def rank_correlation(xs: list[float], ys: list[float]) -> float | None:
    return float(spearmanr(xs, ys).statistic) if len(xs) >= 3 else None


def summarize(rows: list[dict]) -> dict:
    errors = [abs(r["predicted_step_s"] - r["measured_step_s"]) / r["measured_step_s"] for r in rows]
    sim_errors = [abs(r["simulated_step_s"] - r["measured_step_s"]) / r["measured_step_s"]
                  for r in rows]
    by_procs: dict[int, list[dict]] = {}
    for r in rows:
        by_procs.setdefault(r["procs"], []).append(r)
    best = {}
    for procs, group in sorted(by_procs.items()):
        chosen = min(group, key=lambda r: r["predicted_step_s"])
        fastest = min(r["measured_step_s"] for r in group)
        best[str(procs)] = {"predicted_best": chosen["settings"],
                            "its_measured_over_fastest": chosen["measured_step_s"] / fastest,
                            "within_5pct": chosen["measured_step_s"] <= 1.05 * fastest}
    return {"median_rel_error": statistics.median(errors),
            "median_rel_error_simulator": statistics.median(sim_errors),
            "spearman": rank_correlation([r["predicted_step_s"] for r in rows],
                                         [r["measured_step_s"] for r in rows]),
            "spearman_by_procs": {str(p): rank_correlation([r["predicted_step_s"] for r in g],
                                                            [r["measured_step_s"] for r in g])
                                  for p, g in sorted(by_procs.items())},
            "predicted_best_within_5pct": all(b["within_5pct"] for b in best.values()),
            "best_by_procs": best}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="loom train steps per measurement")
    ap.add_argument("--small", action="store_true",
                    help="three plans, one round, few steps (the suite's smoke test)")
    args = ap.parse_args(argv)
    device = cpu_here()  # a quick calibration saved first if there is none
    grid = GRID[:3] if args.small else GRID
    rounds, steps = (1, 6) if args.small else (args.rounds, args.steps)
    measured: dict[int, list[float]] = {i: [] for i in range(len(grid))}
    for r in range(rounds):
        order = list(range(len(grid)))[::(-1 if r % 2 else 1)]
        for i in order:
            measured[i].append(measure(grid[i], steps=steps)["median_step_s"])
            print(f"round {r}: plan {i} {grid[i].settings()}: {measured[i][-1]:.4g} s",
                  file=sys.stderr)
    rows = []
    for i, plan in enumerate(grid):
        predicted, simulated = predict(device, plan)
        step = statistics.median(measured[i])
        rows.append({"settings": plan.settings(), "procs": plan.devices,
                     "predicted_step_s": predicted, "simulated_step_s": simulated,
                     "measured_step_s": step, "measured_rounds_s": measured[i],
                     "rel_error": (predicted - step) / step})
    out = {"device": device.name, "device_source": device.source, "rounds": rounds,
           "steps": steps, "configs": rows, **summarize(rows),
           "search_s_175b_1024": search_time_175b()}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
