"""Which checkpoint a run continues from, after `--resume` or after a rank died, and the
launcher's restart rule (`run.max_restarts`, `loom train --max-restarts N`).

When a rank of `loom train` dies (a signal, a crash, an exit other than the ones below), the
launcher restarts every rank (torch's elastic launcher, like its agent, runs the ranks as one
group: a new rendezvous, new processes) from the newest intact checkpoint of the run folder,
chosen and verified as `--resume` chooses it (`resume_checkpoint`); with none yet, the run
starts over, metrics.jsonl emptied first. At most `max_restarts` times; one line on stderr each.

Not restarted, as a restart would end the same way: a rank that exited 2 (bad input) or 3 (the
non-finite abort: training is deterministic), and a run stopped by SIGINT/SIGTERM (the stop
rule saves and exits 0; after a second signal the user wants it gone). Under `torchrun` its
agent restarts the ranks (`torchrun --max-restarts N`) and the restarted `loom` processes pick
the checkpoint here (`restart_checkpoint`). Details: docs/checkpoints.md, "Restarts".
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from pathlib import Path

from loomtrain.train import messages
from loomtrain.train.launch import exit_text, say

DETERMINISTIC = frozenset({2, 3})  # exit codes of bad input and the non-finite abort


def resume_checkpoint(cfg, run_dir: Path, skip_damaged: bool, advice: str, warn: bool
                      ) -> tuple[Path, list[str]]:
    """(the newest checkpoint of `run_dir`, verified, that `cfg` can continue; the lines that
    say which damaged newer ones `skip_damaged` passed over). CheckpointError (exit 2) if it is
    damaged (naming the newest intact one, then `advice`) or does not fit `cfg`; `warn`: this
    process prints the checksum warnings (one rank of many)."""
    from loomtrain.asyncsgd.state import check_resume
    from loomtrain.train import checkpoint
    from loomtrain.zeroth.train import check_resume as check_optimizer

    latest, skipped = checkpoint.newest(run_dir, skip_damaged, advice=advice, warn=warn)
    # any rank count and ZeRO stage may resume any checkpoint: every layout saves the
    # unsharded names and shapes (train/checkpoint.py), and the data order is a function
    # of the step and the global batch only; not so between synchronous training and the
    # parameter server, nor for the server's own state (its workers, policy and model)
    check_resume(cfg, latest)
    check_optimizer(cfg, latest)  # backprop and each zeroth-order method keep their own state
    return latest, skipped


def restart_checkpoint(cfg, run_dir: Path, rank0: bool) -> Path | None:
    """What restarted ranks continue from: the newest intact checkpoint of `run_dir` (a damaged
    newer one is skipped with a line on stderr), or None when there is none yet, having then
    emptied metrics.jsonl (by `rank0`, the process that writes it), as a resume cuts it back to
    its checkpoint's step: the restarted run logs every step once."""
    from loomtrain.train import checkpoint
    from loomtrain.train.metrics import truncate_metrics

    if not checkpoint.list_checkpoints(run_dir):
        if rank0:
            truncate_metrics(run_dir, 0)
        return None
    latest, skipped = resume_checkpoint(cfg, run_dir, True, "", rank0)
    for line in skipped if rank0 else ():
        print(f"warning: restart: {line}", file=sys.stderr, flush=True)
    return latest


def starting_from(resume: Path | None) -> str:
    if resume is None:
        return "no checkpoint yet: starting the run over"
    from loomtrain.train import checkpoint

    return f"resuming from checkpoint step {checkpoint.read_meta(resume)['step']}"


RANK_NAME = "loom-rank-"  # and the rank: the name of a rank's process (/proc/PID/comm)
_PR_SET_NAME = 15  # <linux/prctl.h>


def name_rank(rank: int) -> None:
    """Name this process `loom-rank-<rank>` (Linux; what `ps` and /proc/PID/comm show), so that
    its launcher can tell which rank ended, even once only its exit status is left."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL(None).prctl(_PR_SET_NAME, f"{RANK_NAME}{rank}".encode(), 0, 0, 0)


def rank_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the live ranks the `loom train` with pid `launcher` started (Linux, from
    /proc, by the names `name_rank` gives): for tests and benchmarks that kill one."""
    ranks = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):  # exited meanwhile
            state, parent = stat.read_text().rsplit(")", 1)[1].split()[:2]
            name = (stat.parent / "comm").read_text().strip()
            if int(parent) == launcher and name.startswith(RANK_NAME) and state != "Z":
                ranks[int(name[len(RANK_NAME):])] = int(stat.parent.name)
    return ranks


