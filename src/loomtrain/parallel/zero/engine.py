"""The ZeRO model wrapper: module hooks that gather, free and reduce one unit at a time (ZeRO,
Rajbhandari et al., arXiv 1910.02054; the unit-by-unit schedule of FSDP, Zhao et al., arXiv
2304.11277). The hooks in the order a step sees them, the launch order and micro-batches:
docs/zero.md, "How it works".
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from loomtrain.parallel.data import grad_norm, norm_weight
from loomtrain.parallel.placement import dp_axis_of
from loomtrain.parallel.zero.communication import (GradReduction, ReductionQueue, publish,
                                                   start_gather)
from loomtrain.parallel.sparse_dp import SparseCommWindow
from loomtrain.parallel.zero.flat import FlatUnit, ShardPlan
from loomtrain.parallel.zero.sparse import PackedGradReduction, set_unit_cuts, unit_wire_bytes

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class ShardedDataParallel(nn.Module):
    """`model = ShardedDataParallel(...)` (built by `shard()`); then
    `loss.backward(); optimizer.step()` as usual. The wrapped module is `.module`.
    `gradient_reduce`: "mean" over the dp replicas (DDP's and FSDP2's gradient) or "sum"."""

    def __init__(self, module: nn.Module, mesh, plan: ShardPlan, units: list[FlatUnit],
                 root: FlatUnit | None, prefetch: int, gradient_reduce: str = "mean"):
        super().__init__()
        self.module, self.mesh, self.plan, self.prefetch = module, mesh, plan, prefetch
        self.gradient_reduce = gradient_reduce
        # the ranks every gradient is summed over: the shard axis, then the replica axis
        # (hierarchical: the whole dp world across nodes; stage 0 in bf16: 1 x dp)
        self._divisor = plan.shard_ranks * plan.replica_ranks if gradient_reduce == "mean" else 1
        self.units, self.root = units, root
        self.all_units = units + ([root] if root is not None else [])
        self.launch_order = units[::-1] + ([root] if root is not None else [])
        self.timeline = None  # a loomtrain.timeline.Timeline while one step is recorded
        self._pieces = None  # (tensor-parallel, replicated) gradient views, for the norm
        self._sync = True
        # under a pipeline schedule (`pipeline`), stages 2-3 hold the step: gradients
        # accumulate unreduced in `no_sync()` until `sync_gradients` reduce-scatters each unit
        # once; stage 3's units stay gathered through it (reshard "step") or are freed after
        # each forward and backward ("micro_batch"), as FSDP2 runs under torch's pipelining
        # with reshard_after_forward False or True (docs/zero.md, "Inside a pipeline")
        self.pipelined, self.reshard = False, "step"
        self._call_of: dict[FlatUnit, int] = {}  # "micro_batch": the stage call of each unit
        self._aside = False  # `aside()`: the module runs on weights its caller passes
        self._callback_queued = False
        self._reductions = ReductionQueue()
        self._sparse: SparseCommWindow | None = None  # while gradient masks are set
        self._gathers: dict[FlatUnit, tuple] = {}
        self._backward_started: set[FlatUnit] = set()
        self._unit_of = {p: u for u in self.all_units for p in u.params}
        self._index_in_unit = {p: i for u in self.all_units for i, p in enumerate(u.params)}
        module.register_forward_pre_hook(self._root_pre_forward)
        module.register_forward_hook(self._root_post_forward)
        for u in units:
            u.module.register_forward_pre_hook(lambda _m, _a, u=u: self._pre_forward(u))
            u.module.register_forward_hook(lambda _m, _a, out, u=u: self._post_forward(u, out))
        for p in self._unit_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        if plan.stage == 1 and plan.compute_dtype == torch.float32:
            for u in self.all_units:  # `.grad` are views of the persistent fp32 accumulator
                u.grad_buffer()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Stage 1: accumulate gradients locally (micro-steps before the last). Stages 2-3
        reduce every micro-batch anyway: they keep no full gradient to accumulate into; under
        a pipeline (`pipelined`) they hold the whole step (`_holding`)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def pipeline(self, reshard: str, calls: list[list[str]]) -> None:
        """Run under a pipeline schedule (the Zero component, at pp > 1), stage 3's units
        kept through the step (`reshard` "step") or not ("micro_batch"). `calls`: the module
        paths of each stage this rank runs; a "micro_batch" prefetch stays inside the stage
        that is running, since the next unit in the rank's order belongs to another stage,
        which runs later (or never in this micro-batch), and a gather started for it would be
        freed unused at the end of the backward."""
        self.pipelined, self.reshard = True, reshard
        for u in self.units:
            name = u.layout.name
            self._call_of[u] = next((i for i, paths in enumerate(calls)
                                     if any(name == x or name.startswith(x + ".") for x in paths)),
                                    None)

    @contextlib.contextmanager
    def aside(self):
        """The module runs on weights its caller passes (the asynchronous pipeline's stashed
        copies, through `torch.func.functional_call`): no hook gathers, frees or reduces; the
        caller reduces their gradients with `reduce_given`."""
        self._aside = True
        try:
            yield
        finally:
            self._aside = False

    def _holding(self) -> bool:
        """Inside a pipelined step at stage 2-3: nothing is reduced until `sync_gradients`."""
        return self.pipelined and not self._sync and self.plan.stage >= 2

    def _keeping(self) -> bool:
        """Inside a pipelined step that keeps stage 3's units gathered: nothing is released
        until `sync_gradients`."""
        return self._holding() and self.reshard == "step"

    # --- stage 3: gathers -------------------------------------------------------------------

    def _start_gather(self, u: FlatUnit) -> None:
        if u.sharded_params and u.full is None and u not in self._gathers:
            self._gathers[u] = start_gather(u, self.mesh, self.timeline)

    def _ensure_gathered(self, u: FlatUnit) -> None:
        if not u.sharded_params or u.full is not None:
            return
        self._start_gather(u)
        full, pending = self._gathers.pop(u)
        if self.timeline is not None:
            self.timeline.begin("compute", f"wait gather {u.layout.name}")
        pending.wait()
        if self.timeline is not None:
            self.timeline.end("compute", f"wait gather {u.layout.name}")
        u.use_gathered(full)

    def _prefetch(self, order: list[FlatUnit], after: int) -> None:
        """Start gathering the `prefetch` units after `order[after - 1]` (after = 0: the
        root's hooks); inside a pipelined micro-batch only those of its stage (`pipeline`),
        and none from the root's, which runs with every stage."""
        ahead = order[after:after + self.prefetch]
        if self._holding() and not self._keeping():
            call = self._call_of.get(order[after - 1]) if after else None
            ahead = [u for u in ahead if call is not None and self._call_of.get(u) == call]
        for u in ahead:
            self._start_gather(u)

    def _drop_gathers(self) -> None:
        """Free every gathered non-root unit and any prefetch nobody used (not while the step
        is kept: the next micro-batch uses them)."""
        if self._keeping():
            return
        for full, pending in self._gathers.values():
            pending.wait()
        self._gathers.clear()
        for u in self.units:
            if u.sharded_params and u.full is not None:
                u.release()

    # --- forward hooks ----------------------------------------------------------------------

    def _root_pre_forward(self, _module, _args) -> None:
        if self._aside:
            return
        if self.root is not None:
            self._ensure_gathered(self.root)
        self._prefetch(self.units, 0)

    def _root_post_forward(self, _module, _args, output) -> None:
        if self._aside:
            return
        if not self._on_backward(output, self.root):
            self._drop_gathers()  # no backward follows (evaluation): free everything now
            self._release_root()

    def _pre_forward(self, u: FlatUnit) -> None:
        if self._aside:
            return
        self._ensure_gathered(u)
        self._prefetch(self.units, self.units.index(u) + 1)
        if self.timeline is not None:
            self.timeline.begin("compute", f"forward {u.layout.name}")

    def _post_forward(self, u: FlatUnit, output) -> None:
        if self._aside:
            return
        if self.timeline is not None:
            self.timeline.end("compute", f"forward {u.layout.name}")
        if u.sharded_params and not self._keeping():
            u.release()
        self._on_backward(output, u)

    def _on_backward(self, output, u: FlatUnit | None) -> bool:
        """Register the pre-backward hook of `u` on the outputs that need a gradient."""
        tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
        if not tensors or not torch.is_grad_enabled():
            return False
        torch.autograd.graph.register_multi_grad_hook(
            tensors, lambda _grads: self._pre_backward(u), mode="any")
        return True

    # --- backward hooks ---------------------------------------------------------------------

    def _queue_finish(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            _queue_callback(self._finish)

    def _pre_backward(self, u: FlatUnit | None) -> None:
        self._queue_finish()
        if u is None or u in self._backward_started:
            return
        self._backward_started.add(u)
        self._ensure_gathered(u)
        backward_order = self.units[::-1]
        if u is self.root:
            self._prefetch(backward_order, 0)
        else:
            self._prefetch(backward_order, backward_order.index(u) + 1)
            if self.timeline is not None:
                self.timeline.begin("compute", f"backward {u.layout.name}")
        u.grad_buffer()

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        u = self._unit_of[p]
        self._queue_finish()  # in case no output hook fired (parameters used outside a unit)
        u.take_grad(self._index_in_unit[p])
        u.ready += 1
        if u.ready == len(u.params):
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        for u in self.launch_order:
            if u.launched:
                continue
            if u.ready < len(u.params) and not force:
                return  # later units wait: the launch order must be the same on every rank
            self._launch(u)

    def _launch(self, u: FlatUnit) -> None:
        u.launched = True
        if self.timeline is not None and u is not self.root:
            self.timeline.end("compute", f"backward {u.layout.name}")
        buffer = u.collect_grads()
        if u.acc is not None and buffer is not u.acc:  # stage 1 in bf16: accumulate in fp32
            u.acc.add_(buffer)
            buffer = u.acc
        if self._holding():
            u.hold(buffer)
        else:
            if u.held is not None:  # the held step's gradient, with what came after its last launch
                u.hold(buffer)
                buffer, u.held = u.held, None
            if self._sync or self.plan.stage >= 2:
                if self._sparse is not None:
                    self._sparse.add_wire(*unit_wire_bytes(u))
                reduction = GradReduction if u.cuts is None else PackedGradReduction
                self._reductions.launched(reduction(u, buffer, self.mesh, self.timeline,
                                                    self._divisor))
        u.drop_grads()
        if u.sharded_params and u is not self.root and not self._keeping():
            u.release()

    def _finish(self) -> None:
        """End of backward: launch what is left, finish every reduction, free what was gathered."""
        self._launch_ready(force=True)
        self._reductions.drain()
        self._drop_gathers()
        self._release_root()
        for u in self.all_units:
            u.ready, u.launched = 0, False
        self._backward_started.clear()
        self._callback_queued = False

    def reduce_given(self, grad_of) -> None:
        """Reduce gradients made outside the hooks (`aside()`): `grad_of(p)`, a tensor or None
        (zeros), for every parameter, unit by unit into its fp32 buffer, then over the shard
        and replica axes into the gradient shards, as a backward's reductions would."""
        for u in self.launch_order:
            buffer = torch.zeros(u.layout.padded, dtype=torch.float32, device=self.mesh.device)
            for p, slot in zip(u.params, u.layout.slots):
                grad = grad_of(p)
                if grad is not None:
                    buffer[slot.offset:slot.offset + slot.numel].copy_(grad.reshape(-1))
            self._reductions.launched(GradReduction(u, buffer, self.mesh, self.timeline,
                                                    self._divisor))
        self._reductions.drain()

    def unreduced_grad(self, p: nn.Parameter) -> torch.Tensor:
        """`p`'s gradient summed over this step's micro-batches, before any reduction
        (`FlatUnit.unreduced_grad`): the pipeline sums the parameters several stages share
        over pp with it, before `sync_gradients`."""
        return self._unit_of[p].unreduced_grad(self._index_in_unit[p])

    def _release_root(self) -> None:
        if self.root is not None and self.root.sharded_params and not self._keeping():
            self.root.release()

    # --- after backward ---------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global 2-norm of the gradient to `max_norm` (0: only measure it); returns
        the norm before clipping. Each rank sums the squares of its own optimizer range, one
        all-reduce over the group those ranges tile adds them up (the norm torch's
        `clip_grad_norm_` computes on the whole gradient, up to summation order)."""
        self.ready_grads()
        grads = [u.grad for u in self.all_units if u.grad.numel()]
        if self.mesh.size("ep") > 1:  # units sharded over dp and over edp (x cp)
            total = grad_norm(self._copies_weighted(), self.mesh, self.plan.data_axis)
        elif self.mesh.size("tp") > 1 or self.mesh.size("pp") > 1:  # pieces weigh differently
            if self._pieces is None:  # views of the persistent gradient shards: built once
                self._pieces = self._grad_pieces()
            total = grad_norm(self._pieces, self.mesh, self.plan.optimizer_axis)
        else:
            total = grad_norm([(grads, 1.0)], self.mesh, self.plan.optimizer_axis)
        if max_norm > 0 and grads:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return total

    def ready_grads(self) -> None:
        """Every gradient shard in memory (FlatUnit.ready_grad): what reads them all calls it."""
        for u in self.all_units:
            u.ready_grad()

    def _copies_weighted(self) -> list[tuple[list[torch.Tensor], float]]:
        """Each unit's gradient range weighted by one over the dp ranks (dp x cp under cp)
        holding the same range: dp over its optimizer ranks, over ep more for a unit of
        experts (each ep rank holds others); under tp or pp, parameter by parameter, times
        `norm_weight`."""
        ep, dp = self.mesh.size("ep"), self.mesh.size(self.plan.data_axis)
        by_piece = self.mesh.size("tp") > 1 or self.mesh.size("pp") > 1
        out = []
        for u in self.all_units:
            held = u.plan.optimizer_ranks * (ep if dp_axis_of(u.params[0], "dp") != "dp" else 1)
            if u.grad.numel():
                pieces = self._grad_pieces([u]) if by_piece else [([u.grad], 1.0)]
                out += [(grads, weight * held / dp) for grads, weight in pieces]
        return out

    def _grad_pieces(self, units=None) -> list[tuple[list[torch.Tensor], float]]:
        """Views of my gradient shards of `units` (None: all), parameter by parameter,
        grouped by `norm_weight`."""
        groups: dict[float, list[torch.Tensor]] = {}
        for u in self.all_units if units is None else units:
            lo, hi = u.optimizer_range
            param_of = dict(zip(u.layout.slots, u.params))
            for piece in u.layout.slices(lo, hi):
                at = piece.unit_offset - lo
                weight = norm_weight(param_of[piece.slot], self.mesh)
                groups.setdefault(weight, []).append(u.grad[at:at + piece.numel])
        return [(grads, w) for w, grads in groups.items()]

    def sync_gradients(self) -> None:
        """Reduce the gradients accumulated under `no_sync()` now, outside any backward (the
        pipeline runtime's end of step): stage 1's, and a pipelined step's at stages 2-3,
        whose gathered units are then freed."""
        assert self.plan.stage == 1 or self.pipelined, "stages 2-3 reduce every backward"
        self._finish()

    def set_gradient_masks(self, masks: dict[nn.Parameter, torch.Tensor] | None) -> None:
        """Reduce only the gradient entries `masks` keep (True) from the next backward on
        (zero/sparse.py); masked-out entries of the reduced gradient are zero. None: the
        dense reductions again. The contract of `DataParallel.set_gradient_masks`: collective
        over the dp ranks, outside backward, once per mask change, the masks of the axis
        member 0 used (and copied into the tensors passed) on every rank; a mask is shaped
        like its parameter in the model (ZeRO-3's are empty between uses)."""
        assert not any(u.launched for u in self.all_units), "set_gradient_masks inside backward"
        masked, sent = set_unit_cuts(self.all_units, masks, self.mesh, self.plan.data_axis)
        self._sparse = (self._sparse or SparseCommWindow()) if masked else None
        if masked:
            self._sparse.mask_sync_wire += sent

    def metrics(self) -> dict:
        """While gradient masks are set, the sparse-communication figures since the previous
        call (`SparseCommWindow.take`: bytes as the meter counts them); else none."""
        return self._sparse.take() if self._sparse is not None else {}

    def master_slices(self) -> list[tuple]:
        """(Slice, view) for each parameter's slice of this rank's fp32 master weights, in
        unit order: what a method that works on the master weights themselves (lowcomm's
        sharded replicas) reads and writes, followed by `publish`."""
        out = []
        for u in self.all_units:
            lo, hi = u.optimizer_range
            out += [(piece, u.master[piece.unit_offset - lo:piece.unit_offset - lo + piece.numel])
                    for piece in u.layout.slices(lo, hi)]
        return out

    def publish(self) -> None:
        """The master weights into the parameters every rank keeps, as after an optimizer
        step (communication.publish)."""
        publish(self.all_units, self.mesh)

    @property
    def parameters_total(self) -> int:
        return sum(math.prod(s.shape) for u in self.all_units for s in u.layout.slots)
