"""Stop signals (SIGINT, SIGTERM), from `loom train`'s first line to its last: a stop is acted
on where it can be and never ends in a traceback or a death by signal.

- `StopFlag` records the signal; the run loop acts on it at the next step boundary, on every
  rank together (train/loop.py). `loom train` installs one first thing (cli.entry), so a
  signal during its imports, config resolution or run-folder creation is a stop too, which
  `stopped_before_start` reports before any rank starts.
- `SignalForwarding`: the launcher's signals sent on to its ranks, a second one as SIGKILL.
- `held_signals`: ranks are started with the two signals blocked, a mask they inherit through
  fork and exec, until their StopFlag unblocks them: a signal that reaches a rank still
  importing torch waits for it instead of killing it.

No torch here: the CLI installs the flag before importing anything heavy. Details and what is
measured: docs/checkpoints.md, "Signals".
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def in_torchrun() -> bool:
    """This process is a rank torchrun started (its agent, not `loom train`, owns the ranks
    and forwards their signals)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


class StopFlag:
    """Set by SIGINT/SIGTERM; acted on at the next step boundary, on every rank together.
    `received`: every signal so far, in order. Made on the main thread; making it also
    unblocks the two signals (`held_signals`), so one that arrived while they were blocked is
    delivered to it now."""

    def __init__(self):
        self.signum = 0
        self.received: list[int] = []
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._set)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def _set(self, signum, _frame):
        self.signum = signum
        self.received.append(signum)


def ignore_stops() -> None:
    """The process's work is over: SIGINT and SIGTERM are ignored from now on, as there is
    nothing left to stop. Called as a rank or `loom train` leaves. A handler written in Python
    is reset to the default action by the interpreter's teardown, so a stop that came late (the
    launcher forwards a group's Ctrl-C to ranks that got it themselves and have already saved)
    killed a rank that was leaving with exit 0: the launcher reported "killed by signal SIGINT"
    and exit 1 (seen once in CI, 2026-12-06). An ignored signal stays ignored through teardown;
    a launcher's second signal is SIGKILL, which still ends a rank that hangs as it leaves."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def stopped_before_start(stop: StopFlag | None, run_dir, resuming: bool) -> bool:
    """Whether `loom train`'s `stop` flag was set before any rank started (nothing trained,
    nothing saved): then one line says so, and the command exits 0. `run_dir`: the run
    folder (None: not made yet). Never under torchrun, whose ranks agree on a stop at their
    first step boundary instead: one of them alone must not leave."""
    if stop is None or not stop.signum or in_torchrun():
        return False
    if resuming:
        kept = f"{run_dir} is as it was; continue with: loom train --resume {run_dir}"
    else:
        kept = f"run folder {run_dir} holds no checkpoint" if run_dir else "no run folder was made"
    print(f"stopped by {signal.Signals(stop.signum).name} before training started: nothing was "
          f"trained or saved; {kept}", file=sys.stderr, flush=True)
    return True


@contextlib.contextmanager
def held_signals():
    """SIGINT and SIGTERM blocked on this thread for the block. Processes it starts inherit the
    mask through fork and exec, and a signal sent to them stays pending until their StopFlag
    unblocks it (multiprocessing starts its resource tracker the same way, bpo-33613). Without
    this, a forwarded SIGTERM killed a rank still importing torch, and a SIGINT gave it a
    KeyboardInterrupt traceback (exit 1, the tester's 2026-12-05 report). This process's own
    signals go to its other threads meanwhile, or wait for the block's end.

    multiprocessing's resource tracker is started first: the first process a thread starts
    starts it, and its own guard ends by unblocking the two signals on that thread (Python
    3.11, resource_tracker.ensure_running), which left every rank unprotected (measured)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class SignalForwarding:
    """`loom train`'s SIGINT/SIGTERM, caught while its ranks run and sent on to them: the first
    as it is (they save a checkpoint at the next step boundary and end normally), any later one
    as SIGKILL. `received` collects the signals; any already in it (they came after the CLI's
    last look, `stopped_before_start`) are pending. `forward` is called from the launcher's loop,
    not from the handler: signals that arrive before the ranks exist wait for them (two of them
    by then: SIGKILL); the ranks, started under `held_signals`, act on them once they can."""

    def __init__(self, received: list[int]):
        self.received, self.pending = received, list(received)
        self.forwarded = 0
        self.killed = False  # the ranks were sent SIGKILL

    def __enter__(self) -> SignalForwarding:
        self.handlers = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *_exc) -> None:
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, _frame) -> None:
        self.received.append(signum)
        self.pending.append(signum)

    def forward(self, ranks_pids) -> None:
        """Send what is pending to the pids `ranks_pids()` returns (called only then)."""
        pids = ranks_pids() if self.pending else []
        if not pids:
            return
        signum = signal.SIGKILL if self.forwarded or len(self.pending) > 1 else self.pending[0]
        self.pending.clear()
        self.forwarded += 1
        self.killed = signum == signal.SIGKILL
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
