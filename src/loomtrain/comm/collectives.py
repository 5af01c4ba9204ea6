"""The collectives loomtrain uses: thin wrappers over torch.distributed with byte accounting.

Every op takes the mesh and the axis it runs on, counts its bytes in `mesh.meter`, records
itself as this rank's last collective and turns a failure into `CollectiveError`; across
nodes, a simulated slow link (comm/link.py) delays it. Details: docs/comm.md.
"""

from __future__ import annotations

import contextlib
import threading
import time
import zlib

import torch
import torch.distributed as dist

from loomtrain.comm import ring
from loomtrain.comm.meter import wire_bytes

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

# Every op runs eagerly inside a compiled function (train.compile, parallel/compile.py): dynamo
# stops its graph at the call (a graph break) and resumes after it, so the op is counted, timed
# and checked here exactly as in an eager run. Traced, dynamo would try the accounting's Python
# (the meter, the clock, the ring tags) and break at an arbitrary line of it instead. This is
# torch.compiler.disable in torch's own lazy form (torch/_compile.py, what torch.optim uses):
# dynamo is imported on the first call, not here, so that a process that never runs a
# collective (the dry run, the planner) does not spend the seconds importing it takes.
_eager = torch._disable_dynamo


class _Shapes(threading.local):
    only = False


_SHAPES = _Shapes()


@contextlib.contextmanager
def shapes_only():
    """Collectives move and count nothing inside: a model run on the meta device for its
    shapes alone (the pipeline's split), whose collectives the run itself never makes."""
    previous, _SHAPES.only = _SHAPES.only, True
    try:
        yield
    finally:
        _SHAPES.only = previous


class CollectiveError(RuntimeError):
    """A collective that failed or did not complete within the process-group timeout.

    `named`: the message names the rank that caused it (the heartbeat's finding, the same text
    on every rank that found it), not only this rank's failed op; `code`: the exit code it
    calls for (4; 1 when the named rank died without a message; a cause a peer left with
    keeps its own)."""

    def __init__(self, message: str, code: int = 4, named: bool = False):
        super().__init__(message)
        self.code, self.named = code, named


def _fail(mesh, op: str, axis: str, err: Exception) -> CollectiveError:
    explain = mesh.activity.explain  # the heartbeat's, while it runs (comm/heartbeat.py)
    found = explain(axis) if explain is not None else None
    if found is not None and found.cause:
        return CollectiveError(found.text, found.code, named=True)
    heartbeats = f" Heartbeats: {found.text}." if found is not None else ""
    return CollectiveError(
        f"rank {mesh.rank}: collective {op} on mesh axis {axis!r} (ranks "
        f"{mesh.group_ranks(axis)}) failed or did not complete within the timeout: a peer "
        f"crashed, hung, or issued a different collective. Cause: {err}{heartbeats}"
    )


class Pending:
    """An asynchronous op in flight; `wait()` blocks and reports failures by name.

    `due`: the perf_counter time before which the op is not complete on the simulated slow
    link (None: no link, or a node-local op)."""

    def __init__(self, work, mesh, op: str, axis: str, on_done=None, due: float | None = None,
                 seq: int = 0, peers: list[int] | None = None):
        self._work, self._mesh, self._op, self._axis = work, mesh, op, axis
        self._on_done, self._due = on_done, due
        self._seq, self._peers = seq, peers  # for comm/activity.py: which op, waiting for whom

    def when_done(self, fn) -> None:
        """Call `fn(t)` with `time.perf_counter()` at the moment the op completes (on the thread
        that completes it), for measured timelines; at once if it already has. Under a simulated
        link `t` is the simulated completion, which may lie after the call."""
        if self._due is not None:
            fn = _not_before(fn, self._due)
        work = self._work
        if work is None:
            fn(time.perf_counter())
        elif isinstance(work, ring.RingWork):
            work.when_done(fn)
        else:
            try:
                work.get_future().then(lambda _: fn(time.perf_counter()))
            except RuntimeError:  # gloo's reduce_scatter work has no future: a watcher waits
                threading.Thread(target=_report_done, args=(work, fn), daemon=True).start()

    def wait(self) -> None:
        if self._work is not None:
            activity = self._mesh.activity
            activity.block(self._axis, self._op, self._seq, self._peers)
            try:
                self._work.wait()
            except RuntimeError as err:
                raise _fail(self._mesh, self._op, self._axis, err) from None
            finally:
                activity.unblock()
            self._work = None
        if self._due is not None:
            left = self._due - time.perf_counter()
            if left > 0:
                time.sleep(left)
                self._mesh.meter.record_link_wait(left)
            self._due = None
        if self._on_done is not None:
            self._on_done()
            self._on_done = None


def _not_before(fn, due: float):
    return lambda t: fn(max(t, due))