class FirstExit:
    """The first of this process's children to end (a rank, by its process name), with its
    exit code (negative: the signal), seen within `POLL_S` of its end: waitid(2) with WNOWAIT
    reports an ended child without reaping it, which is left to its owner (the agent).

    torch's elastic launcher reports one failed rank, the first in rank order among those
    ended at its poll (every 0.2 s); a rank's death ends its peers' next collective at once
    (exit 4), so with rank 1 SIGKILLed it reported rank 0's exit 4 (measured, torch 2.13).
    `take` returns (rank, pid, exit code) of the first rank that ended since the last `take`,
    or None (none seen: then torch's report is all there is). `stop` ends the watching."""

    POLL_S = 0.01  # a waitid per poll: microseconds

    def __init__(self):
        self.first: tuple[int, int, int] | None = None
        self.epoch = 0  # `take` starts a new one; an exit seen in an older one is not kept
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="loom-first-exit").start()

    def take(self) -> tuple[int, int, int] | None:
        first, self.first = self.first, None
        self.epoch += 1
        return first

    def stop(self) -> None:
        self.stopped.set()

    def _watch(self) -> None:
        while not self.stopped.wait(self.POLL_S):
            epoch = self.epoch
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # no child
                continue
            if info is None:  # none has ended
                continue
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            with contextlib.suppress(OSError, ValueError):
                name = Path(f"/proc/{info.si_pid}/comm").read_text().strip()
                if name.startswith(RANK_NAME) and self.first is None and epoch == self.epoch:
                    self.first = (int(name[len(RANK_NAME):]), info.si_pid, code)
            # waitid reports this child until it is reaped; the next to end comes after it
            while _unreaped(info.si_pid) and not self.stopped.wait(self.POLL_S):
                pass


def _unreaped(pid: int) -> bool:
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return False


class Restarts:
    """The launcher's restart rule for one run (`after`, called when the ranks have failed):
    `cfg.run.max_restarts` restarts at most, none after a stop signal (`received`, filled by
    the signal forwarding) or after a rank's deterministic error. `errors`: the folder where
    the ranks leave their messages (train/run.py), emptied before a restart: they are about
    processes that are gone. `ended`: (rank, pid, exit code) of the rank that ended first in
    the last failure, for the launcher's final message. A context manager: its exit stops
    watching the ranks (FirstExit, on Linux)."""

    def __init__(self, cfg, run_dir: Path, received: list[int], errors: Path):
        self.cfg, self.run_dir, self.received, self.errors = cfg, run_dir, received, errors
        self.done = 0
        self.ended: tuple[int, int, int] | None = None
        linux = Path("/proc/self/comm").exists() and hasattr(os, "waitid")
        self.first_exit = FirstExit() if linux else None

    def __enter__(self) -> Restarts:
        return self

    def __exit__(self, *_exc) -> None:
        if self.first_exit is not None:
            self.first_exit.stop()

    def after(self, failures: dict, payload: tuple) -> tuple | None:
        """`train_worker`'s payload for the restarted ranks (resuming from the newest
        checkpoint), or None: the run ends with this failure. `failures`: torch's report
        ({rank: ProcessFailure})."""
        self.ended = self.first_exit.take() if self.first_exit is not None else None
        if self.ended is None:
            rank, failure = min(failures.items())
            self.ended = (rank, failure.pid, failure.exitcode)
        if not self.cfg.run.max_restarts or self.received:
            return None
        codes = {f.exitcode for f in failures.values()} | messages.codes(self.errors)
        if codes & DETERMINISTIC:
            return None  # the launcher prints the ranks' messages
        rank, pid, code = self.ended
        died = f"rank {rank} (pid {pid}) {exit_text(code)}"
        if self.done == self.cfg.run.max_restarts:
            say(f"{died}; no restart left (run.max_restarts={self.done})")
            return None
        self.done += 1
        messages.print_traceback(self.errors)  # a bug that killed the rank: shown, then cleared
        for message in self.errors.glob("*.txt"):
            message.unlink()
        resume = restart_checkpoint(self.cfg, self.run_dir, rank0=True)
        say(f"{died}; restart {self.done} of {self.cfg.run.max_restarts}: "
            f"{starting_from(resume)}")
        return (*payload[:2], None if resume is None else str(resume), *payload[3:])
