"""An asynchronous SGD worker: pull, compute a gradient, push, until the server says stop.

The worker side of server.py (protocol.py), with gradient accumulation (adaptive.py) and
sharded servers (shard.py). Its steps, failure semantics and costs: docs/async.md, "The
parameter server and its workers" and "Sharded servers".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import accumulate

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
    params: torch.Tensor  # the final parameters, sent with the stop(s)
    version: int  # the server's version at the stop (server 0's when sharded)
    steps: int  # gradients this worker pushed (from the step the server started it at)
    versions: list[int] = field(default_factory=list)  # each server's version at its stop


GradFn = Callable[[torch.Tensor, int], "torch.Tensor | tuple[torch.Tensor, float]"]


def run_worker(mesh, grad_fn: GradFn, numel: int, **options) -> WorkerResult:
    """Work for the server on member 0 of `axis` until it sends stop (for sharded servers,
    members 0..S-1, until each has): `worker_pushes` to its end."""
    pushes = worker_pushes(mesh, grad_fn, numel, **options)
    while True:
        try:
            next(pushes)
        except StopIteration as end:
            return end.value


def worker_pushes(mesh, grad_fn: GradFn, numel: int, *, axis: str = "world",
                  channel=None, accumulation: int | AdaptiveAccumulation = 1,
                  shards: list[int] | None = None) -> Iterator[int]:
    """The worker's pushes, one at a time: it yields the gradients each averaged (k) once it is
    sent, and returns (StopIteration.value) its WorkerResult when the server(s) sent stop.

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
    push's measurements and picks the next k. `shards`: the numel of each server's slice
    (shard.shard_bounds), summing to numel: the servers are members 0..len(shards) - 1 of
    `axis` (docs/async.md); None: one server holding all."""
    shards = [numel] if shards is None else list(shards)
    if sum(shards) != numel:
        raise ValueError(f"shards={shards} must sum to numel={numel}")
    if channel is not None and len(shards) > 1:
        raise ValueError("a channel reaches one server; sharded servers need the mesh")
    if channel is None and mesh.local_rank(axis) < len(shards):
        raise ValueError(f"members 0..{len(shards) - 1} of axis {axis!r} are the parameter "
                         "servers, not workers")
    channels = [channel] if channel is not None else [
        comm.MeshChannel(mesh, axis, s) for s in range(len(shards))]
    offsets = [0, *accumulate(shards)]
    adaptive = accumulation if isinstance(accumulation, AdaptiveAccumulation) else None
    if adaptive is None and accumulation < 1:
        raise ValueError(f"accumulation={accumulation} must be >= 1")
    pull = message(0)
    write_header(pull, version=-1)
    started = time.perf_counter()
    for server in channels:
        server.send(pull.buffer, tag=TAG_PULL)
    if adaptive is not None:
        adaptive.observe_latency(time.perf_counter() - started)
    step = start = measured = None
    live = list(range(len(shards)))  # the servers that have not stopped this worker
    slices: list[torch.Tensor | None] = [None] * len(shards)
    versions = [0] * len(shards)
    while True:
        replies = {s: message(shards[s]) for s in live}
        for s, reply in replies.items():
            channels[s].recv(reply.buffer, tag=TAG_PARAMS)
        if measured is not None:  # (compute per gradient, send, its start) of the last push
            compute_s, send_s, sent_at = measured
            adaptive.observe(compute_s, send_s, time.perf_counter() - sent_at,
                             sum(reply.buffer.numel() for reply in replies.values()))
        steps = {int(reply.header[STEP]) for reply in replies.values()}
        assert len(steps) == 1, f"the servers disagree on this worker's step: {steps}"
        if step is None:
            step = start = steps.pop()
        for s, reply in replies.items():
            slices[s], versions[s] = reply.body, int(reply.header[VERSION])
        live = [s for s in live if not replies[s].header[STOP]]
        params = slices[0] if len(slices) == 1 else torch.cat(slices)
        if not live:
            return WorkerResult(params, versions[0], step - start, versions)
        k = adaptive.accumulation if adaptive is not None else accumulation
        pushes = {s: message(shards[s]) for s in live}
        gradient = pushes[0].body if len(shards) == 1 else torch.empty(numel)
        started = time.perf_counter()
        loss = _accumulate(grad_fn, params, step, k, gradient)
        computed = time.perf_counter()
        for s, push in pushes.items():
            if len(shards) > 1:
                push.body.copy_(gradient[offsets[s]:offsets[s + 1]])
            write_header(push, versions[s], step)
            write_loss(push, loss)
            write_count(push, k)
            # the server always has this worker's receive posted: the send does not wait on it
            channels[s].send(push.buffer, tag=TAG_PUSH)
        if adaptive is not None:
            measured = ((computed - started) / k, time.perf_counter() - computed, computed)
        step += k
        yield k


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

