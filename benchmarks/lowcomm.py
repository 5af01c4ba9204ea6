"""Low-communication data parallelism against synchronous data parallelism, on a simulated
slow link between two nodes: bytes, validation loss, wall time.

    .venv/bin/python benchmarks/lowcomm.py [--steps 2000] [--only diloco_h50,noloco] [--plot PNG]
        [--d-model 64] [--layers 2] [--seq-len 64] [--rows 2]      # ~9 min on 2 CPU cores
    .venv/bin/python benchmarks/lowcomm.py --small     # smoke test: tiny model, 40 steps

torchft is its peer (pip install -e ".[peers]"): without it the script says so on stderr and
exits 2, unless --only leaves out the torchft runs.

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
    (DASO, H=10, one step stale), lordo (H=50, rank 16), dp again;

then the peer, torchft (issue 30), each in a fresh world of 4 replica processes, through the
bare loop of benchmarks/bareruns.py (the user's loop without the trainer, on loopback, no
simulated link), loomtrain's wrapper and torchft's alternating, with the [lowcomm] of
local_sgd and diloco_h50 (the same H):

    local_sgd_bare, torchft_local_sgd, diloco_bare, torchft_diloco

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
The bare-loop runs have no simulated link, so no `simulated_wall_s` or `link_s`; their
`sync_step_ms` and `step_ms` are replica 0's mean step with and without a sync;
`socket_bytes_per_rank` is the growth of `wchar` in /proc/self/io (bytes handed to write(),
here only to sockets) over the loop, the one measure that counts torchft's bytes (its
collectives, quorums, commits and heartbeats do not go through loomtrain's meter) and
loomtrain's alike; `bytes_per_rank` is the meter's wire bytes for loomtrain's and that
socket figure for torchft's; `wall_s` is replica 0's seconds from the rendezvous to its last
step; `val_loss` to 6 decimals; `one_model`: every replica ended with the same parameters
(CRC-32).
Top-level: the ratios the targets of issue 7 are about (docs/lowcomm.md), `vs_torchft` and
the targets of issue 30 (loomtrain's DiLoCo sends no more socket bytes than torchft's and
ends no worse in validation loss), and the load average after the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bareruns import TORCHFT_MISSING, run_bare_jobs, torchft_missing
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
# name -> (whose replicas, the run whose [lowcomm] it takes): the bare loop's runs
PEER_RUNS = {
    "local_sgd_bare": ("loomtrain", "local_sgd"),
    "torchft_local_sgd": ("torchft", "local_sgd"),
    "diloco_bare": ("loomtrain", "diloco_h50"),
    "torchft_diloco": ("torchft", "diloco_h50"),
}
# "no worse" in validation loss: the same algorithm in fp32, its sums in another order (one
# flat all-reduce against one per tensor); 2000 steps ended 2e-6 and 6e-6 apart (2026-12-07)
VAL_LOSS_TOLERANCE = 1e-4


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


def bare_run(ranks: dict[int, dict], lowcomm: dict) -> dict:
    """A bare-loop run's figures (bareruns.py): means over the replicas, but replica 0's
    `wall_s` and its mean milliseconds of a step that synced (`sync_step_ms`: the sync and the
    step's compute) and of one that did not (`step_ms`); `val_loss` and `train_loss` are
    token means over all of them, the former to 6 decimals, for the comparison with the
    peer."""
    figures = list(ranks.values())
    steps, syncs = ranks[0]["steps"], ranks[0]["steps"] // lowcomm["inner_steps"]
    socket = sum(r["socket_bytes"] for r in figures) / WORLD
    metered = figures[0]["wire_bytes"] is not None
    val_loss = sum(r["val_sum"] for r in figures) / sum(r["val_tokens"] for r in figures)
    return {"val_loss": round(val_loss, 6),
            "train_loss": round(sum(r["loss_sum"] for r in figures)
                                / sum(r["tokens"] for r in figures), 4),
            "bytes_per_rank": round(sum(r["wire_bytes"] for r in figures) / WORLD if metered
                                    else socket),
            "socket_bytes_per_rank": round(socket),
            "wall_s": round(ranks[0]["loop_s"], 2),
            "sync_step_ms": round(1e3 * ranks[0]["sync_steps_s"] / syncs, 1),
            "step_ms": round(1e3 * ranks[0]["steps_s"] / (steps - syncs), 1),
            "one_model": len({r["fingerprint"] for r in figures}) == 1,
            "lowcomm": lowcomm}


def versus_torchft(runs: dict) -> dict:
    """Per method run by both in the bare loop: torchft's socket bytes and wall time over
    loomtrain's, and loomtrain's validation loss relative to torchft's (below 0: lower)."""
    out = {}
    for method in ("local_sgd", "diloco"):
        loom, ft = runs.get(f"{method}_bare"), runs.get(f"torchft_{method}")
        if loom is None or ft is None:
            continue
        out[method] = {
            "socket_bytes_torchft_over_loomtrain": round(
                ft["socket_bytes_per_rank"] / loom["socket_bytes_per_rank"], 3),
            "val_loss_vs_torchft": round(loom["val_loss"] / ft["val_loss"] - 1, 6),
            "wall_torchft_over_loomtrain": round(ft["wall_s"] / loom["wall_s"], 3)}
    return out


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
    only = args.only.split(",") if args.only else list(RUNS) + list(PEER_RUNS)
    names = [n for n in RUNS if n != "dp" and n in only]
    peers = [n for n in PEER_RUNS if n in only]
    if any(PEER_RUNS[n][0] == "torchft" for n in peers) and torchft_missing():
        print(TORCHFT_MISSING, file=sys.stderr)
        sys.exit(2)
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
    bare = run_bare_jobs([(n, PEER_RUNS[n][0], tree(lowcomm_of[PEER_RUNS[n][1]], root, n, steps,
                                                     args.small, args)) for n in peers], WORLD)
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
    for n in peers:
        runs[n] = bare_run(bare[n], lowcomm_of[PEER_RUNS[n][1]])
    vs_torchft = versus_torchft(runs)
    if "diloco" in vs_torchft:
        loom, ft = runs["diloco_bare"], runs["torchft_diloco"]
        targets["diloco_socket_bytes_at_most_torchft"] = (loom["socket_bytes_per_rank"]
                                                          <= ft["socket_bytes_per_rank"])
        targets["diloco_val_loss_no_worse_than_torchft"] = (
            vs_torchft["diloco"]["val_loss_vs_torchft"] <= VAL_LOSS_TOLERANCE)
    print(json.dumps({"benchmark": "lowcomm", "world": WORLD, "ranks_per_node": RANKS_PER_NODE,
                      "inter_node_gbps": 1.0, "inter_node_latency_ms": 1.0, "steps": steps,
                      "small": args.small, "tokens_per_run": steps * WORLD * args.rows * (32 if args.small else args.seq_len),
                      "model": {"d_model": args.d_model, "n_layers": args.layers,
                                "seq_len": args.seq_len}, "rows_per_replica": args.rows,
                      "dp_runs": {"first": runs.pop("dp_first"), "last": runs.pop("dp_last")},
                      "runs": runs, "vs_dp": summary, "vs_torchft": vs_torchft, "targets": targets,
                      "load_avg": [round(x, 2) for x in os.getloadavg()]}))


if __name__ == "__main__":
    main()
