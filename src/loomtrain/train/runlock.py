"""One writer per run folder: `loom train` holds an exclusive flock on RUN_DIR/loom.lock (its pid
written inside) from before it writes anything until it exits, and its ranks hold the same lock
(the same open file, passed to them as a descriptor), so a folder is busy while the launcher or
any rank it started still lives. The kernel releases the lock when the last of them dies, by any
signal: a crash never leaves a folder locked. A normal exit also removes the file, so a run or a
failed resume leaves no trace; a killed launcher leaves it, unlocked, and the next run takes it.

Another `loom train` on a busy folder exits 2 naming the holder; when the holder's launcher is
dead and only its ranks are left (they are saving and ending: train/orphan.py), it waits for
them, at most `wait_s`. Details: docs/checkpoints.md, "One writer per run folder".
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from pathlib import Path

from loomtrain.errors import RunFolderBusy
from loomtrain.writes import writing

LOCK_NAME = "loom.lock"


class HeldByRanks:
    """The lock's descriptor, for a rank's payload: pickled while multiprocessing spawns a
    process, it makes the new process inherit the descriptor (the way multiprocessing passes
    sockets: reduction.DupFd), so the rank holds the lock until it exits. Pickled elsewhere it
    carries nothing."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import context

        popen = context.get_spawning_popen()
        fd = None if popen is None or self.fd is None else popen.duplicate_for_child(self.fd)
        return HeldByRanks, (fd,)


def _holder(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text().split()[0])
    return None  # just created by a holder that has not written its pid yet


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _try_lock(path: Path) -> int | None:
    """The locked descriptor of `path`, or None if it is busy. A file removed by its holder
    between our open and our lock is not the folder's lock any more: open again."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _busy(run_dir: Path, pid: int | None, why: str) -> RunFolderBusy:
    who = f"pid {pid}" if pid is not None else "another process"
    return RunFolderBusy(
        f"run folder {str(run_dir)!r} is in use: {who} {why} (it holds {run_dir / LOCK_NAME}). "
        f"One run writes a folder at a time; wait for it to end or stop it (kill "
        f"{pid if pid is not None else 'PID'}; it saves a checkpoint), then resume with "
        f"`loom train --resume {run_dir}`. Nothing in the folder was changed")


class RunFolderLock:
    """The lock of at most one run folder, taken by `take` and let go by `release` (both
    idempotent): `loom train` takes it before writing, and releases it when it exits."""

    def __init__(self):
        self.path: Path | None = None
        self.fd: int | None = None

    def take(self, run_dir: Path, wait_s: float) -> None:
        """Raises RunFolderBusy (exit 2) if another run holds `run_dir`, WriteError (exit 2)
        if the lock file cannot be written there (a read-only or full filesystem)."""
        with writing(run_dir / LOCK_NAME):
            self._take(run_dir, wait_s)

    def _take(self, run_dir: Path, wait_s: float) -> None:
        path = run_dir / LOCK_NAME
        deadline, said = time.monotonic() + wait_s, False
        while (fd := _try_lock(path)) is None:
            pid = _holder(path)
            if pid is not None and _alive(pid):
                raise _busy(run_dir, pid, "(`loom train`) is running there")
            if time.monotonic() >= deadline:
                raise _busy(run_dir, pid, f"was killed and its ranks had not ended after {wait_s:g} s")
            if not said:
                print(f"loom: waiting for the ranks of a killed `loom train` (pid {pid}) to save "
                      f"and end in {run_dir}", file=sys.stderr, flush=True)
                said = True
            time.sleep(0.2)
        self.path, self.fd = path, fd
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())

    def for_ranks(self) -> HeldByRanks:
        return HeldByRanks(self.fd)

    def release(self) -> None:
        """Removes the file and unlocks. Both launchers return only once their ranks have
        ended, so nobody else holds it by then."""
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.path = self.fd = None
