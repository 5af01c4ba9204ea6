"""The measured side of the planner's validation (issue 12, point 7): a grid of plans of the
default model (planner/presets.py "default": 4 layers, d_model 256, 4 heads, seq 128, vocab
256; fp32; global batch 32, the default config's) on 1, 2 and 4 CPU processes, each written
by planner/apply.py as the config `loom plan --write-config` writes and trained by `python -m
loomtrain train` in a subprocess, exactly as a user runs it.

The measured step time of a run is the median, over the steps after `warmup`, of the wall time
between consecutive records of metrics.jsonl (`elapsed_s`, logged every step): the whole
iteration of the trainer's loop, its batch, forward, backward, gradient sync, optimizer step
and the per-step loss all-reduce of the record (a few small collectives). The first steps
(allocator warm-up, the first collectives' connections) are left out.

Run: `python benchmarks/planner_measure.py [--steps 8] [--warmup 2] [--only 0,5,9]`; it prints
one JSON line {"configs": [{"settings", "devices", "measured_step_s", ...}]}. A run that fails
is reported with its error rather than stopping the grid. The ranks share this machine's cores
(the trainer gives each cores / nproc threads), which the calibrated cpu-here spec models;
each row also has the 1-minute load average before and after its run, since anything else
running on the machine lengthens the measured steps (on a shared 2-core machine, step times of
one run were seen to vary by a factor of 3 or more at a load average of 7-10).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loomtrain.planner.apply import runnable, write_config
from loomtrain.planner.plan import Plan
from loomtrain.planner.presets import preset

SHAPE = preset("default")
BATCH = 32  # train.global_batch's default


def _fp32(**fields) -> Plan:
    return Plan(precision="fp32", **fields)


# every plan trains the same 32 sequences per step: dp * microbatches * micro_batch = 32
GRID: list[Plan] = [
    # 1 process: gradient accumulation against one big batch
    _fp32(micro_batch=8, microbatches=4),
    _fp32(micro_batch=32, microbatches=1),
    # 2 processes
    _fp32(dp=2, micro_batch=8, microbatches=2),
    _fp32(dp=2, micro_batch=16, microbatches=1, zero_stage=1),
    _fp32(dp=2, micro_batch=8, microbatches=2, zero_stage=2),
    _fp32(dp=2, micro_batch=8, microbatches=2, zero_stage=3),
    _fp32(tp=2, micro_batch=8, microbatches=4),
    _fp32(tp=2, micro_batch=8, microbatches=4, sequence_parallel=True),
    _fp32(pp=2, micro_batch=4, microbatches=8, schedule="1f1b"),
    _fp32(pp=2, micro_batch=4, microbatches=8, schedule="gpipe"),
    _fp32(pp=2, micro_batch=4, microbatches=8, schedule="interleaved", virtual_stages=2),
    _fp32(pp=2, micro_batch=8, microbatches=4, schedule="1f1b", recompute="full"),
    _fp32(cp=2, micro_batch=8, microbatches=4),
    # 4 processes
    _fp32(dp=4, micro_batch=8, microbatches=1),
    _fp32(dp=4, micro_batch=4, microbatches=2, zero_stage=3),
    _fp32(dp=2, tp=2, micro_batch=8, microbatches=2),
    _fp32(dp=2, pp=2, micro_batch=4, microbatches=4, zero_stage=1),
    _fp32(pp=4, micro_batch=2, microbatches=16, schedule="1f1b"),
    _fp32(dp=2, cp=2, micro_batch=8, microbatches=2),
]


def _base(root: Path, steps: int) -> dict:
    """Everything but the plan: a quiet run in `root` of `steps` steps, every step logged, no
    evaluation before the end and no checkpoint but the final one."""
    return {"run": {"dir": str(root), "name": "m", "log_every": 1, "eval_every": 10**6,
                    "eval_batches": 1, "progress": False},
            "train": {"steps": steps},
            "checkpoint": {"every": 0, "keep": 1}}


def step_times(records: list[dict]) -> list[float]:
    """Per-step wall times from metrics.jsonl records logged every step: the differences of
    consecutive `elapsed_s` (the first step's time is its own elapsed_s)."""
    elapsed = [r["elapsed_s"] for r in records]
    return [b - a for a, b in zip([0.0, *elapsed], elapsed)]


def measure(plan: Plan, steps: int = 8, warmup: int = 2, timeout_s: float = 300.0) -> dict:
    """Train `plan` for warmup + steps steps through `python -m loomtrain train` and return
    {median_step_s, step_s (every measured step), wall_s (the whole command), run_dir} or
    {error} when the run fails."""
    why = runnable(plan, SHAPE, BATCH, _base(Path("."), 1))
    if why is not None:
        return {"error": f"not runnable: {why}"}
    with tempfile.TemporaryDirectory(prefix="planner_measure_") as tmp:
        root = Path(tmp)
        config = write_config(root / "plan.toml", plan, SHAPE, BATCH, _base(root, warmup + steps))
        src = Path(__file__).resolve().parents[1] / "src"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        try:
            out = subprocess.run([sys.executable, "-m", "loomtrain", "train", str(config)],
                                 capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s} s"}
        wall_s = time.perf_counter() - start
        if out.returncode != 0:
            return {"error": f"exit {out.returncode}: {out.stderr.strip()[-500:]}"}
        from loomtrain.train.metrics import read_metrics

        records = read_metrics(root / "m")
        if len(records) != warmup + steps:
            return {"error": f"{len(records)} records in metrics.jsonl, expected {warmup + steps}"}
        times = step_times(records)[warmup:]
    # the 1-minute load average before and after: other work on the machine shows in the times
    return {"median_step_s": round(statistics.median(times), 4), "step_s": [round(t, 4) for t in times],
            "wall_s": round(wall_s, 2), "loadavg_1m": [load_before, os.getloadavg()[0]]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="measured steps per plan")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out before them")
    parser.add_argument("--only", help="comma-separated GRID indices (default: all)")
    args = parser.parse_args(argv)
    chosen = [int(i) for i in args.only.split(",")] if args.only else range(len(GRID))
    configs = []
    for i in chosen:
        plan = GRID[i]
        result = measure(plan, args.steps, args.warmup)
        row = {"index": i, "settings": plan.settings(), "devices": plan.devices,
               "measured_step_s": result.get("median_step_s"), **result}
        row.pop("median_step_s", None)
        print(f"  [{i}] {plan.devices} proc {plan.settings()}: "
              f"{row['measured_step_s'] or row.get('error')}", file=sys.stderr, flush=True)
        configs.append(row)
    doc = {"model": SHAPE.__dict__, "global_batch": BATCH, "steps": args.steps,
           "warmup": args.warmup, "configs": configs}
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