def _report_done(work, fn) -> None:
    try:
        work.wait()  # a second wait (the caller's) on a finished work returns at once
    except RuntimeError:
        return  # the caller's own wait reports the failure
    fn(time.perf_counter())


def _start(mesh, op: str, axis: str, payload: int, algorithm: str, call, async_op: bool,
           *, from_root: int = 0, on_done=None, link_ranks=None, on_link: bool = True,
           wire: int | None = None):
    """Count, start and (sync) wait for an op. `link_ranks`: the ranks whose nodes decide
    whether it crosses the simulated link (default: the axis group; send: the two ends).
    `on_link=False`: never delayed by the simulated link (a diagnostic). `wire`: the bytes
    this rank sends, where its data decide them rather than `algorithm`'s formula."""
    started = time.perf_counter()
    n = mesh.size(axis)
    exact = wire
    if wire is None:
        wire = wire_bytes(algorithm, payload, n, from_root=from_root)
    simulated_s, due = 0.0, None
    if mesh.link is not None and on_link:
        ranks = mesh.group_ranks(axis) if link_ranks is None else link_ranks
        # the bytes of the rank that sends the most: this rank's own in every algorithm but
        # the broadcast's tree, which is paced by its root (comm/link.py)
        on_link = wire_bytes(algorithm, payload, n) if exact is None else exact
        simulated_s = mesh.link.delay_s(ranks, on_link)
        due = mesh.link.due(started, ranks, on_link)
        if mesh.link.crosses_nodes(ranks):
            mesh.meter.inter_node_bytes += wire
    mesh.meter.record(axis, op, payload, wire, simulated_s=simulated_s)
    mesh.meter.last_op = f"{op} on {axis} ({payload} bytes)"
    seq = mesh.activity.enter(axis, op)
    try:
        work = call(mesh.group(axis))
    except RuntimeError as err:
        raise _fail(mesh, op, axis, err) from None
    peers = mesh.group_ranks(axis) if link_ranks is None else list(link_ranks)
    pending = Pending(work, mesh, op, axis, on_done, due, seq, peers)
    if async_op:
        return pending
    pending.wait()
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@_eager
def all_reduce(tensor: torch.Tensor, mesh, axis: str, op: str = "sum", async_op: bool = False,
               diagnostic: bool = False):
    """In-place all-reduce of `tensor` over `axis` (ring: 2(N-1)/N x S on the wire).

    `diagnostic`: a measurement outside the algorithm (compression's error against the dense
    sum): counted apart, as op "all_reduce_diagnostic", and never delayed by the simulated link.
    """
    name = "all_reduce_diagnostic" if diagnostic else "all_reduce"
    if mesh.size(axis) == 1 or _SHAPES.only:
        return _nothing(mesh, name, axis, async_op)
    return _start(
        mesh, name, axis, _nbytes(tensor), "ring_all_reduce",
        lambda g: dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=g, async_op=True),
        async_op, on_link=not diagnostic,
    )


@_eager
def broadcast(tensor: torch.Tensor, mesh, axis: str, src_local: int = 0, async_op: bool = False,
              name: str = "broadcast"):
    """Broadcast from the axis member with local index `src_local` (gloo: a binomial tree).
    `name`: the op it is counted as in the meter (a technique's own traffic, "mask_sync")."""
    n = mesh.size(axis)
    if n == 1 or _SHAPES.only:
        return _nothing(mesh, name, axis, async_op)
    ranks = mesh.group_ranks(axis)
    return _start(
        mesh, name, axis, _nbytes(tensor), "tree_broadcast",
        lambda g: dist.broadcast(tensor, src=ranks[src_local], group=g, async_op=True),
        async_op, from_root=(mesh.local_rank(axis) - src_local) % n,
    )


@_eager
def send(tensor: torch.Tensor, mesh, axis: str, dst_local: int, async_op: bool = False,
         tag: int = 0):
    """Point-to-point send to the axis member with local index `dst_local`. gloo matches a
    send to the receive with the same `tag`; NCCL ignores tags and matches in order."""
    dst = mesh.group_ranks(axis)[dst_local]
    return _start(
        mesh, "send", axis, _nbytes(tensor), "send",
        lambda g: dist.isend(tensor, dst=dst, group=g, tag=tag), async_op,
        link_ranks=(mesh.rank, dst),
    )


