"""Low-communication data parallelism against synchronous data parallelism, on a simulated
slow link between two nodes: bytes, validation loss, wall time.

    .venv/bin/python benchmarks/lowcomm.py [--steps 2000] [--only diloco_h50,noloco] [--plot PNG]
        [--d-model 64] [--layers 2] [--seq-len 64] [--rows 2]      # ~9 min on 2 CPU cores
    .venv/bin/python benchmarks/lowcomm.py --small     # smoke test: tiny model, 40 steps

One gloo world of 4 spawned ranks on 127.0.0.1 (one torch thread each), split into 2 simulated
nodes of 2 ranks with a 1 Gbit/s link between them (`[comm] inter_node_gbps = 1`, 1 ms per
op; comm/link.py: a cross-node op completes no sooner than latency + its wire bytes over the
bandwidth). Every run is the trainer's own loop (`run.train_loop`) on the default corpus (the
standard library's source) with the same config but for `[lowcomm]`: the same steps, rows and
tokens, AdamW (the trainer's defaults: lr 3e-3, cosine), the default GPT made small (d_model
64, 2 blocks, rows of 64 tokens, ~0.1 M parameters), 2 rows per replica and step (global
batch 8), 2000 steps: small enough that DiLoCo at H = 200 gets 10 outer steps in a few
minutes of 2 CPU cores, and synchronous DP's gradient all-reduce is a visible part of a step.
Runs, in this order (DP first and again last, so drift over the session shows as the
difference of its two runs):

    (an unreported 5-step DP warm-up), dp, local_sgd (H=50), diloco_h50, diloco_h200,
    streaming_diloco (H=50, F=2, one step in flight), noloco (H=50), dreamddp (H=10),
    hpsgd (one step in flight), hierarchical
    (DASO, H=10, one step stale), lordo (H=50, rank 16), dp again

Per run, figures of the whole run (rank means unless said):
- `val_loss`: the final validation loss (the trainer's evaluation after the last step, which
  ends every method on one model);
- `bytes_per_rank`: wire bytes one rank sent (comm/meter.py), everything the run sent,
  the trainer's small control all-reduces included; `inter_node_bytes_per_rank`: of those, the
  bytes of ops whose group spans both nodes (the ones on the slow link);
- `simulated_wall_s`: rank 0's measured seconds for the loop (from start to the final
  checkpoint) with the simulated link in place: its delays are real waits, so this is what the
  run takes on a cluster whose nodes compute like these ranks and talk over 1 Gbit/s;
- `wall_s`: the same minus the seconds rank 0 waited on the simulated link after the real
  transfer had completed (`CommMeter.link_wait_s`): the run on this machine's own loopback;
- `link_s`: simulated link seconds of the ops this rank sent (hidden or not; a receive is
  its sender's op, not counted twice), and `link_wait_s`.
Top-level: the ratios the targets of issue 7 are about (docs/lowcomm.md).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from trainruns import add_run_arguments, loss_curve, run_jobs

WORLD, RANKS_PER_NODE = 4, 2

# name -> [lowcomm] (the peer, synchronous DP, is {})
RUNS = {
    "dp": {},
    "local_sgd": {"algorithm": "local_sgd", "inner_steps": 50},
    "diloco_h50": {"algorithm": "diloco", "inner_steps": 50},
    "diloco_h200": {"algorithm": "diloco", "inner_steps": 200},
    "streaming_diloco": {"algorithm": "streaming_diloco", "inner_steps": 50, "fragments": 2},
    "noloco": {"algorithm": "noloco", "inner_steps": 50},
    "dreamddp": {"algorithm": "dreamddp", "inner_steps": 10},
    "hpsgd": {"algorithm": "hpsgd"},
    "hierarchical": {"algorithm": "hierarchical", "inner_steps": 10},
    "lordo": {"algorithm": "lordo", "inner_steps": 50},
}


def tree(lowcomm: dict, root: str, name: str, steps: int, small: bool, args) -> dict:
    model = ({"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32} if small
             else {"d_model": args.d_model, "n_layers": args.layers, "n_heads": 4,
                   "seq_len": args.seq_len})
    return {
        "run": {"dir": root, "name": name, "log_every": 10, "eval_every": 10 ** 9,
                "eval_batches": 16, "progress": False, "seed": 1},
        "model": {"name": "gpt", **model},
        "train": {"steps": steps, "global_batch": WORLD * args.rows, "micro_batch": args.rows},
        "parallel": {"nproc": WORLD, "ranks_per_node": RANKS_PER_NODE},
        "comm": {"inter_node_gbps": 1.0, "inter_node_latency_ms": 1.0},
        "checkpoint": {"every": 0},
        "lowcomm": lowcomm,
    }


def plot(path: str, curves: dict[str, list], steps: int, smooth: int = 10) -> None:
    """Training loss (logged every 10 steps, rank 0's view of the global mean; a moving mean
    over `smooth` records, as one step's loss on 8 rows is noisy) against the wire bytes rank
    0 had sent by then, one line per run, log-scale bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    fig = Figure(figsize=(9, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for label, curve in curves.items():
        if label == "dp_last":
            continue
        points = [(b / 2 ** 20, sum(loss for _, loss in curve[i - smooth + 1:i + 1]) / smooth)
                  for i, (b, _) in enumerate(curve) if i + 1 >= smooth]
        xs, ys = zip(*points)
        style = {"color": "black", "linewidth": 2.5} if label == "dp_first" else {}
        ax.plot(xs, ys, label="dp" if label == "dp_first" else label, **style)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("MiB sent by one rank (log scale)")
    ax.set_ylabel(f"training loss (mean of {smooth} records)")
    ax.set_title(f"loss against bytes sent: world 4 (2 nodes x 2, 1 Gbit/s), {steps} steps, "
                 "same tokens", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--plot", default="", help="write the loss-vs-bytes plot (PNG) here")
    parser.add_argument("--replot", default="", help="only redraw --plot from the run folders "
                        "a finished benchmark left in this directory (its metrics.jsonl files)")
    args = parser.parse_args()
    steps = 40 if args.small else args.steps
    if args.replot:
        from loomtrain.train.metrics import read_metrics

        runs = sorted(p.name for p in Path(args.replot).iterdir() if (p / "metrics.jsonl").exists())
        order = ["dp_first"] + [r for r in runs if r not in ("dp_first", "dp_last", "warmup")]
        plot(args.plot, {r: loss_curve(read_metrics(Path(args.replot) / r)) for r in order}, steps)
        return
    names = [n for n in RUNS if n != "dp" and (not args.only or n in args.only.split(","))]
    order = [("dp_first", "dp")] + [(n, n) for n in names] + [("dp_last", "dp")]
    root = tempfile.mkdtemp(prefix="loom-lowcomm-")
    lowcomm_of = {n: dict(RUNS[n]) for n in RUNS}
    if args.small:  # tiny periods for 40 steps
        for n, lc in lowcomm_of.items():
            if "inner_steps" in lc:
                lc["inner_steps"] = {"diloco_h200": 20, "streaming_diloco": 10}.get(n, 10)
    jobs = [(label, tree(lowcomm_of[name], root, label, steps, args.small, args))
            for label, name in order]
    # imports, allocator and thread pools warm before the first measured run: 5 steps of DP
    jobs.insert(0, ("warmup", tree({}, root, "warmup", 5, args.small, args)))
    got = run_jobs(jobs, WORLD, root)
    name_of = dict(order)
    runs = {}
    for label, _ in order:
        ranks = got[label]
        r0 = ranks[0]
        runs[label] = {
            "val_loss": round(r0["val_loss"], 4),
            "train_loss": round(r0["loss"], 4),
            "bytes_per_rank": round(sum(r["bytes"] for r in ranks.values()) / WORLD),
            "inter_node_bytes_per_rank": round(sum(r["inter_node_bytes"] for r in ranks.values()) / WORLD),
            "wall_s": round(r0["loop_s"] - r0["link_wait_s"], 2),
            "simulated_wall_s": round(r0["loop_s"], 2),
            "link_s": round(sum(r["link_s"] for r in ranks.values()) / WORLD, 3),
            "link_wait_s": round(r0["link_wait_s"], 3),
            "lowcomm": lowcomm_of[name_of[label]],
        }
    if args.plot:
        plot(args.plot, {label: got[label][0]["curve"] for label, _ in order}, steps)
    dp = {k: (runs["dp_first"][k] + runs["dp_last"][k]) / 2
          for k in ("val_loss", "bytes_per_rank", "inter_node_bytes_per_rank", "simulated_wall_s",
                    "wall_s")}
    runs["dp"] = {**runs["dp_first"], **{k: round(v, 4) for k, v in dp.items()}}
    summary = {}
    for label in runs:
        if label.startswith("dp"):
            continue
        r = runs[label]
        summary[label] = {"bytes_vs_dp": round(dp["bytes_per_rank"] / r["bytes_per_rank"], 1),
                          "inter_node_bytes_vs_dp": round(
                              dp["inter_node_bytes_per_rank"] / r["inter_node_bytes_per_rank"], 1),
                          "val_loss_vs_dp": round(r["val_loss"] / dp["val_loss"] - 1, 4),
                          "simulated_wall_vs_dp": round(r["simulated_wall_s"] / dp["simulated_wall_s"], 3)}
    outer = {"noloco": RUNS["noloco"].get("inner_steps"), "diloco_h50": 50}
    targets = {}
    if "diloco_h200" in runs:
        targets["diloco_h200_100x_fewer_bytes"] = summary["diloco_h200"]["bytes_vs_dp"] >= 100
        targets["diloco_h200_val_within_3pct"] = abs(summary["diloco_h200"]["val_loss_vs_dp"]) <= 0.03
    if "noloco" in runs and "diloco_h50" in runs and outer["noloco"] == outer["diloco_h50"]:
        # the same number of outer steps: compare the link seconds per outer step
        targets["noloco_sync_below_diloco"] = runs["noloco"]["link_s"] < runs["diloco_h50"]["link_s"]
    targets["every_simulated_wall_below_dp"] = all(
        s["simulated_wall_vs_dp"] < 1 for s in summary.values())
    print(json.dumps({"benchmark": "lowcomm", "world": WORLD, "ranks_per_node": RANKS_PER_NODE,
                      "inter_node_gbps": 1.0, "inter_node_latency_ms": 1.0, "steps": steps,
                      "small": args.small, "tokens_per_run": steps * WORLD * args.rows * (32 if args.small else args.seq_len),
                      "model": {"d_model": args.d_model, "n_layers": args.layers,
                                "seq_len": args.seq_len}, "rows_per_replica": args.rows,
                      "dp_runs": {"first": runs.pop("dp_first"), "last": runs.pop("dp_last")},
                      "runs": runs, "vs_dp": summary, "targets": targets}))


if __name__ == "__main__":
    main()
