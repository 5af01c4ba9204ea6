"""The MILP of optimal.py's problem, solved by HiGHS through scipy.optimize.milp: time-indexed
(a binary per action and start slot, Sousa & Wolsey 1992) on a grid of `unit` seconds.
Variables, constraints, objective and size: docs/pipeline.md, "Memory-budgeted schedule".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from loomtrain.parallel.pipeline.optimal_costs import KEEP, OFFLOADED, RECOMPUTED, backward_kinds
from loomtrain.parallel.pipeline.optimal_heuristic import _recomputed, _timeline
from loomtrain.parallel.pipeline.schedules import F, W, Action

MAX_SLOTS = 40  # beyond, the grid coarsens (rounding the costs): at pp=4, M=8 a 49-slot horizon
# found no plan in 60 s where 27 slots solve in 6 s


def grid_unit(costs, split: bool, horizon_s: float) -> tuple[float, bool]:
    """(slot length, exact): the largest shortest-compute / q (q <= 16) on which every compute
    and send time is a whole number of slots, if the horizon fits in MAX_SLOTS of them; else
    the shortest compute itself, the other times rounded to it."""
    times = [t for c in costs for t in (c.f, c.backward(split), c.w if split else None,
                                       c.recompute_s, c.send) if t]
    shortest = min(t for c in costs for t in (c.f, c.backward(split)))
    for q in range(1, 17):
        unit = shortest / q
        if all(abs(t / unit - round(t / unit)) <= 1e-6 * t / unit for t in times):
            if horizon_s / unit <= MAX_SLOTS:
                return unit, True
            break
    return shortest, False


class _Model:
    def __init__(self):
        self.lb, self.ub, self.integer, self.rows, self.cost = [], [], [], [], []

    def var(self, lb=0.0, ub=1.0, integer=True, cost=0.0) -> int:
        for store, v in ((self.lb, lb), (self.ub, ub), (self.integer, integer), (self.cost, cost)):
            store.append(v)
        return len(self.lb) - 1

    def row(self, terms: dict, lo: float, hi: float) -> None:
        if terms:
            self.rows.append((terms, lo, hi))
        elif not lo <= 0 <= hi:
            self.rows.append(({0: 0.0}, lo, hi))  # an empty row that cannot hold: infeasible

    def solve(self, time_limit_s: float):
        r, col, val, lo, hi = [], [], [], [], []
        for k, (terms, a, b) in enumerate(self.rows):
            for i, v in terms.items():
                r.append(k)
                col.append(i)
                val.append(v)
            lo.append(a)
            hi.append(b)
        matrix = coo_array((val, (r, col)), shape=(len(self.rows), len(self.lb))).tocsr()
        cost = np.array(self.cost)  # scaled to at most 1: HiGHS solved it 2x faster so
        return milp(cost / max(cost.max(), 1.0), integrality=np.array(self.integer, dtype=int),
                    bounds=Bounds(self.lb, self.ub), constraints=LinearConstraint(matrix, lo, hi),
                    options={"time_limit": time_limit_s, "disp": False})


def _plus(*parts) -> dict:
    """The sum of (coefficient, {var: coef}) parts."""
    out: dict = {}
    for k, terms in parts:
        for i, v in terms.items():
            out[i] = out.get(i, 0.0) + k * v
    return out


class _Slots:
    """One rank's start variables: per (action, mode), x[t] (starts in slot t, for t in its
    window) and cumulative ones, cum[t] = x[lo] + ... + x[t] (defined by a row each), so that
    "started by t" and "ended by t" are one variable per mode: the rows stay short."""

    def __init__(self, model):
        self.model, self.x, self.cum, self.d = model, {}, {}, {}

    def add(self, op, mode: str, duration: int, first: int, last: int) -> None:
        if first > last:
            return
        key = (op, mode)
        self.d[key] = duration
        self.x[key] = {t: self.model.var() for t in range(first, last + 1)}
        self.cum[key] = {}
        for t in range(first, last + 1):
            self.cum[key][t] = c = self.model.var(0.0, 1.0, False)
            prev = {self.cum[key][t - 1]: -1.0} if t > first else {}
            self.model.row({c: 1.0, self.x[key][t]: -1.0, **prev}, 0, 0)

    def modes(self, op):
        return [key for key in self.x if key[0] == op]

    def _cum(self, key, t) -> dict:
        cum = self.cum[key]
        first, last = min(cum), max(cum)
        return {} if t < first else {cum[min(t, last)]: 1.0}

    def started(self, op, t) -> dict:  # start <= t
        return _plus(*((1.0, self._cum(key, t)) for key in self.modes(op)))

    def ended(self, op, t) -> dict:  # start + duration <= t
        return _plus(*((1.0, self._cum(key, t - self.d[key])) for key in self.modes(op)))

    def ends_at(self, op, t) -> dict:
        return {self.x[key][t - self.d[key]]: 1.0 for key in self.modes(op) if t - self.d[key] in self.x[key]}

    def starts_at(self, op, t) -> dict:
        return {self.x[key][t]: 1.0 for key in self.modes(op) if t in self.x[key]}

    def recomputed(self, op) -> dict:
        return {self.cum[key][max(self.cum[key])]: 1.0 for key in self.modes(op) if key[1] == "recompute"}

    @property
    def ops(self):
        return sorted({key[0] for key in self.x}, key=str)

    def window(self, op) -> range:
        return range(min(min(self.x[key]) for key in self.modes(op)),
                     max(max(self.x[key]) for key in self.modes(op)) + 1)

    def busy(self, t) -> dict:  # slot t is covered: started by t, not ended by t
        return _plus(*((1.0, self.started(op, t)) for op in self.ops),
                     *((-1.0, self.ended(op, t)) for op in self.ops))


def _windows(pp, M, dur, send, kinds, K, R, T):
    """Earliest start and the least time from start to the end (its tail) of every action,
    from the chains, the stages and each rank's remaining work; durations without recompute."""
    early, tail = {}, {}
    for m in range(M):
        for s in range(pp):
            e = max(early.get((s, F, m - 1), -dur[s][F]) + dur[s][F],
                    early[s - 1, F, m] + dur[s - 1][F] + send[s - 1] if s else 0)
            early[s, F, m] = max(e, m * dur[s][F] + (early[s, F, 0] if m else 0))
    for m in range(M):
        for s in reversed(range(pp)):
            e = max(early[s, F, m] + dur[s][F], early.get((s, K, m - 1), 0) + (dur[s][K] if m else 0),
                    early[s + 1, K, m] + dur[s + 1][K] + send[s + 1] if s + 1 < pp else 0)
            early[s, K, m] = e
            if W in kinds:
                early[s, W, m] = max(e + dur[s][K], early.get((s, W, m - 1), 0) + (dur[s][W] if m else 0))
    for m in reversed(range(M)):
        for s in range(pp):
            after = M - m
            if W in kinds:
                tail[s, W, m] = after * dur[s][W]
            kt = dur[s][K] + max(tail.get((s, K, m + 1), 0), tail.get((s, W, m), 0),
                                 send[s] + tail[s - 1, K, m] if s else 0)
            tail[s, K, m] = max(kt, sum(after * dur[s][k] for k in kinds if k != F))
        for s in reversed(range(pp)):
            ft = dur[s][F] + max(tail.get((s, F, m + 1), 0), tail[s, K, m],
                                 send[s] + tail[s + 1, F, m] if s + 1 < pp else 0)
            tail[s, F, m] = max(ft, dur[s][F] + (after - 1) * dur[s][F]
                                + sum(after * dur[s][k] for k in kinds if k != F))
    return {key: (early[key], T - tail[key]) for key in early}


