"""Ringleader ASGD's gradient table: every update averages one entry per worker, so workers
that hold different data weigh the same however fast they are.

Maranjyan & Richtárik, arXiv 2509.22860 (ICLR 2026). The rounds, our choices, and what happens
when a worker is lost or rejoins: docs/async.md, "Ringleader's table".
"""

from __future__ import annotations

import torch


class _Table:
    """Per worker: the sum of its gradients, their count, the oldest version among them."""

    def __init__(self, workers: int):
        self.sums: list[torch.Tensor | None] = [None] * workers
        self.counts = [0] * workers
        self.oldest: list[int | None] = [None] * workers

    def add(self, worker: int, grad: torch.Tensor, pulled_version: int) -> None:
        if self.sums[worker] is None:
            self.sums[worker] = grad.detach().clone()  # never alias (or grow) the caller's tensor
        else:
            self.sums[worker].add_(grad)
        self.counts[worker] += 1
        previous = self.oldest[worker]
        self.oldest[worker] = pulled_version if previous is None else min(previous, pulled_version)

    def drop(self, worker: int) -> None:
        self.sums[worker], self.counts[worker], self.oldest[worker] = None, 0, None

    def full(self, members: set[int]) -> bool:
        return all(self.counts[w] > 0 for w in members)

    def mean_of_means(self, members: set[int]) -> torch.Tensor:
        """(1/m) sum_{i in members} G_i / b_i; every member's entry must hold a gradient."""
        direction = torch.zeros_like(self.sums[min(members)])
        for w in sorted(members):
            direction.add_(self.sums[w], alpha=1.0 / self.counts[w])
        return direction.div_(len(members))

    def state(self) -> dict:
        return {"sums": [None if s is None else s.clone() for s in self.sums],
                "counts": list(self.counts), "oldest": list(self.oldest)}

    @classmethod
    def from_state(cls, state: dict) -> _Table:
        table = cls(len(state["counts"]))
        table.sums = [None if s is None else s.clone() for s in state["sums"]]
        table.counts = [int(c) for c in state["counts"]]
        table.oldest = [None if v is None else int(v) for v in state["oldest"]]
        return table


class RingleaderTable:
    """The server's side of Ringleader ASGD: `add` one arrival, get the direction of the update
    it triggers, or None when the arrival is held for a later update."""

    def __init__(self, workers: int):
        assert workers >= 1, workers
        self.workers = workers
        self.main = _Table(workers)
        self.buffer = _Table(workers)  # the paper's (G^+, b^+): next round's start
        self.unserved: set[int] | None = None  # None: Phase 1; else Phase 2's workers left
        self.members = set(range(workers))  # the workers in the table: not lost (`remove`)
        self.joining: set[int] = set()  # readmitted in Phase 2: members from the next round
        self.rounds = 0  # completed rounds
        # the oldest version a gradient of the last update was computed on: that update's delay
        # in the paper's sense is (server version before it) - served_oldest <= 2n - 2
        self.served_oldest: int | None = None

    @property
    def phase(self) -> int:
        return 1 if self.unserved is None else 2

    def add(self, worker: int, grad: torch.Tensor, pulled_version: int) -> torch.Tensor | None:
        """Place `grad` (computed on `pulled_version`) by the round rules above; return the
        update direction when this arrival triggers one, else None (also for a removed worker,
        whose gradient is dropped)."""
        if worker not in self.members:
            if worker in self.joining:  # next round's entry
                self.buffer.add(worker, grad, pulled_version)
            return None
        if self.unserved is None:
            return self._collect(worker, grad, pulled_version)
        if worker not in self.unserved:
            self.buffer.add(worker, grad, pulled_version)
            return None
        self.main.add(worker, grad, pulled_version)
        return self._serve(worker)

    def _collect(self, worker: int, grad: torch.Tensor, pulled_version: int):
        self.main.add(worker, grad, pulled_version)
        if not self.main.full(self.members):
            return None
        self.unserved = set(self.members)  # Phase 2 starts; this arrival is served first
        return self._serve(worker)

    def _serve(self, worker: int) -> torch.Tensor:
        direction = self.main.mean_of_means(self.members)
        self.served_oldest = min(self.main.oldest[w] for w in self.members)
        self.unserved.discard(worker)
        self._close_if_served()
        return direction

    def _close_if_served(self) -> None:
        if self.unserved is not None and not self.unserved:
            self.main, self.buffer = self.buffer, _Table(self.workers)
            self.unserved = None
            self.rounds += 1
            self.members |= self.joining
            self.joining.clear()

    def remove(self, worker: int) -> None:
        """The worker is lost: it leaves the table (failure semantics in docs/async.md).
        No update is made here; the next arrival from a remaining worker makes the next one."""
        self.members.discard(worker)
        self.joining.discard(worker)
        self.main.drop(worker)
        self.buffer.drop(worker)
        if self.unserved is not None:
            self.unserved.discard(worker)
            self._close_if_served()

    def readmit(self, worker: int) -> None:
        """The removed `worker` is back (rejoining, docs/async.md): a member again now in
        Phase 1, at the next round in Phase 2."""
        assert worker not in self.members and worker not in self.joining, worker
        (self.members if self.unserved is None else self.joining).add(worker)

    def state_dict(self) -> dict:
        return {"main": self.main.state(), "buffer": self.buffer.state(), "rounds": self.rounds,
                "unserved": None if self.unserved is None else sorted(self.unserved),
                "served_oldest": self.served_oldest, "members": sorted(self.members),
                "joining": sorted(self.joining)}

    def load_state_dict(self, state: dict) -> None:
        self.main = _Table.from_state(state["main"])
        self.buffer = _Table.from_state(state["buffer"])
        self.rounds = int(state["rounds"])
        unserved = state["unserved"]
        self.unserved = None if unserved is None else {int(w) for w in unserved}
        self.served_oldest = state["served_oldest"]
        self.members = {int(w) for w in state["members"]}
        self.joining = {int(w) for w in state.get("joining", ())}
