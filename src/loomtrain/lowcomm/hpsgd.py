"""HPSGD: the synchronization of step t runs while step t+1 computes; the stale average is
merged into the replica when it arrives.

Zhou, Ye, Zhang and Lv, arXiv 2009.02701. The merge as built, memory, deviations from the
paper and failure semantics: docs/lowcomm-hpsgd.md.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from loomtrain import comm
from loomtrain.lowcomm.local_sgd import LocalSGD


def build(model, optimizer, mesh, cfg, seed: int):
    """apply_lowcomm's builder for algorithm="hpsgd"."""
    return HPSGD(model, mesh, cfg.overlap_steps), optimizer


class HPSGD(LocalSGD):
    """`model = HPSGD(model, mesh, overlap_steps=1)`; then per step
    `loss.backward(); optimizer.step(); model.after_step(step)`.

    What a benchmark reads: `sync_wait_s` (seconds waited for syncs, in total), `syncs` (syncs
    merged), and the timeline spans of a step when `timeline` is set (the trainer sets it)."""

    def __init__(self, module: nn.Module, mesh, overlap_steps: int = 1, axis: str | None = None):
        super().__init__(module, mesh, inner_steps=1, axis=axis)
        if overlap_steps not in (0, 1):
            raise ValueError(f"HPSGD keeps at most one step's sync in flight: overlap_steps="
                             f"{overlap_steps} is not 0 or 1")
        self.overlap_steps = overlap_steps
        self.global_params = _flatten_dense_tensors([p.detach() for p in self.params])  # G
        self.snapshot = self.global_params.clone()  # s: x_i before this step's optimizer step
        self.change = torch.zeros_like(self.global_params)  # d_i, then the sum of all d_j
        self._change_views = _unflatten_dense_tensors(self.change, self.params)
        self._snapshot_views = _unflatten_dense_tensors(self.snapshot, self.params)
        self._global_views = _unflatten_dense_tensors(self.global_params, self.params)
        self._ready_step = 0  # the step whose change waits to be launched (0: none)
        self._in_flight = None  # (Pending, step, issued perf_counter, [completion time])
        self.steps_done = 0  # the last step after_step saw (0 after a resume)
        self.sync_wait_s, self.syncs = 0.0, 0
        self._reported_wait_s, self._staleness = 0.0, 0  # since the previous record
        self.timeline = None  # the trainer's Timeline on a recorded step (run.timeline_step)
        self._compute_start = self._update_start = None

    def forward(self, *args, **kwargs):
        if self._ready_step:  # the step's first forward: the previous change leaves now
            self._launch()
        if self.timeline is not None and self._compute_start is None:
            self._compute_start = time.perf_counter()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Entered at a step's start by a pipeline's runtime, which runs the stages without
        the wrapper's forward (and by the trainer before a first micro-batch's forward): the
        previous change leaves here then."""
        if self._ready_step:
            self._launch()
        with super().no_sync():
            yield

    def before_update(self) -> None:
        """The end of the step's backward: only the timeline's boundary."""
        self._update_start = time.perf_counter()

    @torch.no_grad()
    def after_step(self, step: int, last: bool = False) -> bool:
        """Call after optimizer step `step` on every replica: merge the previous step's sync,
        start this step's (it leaves at the next forward; at once with `overlap_steps=0`, or
        when `last`, after which every replica holds G). Returns True (a sync every step)."""
        recorded = (self.timeline, self._compute_start, self._update_start)
        if all(x is not None for x in recorded):
            self.timeline.span("compute", f"forward+backward step {step}", self._compute_start,
                               self._update_start)
            self.timeline.span("compute", f"optimizer step {step}", self._update_start,
                               time.perf_counter())
        self._compute_start = self._update_start = None
        self._merge(step)
        for view, p in zip(self._change_views, self.params):
            view.copy_(p)
        self.change.sub_(self.snapshot)  # d_i,t = x_i - s_i
        self.steps_done, self._ready_step = step, step
        if self.overlap_steps == 0 or last:
            self._merge(step)
            self._set_replica(self.global_params)
        else:
            torch.add(self.global_params, self.change, out=self.snapshot)  # x_i = G + d_i,t
            self._set_replica(self.snapshot)
        return True

    @torch.no_grad()
    def end_period(self) -> None:
        """Wait for the sync in flight and merge it: every replica then holds G, bitwise."""
        if self._ready_step or self._in_flight is not None:
            self._merge(self.steps_done)
            self._set_replica(self.global_params)

    def synchronize(self) -> None:
        """The base class's "hold one model now": the same as `end_period`."""
        self.end_period()

    def metrics(self) -> dict:
        """Since the previous record: the largest staleness (steps) of a merged sync, and the
        seconds this replica waited for syncs (the part of the all-reduce not hidden)."""
        waited = self.sync_wait_s - self._reported_wait_s
        self._reported_wait_s = self.sync_wait_s
        staleness, self._staleness = self._staleness, 0
        return {"hpsgd_staleness": staleness, "hpsgd_sync_wait_s": round(waited, 6)}

    def _launch(self) -> None:
        issued = time.perf_counter()
        pending = comm.all_reduce(self.change, self.mesh, self.axis, async_op=True)
        done_at: list[float] = []
        if self.timeline is not None:  # the comm layer reports the (simulated) completion
            pending.when_done(done_at.append)
        self._in_flight = (pending, self._ready_step, issued, done_at)
        self._ready_step = 0

    def _merge(self, step: int) -> None:
        """Wait for the sync in flight (launching it first if it has not left) and add the
        mean change to G; `step`: the step now, for its staleness."""
        if self._ready_step:
            self._launch()
        if self._in_flight is None:
            return
        pending, changed_at, issued, done_at = self._in_flight
        waited_from = time.perf_counter()
        pending.wait()
        waited_to = time.perf_counter()
        self.sync_wait_s += waited_to - waited_from
        self.change.div_(self.mesh.size(self.axis))
        self.global_params.add_(self.change)
        self._in_flight = None
        self.syncs += 1
        self._staleness = max(self._staleness, step - changed_at)
        self.steps_since_sync = 0
        if self.timeline is not None:
            name = f"all_reduce change of step {changed_at}"
            self.timeline.span("reduce", name, issued, done_at[0] if done_at else waited_to)
            self.timeline.span("compute", f"wait {name}", waited_from, waited_to)

    def _set_replica(self, flat: torch.Tensor) -> None:
        """x_i = `flat` (G, or G + d_i), which is also the next step's snapshot s_i."""
        if flat is not self.snapshot:
            self.snapshot.copy_(flat)
        for p, value in zip(self.params, self._snapshot_views):
            p.copy_(value)

    # checkpoints (lowcomm/state.py): written after end_period, where x_i = G = s_i on every
    # replica and nothing is in flight, so the model entry is all the state there is
    def outer_state(self) -> dict[str, torch.Tensor]:
        return {}

    @torch.no_grad()
    def load_outer_state(self, state: dict[str, torch.Tensor]) -> None:
        super().load_outer_state(state)
        for view, p in zip(self._global_views, self.params):
            view.copy_(p)
        self.snapshot.copy_(self.global_params)
        self._ready_step, self._in_flight = 0, None
