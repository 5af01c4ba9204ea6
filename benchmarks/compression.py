"""Gradient compression against dense data parallelism on a simulated slow link, and the two
sparse all-reduce schemes against each other: bytes, validation loss, wall time.

    .venv/bin/python benchmarks/compression.py [--steps 2000] [--only topk_1pct,powersgd_r4]
        [--d-model 64] [--layers 2] [--seq-len 64] [--rows 2] [--skip-sparse]
    .venv/bin/python benchmarks/compression.py --small     # smoke test: tiny model, 40 steps

Training runs: one gloo world of 4 spawned ranks on 127.0.0.1, 2 simulated nodes of 2 ranks with
a 1 Gbit/s link between them, 1 ms per op (`[comm]`, comm/link.py), the trainer's own loop on
the default corpus with the configuration of benchmarks/lowcomm.py (the default GPT made small:
d_model 64, 2 blocks, rows of 64 tokens, 2 rows per replica and step, AdamW, 2000 steps),
changing only `[compression]`. Runs, in this order (DP first and again last, so drift over the
session shows as the difference of its two runs):

    (an unreported 5-step DP warm-up), dp, topk_1pct, randomk_1pct, powersgd_r4, int8, sign,
    dp again

with error feedback where the method's default has it (all but int8), the sparse all-reduce
rule "auto", and the error against the dense sum measured every 100 steps (a diagnostic
all-reduce off the simulated link, not counted in the bytes). Per run: `val_loss` (the final
validation loss), `bytes_per_step` (wire bytes one rank sent per optimizer step, the
trainer's small control all-reduces included), `simulated_wall_s` (rank 0's loop seconds with
the simulated link's delays), `wall_s` (minus the seconds waited on the link), `ratio` (the
dense ring all-reduce's bytes over the compressed ones, the engine's own count) and
`error` (the mean of the measured relative errors of the compressed gradient sum).

Sparse all-reduce: benchmarks/sparse_allreduce.py (its own world; see there), whose JSON line
is taken in as `sparse_allreduce`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

from lowcomm import RANKS_PER_NODE, WORLD, tree
from trainruns import add_run_arguments, run_jobs

# name -> [compression] (the peer, dense DP, is {})
RUNS = {
    "dp": {},
    "topk_1pct": {"method": "topk", "ratio": 0.01},
    "randomk_1pct": {"method": "randomk", "ratio": 0.01},
    "powersgd_r4": {"method": "powersgd", "rank": 4},
    "int8": {"method": "int8"},
    "sign": {"method": "sign"},
}
ERROR_EVERY = 100


def compression_tree(compression: dict, root: str, label: str, steps: int, args) -> dict:
    t = tree({}, root, label, steps, args.small, args)
    t["train"].update(json.loads(args.train))
    t["comm"]["inter_node_gbps"] = args.gbps
    if compression:
        t["compression"] = {**compression, "error_every": ERROR_EVERY if not args.small else 10}
    return t


def summarize(ranks: dict[int, dict], steps: int) -> dict:
    r0 = ranks[0]
    records = r0["records"]
    ratios = [r["compression_ratio"] for r in records if r.get("compression_ratio")]
    errors = [r["compression_error"] for r in records if "compression_error" in r]
    return {
        "val_loss": round(r0["val_loss"], 4),
        "train_loss": round(r0["loss"], 4),
        "bytes_per_step": round(sum(r["bytes"] for r in ranks.values()) / len(ranks) / steps),
        "simulated_wall_s": round(r0["loop_s"], 2),
        "wall_s": round(r0["loop_s"] - r0["link_wait_s"], 2),
        "link_s": round(sum(r["link_s"] for r in ranks.values()) / len(ranks), 3),
        "ratio": round(mean(ratios), 2) if ratios else None,
        "error": round(mean(errors), 4) if errors else None,
    }


def sparse_allreduce(small: bool) -> dict:
    """benchmarks/sparse_allreduce.py's JSON line, run as its own process."""
    script = Path(__file__).with_name("sparse_allreduce.py")
    cmd = [sys.executable, str(script)] + (["--quick"] if small else [])
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--train", default="{}", help="[train] keys for every run, as JSON "
                        '(e.g. \'{"optimizer": "sgd", "lr": 0.3}\')')
    parser.add_argument("--gbps", type=float, default=1.0, help="the simulated inter-node "
                        "link's bandwidth, Gbit/s (the sparse all-reduce part keeps its own)")
    parser.add_argument("--skip-sparse", action="store_true", help="no sparse all-reduce part")
    args = parser.parse_args()
    steps = 40 if args.small else args.steps
    names = [n for n in RUNS if n != "dp" and (not args.only or n in args.only.split(","))]
    order = [("dp_first", "dp")] + [(n, n) for n in names] + [("dp_last", "dp")]
    root = tempfile.mkdtemp(prefix="loom-compression-")
    jobs = [(label, compression_tree(RUNS[name], root, label, steps, args)) for label, name in order]
    jobs.insert(0, ("warmup", compression_tree({}, root, "warmup", 5, args)))
    got = run_jobs(jobs, WORLD, root)
    runs = {label: summarize(got[label], steps) for label, _ in order}
    first, last = runs.pop("dp_first"), runs.pop("dp_last")
    runs = {"dp": {**first, **{k: round((first[k] + last[k]) / 2, 4) for k in
                               ("val_loss", "bytes_per_step", "simulated_wall_s", "wall_s")}},
            **runs}
    dp = runs["dp"]
    vs_dp = {name: {"bytes_vs_dp": round(dp["bytes_per_step"] / r["bytes_per_step"], 1),
                    "val_loss_vs_dp": round(r["val_loss"] / dp["val_loss"] - 1, 4),
                    "simulated_wall_vs_dp": round(r["simulated_wall_s"] / dp["simulated_wall_s"], 3)}
             for name, r in runs.items() if name != "dp"}
    targets = {}
    if "topk_1pct" in vs_dp:
        targets["topk_1pct_within_3pct"] = abs(vs_dp["topk_1pct"]["val_loss_vs_dp"]) <= 0.03
        targets["topk_1pct_30x_fewer_bytes"] = vs_dp["topk_1pct"]["bytes_vs_dp"] >= 30
    line = {"benchmark": "compression", "world": WORLD, "ranks_per_node": RANKS_PER_NODE,
            "inter_node_gbps": args.gbps, "inter_node_latency_ms": 1.0, "steps": steps,
            "small": args.small, "model": {"d_model": args.d_model, "n_layers": args.layers,
                                           "seq_len": args.seq_len},
            "rows_per_replica": args.rows, "error_every": ERROR_EVERY,
            "train": json.loads(args.train),
            "dp_runs": {"first": first, "last": last}, "runs": runs, "vs_dp": vs_dp}
    if not args.skip_sparse:
        sparse = sparse_allreduce(args.small)
        line["sparse_allreduce"] = sparse.get("sparse_allreduce", sparse)
        line["sparse_allreduce_setup"] = {k: v for k, v in sparse.items() if k != "sparse_allreduce"}
        balanced, gathered = (line["sparse_allreduce"].get(s, {}).get("0.1") for s in
                              ("balanced", "allgather"))
        if balanced and gathered:
            targets["balanced_faster_than_allgather_at_10pct"] = balanced["time_s"] < gathered["time_s"]
    line["targets"] = targets
    print(json.dumps(line))


if __name__ == "__main__":
    main()
