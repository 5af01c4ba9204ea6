"""The fast side of optimal.py: a memory model that depends on the order alone, and a greedy
planner of 1F1B-shaped orders on it, for instances too large for the MILP (and its horizon
for the others). The model and the planner: docs/pipeline.md, "Memory-budgeted schedule".
"""

from __future__ import annotations

import heapq

from loomtrain.parallel.pipeline.optimal_costs import (
    KEEP, OFFLOADED, RECOMPUTED, action_times, backward_kinds)
from loomtrain.parallel.pipeline.schedules import B, F, I, W, Action


def _positions(order) -> dict:
    """(kind, micro-batch) -> its position in one rank's compute order."""
    return {(a.kind, a.microbatch): p for p, a in enumerate(order)}


def _intervals(pos: dict, m: int, decision: str, c, split: bool):
    """Where pair m counts, as (first, last, bytes) over check keys: position p's start is 4p
    (a recomputed K's check), its reload check 4p+1, its end 4p+3 (an F's check)."""
    K, R = backward_kinds(split)
    pf, pk, pr = pos[F, m], pos[K, m], pos[R, m]
    full, inp = c.activation_bytes, c.input_bytes
    if decision == KEEP:
        return [(4 * pf + 1, 4 * pr + 1, full)]
    if decision == RECOMPUTED:
        return [(4 * pf + 1, 4 * pr + 1, inp), (4 * pk, 4 * pr + 1, full - inp)]
    return [(4 * pf + 3, 4 * pf + 4, full), (4 * (pk - 1), 4 * pr + 1, full)]


def _checks(pos: dict, m: int, decision: str, split: bool) -> list[int]:
    K, _ = backward_kinds(split)
    pf, pk = pos[F, m], pos[K, m]
    return [4 * pf + 3] + {KEEP: [], RECOMPUTED: [4 * pk], OFFLOADED: [4 * pk - 3]}[decision]


def levels(order, decisions, c, split: bool) -> list[tuple[int, float]]:
    """(check key, bytes) at every memory check of one rank's compute `order` under
    `decisions` (one per micro-batch): the model's accounting, which bounds simulate()'s
    peak_bytes from above."""
    pos = _positions(order)
    spans = [iv for m, d in enumerate(decisions) for iv in _intervals(pos, m, d, c, split)]
    keys = sorted(k for m, d in enumerate(decisions) for k in _checks(pos, m, d, split))
    return [(k, sum(b for lo, hi, b in spans if lo <= k <= hi)) for k in keys]


def _fits(order, decisions, c, split: bool, budget: float) -> bool:
    return all(level <= budget * (1 + 1e-9) for _, level in levels(order, decisions, c, split))


def _fit_rank(order, c, split: bool, budget: float) -> list[str] | None:
    """Greedy decisions that fit `order` in `budget`: sweep the checks in order; where one
    exceeds, offload the live kept pair whose backward comes last (if its copies can leave
    before the check and come back after it), else recompute it; None if nothing is left."""
    M = len(order) // (3 if split else 2)
    K, R = backward_kinds(split)
    pos = _positions(order)
    decisions = [KEEP] * M
    spans = [_intervals(pos, m, KEEP, c, split) for m in range(M)]
    todo = [4 * pos[F, m] + 3 for m in range(M)]
    heapq.heapify(todo)
    while todo:
        key = heapq.heappop(todo)
        level = sum(b for iv in spans for lo, hi, b in iv if lo <= key <= hi)
        while level > budget * (1 + 1e-9):
            live = [m for m in range(M) if decisions[m] == KEEP
                    and 4 * pos[F, m] + 1 <= key <= 4 * pos[R, m] + 1]
            out = [m for m in live if c.copies_hide(split) and 4 * pos[F, m] + 4 < key < 4 * (pos[K, m] - 1)]
            back = [m for m in live if key < 4 * pos[K, m] and c.input_bytes < c.activation_bytes]
            choice = OFFLOADED if out else RECOMPUTED
            if not (out or back):
                return None
            m = max(out or back, key=lambda m: pos[K, m])
            decisions[m] = choice
            spans[m] = _intervals(pos, m, choice, c, split)
            heapq.heappush(todo, _checks(pos, m, choice, split)[1])
            level = sum(b for iv in spans for lo, hi, b in iv if lo <= key <= hi)
    return decisions


