"""Ringleader ASGD's gradient table: every update averages one entry per worker, so workers
that hold different data weigh the same however fast they are.

Maranjyan & Richtárik, "Ringleader ASGD: The First Asynchronous SGD with Optimal Time
Complexity under Data Heterogeneity" (arXiv 2509.22860, ICLR 2026). The problem is
min f(x) = (1/n) sum_i f_i(x), where worker i samples only its own f_i. Plain asynchronous SGD
applies whichever gradient arrives, so a worker k times faster moves the model k times as often
towards its own f_i. Ringleader keeps, for every worker i, an entry (G_i, b_i): the sum of the
b_i gradients of worker i gathered for the current round, and steps along their mean of means

    g = (1/n) sum_i G_i / b_i,        x <- x - gamma g.

The round structure (from the paper):
- Phase 1 collects and applies nothing: arrivals are added to their worker's entry until every
  entry holds at least one gradient. The arrival that fills the last empty entry triggers the
  round's first update; its worker counts as served.
- Phase 2 serves every other worker exactly once: the next arrival from a worker not yet
  served this round is added to its entry and triggers one update. So a round makes exactly n
  updates, one per worker.
- An arrival in Phase 2 from a worker already served goes to a second table (G_i^+, b_i^+)
  instead: it is neither applied now nor discarded. When the last worker is served the round
  ends, the second table becomes the main one (entries it lacks start empty) and Phase 1 begins.
The paper proves that every gradient in the table is then at most 2n - 2 updates old, whatever
the workers' speeds, and that no worker ever waits (`may_start` is always true for this policy).

The fast worker's extra gradients are averaged inside its own entry: they lower its variance
and do not raise its weight, which stays 1/n. With one worker every arrival is a full round of
one update on that gradient alone: Ringleader with one worker is SGD.

Choices of this implementation (the paper leaves them open or does not apply):
- the table is kept as sums and counts, as in the paper; the direction is recomputed from the
  n entries at each update (n tensors of the model's size: fine for the few workers of a
  parameter server, O(n) memory like the paper's table);
- each entry also records the oldest version its gradients were computed on, so the delay of
  every update in the paper's sense is known (`served_oldest`); the tests check it against
  2n - 2;
- the state (both tables, the phase, who is still to be served) is a plain dict of ints and
  tensors for the server's checkpoint; a restored table continues the round where it was.

Failure semantics: a round needs every worker in the table, so a worker lost for good would
stall Phase 1 (its entry stays empty) or Phase 2 (it is never served) forever. The paper
assumes workers do not fail; our choice is that the server calls `remove(worker)` when it loses
one, and the worker leaves the table: its entries in both tables are dropped (the gradients it
had gathered are never applied), the current round goes on over the remaining workers (a
Phase 1 table is then full at the next arrival, a Phase 2 round closes once the others are
served, at once if it was the last one left to serve), and every later round has one entry
fewer. The update is then the mean over the *remaining* workers, so the objective becomes
(1/m) sum of their f_i over the m workers left: the lost worker's data is no longer trained
on, and nothing can restore its share. A gradient it sent before it was lost that still
arrives is discarded (`add` returns None; the policy reports "discarded"). The set of workers
in the table is part of the state, so a worker stays out after a resume from it.

Rejoining (`readmit`, when the server takes a lost worker back): in Phase 1 it is a member
again at once, with an empty entry, so the round's first update waits for its next gradient
as it waits for everyone's. In Phase 2 it cannot be: the round's updates average one entry per
member and its entry is empty; it joins when the round closes, and its arrivals meanwhile go to
the second table, the next round's start, as an already-served worker's do. From then on the
update is the mean over all workers again and its data weighs 1/n again. Its first gradient
after a long absence may be far older than 2n - 2 updates (the bound assumes no worker
stops); `served_oldest` shows it.
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
        """The worker is lost: it leaves the table (failure semantics in the module docstring).
        No update is made here; the next arrival from a remaining worker makes the next one."""
        self.members.discard(worker)
        self.joining.discard(worker)
        self.main.drop(worker)
        self.buffer.drop(worker)
        if self.unserved is not None:
            self.unserved.discard(worker)
            self._close_if_served()

    def readmit(self, worker: int) -> None:
        """The removed `worker` is back (rejoining, module docstring): a member again now in
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