@dataclass(frozen=True)
class _Grid:
    """The instance in slots: durations per stage and kind, recompute slots (None: the stage
    cannot recompute), send lags, the horizon."""
    pp: int
    M: int
    split: bool
    unit: float
    T: int
    dur: list
    rec: list
    send: list

    @property
    def kinds(self):
        return (F, *backward_kinds(self.split)) if self.split else (F, backward_kinds(False)[0])


def solve_milp(pp: int, microbatches: int, costs, budgets, split: bool, incumbent,
               time_limit_s: float):
    """(orders, decisions, makespan in seconds on the grid, status), or None when the MILP
    finds no plan within the horizon (the `incumbent` (orders, decisions)'s makespan with the
    costs on the grid) and `time_limit_s`."""
    M, (K, R) = microbatches, backward_kinds(split)
    kinds = (F, K, W) if split else (F, K)
    orders, decisions = incumbent
    unit, exact = grid_unit(costs, split, _timeline(orders, costs, _recomputed(decisions))[0])

    def slots(t: float) -> int:
        return max(1, round(t / unit)) if t else 0

    dur = [{F: slots(c.f), K: slots(c.backward(split)), W: slots(c.w) if split else 0} for c in costs]
    rec = [slots(c.recompute_s) if c.input_bytes < c.activation_bytes else None for c in costs]
    send = [round(c.send / unit) for c in costs]
    on_grid = [replace(c, f=d[F] * unit, b=None if split else d[K] * unit, i=d[K] * unit if split else None,
                       w=d[W] * unit if split else None, recompute=slots(c.recompute_s) * unit,
                       send=n * unit) for c, d, n in zip(costs, dur, send)]
    T = math.ceil(_timeline(orders, on_grid, _recomputed(decisions))[0] / unit - 1e-9)
    g = _Grid(pp, M, split, unit, T, dur, rec, send)
    windows = _windows(pp, M, dur, send, kinds, K, R, T)
    if any(lo > hi for lo, hi in windows.values()):
        return None
    model = _Model()
    C = model.var(0, T, False)
    ranks = []
    for s in range(pp):
        rk = _Slots(model)
        for kind in kinds:
            for m in range(M):
                lo, hi = windows[s, kind, m]
                rk.add((kind, m), "plain", dur[s][kind], lo, min(hi, T - dur[s][kind]))
                if kind == K and rec[s] is not None:
                    d = dur[s][K] + rec[s]
                    rk.add((kind, m), "recompute", d, lo, min(hi, T - d))
        if len({op for op, _ in rk.x}) < len(kinds) * M:  # an action with no slot in the horizon
            return None
        ranks.append(rk)
        rk.busy_at = {}
        for t in range(T):
            rk.busy_at[t] = b = model.var(0.0, 1.0, False)
            model.row(_plus((1.0, {b: 1.0}), (-1.0, rk.busy(t))), 0, 0)
    weight_end, weight_c = 1, pp * T + 1  # lexicographic: every rank's end is at most T
    model.cost[C] = weight_c
    for s, rk in enumerate(ranks):
        _rank_rows(model, g, ranks, s, costs[s], budgets[s])
        end = {v: t + rk.d[key] for key in rk.modes((R, M - 1)) for t, v in rk.x[key].items()}
        for v, t in end.items():
            model.cost[v] += weight_end * t
        model.row(_plus((1.0, {C: 1.0}), (-1.0, end)), 0, np.inf)
    result = model.solve(time_limit_s)
    if result.x is None:
        return None
    x = np.round(result.x)
    orders, decisions = [], []
    for s, rk in enumerate(ranks):
        starts = {op: (t, mode) for (op, mode), xs in rk.x.items() for t, v in xs.items() if x[v]}
        orders.append([Action(kind, m, s) for (kind, m) in sorted(starts, key=lambda op: starts[op][0])])
        decisions.append([OFFLOADED if x[rk.offload[m]] else RECOMPUTED if starts[K, m][1] == "recompute"
                          else KEEP for m in range(M)])
    status = "optimal" if result.status == 0 else "time limit"
    return orders, decisions, x[C] * unit, status if exact else f"{status}, grid {unit:.3g} s rounded"


