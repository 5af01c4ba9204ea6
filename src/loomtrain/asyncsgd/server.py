"""The asynchronous parameter server: applies each worker's gradient the moment it arrives.

Keuper & Pfreundt (arXiv 1510.01155) and the asynchronous SGD they survey. The serving loop,
stopping, losing and readmitting workers, non-finite gradients, resuming, costs and sharding:
docs/async.md, "The parameter server and its workers" and the sections it links.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from loomtrain import comm
from loomtrain.asyncsgd.policies import StalenessLog
from loomtrain.asyncsgd.protocol import (
    STEP,
    TAG_PARAMS,
    TAG_PULL,
    TAG_PUSH,
    VERSION,
    Inbox,
    Message,
    message,
    read_count,
    read_loss,
    write_header,
)

log = logging.getLogger(__name__)


class Membership(NamedTuple):
    """A change in the set of live workers."""

    worker: int
    event: str  # "lost" | "returned" (a hung worker came back) | "restarted" (a new process)
    version: int  # the server's version at that moment
    arrivals: int  # gradients received before it: staleness.arrivals[arrivals:] came after


@dataclass
class ServerResult:
    params: torch.Tensor  # the final flat fp32 parameters
    version: int  # updates applied
    staleness: StalenessLog  # every gradient received, in arrival order
    # worker -> why it was (last) dropped; a worker that rejoined stays listed
    lost: dict[int, str] = field(default_factory=dict)
    # per arrival, in the staleness log's order: (the loss its worker reported, the outcome:
    # "applied" | "held" | "discarded" (the policy's word) | "nonfinite" (NaN or infinity in
    # the gradient: discarded by the server) | "late" (after the last update))
    reports: list[tuple[float, str]] = field(default_factory=list)
    membership: list[Membership] = field(default_factory=list)  # losses and rejoins, in order
    aborted: str | None = None  # why the run ended early (non-finite gradients), if it did
    accumulation: list[int] = field(default_factory=list)  # per arrival: gradients averaged


@dataclass
class _Peer:
    """The server's view of one worker: what it is expected to send next and by when."""

    # "pull" | "push": its receive is posted; "wait": held by the policy; "stopping": its stop
    # is being sent; "done" | "lost": finished
    expect: str = "pull"
    inbox: Message | None = None  # the buffer of its posted receive
    deadline: float | None = None  # perf_counter time; None: nothing expected from it
    # the last PARAMS send: held until the next one, because gloo drops a queued send whose
    # work object is freed (measured: the worker then waits forever for that reply)
    sending: comm.Pending | None = None
    channel: comm.MeshChannel | comm.PairChannel | None = None  # how the server reaches it
    generation: int = 0  # of the channel: 0 the mesh, n the n-th pair channel of this worker
    posted: str = "pull"  # the kind of its posted receive (kept when lost: a late message)


