"""Who the replicas are, epoch by epoch: the store protocol between the replicas of a run that
outlives lost replicas and its launcher, which hosts the store and decides each epoch's
members (`Lighthouse`, after torchft's lighthouse).

Epoch e has members, a sorted list of replica indices, and its own process group (made over
the store under the prefix "e<e>/pg"). A replica asks for epoch e+1 by registering where it
is (`register`): a member after a collective failed, or to let a joiner in; a restarted
replica as a joiner. The lighthouse publishes e+1 once every live member of e has registered
(or `bound_s` after the first one did): its members are the live registered members of e, and
the live joiners when every member registered at a step boundary where the replicas hold one
model (a joiner takes that model from a peer). Joiners alone never make an epoch. The launcher
reports each replica whose process ends (`Lighthouse.lost`): it is no longer awaited, and a
process started in its place is a joiner.

Store keys: "epoch" (the newest published), "e<e>/members" ("0,2"), "e<e>/r<i>" (replica i's
registration: "<position> <synchronized>" or "join"), "e<e>/any" (someone registered for e:
what the members read once per step), "finished" (a replica has ended the run: joiners stop
waiting). Guide: docs/lowcomm.md, "Lost replicas".
"""

from __future__ import annotations

import time

JOIN = -1  # the position of a replica that holds no state yet
# where in a step a replica is, by the collective it was in: positions are done * 16 + phase,
# totally ordered along a run. After step `done`: its syncs (SYNC), its record (RECORD), at a
# checkpoint step the agreement on a non-finite streak (AGREE), the sync that brings the
# replicas to one model (SETTLE) and the save (SAVE); then the control all-reduce before step
# done + 1 (BEGIN). A stop agreed there is saved after it, at the same `done` (STOP_SETTLE,
# STOP_SAVE), so that positions keep the order the collectives are issued in.
SYNC, RECORD, AGREE, SETTLE, SAVE, BEGIN, STOP_SETTLE, STOP_SAVE = range(1, 9)
# the phases whose collective changes the model: a member behind one takes the model
MODEL_PHASES = (SYNC, SETTLE, STOP_SETTLE)


def position(done: int, phase: int) -> int:
    """The position of phase `phase` once `done` optimizer steps are done (BEGIN: the control
    all-reduce before step done + 1)."""
    return done * 16 + phase


def phase_of(pos: int) -> int:
    return pos % 16


def done_of(pos: int) -> int:
    return pos // 16


def members_key(epoch: int) -> str:
    return f"e{epoch}/members"


def register(store, epoch: int, replica: int, pos: int, synchronized: bool = False) -> None:
    """Replica `replica` asks for epoch `epoch`, at position `pos` (JOIN: a joiner);
    `synchronized`: the replicas hold one model there (a joiner may come in)."""
    text = "join" if pos == JOIN else f"{pos} {int(synchronized)}"
    store.set(f"e{epoch}/r{replica}", text)
    store.set(f"e{epoch}/any", "1")


def wanted(store, epoch: int) -> bool:
    """Whether some replica registered for `epoch` (one store round trip)."""
    return store.check([f"e{epoch}/any"])


def await_members(store, epoch: int, give_up) -> list[int] | None:
    """The members of `epoch` once published; None when `give_up()` becomes true first or the
    run has finished. Polls every 20 ms, so that both are seen."""
    key = members_key(epoch)
    while not store.check([key]):
        if give_up() or store.check(["finished"]):
            return None
        time.sleep(0.02)
    return [int(r) for r in store.get(key).decode().split(",")]


def latest_epoch(store) -> int:
    return int(store.get("epoch").decode())


class Lighthouse:
    """The launcher's side: publishes epoch 0 (every replica) at once, then each next epoch
    when `tick` finds it due. `holders`: the members of the newest epoch not lost since, the
    replicas that hold the model."""

    def __init__(self, store, nproc: int, bound_s: float):
        self.store, self.nproc, self.bound_s = store, nproc, bound_s
        self.epoch, self.holders = 0, list(range(nproc))
        self._first_s: float | None = None  # when a holder first registered for the next epoch
        self._publish()

    def _publish(self) -> None:
        self.store.set(members_key(self.epoch), ",".join(map(str, self.holders)))
        self.store.set("epoch", str(self.epoch))

    def lost(self, replica: int) -> None:
        """Replica `replica`'s process has ended: a process started in its place is a joiner."""
        if replica in self.holders:
            self.holders.remove(replica)

    def _registered(self, epoch: int) -> dict[int, str]:
        keys = {i: f"e{epoch}/r{i}" for i in range(self.nproc)}
        return {i: self.store.get(k).decode() for i, k in keys.items() if self.store.check([k])}

    def tick(self, now_s: float, alive: set[int]) -> bool:
        """Publish the next epoch if it is due (`alive`: the replicas whose processes run);
        returns whether it published."""
        registered = self._registered(self.epoch + 1)
        survivors = {i: text for i, text in registered.items()
                     if i in self.holders and text != "join"}
        if not survivors:
            self._first_s = None
            return False
        if self._first_s is None:
            self._first_s = now_s
        if len(survivors) < len(self.holders) and now_s - self._first_s < self.bound_s:
            return False
        admitted = list(survivors)
        # a joiner copies one member's model: only where the members hold one model
        if all(_synchronized_boundary(text) for text in survivors.values()):
            admitted += [i for i, text in registered.items() if text == "join" and i in alive]
        self.epoch, self.holders, self._first_s = self.epoch + 1, sorted(admitted), None
        self._publish()
        return True

    def finish(self) -> None:
        """A replica has ended the run: joiners still waiting stop."""
        self.store.set("finished", "1")


def _synchronized_boundary(text: str) -> bool:
    if text == "join":
        return False
    pos, synchronized = text.split()
    return phase_of(int(pos)) == BEGIN and synchronized == "1"
