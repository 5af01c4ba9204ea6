"""The collectives loomtrain uses: thin wrappers over torch.distributed with byte accounting.

Every op takes the mesh and the axis it runs on, records payload and wire bytes in
`mesh.meter`, remembers itself as this rank's last collective (for hang reports), and turns
a failure (a peer that never joined, a timeout) into `CollectiveError` naming the rank, the
op and the axis. On a group of one rank every op returns at once and counts nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loomtrain.comm.meter import wire_bytes

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class CollectiveError(RuntimeError):
    """A collective that failed or did not complete within the process-group timeout."""


def _fail(mesh, op: str, axis: str, err: Exception) -> CollectiveError:
    return CollectiveError(
        f"rank {mesh.rank}: collective {op} on mesh axis {axis!r} (ranks "
        f"{mesh.group_ranks(axis)}) failed or did not complete within the timeout: a peer "
        f"crashed, hung, or issued a different collective. Cause: {err}"
    )


class Pending:
    """An asynchronous op in flight; `wait()` blocks and reports failures by name."""

    def __init__(self, work, mesh, op: str, axis: str, on_done=None):
        self._work, self._mesh, self._op, self._axis = work, mesh, op, axis
        self._on_done = on_done

    def wait(self) -> None:
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as err:
                raise _fail(self._mesh, self._op, self._axis, err) from None
            self._work = None
        if self._on_done is not None:
            self._on_done()
            self._on_done = None


def _start(mesh, op: str, axis: str, payload: int, algorithm: str, call, async_op: bool,
           *, last_in_ring: bool = False, on_done=None):
    n = mesh.size(axis)
    mesh.meter.record(axis, op, payload, wire_bytes(algorithm, payload, n, last_in_ring=last_in_ring))
    mesh.meter.last_op = f"{op} on {axis} ({payload} bytes)"
    try:
        work = call(mesh.group(axis))
    except RuntimeError as err:
        raise _fail(mesh, op, axis, err) from None
    pending = Pending(work, mesh, op, axis, on_done)
    if async_op:
        return pending
    pending.wait()
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, mesh, axis: str, op: str = "sum", async_op: bool = False):
    """In-place all-reduce of `tensor` over `axis` (ring: 2(N-1)/N x S on the wire)."""
    if mesh.size(axis) == 1:
        return Pending(None, mesh, "all_reduce", axis) if async_op else None
    return _start(
        mesh, "all_reduce", axis, _nbytes(tensor), "ring_all_reduce",
        lambda g: dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=g, async_op=True),
        async_op,
    )


def broadcast(tensor: torch.Tensor, mesh, axis: str, src_local: int = 0, async_op: bool = False):
    """Broadcast from the axis member with local index `src_local` (ring: S per forwarding rank)."""
    n = mesh.size(axis)
    if n == 1:
        return Pending(None, mesh, "broadcast", axis) if async_op else None
    ranks = mesh.group_ranks(axis)
    last = (mesh.local_rank(axis) - src_local) % n == n - 1
    return _start(
        mesh, "broadcast", axis, _nbytes(tensor), "ring_broadcast",
        lambda g: dist.broadcast(tensor, src=ranks[src_local], group=g, async_op=True),
        async_op, last_in_ring=last,
    )


def send(tensor: torch.Tensor, mesh, axis: str, dst_local: int, async_op: bool = False):
    """Point-to-point send to the axis member with local index `dst_local`."""
    dst = mesh.group_ranks(axis)[dst_local]
    return _start(
        mesh, "send", axis, _nbytes(tensor), "send",
        lambda g: dist.isend(tensor, dst=dst, group=g), async_op,
    )


def recv(tensor: torch.Tensor, mesh, axis: str, src_local: int, async_op: bool = False):
    """Point-to-point receive from the axis member with local index `src_local` (sends nothing)."""
    src = mesh.group_ranks(axis)[src_local]
    mesh.meter.last_op = f"recv on {axis} ({_nbytes(tensor)} bytes)"
    try:
        work = dist.irecv(tensor, src=src, group=mesh.group(axis))
    except RuntimeError as err:
        raise _fail(mesh, "recv", axis, err) from None
    pending = Pending(work, mesh, "recv", axis)
    if async_op:
        return pending
    pending.wait()
    return None


def barrier(mesh, axis: str = "world") -> None:
    """A barrier as a one-element all-reduce, so it obeys the same timeout and error path."""
    all_reduce(torch.zeros(1, device=mesh.device), mesh, axis)
