"""A restarted worker rejoining a running parameter server (the server's side: server.py): a
rendezvous the server hosts (comm.PairHost), a two-member gloo group (comm.PairChannel), then
the ordinary worker loop over it. When it is accepted or refused, what is recovered and what
it costs: docs/async.md, "Failures and rejoining".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from loomtrain import comm
from loomtrain.asyncsgd.worker import GradFn, WorkerResult, run_worker
from loomtrain.writes import write_atomic

ADDRESS_FILE = "async_rejoin.json"  # in a `loom train` run folder, while its server runs


def rejoin_worker(address: str, worker: int, grad_fn: GradFn, numel: int, *, timeout_s: float,
                  meter: comm.CommMeter | None = None, axis: str = "world",
                  accumulation=1) -> WorkerResult:
    """Rejoin the server whose rejoin host is at `address` ("host:port") as worker `worker`
    and work until it sends stop; `grad_fn` as for `run_worker` (it is called from the step
    the server gives). `timeout_s`: for the rendezvous and every op on the channel.
    `accumulation`: as for `run_worker`."""
    channel, answer = comm.join_pair(address, worker, timeout_s, meter or comm.CommMeter(), axis)
    # from step answer["step"], which the server's first reply repeats
    return run_worker(None, grad_fn, numel, channel=channel, accumulation=accumulation)


def publish_address(run_dir: Path, address: str, workers: int, numel: int) -> None:
    """Write the run's rejoin address (and what a rejoining worker must match) into run_dir,
    by one rename: a reader never sees half a file."""
    write_atomic(run_dir / ADDRESS_FILE, json.dumps({"address": address, "workers": workers,
                                                     "numel": numel, "pid": os.getpid()}))


def withdraw_address(run_dir: Path) -> None:
    (run_dir / ADDRESS_FILE).unlink(missing_ok=True)


def read_address(run_dir: Path) -> dict | None:
    """The published {"address", "workers", "numel", "pid"}, or None if no server runs."""
    try:
        return json.loads((run_dir / ADDRESS_FILE).read_text())
    except FileNotFoundError:
        return None
