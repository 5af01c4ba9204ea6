"""Ring reduce-scatter, ring all-gather and pairwise all-to-all built from isend/irecv.

gloo's reduce-scatter sends the bytes of a full all-reduce; the ring here sends half, as the
first half of the bandwidth-optimal ring all-reduce (Patarasuk & Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009). Tags, the async thread and
the measurements: docs/comm.md, "The rings".
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

# out= variants, so the last step can write the reduced chunk straight into `output` even when
# `output` aliases the input chunk it is reduced with (the usual in-place ZeRO layout)
_REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def ring_reduce_scatter(output, input, *, ranks, me, group, tag, op="sum"):
    """Rank `me` ends with chunk `me` of the elementwise reduction of every rank's `input`.

    Step s sends the partial sum of chunk (me - 1 - s) to the right neighbour and receives the
    partial sum of chunk (me - 2 - s) from the left, then adds its own share of that chunk;
    after N-1 steps the chunk it holds is chunk me, reduced over all N ranks.
    """
    n = len(ranks)
    chunks = input.view(-1).chunk(n)
    result = output.view(-1)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    reduce = _REDUCE[op]
    # The last step receives straight into `result`, unless `result` is my own chunk of
    # `input` (an in-place reduce-scatter), whose values that step still has to add. The other
    # steps alternate two spare chunks: one on the wire while the other receives.
    in_place = result.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()
    spares = [torch.empty_like(result) for _ in range(min(2, n - 1 if in_place else n - 2))]
    outgoing = chunks[(me - 1) % n]
    for step in range(n - 1):
        last = step == n - 2
        incoming = result if last and not in_place else spares[step % 2]
        send = dist.isend(outgoing, dst=right, group=group, tag=tag)
        recv = dist.irecv(incoming, src=left, group=group, tag=tag)
        recv.wait()
        # this reduction overlaps the send posted above
        reduce(incoming, chunks[(me - 2 - step) % n], out=result if last else incoming)
        send.wait()
        outgoing = incoming


def ring_all_gather(output, input, *, ranks, me, group, tag):
    """`output` = every rank's `input`, concatenated in group order.

    Step s forwards chunk (me - s) to the right neighbour and receives chunk (me - s - 1) from
    the left straight into its place in `output`; sends only read, so they stay in flight
    until the end.
    """
    n = len(ranks)
    chunks = output.view(-1).chunk(n)
    chunks[me].copy_(input.view(-1))
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    sends = []
    for step in range(n - 1):
        sends.append(dist.isend(chunks[(me - step) % n], dst=right, group=group, tag=tag))
        dist.irecv(chunks[(me - step - 1) % n], src=left, group=group, tag=tag).wait()
    for send in sends:
        send.wait()


def pairwise_all_to_all(output, input, *, ranks, me, group, tag):
    """Chunk j of `input` goes to rank j; chunk j of `output` comes from rank j.

    All N-1 exchanges are posted at once (step s: to me + s, from me - s, so every rank talks
    to a different peer in each step, the pairwise exchange of MPI's all-to-all). `output` must
    not alias `input`.
    """
    n = len(ranks)
    sent, received = input.view(-1).chunk(n), output.view(-1).chunk(n)
    received[me].copy_(sent[me])
    works = []
    for step in range(1, n):
        dst, src = (me + step) % n, (me - step) % n
        works.append(dist.isend(sent[dst], dst=ranks[dst], group=group, tag=tag))
        works.append(dist.irecv(received[src], src=ranks[src], group=group, tag=tag))
    for work in works:
        work.wait()


class RingWork:
    """A ring running on a background thread; `wait()` joins it and re-raises its error, so
    `comm.Pending` turns a timeout inside the ring into the same CollectiveError as a native op."""

    def __init__(self, ring, args, kwargs):
        self._error: BaseException | None = None
        self._done_at: float | None = None
        self._callbacks: list = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(ring, args, kwargs), daemon=True,
                                        name=f"loomtrain-{ring.__name__}")
        self._thread.start()

    def _run(self, ring, args, kwargs) -> None:
        try:
            ring(*args, **kwargs)
        except BaseException as err:  # handed to the waiting thread, which raises it
            self._error = err
        with self._lock:
            self._done_at = time.perf_counter()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self._done_at)

    def when_done(self, fn) -> None:
        """Call `fn(t)` with the completion time, now if the ring has finished."""
        with self._lock:
            if self._done_at is None:
                self._callbacks.append(fn)
                return
        fn(self._done_at)

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise err


def start(ring, args, kwargs, async_op: bool) -> RingWork | None:
    """Run `ring(*args, **kwargs)` inline (sync) or on a background thread (async)."""
    if async_op:
        return RingWork(ring, args, kwargs)
    ring(*args, **kwargs)
    return None
