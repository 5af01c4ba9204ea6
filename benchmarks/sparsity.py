"""Sparse training against dense training: validation loss, bytes per step under sparse-aware
data parallelism, checkpoint size; and RigL at 10% density with SAM and ZO-SAM.

    .venv/bin/python benchmarks/sparsity.py [--steps 2000] [--only static_0.5,rigl_0.2]
        [--d-model 64] [--layers 2] [--seq-len 64] [--rows 4]
    .venv/bin/python benchmarks/sparsity.py --small     # smoke test: tiny model, 20 steps

One gloo world of 2 spawned ranks on 127.0.0.1 (one torch thread each, plain data parallel,
no simulated link), the trainer's own loop (`run.train_loop`) on the default corpus with the
same config but for `[sparsity]`: the default GPT made small as in benchmarks/lowcomm.py
(d_model 64, 2 blocks, 4 heads, rows of 64 tokens, ~0.1 M parameters), AdamW with the
trainer's defaults (lr 3e-3, cosine), `--rows` rows per replica and step, the same seed, so
every run sees the same batches and is evaluated on the same validation rows
(`run.eval_batches` 32) after its last step. Runs, in this order:

    (an unreported 3-step dense warm-up), dense,
    static, prune, set, rigl at densities 0.5, 0.2, 0.1 (ERK layer densities),
    rigl_0.1_sam, rigl_0.1_zosam

every sparse run with `sparse_comm = true` (the data-parallel engine all-reduces only the kept
gradient entries), `update_every` = steps / 20 (prune, set, rigl; at least 1), the methods'
default schedules (prune: cubic from step 0 to 75% of the steps; set, rigl: cosine decay of the
swapped fraction from alpha 0.3, updates until 75% of the steps), SAM and ZO-SAM at rho 0.05.

Per run (`runs`):
- `val_loss`: the final validation loss; `train_loss`: the last logged training loss;
- `bytes_per_step`: wire bytes one rank sent (comm/meter.py, the mean of the two ranks) over
  the whole run divided by the steps: every op of the run, so for prune, SET and RigL the
  mask syncs (`set_gradient_masks`) and the dense all-reduce of every RigL update step (and
  every step of prune's still-dense start) are in the mean, as are the trainer's small
  control all-reduces (the loss and token counts, the probe losses of ZO-SAM);
- `bytes_per_step_by_op`: `bytes_per_step` split by the meter's op (`all_reduce`: the
  gradient, dense or compact, and the control all-reduces; `mask_sync`: the masks'
  broadcasts, sent by rank 0 alone at world 2, so the mean of the two ranks is half of it).
  The meter's counts, not the engine's `sparse_comm_wire_bytes` and `mask_sync_wire_bytes`
  metrics: `set_gradient_masks(None)` (RigL's dense update steps) discards the engine's
  window, so summing those over the logged records undercounts RigL's bytes;
- `checkpoint_bytes`: the bytes of the final checkpoint folder (every file under it: the
  weights, AdamW's two moments, the RNG states, the masks, loom.json);
- `density` (the final kept fraction of the sparse layers), `backward_per_step` and
  `forward_per_step` (the trainer's counts, means over the run's records), `wall_s` (rank 0's
  loop seconds).
Top-level `vs_dense`: per run, val_loss / dense's - 1 and dense's bytes per step over the
run's; `targets`: the two of issue 11 (docs/sparsity.md#benchmark).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from statistics import mean

from trainruns import run_jobs

WORLD = 2
METHODS = ("static", "prune", "set", "rigl")
DENSITIES = (0.5, 0.2, 0.1)


def run_names() -> dict[str, dict]:
    """name -> [sparsity] (dense: {})."""
    runs = {"dense": {}}
    for method in METHODS:
        for d in DENSITIES:
            runs[f"{method}_{d}"] = {"method": method, "density": d}
    runs["rigl_0.1_sam"] = {"method": "rigl", "density": 0.1, "sam": "sam"}
    runs["rigl_0.1_zosam"] = {"method": "rigl", "density": 0.1, "sam": "zo-sam"}
    return runs


def tree(sparsity: dict, root: str, name: str, steps: int, args) -> dict:
    model = ({"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32} if args.small
             else {"d_model": args.d_model, "n_layers": args.layers, "n_heads": 4,
                   "seq_len": args.seq_len})
    t = {
        "run": {"dir": root, "name": name, "log_every": max(1, steps // 20), "eval_every": 10 ** 9,
                "eval_batches": 8 if args.small else 32, "progress": False, "seed": 1},
        "model": {"name": "gpt", **model},
        "train": {"steps": steps, "global_batch": WORLD * args.rows, "micro_batch": args.rows},
        "parallel": {"nproc": WORLD},
        "checkpoint": {"every": 0},
    }
    if sparsity:
        update = {"update_every": max(5, steps // 20)} if sparsity["method"] != "static" else {}
        t["sparsity"] = {**sparsity, **update, "sparse_comm": True}
    return t


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def summarize(ranks: dict[int, dict], run_dir: Path, steps: int) -> dict:
    from loomtrain.train.checkpoint import list_checkpoints

    r0 = ranks[0]
    records = r0["records"]
    out = {
        "val_loss": round(r0["val_loss"], 4),
        "train_loss": round(r0["loss"], 4),
        "bytes_per_step": round(sum(r["bytes"] for r in ranks.values()) / len(ranks) / steps),
        "checkpoint_bytes": folder_bytes(list_checkpoints(run_dir)[-1]),
        "wall_s": round(r0["loop_s"], 2),
    }
    ops = sorted({op for r in ranks.values() for op in r["bytes_by_op"]})
    out["bytes_per_step_by_op"] = {
        op: round(sum(r["bytes_by_op"].get(op, 0) for r in ranks.values()) / len(ranks) / steps, 1)
        for op in ops}
    if "density" in records[-1]:
        out["density"] = records[-1]["density"]
    for key in ("forward_per_step", "backward_per_step"):
        values = [r[key] for r in records if key in r]
        if values:
            out[key] = round(mean(values), 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--only", default="", help="comma-separated run names (dense is always run)")
    parser.add_argument("--small", action="store_true", help="smoke test: tiny model, 20 steps")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rows", type=int, default=4, help="rows per replica and step")
    args = parser.parse_args()
    steps = 20 if args.small else args.steps
    every = run_names()
    wanted = set(args.only.split(",")) if args.only else set(every)
    names = [n for n in every if n == "dense" or n in wanted]
    root = tempfile.mkdtemp(prefix="loom-sparsity-")
    jobs = [("warmup", tree({}, root, "warmup", 3, args))]
    jobs += [(n, tree(every[n], root, n, steps, args)) for n in names]
    got = run_jobs(jobs, WORLD, root)
    runs = {n: {**summarize(got[n], Path(root) / n, steps), "sparsity": every[n]} for n in names}
    dense = runs["dense"]
    vs_dense = {n: {"val_loss_vs_dense": round(r["val_loss"] / dense["val_loss"] - 1, 4),
                    "bytes_vs_dense": round(dense["bytes_per_step"] / r["bytes_per_step"], 2)}
                for n, r in runs.items() if n != "dense"}
    targets = {}
    if "rigl_0.2" in runs:
        targets["rigl_0.2_val_within_5pct_of_dense"] = vs_dense["rigl_0.2"]["val_loss_vs_dense"] <= 0.05
    if {"rigl_0.1", "rigl_0.1_zosam"} <= runs.keys():
        z, plain = runs["rigl_0.1_zosam"], runs["rigl_0.1"]
        targets["zosam_0.1_at_least_rigl_0.1"] = z["val_loss"] <= plain["val_loss"]
        targets["zosam_one_backward_per_step"] = z["backward_per_step"] == 1
    print(json.dumps({"benchmark": "sparsity", "world": WORLD, "steps": steps, "small": args.small,
                      "model": {"d_model": 32 if args.small else args.d_model,
                                "n_layers": 2 if args.small else args.layers,
                                "seq_len": 32 if args.small else args.seq_len},
                      "rows_per_replica": args.rows, "runs": runs, "vs_dense": vs_dense,
                      "targets": targets}))


if __name__ == "__main__":
    main()
