"""Uneven pipeline stage splits and per-layer recompute, chosen together as one mixed-integer
program (the operator-level MIP planning idea, arXiv 2503.09357; OptPipe, arXiv 2510.05186),
solved by HiGHS through scipy.optimize.milp. The program, why its variables are cumulative,
and measurements: docs/planner-search.md, "Stage split MILP".
"""

from __future__ import annotations

from itertools import combinations, product

import numpy as np


def inflight(schedule: str, pp: int, microbatches: int, offload_activations: float = 0.0) -> list[float]:
    """Microbatch stashes each stage keeps, as cost.py's _memory counts them (one stage per
    rank, no interleaving): GPipe all m; 1F1B and zb-h1 min(m, p - s) (Narayanan et al. 2021,
    sec. 2.2); no pipeline one. Offloading a fraction f keeps (1 - f) of them plus the one
    being computed."""
    if pp == 1:
        counts = [1] * pp
    elif schedule == "gpipe":
        counts = [microbatches] * pp
    else:
        counts = [min(microbatches, pp - s) for s in range(pp)]
    f = offload_activations
    return [n * (1 - f) + (1 if f else 0) for n in counts]


def _check(t, r, p, a, c, stages, inflight_):
    n = len(t)
    assert all(len(v) == n for v in (r, p, a, c)), "t, r, p, a, c need one entry per layer"
    assert len(inflight_) == stages, "inflight needs one entry per stage"
    assert 1 <= stages <= n, f"{stages} stages for {n} layers"


def solve_split(t, r, p, a, c, budget, stages, inflight, time_limit_s: float = 5.0,
                max_bottleneck_s: float | None = None):
    """(layers per stage, recompute flag per layer, the slowest stage's time) minimizing that
    time under the memory budget, or None when no split fits. With `time_limit_s` reached the
    best split found so far is returned (HiGHS's incumbent), or None if it has none."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array
    _check(t, r, p, a, c, stages, inflight)
    n, S = len(t), stages
    t, r, p, a, c = (np.asarray(v, dtype=float) for v in (t, r, p, a, c))
    nu, nw = n * (S - 1), n * S

    def U(l, s):  # the column of u[l,s], s < S - 1
        return l * (S - 1) + s

    def W(l, s):  # the column of w[l,s]
        return nu + l * S + s

    T, nv = nu + nw, nu + nw + 1
    # scale times and bytes to O(1) so HiGHS's tolerances mean the same at every model size
    t_unit = max(float(t.max()), 1e-30)
    b_unit = max(float(budget), 1.0)
    data, cols, rows, lo, hi = [], [], [], [], []

    def row(entries, lower, upper):
        for j, x in entries:
            rows.append(len(lo))
            cols.append(j)
            data.append(x)
        lo.append(lower)
        hi.append(upper)

    def x(l, s, coef):
        """coef * x[l,s] as (entries, constant): x[l,s] = u[l,s] - u[l,s-1], u[l,-1] = 0,
        u[l,S-1] = 1."""
        entries = [(U(l, s), coef)] if s < S - 1 else []
        if s > 0:
            entries.append((U(l, s - 1), -coef))
        return entries, (coef if s == S - 1 else 0.0)

    def stage_row(s, coef_x, w_entries, lower, upper):
        entries, const = list(w_entries), 0.0
        for l in range(n):
            e, k = x(l, s, coef_x[l])
            entries += e
            const += k
        row(entries, lower - const, upper - const)

    for l in range(n):
        for s in range(S - 2):
            row([(U(l, s), 1), (U(l, s + 1), -1)], -np.inf, 0)
        for s in range(S - 1):
            if l < n - 1:
                row([(U(l + 1, s), 1), (U(l, s), -1)], -np.inf, 0)
        for s in range(S):
            e, k = x(l, s, -1.0)
            row([(W(l, s), 1), *e], -np.inf, -k)
    for s in range(S):
        stage_row(s, [1.0] * n, [], 1, np.inf)
        stage_row(s, t / t_unit, [(W(l, s), r[l] / t_unit) for l in range(n)] + [(T, -1)], -np.inf, 0)
        k = inflight[s]
        stage_row(s, (p + k * a) / b_unit, [(W(l, s), -k * (a[l] - c[l]) / b_unit) for l in range(n)],
                  -np.inf, budget / b_unit)
    objective = np.zeros(nv)
    objective[T] = 1.0
    objective[nu:T] = 1e-6 / n  # fewer recomputed layers among equal bottlenecks
    integrality = np.ones(nv)
    integrality[T] = 0
    lower, upper = np.zeros(nv), np.ones(nv)
    upper[T] = np.inf if max_bottleneck_s is None else max_bottleneck_s / t_unit
    for l in range(n):  # layer l lies on a stage in [l - (n - S), l]: every stage holds one
        for s in range(S - 1):
            if s >= l:
                lower[U(l, s)] = 1
            if s < l - (n - S):
                upper[U(l, s)] = 0
    res = milp(objective, integrality=integrality, bounds=Bounds(lower, upper),
               constraints=LinearConstraint(coo_array((data, (rows, cols)), shape=(len(lo), nv)), lo, hi),
               options={"time_limit": time_limit_s, "mip_rel_gap": 1e-6})
    if res.x is None:
        return None
    u = np.round(res.x[:nu]).reshape(n, S - 1)
    below = np.concatenate([u, np.ones((n, 1))], axis=1).sum(axis=0)  # layers on stages <= s
    split = tuple(int(v) for v in np.diff(np.concatenate([[0], below])))
    flags = _fewest_recomputes(p, a, c, budget, split, inflight, r,
                               [bool(v) for v in np.round(res.x[nu:T]).reshape(n, S).sum(axis=1)])
    return split, flags, _bottleneck(t, r, split, flags)


def _fewest_recomputes(p, a, c, budget, split, inflight, r, flags) -> tuple[bool, ...]:
    """Clear the recompute flags a stage does not need to fit, the costliest replay first:
    off the slowest stage they cost the MILP's objective nothing, so it may leave them set."""
    flags, start = list(flags), 0
    for s, size in enumerate(split):
        layers = range(start, start + size)
        used = sum(p[i] + inflight[s] * (c[i] if flags[i] else a[i]) for i in layers)
        for i in sorted((i for i in layers if flags[i]), key=lambda i: -r[i]):
            extra = inflight[s] * (a[i] - c[i])
            if used + extra <= budget:
                flags[i], used = False, used + extra
        start += size
    return tuple(flags)


