"""An asynchronous SGD worker: pull, compute a gradient, push, until the server says stop.

The worker side of server.py (protocol in protocol.py): one PULL, then per step it receives
PARAMS (version v), calls `grad_fn(params, step)` and sends PUSH (the gradient, v and the
loss grad_fn reports, if any). It never talks to another worker. It blocks only on its own reply, for as long as the server's policy
holds it back or the server is busy.

Its steps start where the server's first reply says (header word STEP: 0 in a fresh run; after
a resume, the gradients the server had received from this worker, asyncsgd/state.py).

Failure semantics: if the server dies, the next send or receive raises `comm.CollectiveError`
(at once for a closed connection, after the process-group timeout for a silent server). A
worker the server has dropped as lost (too slow for `worker_timeout_s`) is readmitted when its
late PUSH arrives (server.py) and goes on; if the run has ended meanwhile, or another process
has rejoined in its place, it gets no reply and fails the same way, at the process-group
timeout at the latest. A restarted worker talks to the server over a pair channel
(asyncsgd/rejoin.py) and runs this same loop on it.

Costs per step: sends 24 + 4 x numel bytes (counted in `mesh.meter` as op "send"), receives the
same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loomtrain import comm
from loomtrain.asyncsgd.protocol import (
    STEP,
    STOP,
    TAG_PARAMS,
    TAG_PULL,
    TAG_PUSH,
    VERSION,
    message,
    write_header,
    write_loss,
)


@dataclass
class WorkerResult:
    params: torch.Tensor  # the final parameters, sent with the stop
    version: int  # the server's version at the stop
    steps: int  # gradients this worker pushed (from the step the server started it at)


GradFn = Callable[[torch.Tensor, int], "torch.Tensor | tuple[torch.Tensor, float]"]


def run_worker(mesh, grad_fn: GradFn, numel: int, *, axis: str = "world",
               channel=None) -> WorkerResult:
    """Work for the server on member 0 of `axis` until it sends stop.

    `grad_fn(params, step)`: the gradient (numel values, any float dtype, sent as fp32) of this
    worker's loss at the flat fp32 `params` on its batch number `step`, or (gradient, loss):
    the loss then travels in the PUSH header (protocol.py) to the server's metrics. `params` is
    this worker's own copy: grad_fn may keep it or write into it. `step` starts where the
    server's first reply says (0 in a fresh run; past it from a resumed server, or for a
    restarted worker one after its last gradient that arrived) and counts up. `channel`: talk
    to the server over this comm channel instead of (mesh, axis) (a restarted worker's
    comm.PairChannel; mesh is then not used)."""
    if channel is None:
        if mesh.local_rank(axis) == 0:
            raise ValueError(f"member 0 of axis {axis!r} is the parameter server, not a worker")
        channel = comm.MeshChannel(mesh, axis, 0)
    pull = message(0)
    write_header(pull, version=-1)
    channel.send(pull.buffer, tag=TAG_PULL)
    step = start = None
    while True:
        reply = message(numel)
        channel.recv(reply.buffer, tag=TAG_PARAMS)
        version = int(reply.header[VERSION])
        if step is None:
            step = start = int(reply.header[STEP])
        if reply.header[STOP]:
            return WorkerResult(reply.body, version, step - start)
        push = message(numel)
        out = grad_fn(reply.body, step)
        grad, loss = out if isinstance(out, tuple) else (out, None)
        push.body.copy_(grad.reshape(-1))
        write_header(push, version, step)
        write_loss(push, loss)
        # the server always has this worker's receive posted, so the send does not wait on it
        channel.send(push.buffer, tag=TAG_PUSH)
        step += 1

