"""Multi-process test harness: run a function on N gloo ranks on 127.0.0.1.

`run_world(fn, world, *args, timeout_s=...)` starts `world` processes, each initializes a gloo
process group on a free port with a short collective timeout, runs `fn(rank, world, *args)`,
and sends back its return value (or its traceback). The processes fork from a server that has
imported torch and loomtrain once (multiprocessing's "forkserver"), not spawned afresh: a
spawned rank imports torch itself, seconds of CPU per rank, which summed over the suite's
worlds came to minutes. Each rank takes the caller's environment, working directory and
sys.path (before `fn` and `args` are unpickled), as a spawned one would. The harness fails the
test if any rank raises, or if the whole world has not finished within `timeout_s` (the
processes are then killed), so a hang fails instead of blocking CI. `fn` must be importable
(module level).

For tests of whole `loom train` processes: `alive` and `wait_until` (a launcher's ranks:
train/restart.py `rank_pids`).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once by the fork server, before any rank: what every rank needs (the rest, such as
# the test module that defines `fn`, each rank imports on unpickling it)
PRELOAD = ["torch", "torch.distributed", "loomtrain.train.run", "loomtrain.train.launch"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(rank, world, port, collective_timeout_s, call, queue, env, cwd, path):
    import torch
    import torch.distributed as dist

    import faulthandler

    faulthandler.enable()  # a rank killed by a signal (a crash in gloo) dumps its stack
    os.environ.clear()  # the caller's, not the fork server's (started by an earlier world)
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    finished = False
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        fn, args = pickle.loads(call)
        result = fn(rank, world, *args)
        # plain pickle: tensors travel by value, not as shared memory that dies with the rank
        queue.put((rank, "ok", pickle.dumps(result)))
        finished = True
    except BaseException:  # report any failure, including SystemExit, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            if finished:
                _wait_for_peers(dist)
            dist.destroy_process_group()


def _wait_for_peers(dist) -> None:
    """Rank 0 hosts the store: leaving before the others finish (their singleton groups still
    being made there) resets their connection. A rank whose peers failed waits here until the
    collective timeout or until the parent, holding every result already, kills it."""
    try:
        dist.barrier()
    except Exception:  # a group a timed-out collective broke: the result is already sent
        pass


def run_world(fn, world: int, *args, timeout_s: float = 120.0, collective_timeout_s: float = 30.0,
              expect_errors: bool = False) -> list:
    """Returns the per-rank results in rank order. With `expect_errors`, a failing rank's entry
    is its traceback text (a string) instead of raising."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    caller = (pickle.dumps((fn, args)), queue, dict(os.environ), os.getcwd(), list(sys.path))
    procs = [ctx.Process(target=_entry, args=(r, world, port, collective_timeout_s, *caller))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while len(results) < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise TimeoutError(
                    f"world of {world} did not finish within {timeout_s}s; ranks done: {sorted(results)}")
            try:
                rank, status, value = queue.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty: poll again, unless every process already died
                if all(not p.is_alive() for p in procs) and queue.empty():
                    missing = sorted(set(range(world)) - set(results))
                    codes = {r: procs[r].exitcode for r in missing}  # -N: killed by signal N
                    raise RuntimeError(f"ranks {missing} exited without a result (exit codes "
                                       f"{codes}; a crash's stack is on stderr)") from None
                continue
            results[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors and not expect_errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [pickle.loads(v) if s == "ok" else v for s, v in (results[r] for r in range(world))]


class StopBefore:
    """A StopFlag whose "signal" (SIGTERM) arrives before step `step` (counted from 0): the
    run loop reads `signum` once per step boundary (a parameter-server worker never reads it:
    its server stops it)."""

    def __init__(self, step: int):
        self.step, self.reads = step, 0

    @property
    def signum(self) -> int:
        import signal

        self.reads += 1
        return signal.SIGTERM if self.reads > self.step else 0


def ranks_of(launcher: int) -> list[int]:
    """The pids of a `loom train` launcher's live ranks, by rank."""
    from loomtrain.train.restart import rank_pids

    return [pid for _, pid in sorted(rank_pids(launcher).items())]


def alive(pid: int) -> bool:
    try:  # a zombie has ended: only its exit status is left
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_until(what: str, done, timeout_s: float):
    """`done()`'s first true value, polled every 20 ms; fails the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := done()):
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.02)
    return value