@_eager
def recv(tensor: torch.Tensor, mesh, axis: str, src_local: int, async_op: bool = False,
         tag: int = 0):
    """Point-to-point receive from the axis member with local index `src_local` (sends nothing;
    on the simulated link it takes as long as the matching send: its bytes are the sender's,
    queued on the sender's link, not this rank's)."""
    started = time.perf_counter()
    src = mesh.group_ranks(axis)[src_local]
    mesh.meter.last_op = f"recv on {axis} ({_nbytes(tensor)} bytes)"
    seq = mesh.activity.enter(axis, "recv")
    due = None
    if mesh.link is not None:
        simulated_s = mesh.link.delay_s((src, mesh.rank), _nbytes(tensor))
        if simulated_s:
            mesh.meter.record_simulated(axis, "recv", simulated_s)
            due = started + simulated_s
    try:
        work = dist.irecv(tensor, src=src, group=mesh.group(axis), tag=tag)
    except RuntimeError as err:
        raise _fail(mesh, "recv", axis, err) from None
    pending = Pending(work, mesh, "recv", axis, due=due, seq=seq, peers=[src])
    if async_op:
        return pending
    pending.wait()
    return None


def barrier(mesh, axis: str = "world") -> None:
    """A barrier as a one-element all-reduce, so it obeys the same timeout and error path."""
    all_reduce(torch.zeros(1, device=mesh.device), mesh, axis)


# --- all-gather, reduce-scatter, all-to-all: native gloo, or the send/recv rings of ring.py ---
# Tensors are contiguous; all-gather's output, reduce-scatter's input and both all-to-all
# tensors hold N equal chunks in group order. Wire bytes measured per rank (docs/comm.md):
# native all-gather and all-to-all send (N-1)/N x S like the rings; native reduce-scatter
# sends 2(N-1)/N x S (a clone plus a full all-reduce), the ring (N-1)/N x S.

IMPLS = ("auto", "native", "ring")

# Measured 2026-12-02 with benchmarks/collectives.py: 2 cores shared with other jobs, loopback,
# worlds 2 and 4, three runs (tables in docs/comm.md). The rule: use the ring from the smallest
# size at which the median over runs of ring_ms / native_ms is below 0.9 in both worlds, and
# stays below at every larger size measured (up to 16 MiB); runs swing by more than 10%.
# - reduce_scatter (the ring sends half the bytes): medians 0.78/0.78 (world 2/4) at 256 KiB,
#   0.47/0.67 at 1 MiB, 0.51/0.54 at 4 MiB, 0.43/0.50 at 16 MiB; at 64 KiB and below the
#   ring's N-1 Python-driven steps lose at world 2 (2.3-4.1x).
# - all_gather (same bytes either way): the ring only from 16 MiB, 0.71/0.83; at 4 MiB
#   0.79/0.93; below 1 MiB its medians are 1.7-3.7x native's.
# - all_to_all: never; 0.98/1.01 at 16 MiB, medians 1.8-5.4x native's below 4 MiB.
RING_MIN_BYTES = {"reduce_scatter": 256 << 10, "all_gather": 16 << 20}


def choose_impl(op: str, payload_bytes: int, n: int) -> str:
    """The implementation `impl="auto"` runs for `op` over `n` ranks covering `payload_bytes`.

    Measured at n = 2 and 4 only; the same thresholds are used for every n.
    """
    threshold = RING_MIN_BYTES.get(op)
    if threshold is not None and payload_bytes >= threshold:
        return "ring"
    return "native"


def _ring_tag(mesh, axis: str, op: str) -> int:
    """A p2p tag naming this op instance identically on every rank of the axis group.

    The mesh's own ring sequence number for (axis, op) (not the meter, which users may reset)
    is the op's instance number: every rank of a group issues the same ops on it in the same
    order, the precondition of any collective. The axis is hashed in because "dp" and
    "dp.local" share one process group on one node. gloo takes tags up to 2**31 - 1; 0 is left
    to `send`/`recv`.
    """
    seq = mesh.ring_sequence.get((axis, op), 0) + 1
    mesh.ring_sequence[(axis, op)] = seq
    return 1 + zlib.crc32(f"{axis}/{op}/{seq}".encode()) % (2**31 - 2)


def _resolve(impl: str, op: str, payload_bytes: int, n: int) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r} for {op} is not one of {IMPLS}")
    return choose_impl(op, payload_bytes, n) if impl == "auto" else impl


def _check_chunks(op: str, whole: torch.Tensor, part_numel: int, n: int, *others) -> None:
    if whole.numel() != n * part_numel or not all(t.is_contiguous() for t in (whole, *others)):
        raise ValueError(f"{op} over {n} ranks needs contiguous tensors, the chunked one of "
                         f"{n} x {part_numel} elements, got {whole.numel()}; gloo refuses "
                         f"uneven chunks: pad them")


def _nothing(mesh, op: str, axis: str, async_op: bool):
    """An op with nothing to move: one rank on the axis, or a run for shapes only."""
    return Pending(None, mesh, op, axis) if async_op else None


def _alone(output: torch.Tensor, input: torch.Tensor, mesh, op: str, axis: str, async_op: bool):
    output.view(-1).copy_(input.view(-1))
    return Pending(None, mesh, op, axis) if async_op else None


