"""Staleness policies of the asynchronous parameter server: whether a worker may start now, and
what the server does with a gradient computed on parameters that have moved on since.

plain (Dean et al., NIPS 2012), bounded (Ho et al., NIPS 2013), drop_stale (arXiv 2501.16168),
staleness_scaled (arXiv 1511.05950), ringleader (arXiv 2509.22860, ringleader.py). Each rule
and the interface the server calls: docs/async.md, "Policies".
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from loomtrain.asyncsgd.ringleader import RingleaderTable
from loomtrain.errors import CheckpointError


class Policy:
    """The base: every gradient applied at full rate, no worker ever waits. Subclasses change
    `lr_scale` (None: discard) and `may_start`; Ringleader replaces `on_gradient`."""

    name = ""

    def __init__(self, workers: int, max_staleness: int):
        self.workers = workers
        self.max_staleness = max_staleness
        self.last_outcome: str | None = None  # "applied" | "held" | "discarded", last arrival

    def may_start(self, worker: int, version: int, pulled: dict[int, int]) -> bool:
        return True

    def on_lost(self, worker: int) -> None:
        """The server lost `worker`. Nothing to forget here: the policy keeps no state per
        worker, and `pulled` (from the server) no longer names it."""

    def on_rejoin(self, worker: int) -> None:
        """The lost `worker` is live again. Nothing to restore here (see `on_lost`)."""

    def on_gradient(self, worker: int, grad: torch.Tensor, pulled_version: int, version: int
                    ) -> tuple[torch.Tensor, float] | None:
        """(grad itself, lr_scale(version - pulled_version)), or None if that scale is None."""
        assert 0 <= worker < self.workers and 0 <= pulled_version <= version, (
            worker, pulled_version, version)
        scale = self.lr_scale(version - pulled_version)
        self.last_outcome = "discarded" if scale is None else "applied"
        return None if scale is None else (grad, scale)

    def lr_scale(self, staleness: int) -> float | None:
        return 1.0

    def state_dict(self) -> dict:
        return {"policy": self.name, "workers": self.workers}

    def load_state_dict(self, state: dict) -> None:
        """Check that a server checkpoint was written by this policy for this many workers."""
        if state.get("policy") != self.name or state.get("workers") != self.workers:
            raise CheckpointError(
                f"the parameter server's checkpoint was written with async.policy="
                f"{state.get('policy')!r} for {state.get('workers')} workers; this run has "
                f"async.policy={self.name!r} with {self.workers} workers; resume with the "
                f"same policy and number of processes")


class Plain(Policy):
    """Asynchronous SGD as in Dean et al. (2012): every gradient, whatever its staleness."""

    name = "plain"


class BoundedStaleness(Policy):
    """Stale-synchronous parallel in server versions: fast workers wait for the straggler.

    Rule: a worker may pull version v only if every *other* worker still computing pulled a
    version at least v - s (s = max_staleness): v - pulled[w] <= s for all w in `pulled`.
    Gradients are applied at full rate. In Ho et al.'s SSP (NIPS 2013) the fastest worker's
    clock may lead the slowest's by at most s; here the newest pull may lead the oldest pull
    still being computed by at most s versions.

    What it guarantees, with n workers:
    - spread: at any time, the versions pulled by the workers computing differ by at most s
      (a new pull is at the newest version and within s of every pull in flight);
    - staleness of an applied gradient at most s + n - 1, not s: while a worker computes on
      version p, others may still pull versions up to p + s, and each of the (at most n - 1)
      others can push one more gradient after the version passed p + s. With n = 3, s = 1 a
      gradient can be 3 versions stale (the tests reach that). For a hard bound of s on what is
      applied, discard instead ("drop_stale").
    - no deadlock: a worker is refused only because of workers that are computing, and those
      never wait; when nobody computes, `pulled` is empty and every request is granted. So as
      long as the server asks its waiting workers again after each arrival, some worker always
      makes progress, and the straggler a worker waits for is never the one waiting.
    - a lost worker holds nobody back: the server removes it from `pulled` when it loses it
      and asks the waiting workers again, so the rule then runs over the live workers only
      (no `on_lost` state needed).
    """

    name = "bounded"

    def may_start(self, worker: int, version: int, pulled: dict[int, int]) -> bool:
        return all(version - p <= self.max_staleness for w, p in pulled.items() if w != worker)


class DropStale(Policy):
    """Ringmaster ASGD's rule (arXiv 2501.16168): staleness above max_staleness is discarded.

    The paper also stops a worker's computation once it is known to be too stale; here a
    worker always finishes and the server discards on arrival (the worker then pulls afresh)."""

    name = "drop_stale"

    def lr_scale(self, staleness: int) -> float | None:
        return None if staleness > self.max_staleness else 1.0


class StalenessScaled(Policy):
    """Zhang et al. (IJCAI 2016): the learning rate divided by the gradient's staleness,
    lr_scale = 1 / max(1, tau). max_staleness is not used."""

    name = "staleness_scaled"

    def lr_scale(self, staleness: int) -> float | None:
        return 1.0 / max(1, staleness)


class RingleaderPolicy(Policy):
    """Ringleader ASGD (arXiv 2509.22860): the update is the mean over workers of each
    worker's mean gradient in the table, in rounds of one update per worker; arrivals are held
    ("held"), never discarded, and no worker ever waits. The rules are in ringleader.py.
    max_staleness is not used: the paper bounds every delay by 2n - 2 by construction.

    A lost worker (`on_lost`) leaves the table and the rounds go on over the others, so the
    objective becomes the remaining workers' data (the paper assumes no worker fails; the
    choice and its consequences are in ringleader.py). A gradient from it that still arrives
    is "discarded". A worker that rejoins (`on_rejoin`) gets an entry again: at once in Phase
    1, from the next round in Phase 2 (held for it meanwhile)."""

    name = "ringleader"

    def __init__(self, workers: int, max_staleness: int):
        super().__init__(workers, max_staleness)
        self.table = RingleaderTable(workers)

    def on_gradient(self, worker: int, grad: torch.Tensor, pulled_version: int, version: int
                    ) -> tuple[torch.Tensor, float] | None:
        assert 0 <= worker < self.workers and 0 <= pulled_version <= version, (
            worker, pulled_version, version)
        if worker not in self.table.members and worker not in self.table.joining:
            self.last_outcome = "discarded"
            return None
        direction = self.table.add(worker, grad, pulled_version)
        self.last_outcome = "held" if direction is None else "applied"
        return None if direction is None else (direction, 1.0)

    def on_lost(self, worker: int) -> None:
        self.table.remove(worker)

    def on_rejoin(self, worker: int) -> None:
        self.table.readmit(worker)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "table": self.table.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.table.load_state_dict(state["table"])


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Plain, BoundedStaleness, DropStale, StalenessScaled,
                              RingleaderPolicy)}


def build_policy(name: str, workers: int, max_staleness: int) -> Policy:
    """The policy called `name` (async.policy) for `workers` workers."""
    if name not in POLICIES:
        raise ValueError(f"async.policy must be one of {', '.join(POLICIES)}; got {name!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"the parameter server needs at least one worker (one process besides "
                         f"the server); got workers={workers!r}")
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"async.max_staleness must be a whole number >= 0; got "
                         f"{max_staleness!r}")
    return POLICIES[name](workers, max_staleness)


class Arrival(NamedTuple):
    worker: int
    pulled_version: int
    version: int  # the server's version when the gradient arrived
    applied: bool  # did this arrival make an update
    staleness: int  # version - pulled_version


class StalenessLog:
    """Every arrival at the server, in order."""

    def __init__(self):
        self.arrivals: list[Arrival] = []

    def record(self, worker: int, pulled_version: int, version: int, applied: bool) -> Arrival:
        arrival = Arrival(worker, pulled_version, version, applied, version - pulled_version)
        self.arrivals.append(arrival)
        return arrival

    def histogram(self) -> dict[int, int]:
        """{staleness: count} over the applied arrivals, by increasing staleness."""
        counts: dict[int, int] = {}
        for a in self.arrivals:
            if a.applied:
                counts[a.staleness] = counts.get(a.staleness, 0) + 1
        return dict(sorted(counts.items()))

    def summary(self) -> dict:
        """Counts and the mean and largest staleness of what was applied (0 when nothing was)."""
        applied = [a.staleness for a in self.arrivals if a.applied]
        return {"arrivals": len(self.arrivals), "applied": len(applied),
                "mean_staleness": sum(applied) / len(applied) if applied else 0.0,
                "max_staleness": max(applied, default=0)}
