"""What the benchmarks that compare training methods on a simulated slow link share (lowcomm.py,
compression.py): one gloo world of spawned ranks runs every job (a config tree) in turn through
the trainer's own loop, and each rank reports what its meter counted.

Per job and rank: `bytes` (wire bytes this rank sent, comm/meter.py, without the diagnostic
ops), `inter_node_bytes` (of those, the bytes of ops whose group spans nodes), `link_s`
(simulated link seconds of the ops this rank sent: a receive is its sender's op, not counted
twice), `link_wait_s` (what no computation hid), `loop_s` (the loop's measured seconds, the
simulated delays included: they are real waits), `bytes_by_op` ({op: wire bytes}); rank 0
also the final `val_loss`, the last logged `loss`, the loss-against-bytes `curve` and its
metrics `records`.

`stop_after_s`: every reported job stops after that many seconds of wall time, counted from
its mesh (and simulated link) being made, as on SIGTERM: the run ends at its next step (the
parameter server: its next update), evaluates and saves. None: each runs its train.steps.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path

import torch.multiprocessing as mp
from worlds import free_port, joined_world

DIAGNOSTIC = "all_reduce_diagnostic"  # compression's error measurement: not the method's bytes


def _run_rank(rank: int, world: int, port: int, jobs: list, root: str, out,
              stop_after_s: float | None) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    from loomtrain.train import trainer
    from loomtrain.train.config import config_from_dict
    from loomtrain.train.launch import init_distributed
    from loomtrain.train.metrics import read_metrics
    from loomtrain.train.run import train_loop

    sys.stdout = open(os.devnull, "w")  # the trainer's log: stdout carries the one JSON line
    with joined_world(rank, world, port, timeout_s=600):
        for label, tree in jobs:
            cfg = config_from_dict(tree)
            mesh = init_distributed(cfg)
            start = time.perf_counter()
            stop = trainer.StopFlag()
            timer = threading.Timer(stop_after_s or 0.0, setattr, (stop, "signum", signal.SIGTERM))
            if stop_after_s is not None and label != "warmup" and rank == 0:
                timer.start()  # rank 0 decides the stop: the others follow at the next step
            train_loop(cfg, Path(root) / label, None, mesh, stop)
            timer.cancel()
            elapsed = time.perf_counter() - start
            m = mesh.meter
            link_s = m.total("simulated_s") - m.total("simulated_s", op="recv")
            figures = {"bytes": m.total("wire_bytes") - m.total("wire_bytes", op=DIAGNOSTIC),
                       "inter_node_bytes": m.inter_node_bytes, "link_s": link_s,
                       "link_wait_s": m.link_wait_s, "loop_s": elapsed,
                       "bytes_by_op": {op: m.total("wire_bytes", op=op)
                                       for op in sorted({o for _, o in m.counts})}}
            if rank == 0:
                records = read_metrics(Path(root) / label)
                figures.update(val_loss=records[-1]["val_loss"], loss=records[-1]["loss"],
                               curve=loss_curve(records), records=records)
            if label != "warmup":
                out.put((rank, label, figures))


def add_run_arguments(parser) -> None:
    """The options every such benchmark takes: the run length, which runs, the model's size."""
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--only", default="", help="comma-separated run names (dp is always run)")
    parser.add_argument("--small", action="store_true", help="smoke test: tiny model, 40 steps")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rows", type=int, default=2, help="rows per replica and step")


def loss_curve(records: list[dict]) -> list[tuple[int, float]]:
    """(rank 0's cumulative wire bytes, the logged training loss) at every metrics record."""
    sent, curve = 0, []
    for r in records:
        sent += r["comm_bytes"]["total"]
        curve.append((sent, r["loss"]))
    return curve


def run_jobs(jobs: list[tuple[str, dict]], world: int, root: str,
             stop_after_s: float | None = None) -> dict[str, dict[int, dict]]:
    """Run `jobs` ((label, config tree), in order; a job labelled "warmup" is not reported) in
    one world of `world` spawned ranks; returns {label: {rank: figures}}. Exits if a rank dies."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_run_rank, args=(r, world, port, jobs, root, out, stop_after_s))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[str, dict[int, dict]] = {}
    reported = [label for label, _ in jobs if label != "warmup"]
    for rank, label, figures in collect(procs, out, world * len(reported)):
        got.setdefault(label, {})[rank] = figures
        if len(got[label]) == world:
            print(f"  {label}: done", file=sys.stderr, flush=True)
    for p in procs:
        p.join()
    return got


def collect(procs: list, out, count: int):
    """The next `count` items the spawned `procs` put on `out`, as they come; exits the
    benchmark if one of them dies first (a config it refused, a peer that failed)."""
    for _ in range(count):
        while True:
            try:
                yield out.get(timeout=5)
                break
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    for p in procs:
                        p.kill()
                    sys.exit(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
