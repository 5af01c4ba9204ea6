"""The planner's search: enumerate the plans search_space.py yields, skip those that cannot fit
or cannot beat the K-th best so far (exact branch and bound: the top K equals an exhaustive
evaluation's), rank the rest by the cost model's step time, then let the stage-split MILP
(split_milp.py) rebalance the best pipeline plans. The bounds: docs/planner-search.md.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from loomtrain.models.config import padded_vocab
from loomtrain.planner.cost import (COMPUTE_BYTES, HOST_ADAM_PARAMS_PER_S, OPTIMIZER_TRAFFIC,
                                    _memory, _shard_groups, _stage_groups, _state_bytes,
                                    _sync_parts, _total, bubble_scale, estimate, layer_costs,
                                    layer_kinds, padded, rank_params, split_experts,
                                    stage_layers)
from loomtrain.planner.plan import Estimate, Plan
from loomtrain.planner.presets import ModelShape
from loomtrain.planner.search_space import Space, check_fix
from loomtrain.planner.specs import ClusterSpec

SPACES = ("all", "loom")
REFINE_PLANS = 2  # pipeline plans the MILP rebalances after the grid
REFINE_TIME_LIMIT_S = 1.0  # per MILP: HiGHS's best split by then (estimate() judges it)
PARTS = {"compute": "compute", "tp_cp_comm": "tp/cp/ep collectives", "bubble": "pipeline bubble",
         "zero3_gather": "ZeRO-3 gathers", "offload": "offload copies", "grad_sync": "gradient sync",
         "optimizer": "optimizer step"}


@dataclass
class SearchResult:
    ranked: list[Estimate]  # best first, only plans that fit, at most `top`
    search_s: float
    evaluated: int  # estimate() calls
    pruned: int  # plans skipped by a bound, never estimated
    notes: dict[int, str | None] = field(default_factory=dict)  # rank index -> why `loom train` cannot run it

    def why_first_beats_second(self, a: Estimate, b: Estimate) -> str:
        return why_faster(a, b)


def why_faster(a: Estimate, b: Estimate) -> str:
    """One or two sentences: the step-time parts (Estimate.time) that differ most between
    `a` and `b`, with the settings behind them, and memory when it differs by > 10%."""
    diff = {k: b.time.get(k, 0.0) - a.time.get(k, 0.0) for k in PARTS}
    gain = max(diff, key=diff.get)
    loss = min(diff, key=diff.get)
    sa, sb = a.plan.settings(), b.plan.settings()
    changed = [k for k in dict.fromkeys([*sa, *sb]) if sa.get(k) != sb.get(k)]
    settings = ", ".join(f"{k} {_show(getattr(a.plan, k))} vs {_show(getattr(b.plan, k))}"
                         for k in changed[:4])
    text = (f"#1 is {b.step_time_s - a.step_time_s:.3g} s faster per step ({a.step_time_s:.4g} vs "
            f"{b.step_time_s:.4g} s): it spends {diff[gain]:.3g} s less on {PARTS[gain]}")
    if diff[loss] < 0 and -diff[loss] > 0.05 * diff[gain]:
        text += f" while it spends {-diff[loss]:.3g} s more on {PARTS[loss]}"
    text += f" ({settings})." if settings else "."
    ma, mb = a.mem_per_device_bytes, b.mem_per_device_bytes
    if abs(ma - mb) > 0.1 * max(ma, mb):
        text += f" It needs {ma / 1e9:.3g} GB per device against {mb / 1e9:.3g} GB."
    return text


def _show(v) -> str:
    if isinstance(v, tuple):
        return "-".join(str(int(x)) for x in v)
    return str(v)


class _TopK:
    """The K best fitting estimates so far by (step time, memory, order found); `bound` is
    the K-th step time (inf until there are K)."""

    def __init__(self, k: int):
        self.k, self.heap, self.n = k, [], 0  # a max-heap of the keys, negated

    @property
    def bound(self) -> float:
        return -self.heap[0][0] if len(self.heap) == self.k else float("inf")

    def add(self, e: Estimate) -> None:
        self.n += 1
        item = (-e.step_time_s, -e.mem_per_device_bytes, -self.n, e)
        if len(self.heap) < self.k:
            heapq.heappush(self.heap, item)
        elif item[:3] > self.heap[0][:3]:
            heapq.heapreplace(self.heap, item)

    def remove(self, e: Estimate) -> None:
        self.heap = [x for x in self.heap if x[3] is not e]
        heapq.heapify(self.heap)

    def ranked(self) -> list[Estimate]:
        return [x[3] for x in sorted(self.heap, key=lambda x: x[:3], reverse=True)]


def search(shape: ModelShape, cluster: ClusterSpec, batch: int, top: int = 10, space: str = "all",
           fix: dict | None = None, accept=None, refine: bool = True) -> SearchResult:
    """The `top` fastest plans that fit. Space "all": every plan search_space.py yields,
    `accept(plan)` (a reason it cannot run, or None) only annotating the result's notes;
    space "loom": only plans accept passes (what loomtrain's trainer runs). `fix` pins Plan
    fields; ValueError when it, space or top cannot be met. `refine`: let the stage-split
    MILP rebalance the best pipeline plans (off: the grid alone, as the tests compare it)."""
    if space not in SPACES:
        raise ValueError(f"space {space!r}: choose one of {', '.join(SPACES)}")
    if top < 1:
        raise ValueError(f"top {top}: give the number of plans to list, >= 1")
    if space == "loom" and accept is None:
        raise ValueError('space "loom" needs accept(plan) -> reason or None')
    fix = dict(fix or {})
    check_fix(shape, cluster, batch, fix)
    start = time.perf_counter()
    run = _Run(Space(shape, cluster, batch, fix), top, accept if space == "loom" else None)
    run.grid()
    if not run.candidates and fix:
        raise ValueError(f"no plan of {shape.name} on {cluster.gpus} devices at global batch {batch} "
                         f"matches fix {fix} (check that dp x microbatches x micro_batch can make the "
                         "batch and that the schedule suits pp and virtual_stages)")
    if refine:
        run.refine()
    ranked = run.best.ranked()
    notes = {i: (accept(e.plan) if accept and space == "all" else None) for i, e in enumerate(ranked)}
    return SearchResult(ranked, time.perf_counter() - start, run.evaluated, run.pruned, notes)


class _Run:
    """One search's state: the top K, the counters, per-(tp, cp, b, sp, precision) layer costs."""

    def __init__(self, space: Space, top: int, accept):
        self.space, self.accept = space, accept
        self.shape, self.cluster = space.shape, space.cluster
        self.mem = self.cluster.mem_per_device
        self.best = _TopK(top)
        self.pipelines = _TopK(REFINE_PLANS)  # the fastest one-chunk pipeline plans, to refine
        self.evaluated = self.pruned = self.candidates = 0
        self._layers, self._stages, self._fb, self._tp_held = {}, {}, {}, {}
        self.kinds = Counter(layer_kinds(self.shape))  # layers of each kind
        # the routed experts' weights, all blocks, that ep > 1 splits
        self.experts = sum(n * split_experts(self.shape, k, 2) for k, n in self.kinds.items())

    def layers(self, plan: Plan) -> tuple[dict, dict, float, float]:
        """One microbatch: forward+backward s of each kind of layer (embed, block, moe, head);
        its full-recompute replay s (0 but for blocks); the stash bytes of all layers, without
        and with full recompute."""
        key = (plan.tp, plan.cp, plan.ep, plan.micro_batch, plan.sequence_parallel, plan.precision)
        if key not in self._layers:
            t, r, _, a, c, _ = layer_costs(self.shape, self.cluster, plan)
            kinds = layer_kinds(self.shape)
            self._layers[key] = (dict(zip(kinds, t)), dict(zip(kinds, r)), sum(a), sum(c))
        return self._layers[key]

    def stage_times(self, plan: Plan, recompute: bool = False) -> list[float]:
        """Forward + backward of one microbatch per stage (+ each block's full replay)."""
        t, r, _, _ = self.layers(plan)
        stages = plan.pp * plan.virtual_stages
        if stages not in self._stages:  # the layers of each kind per stage
            kinds = layer_kinds(self.shape)
            self._stages[stages] = [Counter(kinds[i] for i in s)
                                    for s in stage_layers(self.shape, plan)]
        return [sum(n * (t[k] + r[k] * recompute) for k, n in stage.items())
                for stage in self._stages[stages]]

    def pipeline_bound(self, plan: Plan) -> float:
        """compute + tp/cp comm + bubble as step_time.py's formulas give them for these
        stages, without the sends (>= 0) and selective recompute's replay (>= 0)."""
        key = (plan.tp, plan.cp, plan.ep, plan.micro_batch, plan.sequence_parallel, plan.precision,
               plan.recompute == "full", plan.pp, plan.virtual_stages)
        if key not in self._fb:  # (slowest stage, slowest rank's chunks, all stages, stages)
            fb = self.stage_times(plan, plan.recompute == "full")
            p = plan.pp
            self._fb[key] = (max(fb), max(sum(fb[r::p]) for r in range(p)), sum(fb), len(fb))
        slowest, busiest, total, n = self._fb[key]
        p, m = plan.pp, plan.microbatches
        if p == 1 or plan.schedule == "zb-h1":
            bound = m * busiest
        elif plan.schedule == "interleaved":
            bound = m * busiest + (p - 1) * total / n
        else:
            bound = (m - 1) * slowest + total
        bound = m * busiest + bubble_scale(self.cluster, plan) * (bound - m * busiest)
        return bound * (1 - 1e-9)  # summed in another order than step_time.py

    def tp_held(self, tp: int) -> float:
        """The parameters one tp rank holds of the whole model (`rank_params`: a MoE block's
        feed-forward whole), a tied embedding and head counted once."""
        if tp not in self._tp_held:
            shape = padded(self.shape, tp)
            tied = shape.tied_head * padded_vocab(shape.vocab_size, tp) * shape.d_model / tp
            self._tp_held[tp] = sum(n * rank_params(shape, k, tp)
                                    for k, n in self.kinds.items()) - tied
        return self._tp_held[tp]

    def held(self, plan: Plan, per_param: float, per_expert: float) -> float:
        """The mean pp rank's parameters, one tp rank's / pp with the experts ep splits
        E / ep, weighed by the bytes (or shares) per parameter and per expert weight."""
        dense = (self.tp_held(plan.tp) - self.experts) * per_param
        return (dense + self.experts * per_expert / plan.ep) / plan.pp

    def shard_share(self, plan: Plan, experts: bool = False) -> float:
        """The share of its parameters a rank's optimizer updates: 1 / the ZeRO group."""
        return 1 / _shard_groups(self.cluster, plan, experts)[0] if plan.zero_stage else 1.0

    def optimizer_bound(self, plan: Plan) -> float:
        """The optimizer step on at least parameters / (tp pp) (the mean pp rank), sharded."""
        shard = self.held(plan, self.shard_share(plan), self.shard_share(plan, experts=True))
        d = self.cluster.device
        if plan.offload_optimizer:
            return (2 * COMPUTE_BYTES[plan.precision] * shard / d.host_link_bytes_per_s
                    + shard / HOST_ADAM_PARAMS_PER_S)
        return (OPTIMIZER_TRAFFIC[plan.precision] * shard
                / (d.mem_bandwidth_bytes_per_s * d.share(plan.devices)))

    def memory_bound(self, plan: Plan) -> float:
        outer = 8 if plan.diloco_h > 1 else 0
        per_param, per_expert = (
            sum(_state_bytes(plan, _shard_groups(self.cluster, plan, experts)[0])) + outer
            for experts in (False, True))
        a, c = self.layers(plan)[2:]
        stash = a if plan.recompute == "none" else c
        chunks = plan.virtual_stages if plan.offload_activations else 1
        if plan.offload_activations and plan.pp == 1:  # all but two blocks may leave
            stash = 0
        return self.held(plan, per_param, per_expert) + stash / (plan.pp * chunks)

    def fits(self, plan: Plan, groups) -> bool:
        """The memory bound first, then cost.py's exact memory (cheaper than an estimate)."""
        if self.memory_bound(plan) > self.mem:
            return False
        return sum(_memory(self.shape, self.cluster, plan, groups).values()) <= self.mem

    def grid(self) -> None:
        """Compute keys in order of their bound; stop when the K-th best beats the rest."""
        items = []
        for dp, tp, pp, cp in self.space.meshes():
            variants = self.space.sync_variants(dp, tp, cp)
            keys = self.space.compute_keys(tp, pp)
            eps = self.space.expert_splits(dp)
            for b, m in self.space.micro_batches(dp):
                for ep in eps:
                    for key in keys:
                        plan = Plan(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch=b,
                                    microbatches=m, **key)
                        items.append((self.pipeline_bound(plan), len(items), plan, variants))
                self.candidates += len(eps) * len(keys) * len(variants)
        items.sort(key=lambda x: x[:2])
        for i, (bound, _, plan, variants) in enumerate(items):
            if bound > self.best.bound:
                self.pruned += sum(len(x[3]) for x in items[i:])
                return
            self.compute_key(plan, bound, variants)

    def sync_bound(self, plan: Plan, groups, pipeline_s: float) -> float:
        """A bound on compute + comm + bubble + ZeRO-3 gathers + gradient sync, from pp rank
        0's own syncs (cost._sync_costs of its parameters; affine in the bytes, so one call
        on the sum is at most the per-stage sum). ZeRO-3: the comm stream carries every
        gather and reduce-scatter, and the step lasts at least as long. Otherwise rank 0's
        sync beyond its last backward (all of it where nothing overlaps) adds to the step."""
        dense, experts = _sync_parts(self.shape, self.cluster, plan, groups[::plan.pp])
        sync_s, gather_s = dense[0] + experts[0], dense[1] + experts[1]
        if gather_s:
            return max(pipeline_s, plan.microbatches * gather_s + sync_s)
        d = self.cluster.device
        if d.cores is None or plan.devices < d.cores:  # step_time.py's grad_sync_overlaps
            sync_s -= sum(_total(g, "input_s") + _total(g, "weight_s") for g in groups[::plan.pp])
        return pipeline_s + max(0.0, sync_s)

    def compute_key(self, base: Plan, bound: float, variants: list[dict]) -> None:
        """The sync variants of one compute key, lowest bound first; offload variants only
        for a plan that does not fit without."""
        groups = _stage_groups(self.shape, self.cluster, base)  # the same for every variant

        def lower(plan: Plan) -> float:
            return self.sync_bound(plan, groups, bound) + self.optimizer_bound(plan)

        todo = sorted((replace(base, **v) for v in variants), key=lower)
        while todo:
            plan = todo.pop(0)
            if lower(plan) > self.best.bound:
                self.pruned += 1
                more = [x for x in self.offload_twins(plan) if lower(x) <= self.best.bound]
                if more and not self.fits(plan, groups):
                    todo.extend(more)
                continue
            if not self.fits(plan, groups):
                self.pruned += 1
                todo.extend(self.offload_twins(plan))
                continue
            if self.accept is not None and self.accept(plan) is not None:
                self.pruned += 1
                continue
            e = estimate(self.shape, self.cluster, plan)
            self.evaluated += 1
            bound = e.time["compute"] + e.time["tp_cp_comm"] + e.time["bubble"]  # exact now
            self.best.add(e)
            if plan.pp > 1 and plan.virtual_stages == 1:
                self.pipelines.add(e)

    def offload_twins(self, plan: Plan) -> list[Plan]:
        if plan.offload_optimizer or plan.offload_activations:
            return []
        more = [replace(plan, **o) for o in self.space.offload_variants(plan)]
        self.candidates += len(more)
        return more

    def refine(self) -> None:
        """Rebalance the fastest pipeline plans with the MILP; keep a rebalanced plan when
        estimate() finds it faster and fitting (it replaces its even-split original). A plan
        is tried only if a perfect balance might lift it into the top K: work and bubble shrink
        by about (m + p - 1) x (its slowest stage - the mean stage without recompute), a
        screen rather than a bound (the syncs move too); estimate() has the last word."""
        from loomtrain.planner.split_milp import refine_split
        for e in self.pipelines.ranked():
            if e.step_time_s - self.balance_gain(e.plan) >= self.best.bound:
                continue
            plan = refine_split(self.shape, self.cluster, e.plan, time_limit_s=REFINE_TIME_LIMIT_S)
            if plan is None or (self.accept is not None and self.accept(plan) is not None):
                continue
            better = estimate(self.shape, self.cluster, plan)
            self.evaluated += 1
            if better.fits and better.step_time_s < e.step_time_s:
                self.best.remove(e)
                self.best.add(better)

    def balance_gain(self, plan: Plan) -> float:
        t = self.layers(plan)[0]
        fb = self.stage_times(plan, plan.recompute != "none")
        lowest = sum(n * t[k] for k, n in self.kinds.items()) / plan.pp
        return (plan.microbatches + plan.pp - 1) * (max(fb) - lowest)
