"""One replica's side of a run whose replicas outlive a lost one (local SGD, DiLoCo): the
process group of each epoch (lowcomm/quorum.py), re-formed when a collective fails or a
restarted replica asks to join, and the hand-over that brings every member to one place.

`ReplicaGroup.guard(phase, attempt)` runs one collective phase of a step (the control
all-reduce, a sync, a record, a checkpoint). When it fails (a peer died: gloo reports it at
once), this replica destroys its group, which fails its peers' pending collectives at once
too, registers where it is, and forms the next epoch's group with the members the launcher
publishes. There the members compare positions: those that are equal retry the phase (a
failed sync has changed nothing: it all-reduces a copy); a member whose peers got further
(the lost replica died inside a collective that some completed) takes what it missed from
the most advanced one, the source: the synchronized model after a sync, the control answer
before a step. A joiner takes the model, the wrapper's outer state, the inner optimizer's
state and the step from the source.

Every member of an epoch issues the same collectives in the same order: each decision that
chooses a collective is agreed (the control all-reduce, the reconcile's positions, the
lighthouse's members, the newest checkpoint's step handed to a joiner), and a replica that
leaves on an error issues none (`session`). Guide: docs/lowcomm.md, "Lost replicas".
"""

from __future__ import annotations

import contextlib
import datetime
import time
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors

from loomtrain import comm
from loomtrain.lowcomm import quorum
from loomtrain.lowcomm.quorum import (AGREE, BEGIN, JOIN, MODEL_PHASES, done_of, phase_of,
                                      position)
from loomtrain.mesh import build_mesh
from loomtrain.parallel.data import broadcast_tensors
from loomtrain.train.checkpoint import init_optimizer_state


@dataclass(frozen=True)
class Seat:
    """What the launcher gives a replica process: the store's port, its replica index among
    `nproc`, and whether it joins a running run (a restarted replica)."""

    port: int
    replica: int
    nproc: int
    joining: bool = False


class ReplicaLeftOut(comm.CollectiveError):
    """The others re-formed without this replica: it did not register in time."""