# --- orders and their timeline -------------------------------------------------------------

def _order(r: int, microbatches: int, warmup: int, lag: int, split: bool) -> list[Action]:
    """Rank r's 1F1B-shaped order: `warmup` forwards, then a forward and a backward in turn;
    split, each I is followed by the W of `lag` micro-batches before (ZB-H1: lag = r, warmup
    pp-r-1; 1F1B: warmup pp-r-1; serial: warmup 0, lag 0), the rest at the end."""
    K, _ = backward_kinds(split)
    warmup = min(warmup, microbatches)
    order = [Action(F, m, r) for m in range(warmup)]
    weights = [Action(W, m, r) for m in range(microbatches)] if split else []
    for k in range(microbatches):
        if warmup + k < microbatches:
            order.append(Action(F, warmup + k, r))
        order.append(Action(K, k, r))
        if split and k >= lag:
            order.append(weights.pop(0))
    return order + weights


def _timeline(orders, costs, recompute) -> tuple[float, float]:
    """(makespan, summed span idle) of the compute timeline simulate() gives these orders when
    no copy delays a compute: each compute as soon as its rank is free and its input arrived."""
    duration, pp = action_times(costs, recompute), len(orders)
    end: dict[tuple, float] = {}
    clock, nxt = [0.0] * pp, [0] * pp
    progressed = True
    while progressed:
        progressed = False
        for r, order in enumerate(orders):
            while nxt[r] < len(order):
                a = order[nxt[r]]
                m, s = a.microbatch, a.stage
                src = s - 1 if a.kind == F else s + 1 if a.kind in (B, I) else -1
                src = src if 0 <= src < pp else None
                if src is not None and (a.kind, m, src) not in end:
                    break
                ready = end[a.kind, m, src] + costs[src].send if src is not None else 0.0
                clock[r] = end[a.kind, m, s] = max(clock[r], ready) + duration(a)
                nxt[r], progressed = nxt[r] + 1, True
    assert all(n == len(o) for n, o in zip(nxt, orders)), "orders deadlock"
    first = [end[F, 0, r] - costs[r].f for r in range(pp)]
    plain = action_times(costs)
    useful = [sum(plain(a) for a in order) for order in orders]
    return max(clock), sum(c - f - u for c, f, u in zip(clock, first, useful))


def _recomputed(decisions) -> frozenset:
    return frozenset((m, r) for r, ds in enumerate(decisions) for m, d in enumerate(ds) if d == RECOMPUTED)


def heuristic(pp: int, microbatches: int, costs, budgets, split: bool):
    """(orders, decisions, makespan) of the best fitted order: warm-up forwards from 1F1B's
    pp-r-1 up to ZB-H2's 2(pp-r)-1 on rank r, W's deferred by r micro-batches (ZB-H1) or not,
    and the serial order (one micro-batch in flight), which fits any budget that holds one
    micro-batch's activations."""
    M = microbatches
    shapes = [([min(M, pp - r - 1 + min(extra, pp - r)) for r in range(pp)], lags)
              for extra in range(pp + 1) for lags in (list(range(pp)), [0] * pp)]
    best = None
    for warmups, lags in shapes + [([0] * pp, [0] * pp)]:
        orders = [_order(r, M, warmups[r], lags[r] if split else 0, split) for r in range(pp)]
        decisions = [_fit_rank(orders[r], costs[r], split, budgets[r]) for r in range(pp)]
        if any(d is None for d in decisions):
            continue
        key = _timeline(orders, costs, _recomputed(decisions))
        if best is None or key < best[3]:
            best = (orders, decisions, key[0], key)
    return best[:3]


def prune(orders, decisions, costs, split, budgets):
    """Turns back to KEEP the offloads and recomputes the budget does not need (later pairs
    first): the MILP's objective is indifferent to an offload that saves nothing."""
    decisions = [list(ds) for ds in decisions]
    for r, ds in enumerate(decisions):
        for m in reversed(range(len(ds))):
            if ds[m] != KEEP:
                trial = ds[:m] + [KEEP] + ds[m + 1:]
                if _fits(orders[r], trial, costs[r], split, budgets[r]):
                    ds[m] = KEEP
    return decisions


