"""The asynchronous parameter server: applies each worker's gradient the moment it arrives.

Keuper & Pfreundt (arXiv 1510.01155) and the asynchronous SGD they survey: workers pull the
parameters, compute a gradient on their own batch, push it; the server applies it at once,
    params <- params - lr * lr_scale * direction,    version <- version + 1,
where the policy (policies.py) turns the gradient into (direction, lr_scale) or drops it, and
may hold a worker back before it starts a step (bounded staleness). Plain SGD on one flat fp32
buffer by default; with an `optimizer` (the trainer's AdamW or SGD over views into that buffer)
the direction becomes the buffer's gradient and the optimizer steps at lr x lr_scale instead.
The staleness of an arrival is (version when it arrived) - (version it was pulled at).

Protocol and message layout: protocol.py. The server keeps exactly one posted receive per live
worker (PULL first, then PUSH) and serves the completions in the order they happen; it never
joins a barrier or a collective, so a slow worker delays only itself. It sleeps on the inbox
(protocol.Inbox) until a message arrives or the earliest worker deadline passes: no polling.
Measured (2 shared cores, gloo on loopback): with one worker taking 50 ms per gradient the
server used 2% of a core; with instant gradients and 16 parameters a round trip (PUSH, apply,
PARAMS) took 1.6 ms at one worker, and three workers together got one update per 0.5 ms.

Stopping: once `total_updates` updates are applied, every worker gets a PARAMS reply with
stop = 1 (holding the final parameters) at its next push or pull; gradients that arrive after
the last update are logged with applied = False. The run returns when every worker has been
sent its stop and has read it, or is lost.

Failure semantics: a worker is lost when its receive fails (its process died: gloo reports
"Connection closed by peer" at once), or when it sends nothing within `worker_timeout_s` of
the server expecting it to (it hung; the deadline runs from the PARAMS reply, so it must cover
one gradient computation). A lost worker is logged, dropped from the policy's `pulled` map,
and never waited for or answered again; its posted receive stays posted, so one process group
serves one run when a worker was lost. A policy with `on_lost(worker)` is told. If every worker
is lost the run returns early, with fewer than `total_updates` updates (the result says so).

Costs per applied gradient: one PUSH received and one PARAMS sent, 32 + 4 x numel bytes each
way (`mesh.meter`: the server's sends are counted there; receives send nothing). The PUSH's
loss rides in its header (protocol.py): no extra bytes. A PUSH may hold the mean of k
gradients (its header says k; worker.py); the policy treats it as one gradient, and the server
only records k (`accumulation`, for the metrics' tokens).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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


@dataclass
class ServerResult:
    params: torch.Tensor  # the final flat fp32 parameters
    version: int  # updates applied
    staleness: StalenessLog  # every gradient received, in arrival order
    lost: dict[int, str] = field(default_factory=dict)  # worker -> why it was dropped
    # per arrival, in the staleness log's order: (the loss its worker reported, the outcome:
    # "applied" | "held" | "discarded" (the policy's word) | "late" (after the last update))
    reports: list[tuple[float, str]] = field(default_factory=list)
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


class ParameterServer:
    """Server loop state; `serve()` is the entry point."""

    def __init__(self, mesh, axis: str, params: torch.Tensor, policy, lr: float,
                 total_updates: int, worker_timeout_s: float, optimizer=None,
                 lr_schedule: Callable[[int], float] | None = None,
                 on_update: Callable[["ParameterServer"], None] | None = None):
        self.mesh, self.axis, self.policy, self.lr = mesh, axis, policy, lr
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
        self.pulled: dict[int, int] = {}  # live worker -> version of the parameters it holds
        self.waiting: list[int] = []  # workers whose pull is not answered yet, in order
        self.peers = [_Peer() for _ in range(mesh.size(axis) - 1)]
        self.inbox = Inbox()

    def run(self) -> ServerResult:
        for w in range(len(self.peers)):
            self._post(w, "pull", message(0), TAG_PULL)
        while any(p.expect not in ("done", "lost") for p in self.peers):
            event = self.inbox.next(self._time_to_deadline())
            if event is None:
                self._expire()
            else:
                self._on_event(*event)
        self.inbox.close()
        if self.version < self.total_updates:
            log.error("async SGD stopped after %d of %d updates: every worker was lost (%s)",
                      self.version, self.total_updates, self.lost)
        return ServerResult(self.params, self.version, self.staleness, self.lost, self.reports,
                            self.accumulation)

    def _post(self, w: int, expect: str, msg: Message, tag: int) -> None:
        peer = self.peers[w]
        peer.expect, peer.inbox = expect, msg
        peer.deadline = time.perf_counter() + self.timeout_s
        pending = comm.recv(msg.buffer, self.mesh, self.axis, w + 1, async_op=True, tag=tag)
        self.inbox.watch(w, "recv", pending)

    def _time_to_deadline(self) -> float | None:
        deadlines = [p.deadline for p in self.peers if p.deadline is not None]
        return max(0.0, min(deadlines) - time.perf_counter()) if deadlines else None

    def _expire(self) -> None:
        now = time.perf_counter()
        for w, peer in enumerate(self.peers):
            if peer.deadline is not None and peer.deadline <= now:
                self._lose(w, f"no message within worker_timeout_s={self.timeout_s} "
                              f"(expected {peer.expect})")

    def _on_event(self, w: int, what: str, error: Exception | None) -> None:
        peer = self.peers[w]
        if peer.expect == "lost":
            return  # a late completion (or failure) of a worker already dropped
        if error is not None:
            self._lose(w, str(error))
            return
        if peer.expect == "stopping":
            peer.expect, peer.deadline = "done", None
            return
        if peer.expect == "push":
            self._on_gradient(w, peer.inbox)
        peer.expect, peer.deadline = "wait", None
        self.pulled.pop(w, None)  # it computes nothing until its next reply
        self.waiting.append(w)
        self._answer_waiting()

    def _on_gradient(self, w: int, msg: Message) -> None:
        """Apply one PUSH through the policy. The policy owns `msg.body`: every posted receive
        gets a fresh buffer, so a policy may keep the gradient (a gradient table)."""
        pulled_version = int(msg.header[VERSION])
        arrived_at = self.version
        update, outcome = None, "late"
        if self.version < self.total_updates:
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
        if update is not None and self.on_update is not None:
            self.on_update(self)  # may lower total_updates to version: the run then stops

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
        write_header(reply, self.version, stop=stop)
        reply.body.copy_(self.params)
        peer = self.peers[w]
        if peer.sending is not None:
            # the PUSH that came since proves the worker read the previous PARAMS: at once
            peer.sending.wait()
        peer.sending = comm.send(reply.buffer, self.mesh, self.axis, w + 1, async_op=True,
                                 tag=TAG_PARAMS)
        if stop:  # watched: its completion (the worker read it) ends this worker
            peer.expect, peer.deadline = "stopping", time.perf_counter() + self.timeout_s
            self.inbox.watch(w, "send", peer.sending)

    def _lose(self, w: int, reason: str) -> None:
        peer = self.peers[w]
        peer.expect, peer.deadline = "lost", None
        self.lost[w] = reason
        self.pulled.pop(w, None)
        if hasattr(self.policy, "on_lost"):  # e.g. a gradient table forgetting the worker
            self.policy.on_lost(w)
        if w in self.waiting:
            self.waiting.remove(w)
        log.warning("async SGD: worker %d (rank %d) lost at version %d: %s", w,
                    self.mesh.group_ranks(self.axis)[w + 1], self.version, reason)
        if any(p.expect not in ("done", "lost") for p in self.peers):
            self._answer_waiting()  # a policy may have been holding others back for it


def serve(mesh, params: torch.Tensor, policy, *, lr: float, total_updates: int,
          worker_timeout_s: float = 60.0, axis: str = "world", optimizer=None,
          lr_schedule: Callable[[int], float] | None = None,
          on_update: Callable[[ParameterServer], None] | None = None) -> ServerResult:
    """Run the parameter server on member 0 of `axis` until `total_updates` updates are
    applied; members 1.. run `worker.run_worker`. `params`: the initial parameters (copied,
    flattened to fp32). `policy`: has `may_start(worker, version, pulled)` and
    `on_gradient(worker, grad, pulled_version, version)` (policies.py). Protocol, stopping and
    failure semantics: the module docstring.

    `optimizer`: a torch optimizer whose parameters are views into `params` (a flat fp32
    tensor, then used in place, not copied) and whose gradients are views into `params.grad`;
    each update writes the direction there and steps with every group's lr = lr x lr_scale.
    `lr_schedule(version)`: the lr of the update made at `version` (default: `lr`).
    `on_update(server)`: called after every update (metrics, evaluation); it may end the run
    early by setting `server.total_updates = server.version`."""
    if optimizer is not None and (params.dim() != 1 or params.dtype != torch.float32
                                  or params.grad is None or params.grad.shape != params.shape):
        raise ValueError("with an optimizer, params must be a flat fp32 tensor whose .grad is a "
                         "flat buffer of the same size (the optimizer's gradients view into it)")
    if total_updates < 1 or lr <= 0 or worker_timeout_s <= 0:
        raise ValueError(f"total_updates={total_updates} must be >= 1, lr={lr} and "
                         f"worker_timeout_s={worker_timeout_s} must be > 0")
    if mesh.size(axis) < 2 or mesh.local_rank(axis) != 0:
        raise ValueError(f"serve runs on member 0 of axis {axis!r} with at least one worker; "
                         f"this is member {mesh.local_rank(axis)} of {mesh.size(axis)}")
    server = ParameterServer(mesh, axis, params, policy, lr, total_updates, worker_timeout_s,
                             optimizer, lr_schedule, on_update)
    return server.run()
