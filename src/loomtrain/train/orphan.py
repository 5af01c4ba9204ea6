"""A rank started by `loom train` never outlives it: when the launching process dies, by any
signal, SIGKILL included, the rank is sent SIGTERM, which the run loop treats as any stop
(the state is saved at the next step boundary and the rank exits 0); if it has not ended
`grace_s` later (blocked where no step boundary comes), it SIGKILLs itself.

Two ways, as each misses a case of the other:
- prctl(PR_SET_PDEATHSIG, SIGTERM) (Linux): the kernel signals the rank the moment its parent
  dies. "Parent" is the thread that started it: both launchers start their ranks from a
  thread that lives as long as the ranks do (`launch_tolerant`'s main thread; the elastic
  agent's thread in `launch_forwarding_signals`, which returns only once its workers have).
- a watchdog thread polling every `POLL_S` whether the launcher is alive: for a launcher that
  is not the direct parent, and where there is no prctl. A direct parent is judged by
  os.getppid() (a dead parent's ranks are reparented), which a recycled pid cannot fool.

Not installed under torchrun (its agent stops its workers) nor in a run started in-process.
Details: docs/checkpoints.md, "Signals".
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback

POLL_S = 0.5
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def grace_s(timeout_s: float) -> float:
    """How long a rank may take to save and end once its launcher is dead: a step boundary and
    the save's collectives, each bounded by parallel.timeout_s (`timeout_s`), plus the save."""
    return timeout_s + 30.0


@contextlib.contextmanager
def ending_with_launcher(launcher_pid: int, timeout_s: float):
    """The block (a rank's run) ends when `launcher_pid` dies: `end_with_launcher`, with the
    grace of parallel.timeout_s = `timeout_s`. A block that ends after the launcher died
    leaves the process at once (os._exit, its output flushed), with code 0, its SystemExit's
    or 1 after a traceback: a function worker of the elastic launcher otherwise waits for its
    agent to read its return value, and a dead agent never does (measured: the rank hung
    until the SIGKILL `grace_s` later). A block that ends while the launcher is dying (its
    thread that started the rank is gone, so PR_SET_PDEATHSIG has stopped the run, but the
    process is still exiting: measured 60-200 ms for a SIGKILLed `loom train`, in which a stop
    at a step boundary was saved) has returned to that agent: the watchdog then ends the
    process once it sees the launcher gone."""
    returned = threading.Event()
    alive = end_with_launcher(launcher_pid, grace_s(timeout_s), returned)
    code = 0
    try:
        yield
    except SystemExit as stop:
        if alive():
            raise
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        if alive():
            raise
        traceback.print_exc()
        code = 1
    returned.set()  # before asking: the launcher may die between the two
    if not alive():  # asked now: the stop may have come from PR_SET_PDEATHSIG, before a poll
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def end_with_launcher(launcher_pid: int, grace_s: float,
                      returned: threading.Event | None = None):
    """Arrange that this process gets SIGTERM when `launcher_pid` dies, and SIGKILL `grace_s`
    after that (exit 0 at once instead once `returned` is set: the run has ended normally);
    returns a function that tells whether the launcher lives. The rank's stop flag is
    installed before this (run.train_worker), so the SIGTERM is a stop from the start."""
    direct = os.getppid() == launcher_pid
    if direct and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)  # failure: the watchdog acts
    threading.Thread(target=_watch, args=(launcher_pid, direct, grace_s, returned), daemon=True,
                     name="loom-launcher-watch").start()  # also sees a parent dead before prctl
    return lambda: _alive(launcher_pid, direct)


def _alive(pid: int, direct: bool) -> bool:
    if direct:
        return os.getppid() == pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        pass
    return True


def _watch(launcher_pid: int, direct: bool, grace_s: float, returned) -> None:
    while _alive(launcher_pid, direct):
        time.sleep(POLL_S)
    if returned is not None and returned.is_set():  # nobody is left to take its return value
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)
