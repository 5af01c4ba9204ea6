"""The launcher of a local SGD or DiLoCo run whose replicas outlive a lost one
(`run.max_restarts` > 0 under [lowcomm]): it spawns the replicas itself, as the parameter
server's launcher does (train/launch.py `launch_tolerant`), hosts the store they meet through
and decides each epoch's members (lowcomm/quorum.py `Lighthouse`), and restarts a lost
replica, which rejoins the others (lowcomm/replicas.py).

Details: docs/lowcomm.md, "Lost replicas"; docs/checkpoints.md, "Restarts".
"""

from __future__ import annotations

import datetime
import multiprocessing
import time
from multiprocessing.connection import wait
from pathlib import Path

import torch.distributed as dist

from loomtrain.lowcomm.quorum import Lighthouse
from loomtrain.lowcomm.replicas import Seat
from loomtrain.train import messages
from loomtrain.train.launch import _tolerant_rank, child_failed, exit_text, free_port, say
from loomtrain.train.stop import SignalForwarding, held_signals

_FATAL = (2, 3)  # bad input, a non-finite streak: every replica would meet it again


def launch_replicas(cfg, entrypoint, payload: tuple, received: list[int], run_dir: Path,
                    errors: Path | None = None) -> None:
    """`entrypoint(*payload, seat)` on parallel.nproc local processes, replica i's `seat`
    (lowcomm/replicas.py `Seat`) telling it the store's port and its index.

    - The store (torch's TCPStore) lives in this process: no replica's death takes it along.
    - A replica that exits other than with 0, 2 or 3 is lost: reported in one line on
      stderr, and restarted as a joiner while run.max_restarts restarts are left (in all, for
      every replica together), no signal has come and no replica has ended the run. A joiner
      is let in by the others at their next step boundary after a sync; until then, and if
      it never is, they train without it.
    - SIGINT/SIGTERM are forwarded as by `launch_forwarding_signals` (`SignalForwarding`):
      the first to every live replica (they stop at the same step boundary and save), a
      second SIGKILLs them.
    - The run fails (torch's ChildFailedError, for the CLI's exit code) when a replica exits
      with 2 or 3 (the others are killed), or when every replica that holds the model is
      lost; it succeeds once every replica has ended and one ended with 0."""
    nproc, limit = cfg.parallel.nproc, cfg.run.max_restarts
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=cfg.parallel.timeout_s))
    lighthouse = Lighthouse(store, nproc, cfg.parallel.timeout_s)
    procs: dict[int, multiprocessing.Process] = {}
    handled: set[int] = set()  # pids whose end was dealt with
    restarts, finished, failed, last_lost = 0, False, None, None

    def start(replica: int, joining: bool) -> multiprocessing.Process:
        seat = Seat(port, replica, nproc, joining)
        p = ctx.Process(target=_tolerant_rank, name=f"loom-replica-{replica}",
                        args=(replica, nproc, port, entrypoint, (*payload, seat)))
        with held_signals():  # the replica acts on a stop once it can: stop.py
            p.start()
        procs[replica] = p
        return p

    def restart(replica: int, p, used: int) -> int:
        """Report lost replica `replica`, and restart it if restarts are left; returns 1 if
        it did."""
        what = f"replica {replica} (pid {p.pid}) {exit_text(p.exitcode)}"
        said = messages.take(errors, p.pid) if errors is not None else None
        if said:  # its message, here once, not again at the end (messages.report)
            what += f" ({said})"
        if used >= limit:
            say(f"{what}; not restarted (the run.max_restarts={limit} restarts are used): the "
                 "other replicas go on without it")
            return 0
        q = start(replica, True)
        say(f"{what}; restarted as pid {q.pid} (restart {used + 1} of run.max_restarts="
             f"{limit}): it rejoins the others after their next sync")
        return 1

    def live() -> list[multiprocessing.Process]:
        return [p for p in procs.values() if p.exitcode is None]

    with SignalForwarding(received) as signals:
        try:
            for replica in range(nproc):
                start(replica, False)
            say(f"replicas started as pids {[p.pid for p in procs.values()]} (replica i: the "
                 f"i-th); a lost replica is restarted, up to run.max_restarts={limit} times in "
                 "all, and rejoins the others with a peer's model")
            while live() and failed is None:
                wait([p.sentinel for p in live()], timeout=0.1)
                signals.forward(lambda: [p.pid for p in live()])
                for replica, p in list(procs.items()):
                    if p.exitcode is None or p.pid in handled:
                        continue
                    handled.add(p.pid)
                    lighthouse.lost(replica)
                    if p.exitcode == 0:
                        finished = True
                        lighthouse.finish()
                    elif p.exitcode in _FATAL:
                        failed = (replica, p)
                    else:
                        last_lost = (replica, p)
                        if not (finished or received):
                            restarts += restart(replica, p, restarts)
                lighthouse.tick(time.monotonic(), {r for r, p in procs.items()
                                                   if p.exitcode is None})
                if not lighthouse.holders and not finished and failed is None:
                    failed = last_lost
                    if not signals.killed:
                        say(f"every replica that held the model is lost; continue from the "
                             f"newest checkpoint with: loom train --resume {run_dir}")
        finally:  # the replicas never outlive the launcher
            for p in live():
                p.kill()
                p.join()
    if failed is not None:
        raise child_failed(entrypoint, *failed)