class ParameterServer:
    """Server loop state; `build_server()` makes one, `serve()` runs one to its end."""

    def __init__(self, mesh, axis: str, params: torch.Tensor, policy, lr: float,
                 total_updates: int, worker_timeout_s: float, optimizer=None,
                 lr_schedule: Callable[[int], float] | None = None,
                 on_update: Callable[["ParameterServer"], None] | None = None,
                 rejoin: comm.PairHost | None = None, servers: int = 1):
        self.mesh, self.axis, self.policy, self.lr = mesh, axis, policy, lr
        self.rejoin = rejoin
        self.optimizer, self.lr_schedule, self.on_update = optimizer, lr_schedule, on_update
        if optimizer is None:
            self.params = params.detach().to(torch.float32).flatten().clone()
        else:  # the optimizer's parameters are views into it: updated in place
            self.params = params
        self.total_updates, self.timeout_s = total_updates, worker_timeout_s
        self.version = 0
        self.last_lr = lr  # the schedule's lr of the latest update (before lr_scale)
        self.staleness = StalenessLog()
        self.reports: list[tuple[float, str]] = []
        self.accumulation: list[int] = []  # per arrival, in the staleness log's order: its k
        self.lost: dict[int, str] = {}
        self.membership: list[Membership] = []
        self.pulled: dict[int, int] = {}  # live worker -> version of the parameters it holds
        self.waiting: list[int] = []  # workers whose pull is not answered yet, in order
        self.peers = [_Peer(channel=comm.MeshChannel(mesh, axis, servers + w))  # members S..
                      for w in range(mesh.size(axis) - servers)]
        self.worker_steps = [0] * len(self.peers)  # per worker: one after its last step that arrived
        self.max_nonfinite: int | None = None  # build_server() sets it
        self.nonfinite_in_a_row = 0
        self.aborted: str | None = None
        self.inbox = Inbox()

    def run(self) -> ServerResult:
        """Serve to the end, calling `on_update` after every update."""
        for _ in self.updates():
            if self.on_update is not None:
                self.on_update(self)  # may lower total_updates to version: the run then stops
        return self.result()

    def updates(self) -> Iterator[None]:
        """Serve until every worker is done or lost, yielding after each update, while the
        worker whose gradient made it waits for its reply: what runs there (the run loop's
        step boundary: records, checkpoints, a stop) sees the update and may end the run by
        lowering `total_updates` to `version`."""
        for w in range(len(self.peers)):
            self._post(w, "pull", message(0), TAG_PULL)
        if self.rejoin is not None:
            self.rejoin.watch(lambda w, generation: self.inbox.report((w, generation), "rejoin"))
        try:
            while any(p.expect not in ("done", "lost") for p in self.peers):
                event = self.inbox.next(self._time_to_deadline())
                if event is not None:
                    yield from self._on_event(*event)
                if self._time_to_deadline() == 0.0:
                    # a deadline passed, also while events kept coming (a busy server): first
                    # serve what has already arrived, so a worker whose message waits in the
                    # queue is not dropped, then drop those still silent
                    while (queued := self.inbox.next(0)) is not None:
                        yield from self._on_event(*queued)
                    self._expire()
        finally:
            if self.rejoin is not None:
                self.rejoin.close()
        self.inbox.close()
        if self.version < self.total_updates:
            log.error("async SGD stopped after %d of %d updates: every worker was lost (%s)",
                      self.version, self.total_updates, self.lost)

    def result(self) -> ServerResult:
        return ServerResult(self.params, self.version, self.staleness, self.lost, self.reports,
                            self.membership, self.aborted, self.accumulation)

    def _post(self, w: int, expect: str, msg: Message, tag: int) -> None:
        peer = self.peers[w]
        peer.expect, peer.inbox = expect, msg
        peer.deadline = time.perf_counter() + self.timeout_s
        peer.posted = expect
        pending = peer.channel.recv(msg.buffer, tag=tag, async_op=True)
        self.inbox.watch((w, peer.generation), "recv", pending)

    def _time_to_deadline(self) -> float | None:
        deadlines = [p.deadline for p in self.peers if p.deadline is not None]
        return max(0.0, min(deadlines) - time.perf_counter()) if deadlines else None

    def _expire(self) -> None:
        now = time.perf_counter()
        for w, peer in enumerate(self.peers):
            if peer.deadline is not None and peer.deadline <= now:
                self._lose(w, f"no message within worker_timeout_s={self.timeout_s} "
                              f"(expected {peer.expect})")

    def _on_event(self, key: tuple[int, int], what: str, error: Exception | None
                  ) -> Iterator[None]:
        w, generation = key
        if what == "rejoin":  # from the rejoin host: (worker, request's generation), no error
            self._on_rejoin_request(w, generation)
            return
        peer = self.peers[w]
        if generation != peer.generation:
            return  # an op on the channel this worker had before it restarted
        if peer.expect == "lost":
            if error is not None or what != "recv":
                return  # a late failure, or stop send, of a worker already dropped
            self._readmit(w, "returned")  # its late message: it was hung, not dead
        if error is not None:
            self._lose(w, str(error))
            return
        if peer.expect == "stopping":
            peer.expect, peer.deadline = "done", None
            return
        if peer.expect == "push" and self._on_gradient(w, peer.inbox):
            yield  # an update: `updates()` hands it to its caller
        peer.expect, peer.deadline = "wait", None
        self.pulled.pop(w, None)  # it computes nothing until its next reply
        self.waiting.append(w)
        self._answer_waiting()

    def _on_gradient(self, w: int, msg: Message) -> bool:
        """Apply one PUSH through the policy; whether it made an update. The policy owns
        `msg.body`: every posted receive gets a fresh buffer, so a policy may keep the
        gradient (a gradient table)."""
        pulled_version = int(msg.header[VERSION])
        arrived_at = self.version
        update, outcome = None, "late"
        # one after its last step that arrived: where a resumed server or a restart starts it
        self.worker_steps[w] = int(msg.header[STEP]) + read_count(msg)  # it covered k steps
        if self.version < self.total_updates and not bool(torch.isfinite(msg.body).all()):
            outcome = "nonfinite"
            self._on_nonfinite(w, int(msg.header[STEP]))
        elif self.version < self.total_updates:
            self.nonfinite_in_a_row = 0
            update = self.policy.on_gradient(w, msg.body, pulled_version, self.version)
            outcome = self.policy.last_outcome
        if update is not None:
            self._apply(*update)
            self.version += 1
        self.staleness.record(w, pulled_version, arrived_at, update is not None)
        self.reports.append((read_loss(msg), outcome))
        self.accumulation.append(read_count(msg))
        log.debug("worker %d step %d: pulled v%d, arrived at v%d, %s", w,
                  int(msg.header[STEP]), pulled_version, arrived_at, outcome)
        return update is not None

    def _on_nonfinite(self, w: int, step: int) -> None:
        self.nonfinite_in_a_row += 1
        log.warning("async SGD: worker %d step %d: non-finite gradient discarded (%d in a row)",
                    w, step, self.nonfinite_in_a_row)
        if self.max_nonfinite is not None and self.nonfinite_in_a_row >= self.max_nonfinite:
            self.aborted = (f"{self.nonfinite_in_a_row} gradients in a row were non-finite "
                            f"(limit {self.max_nonfinite}) at version {self.version}")
            self.total_updates = self.version  # every worker gets its stop

    def _apply(self, direction: torch.Tensor, lr_scale: float) -> None:
        """params <- params - lr * lr_scale * direction, or the optimizer's step on it, with
        lr from the schedule at the current version (the constant `lr` without one)."""
        lr = self.lr if self.lr_schedule is None else self.lr_schedule(self.version)
        self.last_lr = lr
        if self.optimizer is None:
            self.params.add_(direction, alpha=-lr * lr_scale)
            return
        self.params.grad.copy_(direction)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * lr_scale
        self.optimizer.step()

    def _answer_waiting(self) -> None:
        """Reply to every waiting worker the policy lets start (all of them once stopping)."""
        stopping = self.version >= self.total_updates
        for w in list(self.waiting):
            if stopping or self.policy.may_start(w, self.version, dict(self.pulled)):
                self.waiting.remove(w)
                self._reply(w, stop=stopping)
        computing = any(p.expect in ("pull", "push") for p in self.peers)
        if self.waiting and not computing:
            raise RuntimeError(f"policy {type(self.policy).__name__} holds back workers "
                               f"{self.waiting} at version {self.version} while no worker "
                               f"computes or is yet to pull: nothing can release them")

    def _reply(self, w: int, stop: bool) -> None:
        """PARAMS to worker w (stop: the last one), after posting the receive of its PUSH."""
        if not stop:
            self.pulled[w] = self.version
            self._post(w, "push", message(self.params.numel()), TAG_PUSH)
        reply = message(self.params.numel())
        write_header(reply, self.version, self.worker_steps[w], stop=stop)
        reply.body.copy_(self.params)
        peer = self.peers[w]
        if peer.sending is not None:
            # the PUSH that came since proves the worker read the previous PARAMS: at once
            peer.sending.wait()
        peer.sending = peer.channel.send(reply.buffer, tag=TAG_PARAMS, async_op=True)
        if stop:  # watched: its completion (the worker read it) ends this worker
            peer.expect, peer.deadline = "stopping", time.perf_counter() + self.timeout_s
            self.inbox.watch((w, peer.generation), "send", peer.sending)

    def state_dict(self) -> dict:
        """What a resumed server needs besides its parameters and optimizer (the caller saves
        those): the version (the lr schedule's position too), each worker's step and the
        policy's state. Plain ints and lists, and the policy's tensors."""
        return {"version": self.version, "worker_steps": list(self.worker_steps),
                "policy": self.policy.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Before `run`. The policy refuses a state of another policy or number of workers."""
        self.policy.load_state_dict(state["policy"])
        self.version = int(state["version"])
        self.worker_steps = [int(s) for s in state["worker_steps"]]

    def _lose(self, w: int, reason: str) -> None:
        peer = self.peers[w]
        peer.expect, peer.deadline = "lost", None
        self.lost[w] = reason
        self.membership.append(Membership(w, "lost", self.version, len(self.staleness.arrivals)))
        self.pulled.pop(w, None)
        if hasattr(self.policy, "on_lost"):  # e.g. a gradient table forgetting the worker
            self.policy.on_lost(w)
        if w in self.waiting:
            self.waiting.remove(w)
        log.warning("async SGD: worker %d (%s) lost at version %d: %s", w, peer.channel.name,
                    self.version, reason)
        if any(p.expect not in ("done", "lost") for p in self.peers):
            self._answer_waiting()  # a policy may have been holding others back for it

    def _readmit(self, w: int, event: str) -> None:
        """Worker w, lost, is live again ("returned" | "restarted"); its receive is posted."""
        peer = self.peers[w]
        peer.expect = peer.posted
        peer.deadline = time.perf_counter() + self.timeout_s
        self.membership.append(Membership(w, event, self.version, len(self.staleness.arrivals)))
        if hasattr(self.policy, "on_rejoin"):  # e.g. a gradient table taking it back
            self.policy.on_rejoin(w)
        log.warning("async SGD: worker %d (%s) rejoined (%s) at version %d", w,
                    peer.channel.name, event, self.version)

    def _on_rejoin_request(self, w: int, generation: int) -> None:
        """A new process asks to be worker w (docs/async.md): refuse, or build its channel,
        readmit w and post its PULL."""
        refusal = self._rejoin_refusal(w)
        if refusal is not None:
            self.rejoin.refuse(w, generation, refusal)
            log.warning("async SGD: refused a rejoin as worker %d: %s", w, refusal)
            return
        peer = self.peers[w]
        try:
            channel = self.rejoin.accept(w, generation, {"step": self.worker_steps[w],
                                                         "version": self.version},
                                         self.mesh.meter, self.axis)
        except comm.PairError as err:
            log.warning("async SGD: worker %d's rejoin failed; it stays lost: %s", w, err)
            return
        peer.channel, peer.generation, peer.sending = channel, generation, None
        self._post(w, "pull", message(0), TAG_PULL)
        self._readmit(w, "restarted")

    def _rejoin_refusal(self, w: int) -> str | None:
        if not 0 <= w < len(self.peers):
            return f"worker {w} does not exist: this run has workers 0..{len(self.peers) - 1}"
        state = self.peers[w].expect
        if state != "lost":
            what = "has finished" if state in ("stopping", "done") else "is alive"
            return (f"worker {w} {what}: only a worker the server has lost may rejoin (a dead "
                    f"process is lost at once, a silent one after worker_timeout_s="
                    f"{self.timeout_s})")
        if self.version >= self.total_updates:
            return f"the run is stopping (all {self.total_updates} updates are applied)"
        return None


def serve(mesh, params: torch.Tensor, policy, **options) -> ServerResult:
    """`build_server(...).run()`: serve to the end, calling `on_update` after each update."""
    return build_server(mesh, params, policy, **options).run()


def build_server(mesh, params: torch.Tensor, policy, *, lr: float, total_updates: int,
                 worker_timeout_s: float = 60.0, axis: str = "world", optimizer=None,
                 lr_schedule: Callable[[int], float] | None = None,
                 on_update: Callable[[ParameterServer], None] | None = None,
                 rejoin: comm.PairHost | None = None, state: dict | None = None,
                 max_nonfinite: int | None = None, servers: int = 1) -> ParameterServer:
    """The parameter server of member 0 of `axis`, to serve (`run()` or `updates()`) until
    `total_updates` updates are applied; members 1.. run `worker.run_worker`. `params`: the initial parameters (copied,
    flattened to fp32). `servers`: with S > 1 the parameters are sharded (shard.py): this is
    server s, member s < S, `params` is its slice, and its workers are members S..; the
    others run `serve` on their slices. `policy`: has `may_start(worker, version, pulled)` and
    `on_gradient(worker, grad, pulled_version, version)` (policies.py). Protocol, stopping and
    failure semantics: docs/async.md.

    `optimizer`: a torch optimizer whose parameters are views into `params` (a flat fp32
    tensor, then used in place, not copied) and whose gradients are views into `params.grad`;
    each update writes the direction there and steps with every group's lr = lr x lr_scale.
    `lr_schedule(version)`: the lr of the update made at `version` (default: `lr`).
    `on_update(server)`: called by `run()` after every update (metrics, evaluation,
    checkpoints); it may end the run early by setting `server.total_updates = server.version`. `state`: a
    `ParameterServer.state_dict()` to resume from (with `params` and `optimizer` restored by
    the caller); `total_updates` then counts from version 0 as before, not from the state's.
    `max_nonfinite`: end the run after this many non-finite gradients in a row (None: never).
    `rejoin`: a comm.PairHost whose address the caller has published: restarted workers ask it
    for a lost worker's place (docs/async.md); serve watches it and closes it at the end."""
    if optimizer is not None and (params.dim() != 1 or params.dtype != torch.float32
                                  or params.grad is None or params.grad.shape != params.shape):
        raise ValueError("with an optimizer, params must be a flat fp32 tensor whose .grad is a "
                         "flat buffer of the same size (the optimizer's gradients view into it)")
    if total_updates < 1 or lr <= 0 or worker_timeout_s <= 0:
        raise ValueError(f"total_updates={total_updates} must be >= 1, lr={lr} and "
                         f"worker_timeout_s={worker_timeout_s} must be > 0")
    if mesh.size(axis) <= servers or not 0 <= mesh.local_rank(axis) < servers:
        raise ValueError(f"serve runs on members 0..{servers - 1} of axis {axis!r} (servers="
                         f"{servers}) with at least one worker; this is member "
                         f"{mesh.local_rank(axis)} of {mesh.size(axis)}")
    if rejoin is not None and servers > 1:
        raise ValueError("rejoin with servers > 1 is not supported: a restarted worker pairs "
                         "with one server, and needs every server's slice")
    server = ParameterServer(mesh, axis, params, policy, lr, total_updates, worker_timeout_s,
                             optimizer, lr_schedule, on_update, rejoin, servers)
    server.max_nonfinite = max_nonfinite
    if state is not None:
        server.load_state_dict(state)
    return server