def _rank_rows(model: _Model, g: _Grid, ranks: list, s: int, c, budget: float) -> None:
    """Rank s's rows: once per action, precedence, left-justified starts, decisions, memory."""
    rk, M, kinds, send = ranks[s], g.M, g.kinds, g.send
    K, _ = backward_kinds(g.split)
    for op in rk.ops:
        model.row({v: 1.0 for key in rk.modes(op) for v in rk.x[key].values()}, 1, 1)
    arcs = [((k, m), (k, m + 1), 0, None) for k in kinds for m in range(M - 1)]
    arcs += [((a, m), (b, m), 0, None) for a, b in zip(kinds, kinds[1:]) for m in range(M)]
    if s > 0:
        arcs += [((F, m), (F, m), send[s - 1], s - 1) for m in range(M)]
    if s + 1 < g.pp:
        arcs += [((K, m), (K, m), send[s + 1], s + 1) for m in range(M)]
    remote = {}
    for a, b, lag, src in arcs:
        other = rk if src is None else ranks[src]
        if src is not None:
            remote[b] = (other, a, lag)
        for t in rk.window(b):
            model.row(_plus((1.0, rk.started(b, t)), (-1.0, other.ended(a, t - lag))), -np.inf, 0)
    for op in rk.ops:  # left-justified
        feed = remote.get(op)
        for t in (t for t in rk.window(op) if t > 0):
            arrives = feed[0].ends_at(feed[1], t - feed[2]) if feed else {}
            model.row(_plus((1.0, rk.starts_at(op, t)), (-1.0, {rk.busy_at[t - 1]: 1.0}), (-1.0, arrives)),
                      -np.inf, 0)
    rk.offload = []
    for m in range(M):
        o = model.var(0, 1 if c.copies_hide(g.split) else 0)
        rk.offload.append(o)
        model.row(_plus((1.0, {o: 1.0}), (1.0, rk.recomputed((K, m)))), -np.inf, 1)
        for t in rk.window((K, m)):  # an offloaded K: no idle right before it, not right after its F
            if t > 0:
                model.row(_plus((1.0, rk.starts_at((K, m), t)), (1.0, {o: 1.0}),
                                (-1.0, {rk.busy_at[t - 1]: 1.0})), -np.inf, 1)
            model.row(_plus((1.0, rk.started((K, m), t)), (-1.0, rk.ended((F, m), t - 1)), (1.0, {o: 1.0})),
                      -np.inf, 1)
    _memory(model, g, rk, s, c, budget)


