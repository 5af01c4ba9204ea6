"""Adaptive communication load on a link that slows mid-run: a parameter server whose workers
choose their accumulation from the round trips they measure, against the same workers pushing
every gradient (k = 1).

    .venv/bin/python benchmarks/async_adaptive.py [--run-s 80] [--slow-at-s 30] [--gbps 1]
        [--slow-gbps 0.05] [--max-accumulation 128] [--comm-fraction 0.25]   # ~3 min, 2 cores
    .venv/bin/python benchmarks/async_adaptive.py --small   # smoke test: tiny model, ~30 s

One gloo world of 5 ranks on 127.0.0.1: the parameter server on rank 0 and 4 workers, each on
a simulated node of its own (`parallel.ranks_per_node = 1`), so every PUSH and PARAMS crosses
the simulated link (comm/link.py): `--gbps` per rank, no latency, until `--slow-at-s` seconds
after the link was made (the run's start), then `--slow-gbps` (`comm.link_changes`). The task
is benchmarks/async.py's: the default GPT made small (d_model 64, 2 blocks, rows of 64 tokens,
120,576 parameters: a 482 kB message), AdamW lr 3e-3 with 20 warm-up updates and train.steps so
large that the cosine barely moves, 2 rows per worker and gradient, policy "plain". Runs, one
after the other in the same world (after an unreported 5-update warm-up):

- `adaptive`: `async.adaptive = true` (`--max-accumulation`, `--comm-fraction`); the default
  128 (the config's is 8) because on the slow link a round trip of >= 155 ms against ~4-8 ms
  per gradient needs k ~ r (1 - f) / (f c) ~ 60-120 for a share of 0.25: with 8, or 32, the
  link stays saturated at k = max (measured with 32: utilisation ~1.0);
- `fixed_k1`: the same without it: every gradient is pushed (k = 1).

Each run stops after `--run-s` seconds of wall time (as on SIGTERM: at the server's next
update, which it then evaluates and saves), so both get the same time, not the same tokens.
The server writes a record every `--log-every` updates with `accumulation_mean` (the mean k of
the arrivals since the previous record), `link_utilization` (the server's PARAMS bytes sent
since then over what its link could carry in that time: above ~1 its send queue grows),
`link_gbps`, `tokens_per_s` (k x 2 rows x seq_len per arrival) and `elapsed_s` (since the
server started serving, about a second after the link was made).

Per run: `windows`, the records grouped by `elapsed_s` into `--window-s` windows, each with the
arrival-weighted mean k, the time-weighted link utilisation and tokens/s, and the link's
bandwidth at the window's last record, the updates made and the mean training loss the
workers reported (arrival-weighted); `slow_from_elapsed_s`, the elapsed_s of the first
record on the slow link; `tokens`, `updates`, `tokens_per_s` overall, on the fast link and on
the slow one (`fast_tokens_per_s`, `slow_tokens_per_s`); `slow_link_utilization` (time-weighted
over the slow phase's second half, after the controllers adapted); `final_val_loss` (64
batches of 2 rows at the stop); `wall_s`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from trainruns import run_jobs

WORKERS = 4
RUNS = {"adaptive": True, "fixed_k1": False}


def tree(name: str, root: str, args) -> dict:
    model = ({"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32} if args.small
             else {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64})
    t = {
        "run": {"dir": root, "name": name, "log_every": args.log_every, "eval_every": 10 ** 9,
                "eval_batches": 64, "progress": False, "seed": 1},
        "model": {"name": "gpt", **model},
        "train": {"steps": 10 ** 7, "global_batch": WORKERS * args.rows, "micro_batch": args.rows},
        "parallel": {"nproc": WORKERS + 1, "ranks_per_node": 1},
        "comm": {"inter_node_gbps": args.gbps, "link_changes": [[args.slow_at_s, args.slow_gbps]]},
        "checkpoint": {"every": 0},
        "async": {"mode": "ps", "worker_timeout_s": 120},
    }
    if RUNS[name]:
        t["async"].update(adaptive=True, max_accumulation=args.max_accumulation,
                          comm_fraction=args.comm_fraction)
    return t


def _weighted(records: list[dict], key: str, weights: list[float]) -> float | None:
    total = sum(weights)
    return sum(r[key] * w for r, w in zip(records, weights)) / total if total else None


def _durations(records: list[dict], since: float) -> list[float]:
    """Each record's window: its elapsed_s less the previous record's (the first: `since`)."""
    times = [since] + [r["elapsed_s"] for r in records]
    return [b - a for a, b in zip(times, times[1:])]


def summarize(figures: dict, window_s: float) -> dict:
    records = [r for r in figures["records"] if "link_gbps" in r]
    durations = _durations(records, 0.0)
    arrivals = [r["applied"] + r["discarded"] + r["held"] for r in records]
    windows = []
    for start in range(0, int(records[-1]["elapsed_s"] // window_s) + 1):
        idx = [i for i, r in enumerate(records) if start * window_s <= r["elapsed_s"]
               < (start + 1) * window_s]
        if not idx:
            continue
        rs, ds = [records[i] for i in idx], [durations[i] for i in idx]
        before = records[idx[0] - 1]["step"] if idx[0] else 0
        windows.append({"from_s": start * window_s, "to_s": (start + 1) * window_s,
                        "link_gbps": rs[-1]["link_gbps"],
                        "k_mean": round(_weighted(rs, "accumulation_mean",
                                                  [arrivals[i] for i in idx]), 2),
                        "updates": rs[-1]["step"] - before,
                        "loss": round(_weighted(rs, "loss", [arrivals[i] for i in idx]), 4),
                        "link_utilization": round(_weighted(rs, "link_utilization", ds), 3),
                        "tokens_per_s": round(_weighted(rs, "tokens_per_s", ds))})
    fast_gbps = records[0]["link_gbps"]
    slow = [i for i, r in enumerate(records) if r["link_gbps"] != fast_gbps]
    fast = [i for i, r in enumerate(records) if r["link_gbps"] == fast_gbps]
    settled = slow[len(slow) // 2:]  # the slow phase's second half

    def over(key, idx):
        value = _weighted([records[i] for i in idx], key, [durations[i] for i in idx])
        return None if value is None else round(value, 3 if key == "link_utilization" else 0)

    tokens = sum(r["tokens_per_s"] * d for r, d in zip(records, durations))
    last = figures["records"][-1]
    return {"windows": windows,
            "slow_from_elapsed_s": records[slow[0]]["elapsed_s"] if slow else None,
            "tokens": round(tokens), "updates": last["step"],
            "tokens_per_s": round(tokens / sum(durations)),
            "fast_tokens_per_s": over("tokens_per_s", fast),
            "slow_tokens_per_s": over("tokens_per_s", slow),
            "fast_k_mean": round(_weighted([records[i] for i in fast], "accumulation_mean",
                                           [arrivals[i] for i in fast]) or 0, 2),
            "slow_k_mean": round(_weighted([records[i] for i in settled], "accumulation_mean",
                                           [arrivals[i] for i in settled]) or 0, 2),
            "fast_link_utilization": over("link_utilization", fast),
            "slow_link_utilization": over("link_utilization", settled),
            "final_val_loss": round(last["val_loss"], 4), "wall_s": round(figures["loop_s"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="smoke test: tiny model, short runs")
    parser.add_argument("--run-s", type=float, default=80.0, help="wall seconds per run")
    parser.add_argument("--slow-at-s", type=float, default=30.0,
                        help="seconds after the link is made at which it slows")
    parser.add_argument("--gbps", type=float, default=1.0)
    parser.add_argument("--slow-gbps", type=float, default=0.05)
    parser.add_argument("--max-accumulation", type=int, default=128)
    parser.add_argument("--comm-fraction", type=float, default=0.25)
    parser.add_argument("--rows", type=int, default=2, help="rows per worker and gradient")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--window-s", type=float, default=10.0)
    args = parser.parse_args()
    if args.small:  # the tiny GPT's 120 kB message needs a slower link to saturate
        args.run_s, args.slow_at_s, args.slow_gbps, args.window_s = 7.0, 3.0, 0.01, 2.0
    root = tempfile.mkdtemp(prefix="loom-async-adaptive-")
    jobs = [(name, tree(name, root, args)) for name in RUNS]
    warmup = tree("fixed_k1", root, args)
    warmup["train"]["steps"] = 5
    jobs.insert(0, ("warmup", warmup))
    got = run_jobs(jobs, WORKERS + 1, root, stop_after_s=args.run_s)
    runs = {name: summarize(got[name][0], args.window_s) for name in RUNS}
    a, f = runs["adaptive"], runs["fixed_k1"]
    print(json.dumps({
        "benchmark": "async_adaptive", "small": args.small, "workers": WORKERS,
        "link": {"gbps": args.gbps, "slow_gbps": args.slow_gbps, "slow_at_s": args.slow_at_s},
        "run_s": args.run_s, "window_s": args.window_s, "rows_per_gradient": args.rows,
        "max_accumulation": args.max_accumulation, "comm_fraction": args.comm_fraction,
        "runs": runs,
        "adaptive_vs_fixed": {
            "slow_tokens_per_s": round(a["slow_tokens_per_s"] / f["slow_tokens_per_s"], 2)
            if a["slow_tokens_per_s"] and f["slow_tokens_per_s"] else None,
            "final_val_loss_diff": round(a["final_val_loss"] - f["final_val_loss"], 4)},
    }))
    print(f"done: {root}", file=sys.stderr)


if __name__ == "__main__":
    main()