def _run_chunked(mesh, axis: str, name: str, payload: int, impl: str, async_op: bool,
                 native, native_algorithm: str, ring_fn, ring_algorithm: str, tensors: tuple,
                 **ring_kwargs):
    """Start op `name` as the native gloo call `native(group)` or as `ring_fn` of ring.py, each
    counted with the formula of its own algorithm."""
    if _resolve(impl, name, payload, mesh.size(axis)) == "native":
        return _start(mesh, name, axis, payload, native_algorithm, native, async_op)
    ranks, me = mesh.group_ranks(axis), mesh.local_rank(axis)

    def call(group):
        kwargs = dict(ranks=ranks, me=me, group=group, tag=_ring_tag(mesh, axis, name), **ring_kwargs)
        return ring.start(ring_fn, tensors, kwargs, async_op)
    return _start(mesh, name, axis, payload, ring_algorithm, call, async_op)


@_eager
def all_gather(output: torch.Tensor, input: torch.Tensor, mesh, axis: str,
               async_op: bool = False, impl: str = "auto"):
    """`output` = every axis member's `input`, concatenated in group order.

    S = the gathered output; native and ring both send (N-1)/N x S.
    """
    n = mesh.size(axis)
    if _SHAPES.only:
        return _nothing(mesh, "all_gather", axis, async_op)
    if n == 1:
        return _alone(output, input, mesh, "all_gather", axis, async_op)
    _check_chunks("all_gather", output, input.numel(), n, input)

    def native(g):
        return dist.all_gather_single(output.view(-1), input.view(-1), group=g, async_op=True)
    return _run_chunked(mesh, axis, "all_gather", _nbytes(output), impl, async_op,
                        native, "ring_all_gather", ring.ring_all_gather, "ring_all_gather",
                        (output, input))


@_eager
def reduce_scatter(output: torch.Tensor, input: torch.Tensor, mesh, axis: str, op: str = "sum",
                   async_op: bool = False, impl: str = "auto"):
    """`output` = chunk (my index on `axis`) of the reduction of every member's `input`.

    S = the full input. Native gloo all-reduces the whole input and keeps a chunk, so it sends
    2(N-1)/N x S and is counted so; the ring sends (N-1)/N x S.
    """
    n = mesh.size(axis)
    if _SHAPES.only:
        return _nothing(mesh, "reduce_scatter", axis, async_op)
    if n == 1:
        return _alone(output, input, mesh, "reduce_scatter", axis, async_op)
    _check_chunks("reduce_scatter", input, output.numel(), n, output)

    def native(g):
        return dist.reduce_scatter_single(output.view(-1), input.view(-1), op=_REDUCE_OPS[op],
                                          group=g, async_op=True)
    return _run_chunked(mesh, axis, "reduce_scatter", _nbytes(input), impl, async_op,
                        native, "ring_all_reduce", ring.ring_reduce_scatter, "ring_reduce_scatter",
                        (output, input), op=op)


@_eager
def all_to_all(output: torch.Tensor, input: torch.Tensor, mesh, axis: str,
               async_op: bool = False, impl: str = "auto"):
    """Chunk j of `input` goes to member j; chunk j of `output` comes from member j.

    S = the input; native and pairwise both send (N-1)/N x S. `output` must not alias `input`.
    """
    n = mesh.size(axis)
    if _SHAPES.only:
        return _nothing(mesh, "all_to_all", axis, async_op)
    if n == 1:
        return _alone(output, input, mesh, "all_to_all", axis, async_op)
    _check_chunks("all_to_all", input, output.numel() // n, n, output)

    def native(g):
        return dist.all_to_all_single(output.view(-1), input.view(-1), group=g, async_op=True)
    return _run_chunked(mesh, axis, "all_to_all", _nbytes(input), impl, async_op,
                        native, "all_to_all", ring.pairwise_all_to_all, "all_to_all",
                        (output, input))


@_eager
def all_to_all_uneven(output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                      input_splits: list[int], mesh, axis: str) -> None:
    """An all-to-all of rows in uneven chunks (alltoallv, which gloo and NCCL both run):
    `input_splits[j]` rows (dim 0) of `input` go to member j, `output_splits[j]` rows of
    `output` come from member j. Counted with the input as payload and, as wire bytes, the
    rows this rank actually sends to the other members (the data decide the split, not a
    formula)."""
    if _SHAPES.only:
        return
    if mesh.size(axis) == 1:
        output.copy_(input)
        return
    row = _nbytes(input) // max(input.shape[0], 1)
    sent = (input.shape[0] - input_splits[mesh.local_rank(axis)]) * row
    _start(mesh, "all_to_all", axis, _nbytes(input), "all_to_all",
           lambda g: dist.all_to_all_single(output, input, output_splits, input_splits,
                                            group=g, async_op=True), False, wire=sent)