def _bottleneck(t, r, split, flags) -> float:
    out, start = 0.0, 0
    for size in split:
        out = max(out, sum(t[i] + (r[i] if flags[i] else 0.0) for i in range(start, start + size)))
        start += size
    return float(out)


def brute_force_split(t, r, p, a, c, budget, stages, inflight):
    """solve_split by enumeration (every split, every recompute subset): for tests on a few
    layers. Ties in the bottleneck go to the fewest recomputed layers."""
    _check(t, r, p, a, c, stages, inflight)
    n = len(t)
    best = None
    for cuts in combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        split = tuple(b - a_ for a_, b in zip(bounds, bounds[1:]))
        for flags in product((False, True), repeat=n):
            fits = all(
                sum(p[i] + inflight[s] * (c[i] if flags[i] else a[i]) for i in range(lo, hi)) <= budget
                for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])))
            if not fits:
                continue
            key = (_bottleneck(t, r, split, flags), sum(flags))
            if best is None or key < best[0]:
                best = (key, split, flags)
    return None if best is None else (best[1], best[2], best[0][0])


def refine_split(shape, cluster, plan, time_limit_s: float = 5.0):
    """`plan` with the MILP's split and per-block recompute flags (Plan.split counts embed and
    head as layers; recompute_layers has one flag per block), or None when the MILP finds
    nothing faster than the plan's own even split or the plan is not a one-chunk pipeline.
    The caller checks the result with cost.estimate, which the MILP only approximates (it
    balances the slowest stage; the schedule's formula and the syncs come on top)."""
    from dataclasses import replace

    from loomtrain.planner.cost import WEIGHT_BYTES, layer_costs, stage_layers
    if plan.pp < 2 or plan.virtual_stages != 1 or plan.diloco_h != 1:
        return None
    t, r, p, a, c, budget = layer_costs(shape, cluster, plan)
    if plan.zero_stage == 3:  # the computing and the prefetched unit, gathered whole
        budget -= 2 * _largest_layer_params(shape, plan) * WEIGHT_BYTES[plan.precision]
    keep = inflight(plan.schedule, plan.pp, plan.microbatches, plan.offload_activations)
    # the plan's own slowest stage caps the MILP's T (it prunes HiGHS's tree; a cap no split
    # meets ends the search early); selective recompute, which layer_costs cannot time, is
    # capped by full recompute's (slower) and left to estimate() to judge
    full = plan.recompute != "none"
    now = max(sum(t[i] + (r[i] if full else 0.0) for i in rng) for rng in stage_layers(shape, plan))
    if plan.recompute == "none" and min_bottleneck(t, plan.pp) >= now * (1 - 1e-9):
        return None  # no split is faster even with unlimited memory: the MILP cannot win
    solved = solve_split(t, r, p, a, c, budget, plan.pp, keep, time_limit_s, max_bottleneck_s=now)
    if solved is None:
        return None
    split, flags, bottleneck = solved
    if plan.recompute != "selective" and bottleneck >= now * (1 - 1e-9):
        return None
    return replace(plan, split=split, recompute_layers=flags[1:-1], recompute="none")


def min_bottleneck(t, stages: int) -> float:
    """A lower bound, within 1e-12 relative, on the slowest stage of any contiguous split of
    times t into `stages` stages without recompute (the MILP without its memory rows): a
    bisection on T, packing layers greedily while they fit under T."""
    def stages_needed(limit):
        count, load = 1, 0.0
        for x in t:
            if load + x > limit:
                count, load = count + 1, 0.0
            load += x
        return count

    lo, hi = max(max(t), sum(t) / stages), sum(t)
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if stages_needed(mid) <= stages else (mid, hi)
    return lo


def _largest_layer_params(shape, plan) -> float:
    from loomtrain.planner.cost import layer_kinds, padded, rank_params
    held = padded(shape, plan.tp)
    return max(rank_params(held, k, plan.tp, plan.ep) for k in set(layer_kinds(shape)))
