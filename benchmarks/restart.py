"""How long an automatic restart takes (`loom train --max-restarts N`, train/restart.py):
from a rank's SIGKILL to the restarted run's next step in metrics.jsonl.

    .venv/bin/python benchmarks/restart.py [--rounds 3] [--nproc 2]

Each round runs `loom train` on the tiny GPT of the tests (d_model 32, 2 layers, 60 KB of the
stdlib as corpus, checkpoint every 3 steps) with --max-restarts 1 and SIGKILLs rank 1 once the
first checkpoint is published. Per round: `line_s` (kill -> the launcher's restart line),
`resumed_s` (kill -> rank 0's "resumed from" line: the new ranks have started, joined and
loaded the checkpoint) and `step_s` (kill -> the first step after it logged), and, for
scale, `start_s` (the same command's start -> its first step logged). Polled every 10 ms.
The last line on stdout is one JSON object with the per-round figures and their medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from loomtrain.train import checkpoint
from loomtrain.train.config import config_from_dict, config_to_toml
from loomtrain.train.metrics import read_metrics
from loomtrain.train.restart import rank_pids

CORPUS = ["textwrap.py", "string.py", "bisect.py", "heapq.py", "colorsys.py", "fnmatch.py"]


def tiny_tree(root: Path, nproc: int) -> dict:
    """The config tree of the tiny run (its corpus written to `root`), with checkpoints every 3
    steps; benchmarks/faults.py starts from it too."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = root / "corpus.txt"
    corpus.write_bytes(b"\n".join((stdlib / name).read_bytes() for name in CORPUS))
    return {
        "run": {"dir": str(root / "runs"), "name": "t", "log_every": 1, "eval_every": 10**6,
                "progress": False, "seed": 1},
        "model": {"name": "gpt", "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
        "data": {"source": str(corpus), "val_fraction": 0.1},
        "train": {"steps": 60, "global_batch": 8, "micro_batch": 2, "warmup_steps": 2},
        "parallel": {"nproc": nproc, "bucket_mb": 0.01, "timeout_s": 30},
        "checkpoint": {"every": 3, "keep": 2}}


def write_config(root: Path, tree: dict) -> Path:
    path = root / "t.toml"
    path.write_text(config_to_toml(config_from_dict(tree)))
    return path


def until(done, timeout_s: float = 120.0):
    """`done()`'s first true value, polled every 10 ms; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := done()):
        if time.monotonic() > deadline:
            raise TimeoutError("the run did not get there in time")
        time.sleep(0.01)
    return value


def one_round(root: Path, nproc: int) -> dict[str, float]:
    run_dir, log = root / "runs" / "t", root / "loom.txt"
    with log.open("w") as out:
        started = time.monotonic()
        config = write_config(root, tiny_tree(root, nproc))
        proc = subprocess.Popen([sys.executable, "-m", "loomtrain", "train", str(config),
                                 "--max-restarts", "1"], stdout=out, stderr=out,
                                start_new_session=True)
    try:
        until(lambda: read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else None)
        start_s = time.monotonic() - started
        until(lambda: checkpoint.list_checkpoints(run_dir))
        os.kill(until(lambda: rank_pids(proc.pid).get(1)), signal.SIGKILL)
        killed = time.monotonic()
        until(lambda: "restart 1 of 1" in log.read_text())
        line_s = time.monotonic() - killed
        found = until(lambda: re.search(r"resumed from \S+ at step (\d+)", log.read_text()))
        resumed_s = time.monotonic() - killed
        at = int(found[1])
        until(lambda: any(r["step"] > at for r in read_metrics(run_dir)))
        step_s = time.monotonic() - killed
        if proc.wait(300) != 0:
            raise RuntimeError(log.read_text()[-3000:])
        return {"start_s": start_s, "line_s": line_s, "resumed_s": resumed_s, "step_s": step_s}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    rounds = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="loom-restart-") as root:
            rounds.append({k: round(v, 3) for k, v in one_round(Path(root), args.nproc).items()})
        print(f"round {i + 1}: {rounds[-1]}", file=sys.stderr)
    medians = {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}
    print(json.dumps({"benchmark": "restart", "nproc": args.nproc, "rounds": rounds,
                      "median": medians, "cpu_count": os.cpu_count()}))


if __name__ == "__main__":
    main()
