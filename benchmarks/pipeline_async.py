"""Asynchronous pipeline training against the synchronous 1F1B schedule on the default task:
the same tokens, final validation loss and tokens/s.

    .venv/bin/python benchmarks/pipeline_async.py [--steps 150] [--small]

Three runs of `loom train` (the default GPT on the standard library's sources, pp 2 on two
CPU ranks, the trainer's own loop, evaluation and logging) differing only in the schedule:
`1f1b` (synchronous: the single-process maths), `async` with `async_optimizer = "stash"`
(PipeDream's weight stashing, the train.optimizer stepped after every micro-batch) and
`async` with `"nesterov"` (the delay-corrected Nesterov of Ajanthan et al., arXiv
2505.01099). Each sees the same batches in the same order for `--steps` steps; the async runs
make one update per micro-batch on every stage (train.global_batch / micro_batch of them per
step) where 1F1B makes one per step. The runs go one after the other (the machine has two
cores: two ranks fill it); tokens/s is the median of the runs' logged windows after the
first. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = {  # name -> the settings that differ
    "1f1b": ['parallel.schedule="1f1b"'],
    "async_stash": ['parallel.schedule="async"', 'parallel.async_optimizer="stash"'],
    "async_nesterov": ['parallel.schedule="async"', 'parallel.async_optimizer="nesterov"'],
}
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
         "train.global_batch=8", "train.micro_batch=2", "run.eval_batches=2"]


def run(name: str, settings: list[str], args, root: Path) -> dict:
    common = ["--nproc", "2", "--set", "parallel.pp=2", "--set", f"train.steps={args.steps}",
              "--set", f"run.eval_every={args.steps}", "--set", f"run.dir={root}",
              "--set", f"run.name={name}", "--set", "run.progress=false",
              "--set", f"run.log_every={max(1, args.steps // 10)}",
              "--set", "checkpoint.every=0"]
    if name == "async_nesterov":
        settings = settings + [f"parallel.async_momentum={args.momentum}"]
    if name.startswith("async") and args.async_lr is not None:
        settings = settings + [f"train.lr={args.async_lr}"]
    for s in settings + (SMALL if args.small else []):
        common += ["--set", s]
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "loomtrain", "train", *common],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"loom train ({name}) failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in records[1:]] or [records[0]["tokens_per_s"]]
    return {"val_loss": records[-1]["val_loss"], "train_loss": records[-1]["loss"],
            "tokens_per_s": statistics.median(speeds), "wall_s": time.perf_counter() - t0}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--momentum", type=float, default=0.9,
                        help="parallel.async_momentum for the Nesterov run (the paper's 0.99 "
                             "averages over ~100 updates: too many for a short run)")
    parser.add_argument("--async-lr", type=float, default=None,
                        help="train.lr of the async runs (default: the config's, 3e-3): they "
                             "update after every micro-batch, M times as often as 1F1B")
    parser.add_argument("--small", action="store_true", help="a tiny GPT (the smoke test)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: run(name, settings, args, Path(tmp)) for name, settings in RUNS.items()}
    sync = runs["1f1b"]["val_loss"]
    for name, r in runs.items():
        r["val_loss_vs_1f1b"] = r["val_loss"] / sync - 1.0
    out = {"benchmark": "pipeline_async", "date": time.strftime("%Y-%m-%d"), "steps": args.steps,
           "pp": 2, "async_momentum": args.momentum, "async_lr": args.async_lr,
           "small": args.small, "runs": runs}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
