"""Sharded parameter servers: S server ranks each own a contiguous slice of the flat parameters
(`shard_bounds`, pure), serve it on their own and meet only at the end, when server 0 gathers
the whole model. Layout, protocol, costs and limits: docs/async.md, "Sharded servers".
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate

import torch

from loomtrain import comm
from loomtrain.asyncsgd.protocol import STOP, TAG_SLICE, VERSION, message, write_header


def shard_bounds(sizes: Sequence[int], servers: int) -> list[tuple[int, int]]:
    """[(start, stop)] of each server's slice of the flat vector whose parameters have the
    numels `sizes`, in order (docs/async.md). ValueError if there are fewer
    parameters than servers."""
    if servers < 1 or any(n < 1 for n in sizes):
        raise ValueError(f"servers={servers} must be >= 1 and every parameter non-empty")
    if len(sizes) < servers:
        raise ValueError(f"async.servers={servers}: the model has only {len(sizes)} parameter "
                         "tensors, and each server owns at least one")
    ends = list(accumulate(sizes))  # ends[i]: the boundary after parameter i
    total, cuts = ends[-1], [0]
    previous = -1  # the parameter index of the previous cut
    for s in range(1, servers):
        lo, hi = previous + 1, len(sizes) - (servers - s) - 1  # leaves each slice a parameter
        target = s * total / servers
        i = bisect_left(ends, target)
        candidates = {min(max(j, lo), hi) for j in (i - 1, i)}
        previous = min(candidates, key=lambda j: (abs(ends[j] - target), j))
        cuts.append(ends[previous])
    cuts.append(total)
    return list(zip(cuts[:-1], cuts[1:]))


def owned_parameters(params: Sequence[torch.nn.Parameter], bounds: tuple[int, int]) -> list:
    """The parameters (in flat order) whose elements lie in `bounds`: one server's."""
    offsets = [0, *accumulate(p.numel() for p in params)]
    return [p for p, at in zip(params, offsets) if bounds[0] <= at < bounds[1]]


def server_slice(flat: torch.Tensor, bounds: tuple[int, int]) -> torch.Tensor:
    """A view of `flat` over `bounds`, its `.grad` the same view of `flat.grad`: what `serve`
    takes with an optimizer over the parameters it holds."""
    view = flat[bounds[0]:bounds[1]]
    view.grad = flat.grad[bounds[0]:bounds[1]]
    return view


def send_final(mesh, axis: str, params: torch.Tensor, version: int, aborted: bool) -> None:
    """Server s >= 1, after serving: its final slice to server 0 (blocking)."""
    msg = message(params.numel())
    write_header(msg, version, stop=aborted)
    msg.body.copy_(params)
    comm.send(msg.buffer, mesh, axis, 0, tag=TAG_SLICE)


def gather_final(mesh, axis: str, flat: torch.Tensor, bounds: list[tuple[int, int]]
                 ) -> list[tuple[int, bool]]:
    """Server 0, after serving: every other server's final slice into `flat`; returns their
    (version, aborted), servers 1..S-1 in order. Waits for each (at most the process-group
    timeout for a server still serving)."""
    out = []
    for s, (start, stop) in enumerate(bounds[1:], start=1):
        msg = message(stop - start)
        comm.recv(msg.buffer, mesh, axis, s, tag=TAG_SLICE)
        flat[start:stop].copy_(msg.body)
        out.append((int(msg.header[VERSION]), bool(msg.header[STOP])))
    return out
