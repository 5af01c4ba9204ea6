"""A rank that stops answering ends the job with a message naming rank, op and axis."""

from __future__ import annotations

import time
from pathlib import Path

import loomtrain.train.run as run
import loomtrain.train.trainer as trainer
from harness import run_world


def _one_rank_hangs(rank, world, cfg, run_dir):
    if rank == 1:
        real = trainer.step
        calls = []

        def stalled(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                time.sleep(12)  # far past the 3 s collective timeout of rank 0
                raise SystemExit(0)
            return real(*args, **kwargs)

        trainer.step = stalled
    t0 = time.monotonic()
    try:
        run.run(cfg, Path(run_dir), None)
    except trainer.comm.CollectiveError as err:
        return ("collective_error", str(err), time.monotonic() - t0)
    return ("finished", "", time.monotonic() - t0)


def test_stalled_peer_raises_named_collective_error(tiny, tmp_path):
    cfg = tiny(parallel={"nproc": 2, "timeout_s": 3}, train={"steps": 10})
    results = run_world(_one_rank_hangs, 2, cfg, str(tmp_path / "run"), timeout_s=90,
                        collective_timeout_s=3, expect_errors=True)
    status, message, seconds = results[0]
    assert status == "collective_error", results[0]
    # rank 0 waits in the step's control all-reduce over all ranks
    assert "rank 0" in message and "all_reduce" in message and "mesh axis 'world'" in message
    assert seconds < 30  # the timeout, not the sleeping peer, ended it
