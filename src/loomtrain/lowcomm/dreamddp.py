"""DreamDDP: local SGD whose parameter average is split by layer over the H steps of a period,
each layer's all-reduce overlapping the backward of the layers before it.

Tang et al., arXiv 2502.11058. The algorithm as built, its deviations from the paper and its
failure semantics: docs/lowcomm-dreamddp.md (the schedule itself: dreamddp_schedule.py).
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.nn as nn

from loomtrain import comm
from loomtrain.comm.meter import wire_bytes
from loomtrain.lowcomm.dreamddp_schedule import (backward_order, exposed_s, fit_alpha_beta, naive,
                                                 plan, shared_last)
from loomtrain.lowcomm.local_sgd import LocalSGD


def build(model, optimizer, mesh, cfg, seed: int):
    """apply_lowcomm's builder for algorithm="dreamddp"."""
    return DreamDDP(model, mesh, cfg.inner_steps), optimizer


def layer_units(module: nn.Module) -> list[tuple[str, list[nn.Parameter]]]:
    """(unit name, its trainable tensors) in the module's order: each top-level child, a
    ModuleList or Sequential split into its elements; a tied tensor once, under its first name."""
    units: dict[str, list[nn.Parameter]] = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        parts = name.split(".")
        unit = parts[0]
        if len(parts) > 2 and isinstance(module.get_submodule(unit), (nn.ModuleList, nn.Sequential)):
            unit = f"{parts[0]}.{parts[1]}"
        units.setdefault(unit, []).append(p)
    return list(units.items())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@torch.no_grad()
def _flatten_into_one(tensors: list[nn.Parameter]) -> torch.Tensor:
    """One buffer holding `tensors` back to back; each becomes a view of its slice (same
    Parameter objects, so optimizers and hooks keep them). One dtype (LocalSGD asserts it)."""
    if len(tensors) == 1:
        return tensors[0].detach()
    flat = torch.cat([p.detach().reshape(-1) for p in tensors])
    offset = 0
    for p in tensors:
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