def _memory(model: _Model, g: _Grid, rk: _Slots, s: int, c, budget: float) -> None:
    """At each slot boundary t (simulate()'s level after the events at t, releases first),
    the pairs' bytes sum to at most the budget."""
    M, (K, R), dur, rec = g.M, backward_kinds(g.split), g.dur[s], g.rec[s]
    full, inp = c.activation_bytes / budget, c.input_bytes / budget
    off_slots = math.ceil((c.offload or 0.0) / g.unit - 1e-9)
    reach = max(dur[F], dur[K] + (rec or 0), dur[W])  # a reload starts at most this before K
    for t in range(g.T + 1):
        level = {}
        for k in range(M):
            alive = _plus((1.0, rk.ended((F, k), t)), (-1.0, rk.ended((R, k), t)))
            if not alive and not rk.started((K, k), t + reach):
                continue
            z = model.var(0, np.inf, False)
            level[z] = 1.0
            o, recomputed = rk.offload[k], rk.recomputed((K, k))
            decided = _plus((1.0, {o: 1.0}), (1.0, recomputed))
            # kept: full while alive, unless offloaded or recomputed
            model.row(_plus((1.0, {z: 1.0}), (-full, alive), (full, decided)), 0, np.inf)
            # recomputed: its input while alive, all of it from its K's start
            model.row(_plus((1.0, {z: 1.0}), (-inp, alive), (-(full - inp), rk.started((K, k), t)),
                            (full - inp, rk.ended((R, k), t)), (-full, recomputed)), -full, np.inf)
            # offloaded: from its F's end to its offload's, and from its reload to its release
            model.row(_plus((1.0, {z: 1.0}), (-full, rk.ended((F, k), t)), (full, rk.ended((F, k), t - off_slots)),
                            (-full, rk.started((K, k), t + reach)), (full, rk.ended((R, k), t)),
                            (-full, {o: 1.0})), -full, np.inf)
        model.row(level, -np.inf, 1.0)
