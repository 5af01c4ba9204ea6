"""The collectives ZeRO needs, over the shard axis (L ranks) and the replica axis (C ranks).

A unit's gradient is reduce-scattered over the shard axis, then all-reduced or
reduce-scattered over the replicas (AsyncHZP, arXiv 2510.20111; ZeRO++'s hpZ, arXiv
2306.10209); parameters are gathered back the other way. Bytes, the mean and the ordering
rule: docs/zero.md, "Hierarchical ZeRO".
"""

from __future__ import annotations

import time

import torch

from loomtrain import comm
from loomtrain.parallel.zero.flat import FlatUnit


# Sources at least this large are freed by a completion callback (comm's ring ops complete on
# their own thread, so no watcher thread is started; gloo's smaller native ops would need one).
FREE_ON_COMPLETION_BYTES = 1 << 20


class GradReduction:
    """One unit's gradient in flight: reduce-scatter over the shard axis, then the replica
    step, then divided by `divisor` (the dp size for a mean, 1 for a sum) and added into the
    unit's `grad`. `advance()` does one blocking phase."""

    def __init__(self, unit: FlatUnit, source: torch.Tensor, mesh, timeline=None, divisor: int = 1):
        plan = unit.plan
        self.unit, self.mesh, self.timeline, self.divisor = unit, mesh, timeline, divisor
        self.source = source if source.dtype == torch.float32 else source.float()
        lo, hi = unit.shard
        in_place = unit.acc is not None and self.source is unit.acc
        # stage 1 reduces in place (the shard is a view of the fp32 accumulator); otherwise a
        # shard-sized output, so the full-size source can be freed once the op is done: the
        # unit's `grad` itself when it holds nothing yet and is exactly my shard (no replica
        # reduce-scatter, no host copy), else a new one added into `grad` at the end
        if in_place:
            self.shard = self.source[lo:hi]
        elif (unit.grad_is_zero and not plan.optimizer_over_replicas
              and unit.grad.device == source.device and unit.grad.numel() == hi - lo):
            self.shard = unit.ready_grad(zeroed=False)  # the reduce-scatter writes all of it
            unit.grad_is_zero = False
        else:
            self.shard = torch.empty(hi - lo, dtype=torch.float32, device=source.device)
        self.phase = "shard"
        self.pending = self._start("reduce_scatter", lambda: comm.reduce_scatter(
            self.shard, self.source, mesh, plan.shard_axis, async_op=True))
        if not in_place and self.source.numel() * 4 >= FREE_ON_COMPLETION_BYTES:
            # the full-size source is freed the moment the reduce-scatter completes, not when
            # the queue next advances (one unit's backward later): without this, every unit's
            # backward ran beside the previous unit's whole gradient (+1 unit at the peak)
            storage = self.source.untyped_storage()
            self.pending.when_done(lambda _t: storage.resize_(0))

    def _start(self, what: str, issue):
        t0 = time.perf_counter()
        pending = issue()
        if self.timeline is not None:
            self.timeline.track(pending, "reduce", f"{what} {self.unit.layout.name}", t0)
        return pending

    def advance(self) -> bool:
        """Wait for the op in flight and start the next; True once the gradient is delivered."""
        self.pending.wait()
        plan = self.unit.plan
        if self.phase == "shard":
            self.source = None  # a full-size temporary is freed here (stage 1's `acc` is kept by the unit)
            self.reduced = self.shard
            if plan.replica_ranks > 1:
                self.phase = "replica"
                if plan.optimizer_over_replicas:
                    self.reduced = self.shard.chunk(plan.replica_ranks)[plan.replica_index]
                    self.pending = self._start("reduce_scatter", lambda: comm.reduce_scatter(
                        self.reduced, self.shard, self.mesh, plan.replica_axis, async_op=True))
                else:
                    self.pending = self._start("all_reduce", lambda: comm.all_reduce(
                        self.shard, self.mesh, plan.replica_axis, async_op=True))
                return False
        if self.divisor > 1:
            self.reduced.div_(self.divisor)
        self.unit.accumulate(self.reduced)
        self.shard = self.reduced = None
        self.phase = "done"
        return True


class ReductionQueue:
    """Reductions in launch order. Each launch moves every older one on by one phase, so a
    unit's reduce-scatter runs during the next unit's backward and its replica step during the
    one after (at most three units' buffers alive); `drain()` finishes them all."""

    def __init__(self):
        self.items: list[GradReduction] = []

    def launched(self, reduction: GradReduction) -> None:
        self.items = [r for r in self.items if not r.advance()] + [reduction]

    def drain(self) -> None:
        for r in self.items:  # every replica step is issued before any is waited for
            if r.phase == "shard":
                r.advance()
        for r in self.items:
            while r.phase != "done":
                r.advance()
        self.items = []


def start_gather(unit: FlatUnit, mesh, timeline=None):
    """Stage 3: all-gather the unit from every shard rank into its gather buffer; returns
    (buffer, pending op)."""
    full = unit.gather_buffer()
    t0 = time.perf_counter()
    pending = comm.all_gather(full, unit.store, mesh, unit.plan.shard_axis, async_op=True)
    if timeline is not None:
        timeline.track(pending, "gather", f"all_gather {unit.layout.name}", t0)
    return full, pending


def publish(units: list[FlatUnit], mesh) -> None:
    """After the optimizer step: master weights into the parameter store (cast, or copied from
    host memory), then the all-gathers, each in place, that give every rank the parameters it
    keeps: over the replica axis when the optimizer range is smaller than the shard, then over
    the shard axis for stages 1-2."""
    for plan in dict.fromkeys(u.plan for u in units):  # units sharded over another axis apart
        _publish([u for u in units if u.plan == plan], plan, mesh)


def _publish(units: list[FlatUnit], plan, mesh) -> None:
    with torch.no_grad():
        for u in units:
            own = u.local(u.optimizer_range)
            if own.data_ptr() != u.master.data_ptr():
                own.copy_(u.master)
        if plan.optimizer_over_replicas and plan.replica_ranks > 1:
            _gather_in_place([u.local(u.shard) for u in units], mesh, plan.replica_axis,
                             plan.replica_ranks, plan.replica_index)
        if plan.stage < 3 and plan.shard_ranks > 1:
            _gather_in_place([u.store for u in units], mesh, plan.shard_axis, plan.shard_ranks,
                             plan.shard_index)


def _gather_in_place(wholes: list[torch.Tensor], mesh, axis: str, ranks: int, index: int) -> None:
    """All-gather each tensor from its own chunk `index`, in place; all in flight at once."""
    pending = [comm.all_gather(w, w.chunk(ranks)[index], mesh, axis, async_op=True) for w in wholes]
    for p in pending:
        p.wait()