class DreamDDP(LocalSGD):
    """`model = DreamDDP(model, mesh, inner_steps=H)`; per step `loss.backward();
    model.clip_grad_norm_(c)` (or `model.before_update()`), `optimizer.step();
    model.after_step(step)`. The schedule is `iteration_of` (None during the warm-up)."""

    def __init__(self, module: nn.Module, mesh, inner_steps: int, axis: str | None = None):
        super().__init__(module, mesh, inner_steps, axis)
        # under a pipeline a rank's units are its stages' layers, and the runtime runs the
        # stages without this forward: see `no_sync` and `_on_grad_ready`
        self.staged = mesh.size("pp") > 1
        self.units = layer_units(module)
        self.unit_names = [name for name, _ in self.units]
        self._flat = [_flatten_into_one(tensors) for _, tensors in self.units]
        self._unit_of = {p: u for u, (_, tensors) in enumerate(self.units) for p in tensors}
        # the units holding a tensor that several pipeline stages hold (the tied embedding
        # and head), whose copies must sync at the same iteration on every stage
        self.shared_units = [u for u, (_, tensors) in enumerate(self.units)
                             if any(getattr(p, "pp_copies", 1) > 1 for p in tensors)]
        # the gradient accumulations that complete each unit in a step: one per tensor in the
        # last micro-batch's backward; under a pipeline, counted in the first step (every
        # micro-batch's backward of every stage of the rank that uses the unit accumulates)
        self._expected = None if self.staged else [len(tensors) for _, tensors in self.units]
        self._counted = None
        self.iteration_of: list[int] | None = None
        self.ready_s: list[float] = []  # agreed: each unit's gradients complete, from backward start
        self.comm_s: list[float] = []  # agreed: each unit's all-reduce seconds
        self.schedule_record: dict | None = None
        self.steps_done = 0
        self._accumulating = False
        self._ready_sum, self._measured, self._samples = [0.0] * len(self.units), 0, []
        self._launches = []  # the warm-up sync's all-reduces: [wire bytes, launched, completed]
        self._wait_s, self._logged = 0.0, False
        self._synced, self._synced_tensors, self._lead_s, self._full = [], 0, None, False
        self._reset_step()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for p in self.params]

    # --- the current step ---
    def _reset_step(self) -> None:
        self._calls = [0] * len(self.units)
        self._ready_at = [None] * len(self.units)
        self._issued = [False] * len(self.units)
        self._pending = []
        self._backward_t0 = self._first_issue = None

    def _syncs_now(self, u: int) -> bool:
        """Whether unit u is averaged in the step under way (iteration steps_done mod H)."""
        k = self.steps_done % self.inner_steps
        if self.iteration_of is None:  # warm-up: the naive schedule, every unit at the last
            return k == self.inner_steps - 1
        return self.iteration_of[u] == k

    def _measuring(self) -> bool:
        return self.iteration_of is None and self.inner_steps > 1 and not self._syncs_now(0)

    def _link_times_dp(self) -> bool:
        link = self.mesh.link
        return link is not None and link.crosses_nodes(self.mesh.group_ranks(self.axis))

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if not self._accumulating and torch.is_tensor(out) and out.requires_grad:
            out.register_hook(self._on_backward_start)
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """The trainer's micro-batches before the last: their backward neither syncs nor
        measures. A pipeline's runtime enters it for its whole step (it runs the stages, not
        this forward): the step's start, from which the units' readiness is timed (the plan
        reads only differences of those times), and the counting of every accumulation."""
        if self.staged:
            self._backward_t0 = time.perf_counter()
            yield
            return
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def _on_backward_start(self, grad):
        self._backward_t0 = time.perf_counter()

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """The unit's last accumulation of the step completes it: its parameters are read by
        no later backward of the step, so their average may start. Its time is the unit's
        readiness (the last call's, where the count is not known yet)."""
        if self._accumulating:
            return
        u = self._unit_of[p]
        self._calls[u] += 1
        self._ready_at[u] = time.perf_counter()
        complete = self._expected is not None and self._calls[u] == self._expected[u]
        if complete and self._syncs_now(u):
            self._issue(u)

    def _issue(self, u: int) -> None:
        """All-reduce (sum) unit u's flat buffer in place, asynchronously."""
        self._issued[u] = True
        if self._first_issue is None:
            self._first_issue = time.perf_counter()
        flat = self._flat[u]
        launched = time.perf_counter()
        work = comm.all_reduce(flat, self.mesh, self.axis, async_op=True)
        self._pending.append((u, work))
        if self.iteration_of is None and not self._link_times_dp():
            # the warm-up sync times its own all-reduces for the fit
            sample = [wire_bytes("ring_all_reduce", _nbytes(flat), self.mesh.size(self.axis)),
                      launched, None]
            self._launches.append(sample)
            work.when_done(lambda t, s=sample: s.__setitem__(2, t))

    @torch.no_grad()
    def before_update(self) -> None:
        """Finish the step's syncs: wait for the all-reduces, divide by the replica count."""
        started = time.perf_counter()
        for u in range(len(self.units)):
            if self._syncs_now(u) and not self._issued[u]:  # a tensor got no gradient
                self._issue(u)
        for _, work in self._pending:
            work.wait()
        n = self.mesh.size(self.axis)
        for u, _ in self._pending:
            self._flat[u].div_(n)
        self._wait_s += time.perf_counter() - started
        self._note_step(started)
        self._count_accumulations()
        self._reset_step()

    def _count_accumulations(self) -> None:
        """Under a pipeline, the first step's accumulations per unit are every step's (the
        same schedule runs every step); checked, since a count reached early would have
        averaged a unit that a later backward of the step still read. A zero-bubble
        schedule reads linear weights in backward ops whose weight gradients no hook sees
        (`defers_weight_grads`): no count says when a unit is read no more, and every unit
        waits for `before_update`."""
        if not self.staged:
            return
        if self._counted is None:
            self._counted = list(self._calls)
            deferred = self.module.runtime.defers_weight_grads
            self._expected = [-1 if deferred else c for c in self._calls]
        assert self._calls == self._counted, ("the gradient accumulations per unit changed "
                                              "between steps", self._calls, self._counted)

    def _note_step(self, backward_end: float) -> None:
        """What the step leaves for metrics and for the warm-up's measurement."""
        self._synced = [self.unit_names[u] for u in range(len(self.units)) if self._issued[u]]
        self._synced_tensors = sum(len(self.units[u][1]) for u, _ in self._pending)
        done = [t for t in self._ready_at if t is not None]
        self._lead_s = None
        if self._first_issue is not None and done:
            self._lead_s = max(done) - self._first_issue
        if self._measuring() and self._backward_t0 is not None:
            self._measured += 1
            for u, t in enumerate(self._ready_at):  # no gradient: ready at the backward's end
                self._ready_sum[u] += (backward_end if t is None else t) - self._backward_t0

    def after_step(self, step: int, last: bool = False) -> bool:
        """Call after optimizer step `step` (from 1). Ends the warm-up at its period's end;
        after the run's `last` step, a full sync. Returns whether the replicas are one model."""
        assert not self._pending, "call before_update() (or clip_grad_norm_) before the step"
        self.steps_done = step
        self.steps_since_sync += 1
        self._full = False
        self._take_samples()
        if self.iteration_of is None and step % self.inner_steps == 0 and self._measured:
            self._fix_schedule()
        if last:
            self.synchronize()
            return True
        return False

    # --- the schedule ---
    def _take_samples(self) -> None:
        """(wire bytes, seconds) of each timed all-reduce: from its launch, or from the end of
        the one before it if later (they queue), to its completion. Taken after the optimizer
        step, so that the completion callbacks (run by the communication thread) have run."""
        previous = None
        for wire, launched, end in self._launches:
            if end is None:
                continue
            start = launched if previous is None else max(launched, previous)
            self._samples.append((wire, max(0.0, end - start)))
            previous = end
        self._launches = []

    def _op_s(self, payload_bytes: int, alpha: float, beta: float) -> float:
        """Seconds an all-reduce of `payload_bytes` occupies the link: the simulated link's
        transfer (its latency runs alongside: `_latency_s`), or the fitted alpha-beta."""
        wire = wire_bytes("ring_all_reduce", payload_bytes, self.mesh.size(self.axis))
        if self._link_times_dp():
            return self.mesh.link.transfer_s(wire)
        return alpha + beta * wire

    def _latency_s(self) -> float:
        return self.mesh.link.latency_ms / 1e3 if self._link_times_dp() else 0.0

    def _peer_axes(self) -> tuple[str, ...]:
        """The axes of the ranks that hold this rank's units: every rank (the tp and cp ranks
        of a replica hold the same units: tp pieces of them, and whole tensors they
        replicate), or under a pipeline every rank of its stage (tp, cp and dp together)."""
        return ("tp", "cp", "dp") if self.staged else ("world",)

    def _fix_schedule(self) -> None:
        """Agree on the measurements (their mean over the peers: `_peer_axes`) and on the
        plan of the first of them, which must sync each unit at the same iteration
        everywhere, or the copies of a replicated tensor would part. A tensor that several
        stages hold syncs at the period's last iteration on each (`shared_last`)."""
        n = len(self.units)
        alpha, beta = fit_alpha_beta(self._samples)
        ready = [s / self._measured for s in self._ready_sum]
        comm_s = [self._op_s(_nbytes(flat), alpha, beta) for flat in self._flat]
        stats = torch.tensor(ready + comm_s, dtype=torch.float64, device=self.mesh.device)
        for axis in self._peer_axes():  # summed over each axis in turn: over all of them
            comm.all_reduce(stats, self.mesh, axis)
        stats /= math.prod(self.mesh.size(axis) for axis in self._peer_axes())
        ready, comm_s = stats[:n].tolist(), stats[n:].tolist()
        order, backward = backward_order(ready)
        found = plan(backward, [comm_s[u] for u in order], self.inner_steps, self._latency_s())
        mine = [0] * n
        for position, u in enumerate(order):
            mine[u] = found.iteration[position]
        mine = shared_last(mine, self.shared_units, self.inner_steps)
        iteration = torch.tensor(mine, dtype=torch.int64, device=self.mesh.device)
        for axis in self._peer_axes():
            comm.broadcast(iteration, self.mesh, axis, 0)
        self._set_schedule(iteration.tolist(), ready, comm_s, exact=found.exact)

    def _set_schedule(self, iteration, ready, comm_s, exact=None) -> None:
        self.iteration_of, self.ready_s, self.comm_s = list(iteration), list(ready), list(comm_s)
        order, backward = backward_order(ready)
        comm_in_order = [comm_s[u] for u in order]
        H, latency = self.inner_steps, self._latency_s()

        def predicted(iteration) -> float:
            return round(exposed_s(backward, comm_in_order, iteration, H, latency), 6)
        self.schedule_record = {
            "units": self.unit_names, "iteration": self.iteration_of,
            "ready_s": [round(t, 6) for t in ready], "comm_s": [round(t, 6) for t in comm_s],
            "latency_s": latency,
            "exposed_s": predicted([self.iteration_of[u] for u in order]),
            "naive_exposed_s": predicted(naive(len(order), H)),
            "exact": exact, "time_model": "link" if self._link_times_dp() else "measured"}
        self._logged = False

    # --- full syncs, metrics, checkpoints ---
    @torch.no_grad()
    def synchronize(self) -> None:
        """Every tensor becomes its mean over the replicas, in place: one all-reduce per unit."""
        works = [comm.all_reduce(flat, self.mesh, self.axis, async_op=True) for flat in self._flat]
        for work in works:
            work.wait()
        n = self.mesh.size(self.axis)
        for flat in self._flat:
            flat.div_(n)
        self.steps_since_sync = 0
        self._full = True

    def metrics(self) -> dict:
        """The units synced in the logged step and their tensor count, the seconds waited for
        syncs since the previous record (exposed), how long before the backward's last gradient
        the step's first all-reduce was issued (the overlap; None without a sync), whether a
        full sync ran, and the schedule once."""
        rec = {"dreamddp_synced": self._synced, "dreamddp_synced_tensors": self._synced_tensors,
               "dreamddp_wait_s": round(self._wait_s, 6),
               "dreamddp_issue_lead_s": None if self._lead_s is None else round(self._lead_s, 6),
               "dreamddp_full_sync": self._full}
        self._wait_s = 0.0
        if self.schedule_record is not None and not self._logged:
            rec["dreamddp_schedule"] = self.schedule_record
            self._logged = True
        return rec

    def outer_state(self) -> dict[str, torch.Tensor]:
        """The schedule and the measurements it came from (-1 and 0 during the warm-up) and
        the step count: identical on every replica (agreed), so written once."""
        n = len(self.units)
        fixed = self.iteration_of is not None
        return {"schedule": torch.tensor(self.iteration_of if fixed else [-1] * n),
                "ready_s": torch.tensor(self.ready_s if fixed else [0.0] * n, dtype=torch.float64),
                "comm_s": torch.tensor(self.comm_s if fixed else [0.0] * n, dtype=torch.float64),
                "steps_done": torch.tensor([self.steps_done])}

    def load_outer_state(self, state: dict[str, torch.Tensor]) -> None:
        """A checkpoint from the warm-up starts measuring again at its next period."""
        super().load_outer_state(state)
        self.steps_done = int(state["steps_done"][0])
        self._ready_sum, self._measured, self._samples = [0.0] * len(self.units), 0, []
        self.iteration_of, self.schedule_record = None, None
        if int(state["schedule"][0]) >= 0:
            self._set_schedule(state["schedule"].tolist(), state["ready_s"].tolist(),
                               state["comm_s"].tolist())
        self._reset_step()
