"""Heartbeats through the process group's store, and a watchdog that names the rank holding up
a collective: one that stopped answering, died, or issued a different collective.

`start_heartbeat(mesh, timeout_s, on_cause)` (train/run.py, every rank once its process group
exists; world > 1) starts a daemon thread that, every `interval_s` (1 s; `timeout_s` / 4 when
smaller):
- writes this rank's record (comm/stall.py: rank, host, pid, a beat counter, wall time, the
  collectives it entered and the one it is blocked in, from comm/activity.py) under
  "loom/heartbeat/RANK" in the process group's store, through a client of its own
  (`clone()`: a second connection; torch's TCPStore client serializes its calls under one
  mutex, so a shared one would be safe, but a call of this thread held up by a slow store
  would hold up the training thread's own store calls too);
- once this rank has been blocked `probe_after_s` in one op, reads the records of the ranks it
  waits for and judges them (`stall.judge`). A cause found is published in this rank's record
  (its "left" field, which the other ranks adopt) and handed to `on_cause(text, code)`, which
  ends the process (train/run.py); with no `on_cause` it becomes the message of the op's own
  failure instead.

The training thread pays only comm/activity.py's in-memory updates. When an op fails (a dead
peer closes its connections at once; the process-group timeout), collectives._fail asks
`explain` for the cause, with one fresh read of the group's records.

The thread needs the GIL about once per beat: a call that holds it longer than `timeout_s`
(the key parallel.heartbeat_timeout_s) would be taken for a stall. If the store stops
answering (its host is the stalled process), no cause is found and the op's own timeout,
parallel.timeout_s, ends the wait. Details: docs/training.md, "Stalled and dead ranks".

Measured 2026-12-06 (2 loaded CPU cores, tiny GPT, `loom train`): a SIGSTOPped rank of 3 was
named 3.5 s after the stop with timeout_s = 3, one of 4 at 30.0 s with the default 30; the
training thread's part costs 2.8 us per collective.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from loomtrain.comm import stall
from loomtrain.comm.activity import Waiting

PREFIX = "loom/heartbeat/"
PROBE_RECORDS = 64


def start_heartbeat(mesh, timeout_s: float,
                    on_cause: Callable[[str, int], None] | None = None) -> Heartbeat:
    """Start `mesh`'s heartbeat over the default process group's store (see the module)."""
    store = dist.distributed_c10d._get_default_store().clone()
    store.set_timeout(datetime.timedelta(seconds=max(1.0, min(10.0, timeout_s))))
    return Heartbeat(mesh, store, timeout_s, on_cause).start()


class Heartbeat:
    """One rank's heartbeat thread and what it has seen of its peers (see the module)."""

    def __init__(self, mesh, store, timeout_s: float, on_cause=None):
        self.mesh, self.store, self.timeout_s, self.on_cause = mesh, store, timeout_s, on_cause
        self.interval_s = min(1.0, timeout_s / 4)
        self.probe_after_s = min(2.0, timeout_s / 2)
        self.host, self.pid, self.beat = socket.gethostname(), os.getpid(), 0
        # containers may share a host name but not their pids: a pid is looked up only in
        # the same pid namespace
        ns = Path("/proc/self/ns/pid")
        self.pid_ns = os.readlink(ns) if ns.exists() else ""
        self.left: dict | None = None  # the cause this rank ends on, once it knows it
        self._seen: dict[int, tuple] = {}  # rank -> (its beat, first seen (monotonic), age then)
        self._lock = threading.Lock()  # `_seen` and the store, between the thread and `explain`
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="loom-heartbeat")

    def start(self) -> Heartbeat:
        self._publish()  # before this rank can be waited for
        self.mesh.activity.explain = self.explain
        self._thread.start()
        return self

    def stop(self) -> None:
        self.mesh.activity.explain = None
        self._stop.set()
        self._thread.join(self.interval_s + 1.0)  # a store call blocked longer: left behind

    def leave(self, text: str, code: int, cause: bool = True) -> None:
        """Publish what this rank ends on: a cause, for its peers to adopt (stall.judge, rule
        1), or (`cause` False) the failure of its collective, so that a peer that then finds
        this process gone does not take it for one that died."""
        self.left = {"text": text, "code": code, "cause": cause}
        try:
            self._publish()
        except RuntimeError:
            pass  # the store is gone: the peers find the cause themselves, or time out

    def explain(self, axis: str) -> stall.Finding | None:
        """Why this rank's op on `axis` failed, from the group's records read now: a cause
        (`stall.judge`, one reading enough), or a note on the live peers that had not reached
        the op (`cause` False), or None."""
        if self.left is not None and self.left["cause"]:  # found by this rank's own watchdog
            return stall.Finding(self.left["text"], self.left["code"])
        activity = self.mesh.activity
        waiting = activity.waiting
        if waiting is None or waiting.axis != axis:  # failed as it was issued
            seq, op = activity.entered.get(axis, (0, ""))
            waiting = Waiting(axis, op, seq, self.mesh.group_ranks(axis), time.monotonic())
        try:
            peers = self._read(waiting.peers)
        except RuntimeError:
            return None
        found = stall.judge(self.mesh.rank, waiting, peers, self.timeout_s, min_watch_s=0.0)
        if found is None:
            note = stall.behind(waiting, peers)
            found = stall.Finding(note, stall.EXIT_COMM, cause=False) if note else None
        return found

    def _run(self) -> None:
        probed = 0.0
        while not self._stop.wait(self.interval_s):
            waiting = self.mesh.activity.waiting
            try:
                self._publish()
                now = time.monotonic()
                # a large group's records are read less often: each blocked rank reads about
                # PROBE_RECORDS of them per beat, bounding the store's load (not measured
                # beyond 8 ranks; a stall is then named up to len / PROBE_RECORDS beats later)
                every_s = self.interval_s * len(waiting.peers) / PROBE_RECORDS if waiting else 0.0
                if (waiting is None or self.left is not None or now - probed < every_s
                        or now - waiting.since < self.probe_after_s):
                    continue
                probed = now
                found = stall.judge(self.mesh.rank, waiting, self._read(waiting.peers),
                                    self.timeout_s, min_watch_s=2 * self.interval_s)
            except RuntimeError:
                continue  # the store did not answer: the op's own timeout ends the wait
            still = self.mesh.activity.waiting is waiting and not self._stop.is_set()
            if found is not None and still:
                self.leave(found.text, found.code)
                if self.on_cause is not None:
                    self.on_cause(found.text, found.code)  # ends the process

    def _record(self) -> dict:
        activity = self.mesh.activity
        waiting = activity.waiting
        return {"rank": self.mesh.rank, "host": self.host, "pid": self.pid,
                "pid_ns": self.pid_ns, "beat": self.beat,
                "wall": time.time(), "last": activity.last, "entered": dict(activity.entered),
                "left": self.left, "waiting": waiting and {
                    "axis": waiting.axis, "op": waiting.op, "seq": waiting.seq,
                    "ranks": stall.ranks_text(waiting.peers)}}

    def _publish(self) -> None:
        with self._lock:
            self.beat += 1
            self.store.set(PREFIX + str(self.mesh.rank), json.dumps(self._record()))

    def _read(self, ranks: list[int]) -> dict[int, stall.Peer]:
        """The records of `ranks` (this rank left out), with what this rank saw of them. A
        missing key is never read: a get would wait for it until the store's timeout."""
        ranks = [r for r in ranks if r != self.mesh.rank]
        keys = [PREFIX + str(r) for r in ranks]
        with self._lock:
            if self.store.check(keys):
                values = self.store.multi_get(keys)
            else:
                values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
            now, wall = time.monotonic(), time.time()
            peers = {}
            for rank, value in zip(ranks, values):
                record = json.loads(value) if value is not None else None
                beat = record and record["beat"]
                if rank not in self._seen or self._seen[rank][0] != beat:
                    # its age when first seen, by its clock; from then on, by this rank's
                    age = max(0.0, wall - record["wall"]) if record else 0.0
                    self._seen[rank] = (beat, now, age)
                _, first, age = self._seen[rank]
                here = record and (record["host"], record["pid_ns"]) == (self.host, self.pid_ns)
                gone = bool(here) and not _running(record["pid"])
                peers[rank] = stall.Peer(record, age + now - first, now - first, gone)
        return peers


def _running(pid: int) -> bool:
    """Whether process `pid` (on this host) runs: a zombie has ended, only not been reaped.
    Without /proc (not Linux) every process counts as running: none is named dead."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return not Path("/proc/self/stat").exists()