class ReplicaGroup:
    """This replica's membership. `mesh` is the run's mesh, rebuilt in place at each epoch
    (dp = the members), so every holder of it sees the current group. The mode sets `built`
    (the model and optimizer a hand-over copies) and `reformed` (told `(members before,
    agreed position, source, seconds)` after each re-form)."""

    def __init__(self, seat: Seat, timeout_s: float, device: torch.device):
        self.store = dist.TCPStore("127.0.0.1", seat.port, is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.replica, self.nproc, self.timeout_s, self.device = (seat.replica, seat.nproc,
                                                                 timeout_s, device)
        self.epoch, self.members, self.mesh = -1, [], None
        self.done = 0  # optimizer steps done: the position of the phase the mode runs
        self.control: tuple | None = None  # the last control answer (tokens, stop, join, streak)
        self.streaking = False  # the last agreement on a non-finite streak (AGREE)
        self.saved_at = 0  # the step the newest checkpoint holds: the same on every member
        self.built = None
        self.reformed = lambda before, agreed, source, seconds: None

    @property
    def away(self) -> list[int]:
        return [r for r in range(self.nproc) if r not in self.members]

    @property
    def writer(self) -> bool:
        """The lowest member writes the metrics and publishes the checkpoints."""
        return self.mesh.rank == 0

    def start(self, joining: bool):
        """The mesh to build the model on: epoch 0's (every replica), or for a joiner a group
        of its own until `join`."""
        if joining:
            self._form(-1, [self.replica], prefix=f"alone{self.replica}.{time.time_ns()}")
        else:
            self._form(0, quorum.await_members(self.store, 0, lambda: False))
        return self.mesh

    def join(self, stop) -> int | None:
        """A restarted replica: wait until the members let it in (at their next step boundary
        where they hold one model), take the model from one; returns their step (None: the run
        ended, or a stop signal came, first)."""
        epoch = quorum.latest_epoch(self.store) + 1
        while True:
            quorum.register(self.store, epoch, self.replica, JOIN)
            members = quorum.await_members(self.store, epoch, lambda: stop.signum)
            if members is None:
                return None
            if self.replica in members:
                break
            epoch = max(epoch, quorum.latest_epoch(self.store)) + 1
        started = time.perf_counter()
        self._form(epoch, members)
        agreed, source = self._reconcile(JOIN)
        assert phase_of(agreed) == BEGIN, agreed  # the lighthouse lets joiners in only there
        self.reformed([r for r in members if r != self.replica], agreed, source,
                      time.perf_counter() - started)
        return done_of(agreed)

    def join_requested(self) -> bool:
        """Whether a replica asked for the next epoch. False without the store: the launcher
        that hosts it is dead, and this replica stops at this step boundary and saves
        (train/orphan.py), which needs only the group's connections."""
        try:
            return quorum.wanted(self.store, self.epoch + 1)
        except RuntimeError:
            return False

    def guard(self, phase: int, attempt, caught_up=lambda: None, errors=(comm.CollectiveError,)):
        """`attempt()`, re-run in a re-formed group while it fails with `errors`; a member
        the others got past returns `caught_up()` instead. A failure again among the same
        members is not a lost replica: raised."""
        pos = position(self.done, phase)
        failed_among = None
        while True:
            try:
                return attempt()
            except errors as err:
                # re-formed outside this block: its traceback holds the old group, whose
                # connections close (failing the peers' pending collectives) once it is freed
                error = err.with_traceback(None)
                error.__context__ = None
            if failed_among == self.members:
                raise error
            failed_among = list(self.members)
            if self.admit(pos) > pos:
                return caught_up()

    def admit(self, pos: int) -> int:
        """Leave this group and form the next with whoever the launcher publishes: after a
        failure, or to let joiners in (then `pos` is a step boundary). Returns the agreed
        position (the most advanced member's)."""
        started, before = time.perf_counter(), list(self.members)
        synchronized = self.built.model.joinable()
        give_up_s = 2 * self.timeout_s + 10  # the lighthouse publishes within timeout_s
        while True:
            self._leave()
            epoch = self.epoch + 1
            quorum.register(self.store, epoch, self.replica, pos, synchronized)
            members = quorum.await_members(self.store, epoch,
                                           lambda: time.perf_counter() - started > give_up_s)
            if members is None or self.replica not in members:
                raise ReplicaLeftOut(
                    f"replica {self.replica}: the other replicas re-formed their group without "
                    f"it (it did not answer within parallel.timeout_s={self.timeout_s:g} s, or the "
                    "run has ended)")
            try:
                self._form(epoch, members)
                agreed, source = self._reconcile(pos)
                break
            except comm.CollectiveError:  # another replica lost while re-forming: next epoch
                continue
        self.reformed(before, agreed, source, time.perf_counter() - started)
        return agreed

    def _leave(self) -> None:
        """Destroy the group and drop every reference to it: gloo closes its connections only
        when the group is freed (measured: a peer blocked receiving from this replica fails
        at once then, and only at parallel.timeout_s while the group lives)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.mesh is not None:
            self.mesh._groups, self.mesh.device_mesh = {}, None

    def _form(self, epoch: int, members: list[int], prefix: str | None = None) -> None:
        self._leave()
        self.epoch, self.members = epoch, members  # a failed start still asks for the next one
        store = dist.PrefixStore(prefix or f"e{epoch}/pg", self.store)
        try:
            dist.init_process_group("gloo", store=store, rank=members.index(self.replica),
                                    world_size=len(members),
                                    timeout=datetime.timedelta(seconds=self.timeout_s))
            fresh = build_mesh({"dp": len(members)}, device=self.device)
        except RuntimeError as err:  # a member died before it connected: the store's timeout
            raise comm.CollectiveError(f"replica {self.replica}: the group of replicas {members} "
                                       f"(epoch {epoch}) could not be formed: {err}") from None
        if self.mesh is None:
            self.mesh = fresh
        else:  # in place: the model, the mode and the layout hold this object
            for name in ("sizes", "rank", "ranks_per_node", "device_mesh", "_groups",
                         "ring_sequence"):
                setattr(self.mesh, name, getattr(fresh, name))

    def _reconcile(self, pos: int) -> tuple[int, int]:
        """Every member's position, in one all-reduce; those behind the most advanced one (the
        lowest such: the source) take what they missed from it. Returns (agreed, source)."""
        slots = torch.zeros(self.nproc, dtype=torch.float64)
        slots[self.replica] = pos + 2  # JOIN (-1) is 1; 0: not a member
        comm.all_reduce(slots, self.mesh, "world")
        at = {r: int(v) - 2 for r, v in enumerate(slots.tolist()) if v}
        agreed = max(at.values())
        source = min(r for r, p in at.items() if p == agreed)
        behind = [p for p in at.values() if p < agreed]
        if behind:
            state = any(p == JOIN or phase_of(p) in MODEL_PHASES for p in behind)
            self._hand_over(self.members.index(source), pos if pos < agreed else None, state)
        return agreed, source

    @torch.no_grad()
    def _hand_over(self, src: int, behind: int | None, state: bool) -> None:
        """Broadcast from member `src`: the control answer and the counters, and with `state`
        the model, the wrapper's replica state and the inner optimizer's state. `behind`: this
        replica's position if it takes them (None: it only takes part)."""
        model, optimizer = self.built.model, self.built.optimizer
        header = torch.zeros(8, dtype=torch.float64)
        if self.mesh.rank == src:
            header[:] = torch.tensor([model.steps_since_sync, bool(optimizer.state),
                                      *(self.control or (0.0, False, False, False)),
                                      self.saved_at, self.streaking], dtype=torch.float64)
        comm.broadcast(header, self.mesh, "world", src)
        if behind == JOIN:  # whether a stop right after the rejoin saves: as the members decide
            self.saved_at = int(header[6])
        if behind is not None and phase_of(behind) == BEGIN:  # a step the others have begun
            self.control = (float(header[2]), *(bool(x) for x in header[3:6].tolist()))
        if behind is not None and phase_of(behind) == AGREE:  # what the others agreed on
            self.streaking = bool(header[7])
        if not state:
            return
        takes = behind is not None and (behind == JOIN or phase_of(behind) in MODEL_PHASES)
        if header[1] and not optimizer.state:  # a joiner, or a member yet to step (step 1 only)
            init_optimizer_state(optimizer)  # tensors for the source's to land in
        live = [t for t in model.module.state_dict(keep_vars=True).values()
                if isinstance(t, torch.Tensor)]
        if header[1]:
            live += [v for group in optimizer.param_groups for p in group["params"]
                     for _, v in sorted(optimizer.state[p].items()) if torch.is_tensor(v)]
        extra = model.replica_state()  # fresh tensors
        tensors = [t.detach() if takes else t.detach().clone() for t in live]
        broadcast_tensors(tensors + list(extra.values()), self.mesh, "world", src)
        if takes:
            model.load_replica_state(extra)
            model.steps_since_sync = int(header[0])

    def fingerprints(self) -> list[int | None]:
        """Every member's CRC-32 of its parameters, by replica index (None: away): equal on
        all of them wherever the replicas hold one model."""
        flat = _flatten_dense_tensors([p.detach() for p in self.built.model.params]).cpu()
        slots = torch.zeros(self.nproc, dtype=torch.float64)
        slots[self.replica] = zlib.crc32(flat.numpy().tobytes()) + 1
        comm.all_reduce(slots, self.mesh, "world")
        return [int(v) - 1 if v else None for v in slots.tolist()]

    @contextlib.contextmanager
    def session(self):
        """Around the replica's run: at its end, `close`; on an exception (a write error, a
        collective that failed again among the same members, a bug), leave the group at once
        with no collective. The members are then elsewhere in their sequence, and a barrier
        there would meet another collective under the same gloo tag: a size mismatch aborts
        the process (SIGABRT: its error never printed, its exit code lost), a smaller message
        lands silently in a peer's larger receive. Freeing the group fails the members'
        pending collectives at once, and they re-form without this replica."""
        try:
            yield self
        except BaseException:
            self._leave()
            raise
        self.close()

    def close(self) -> None:
        """Leave the group after a barrier of its members, which reach it together: after the
        last step's or a stop's checkpoint (a member lost by now is not waited for)."""
        if self.mesh is not None and self.mesh.world > 1:
            try:
                comm.barrier(self.mesh)
            except comm.CollectiveError:
                pass
        self._leave()
