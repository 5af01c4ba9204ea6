"""An asynchronous SGD worker: pull, compute a gradient, push, until the server says stop.

The worker side of server.py (protocol in protocol.py): one PULL, then per step it receives
PARAMS (version v), calls `grad_fn(params, step)` and sends PUSH (the gradient, v and the
loss grad_fn reports, if any). It never talks to another worker. It blocks only on its own reply, for as long as the server's policy
holds it back or the server is busy.

Its steps start where the server's first reply says (header word STEP: 0 in a fresh run; after
a resume, the step after this worker's last gradient the server had received,
asyncsgd/state.py).

Accumulation (`accumulation`: a fixed k, or an adaptive.AdaptiveAccumulation that picks k per
push from the round trips it measures): the worker calls grad_fn k times at the same pulled
parameters, on steps s .. s + k - 1 (distinct batches), and pushes the mean of the k gradients
(summed in step order, then divided by k) and of their losses; the header's count word says k.
One message each way per k gradients; with k = 1 this is the plain loop.

Failure semantics: if the server dies, the next send or receive raises `comm.CollectiveError`
(at once for a closed connection, after the process-group timeout for a silent server). A
worker the server has dropped as lost (too slow for `worker_timeout_s`) is readmitted when its
late PUSH arrives (server.py) and goes on; if the run has ended meanwhile, or another process
has rejoined in its place, it gets no reply and fails the same way, at the process-group
timeout at the latest. A restarted worker talks to the server over a pair channel
(asyncsgd/rejoin.py) and runs this same loop on it.

Costs per push (k gradients): sends 32 + 4 x numel bytes (counted in `mesh.meter` as op "send"),
receives the same; the k gradients are summed in the PUSH's own body.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loomtrain import comm
from loomtrain.asyncsgd.adaptive import AdaptiveAccumulation
from loomtrain.asyncsgd.protocol import (
    STEP,
    STOP,
    TAG_PARAMS,
    TAG_PULL,
    TAG_PUSH,
    VERSION,
    message,
    write_count,
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
               channel=None, accumulation: int | AdaptiveAccumulation = 1) -> WorkerResult:
    """Work for the server on member 0 of `axis` until it sends stop.

    `grad_fn(params, step)`: the gradient (numel values, any float dtype, sent as fp32) of this
    worker's loss at the flat fp32 `params` on its batch number `step`, or (gradient, loss):
    the loss then travels in the PUSH header (protocol.py) to the server's metrics. `params` is
    this worker's own copy: grad_fn may keep it, but must not write into it (with k > 1 the
    next call gets the same). The returned gradient is read before the next call, so grad_fn
    may reuse its buffer. `step` starts where the server's first reply says (0 in a fresh run;
    past it from a resumed server, or for a restarted worker one after its last gradient that
    arrived) and counts up. `channel`: talk to the server over this comm channel instead of
    (mesh, axis) (a restarted worker's comm.PairChannel; mesh is then not used).
    `accumulation`: gradients per push, a fixed k >= 1 or a controller that is told each
    push's measurements and picks the next k."""
    if channel is None:
        if mesh.local_rank(axis) == 0:
            raise ValueError(f"member 0 of axis {axis!r} is the parameter server, not a worker")
        channel = comm.MeshChannel(mesh, axis, 0)
    adaptive = accumulation if isinstance(accumulation, AdaptiveAccumulation) else None
    if adaptive is None and accumulation < 1:
        raise ValueError(f"accumulation={accumulation} must be >= 1")
    pull = message(0)
    write_header(pull, version=-1)
    started = time.perf_counter()
    channel.send(pull.buffer, tag=TAG_PULL)
    if adaptive is not None:
        adaptive.observe_latency(time.perf_counter() - started)
    step = start = measured = None
    while True:
        reply = message(numel)
        channel.recv(reply.buffer, tag=TAG_PARAMS)
        if measured is not None:  # (compute per gradient, send, its start) of the last push
            compute_s, send_s, sent_at = measured
            adaptive.observe(compute_s, send_s, time.perf_counter() - sent_at,
                             reply.buffer.numel())
        version = int(reply.header[VERSION])
        if step is None:
            step = start = int(reply.header[STEP])
        if reply.header[STOP]:
            return WorkerResult(reply.body, version, step - start)
        k = adaptive.accumulation if adaptive is not None else accumulation
        push = message(numel)
        started = time.perf_counter()
        loss = _accumulate(grad_fn, reply.body, step, k, push.body)
        computed = time.perf_counter()
        write_header(push, version, step)
        write_loss(push, loss)
        write_count(push, k)
        # the server always has this worker's receive posted, so the send does not wait on it
        channel.send(push.buffer, tag=TAG_PUSH)
        if adaptive is not None:
            measured = ((computed - started) / k, time.perf_counter() - computed, computed)
        step += k


def _accumulate(grad_fn: GradFn, params: torch.Tensor, step: int, k: int,
                out: torch.Tensor) -> float | None:
    """out <- the mean of grad_fn's gradients at `params` on steps step .. step + k - 1 (summed
    in step order, then / k); returns the mean of their losses (None if any reported none)."""
    losses = []
    for i in range(k):
        result = grad_fn(params, step + i)
        grad, loss = result if isinstance(result, tuple) else (result, None)
        if i == 0:
            out.copy_(grad.reshape(-1))
        else:
            out.add_(grad.reshape(-1))
        losses.append(loss)
    if k > 1:
        out.div_(k)
    return None if None in losses else sum(losses) / k

