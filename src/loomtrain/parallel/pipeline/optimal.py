"""Memory-budgeted pipeline schedules (schedule = "optimal"): every rank's order and each
(micro-batch, stage) pair's keep, offload or recompute, chosen together to finish first under
a per-rank activation budget (the OptPipe idea, arXiv 2510.05186, on zero-bubble's split
backward, arXiv 2401.10241). What every plan assumes, the solvers and the limits:
docs/pipeline.md, "Memory-budgeted schedule".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from loomtrain.parallel.pipeline.optimal_costs import (
    OFFLOADED, RECOMPUTED, action_times, backward_kinds)
from loomtrain.parallel.pipeline.optimal_heuristic import heuristic, prune
from loomtrain.parallel.pipeline.schedules import (
    B, COMPUTE, F, I, OFFLOAD, RELOAD, SEND_F, W, Action, Schedule, from_compute_orders,
    one_f_one_b, simulate, with_offload, zb_h1)

MILP_PAIRS = 32  # pp * microbatches up to which solve() tries the MILP (pp=4, M=8: 6-9 s here)


@dataclass(frozen=True)
class Plan:
    """`makespan`, `idle` (per rank, within the makespan), `span_idle` (per rank, between its
    first and last compute: zero-bubble's bubble, what a rank loses when consecutive steps
    overlap), `bubble` (sum(idle) / (pp * makespan)) and `peak_bytes` come from simulate();
    `objective`: the MILP's makespan on its grid (equal to `makespan` when the grid holds the
    costs exactly), the heuristic's own timing otherwise; `method`: "milp", "heuristic" or "baseline" (a fixed-rule
    schedule made to fit, when it beat the search: `_no_worse_than_baselines`);
    `status`: the solver's word ("optimal", "time limit", why the heuristic's plan stands)."""
    schedule: Schedule
    makespan: float
    objective: float
    idle: tuple[float, ...]
    span_idle: tuple[float, ...]
    bubble: float
    peak_bytes: tuple[float, ...]
    method: str
    status: str
    solve_s: float


# --- the byte-level peak, and a schedule measured under costs -------------------------------

def peak_bytes(schedule: Schedule, result, costs) -> tuple[float, ...]:
    """Each rank's most activation bytes at once in simulate()'s `result`, counted as
    peak_stash counts pairs: a pair from its F's end (its input only if recomputed; all of it
    again from its backward's start) to its release (W, or B's end), less the time from its
    OFFLOAD's end to its RELOAD's start; at equal times releases count first."""
    peaks = []
    for spans in result.spans:
        events = []
        for a, t0, t1 in spans:
            c, rec = costs[a.stage], (a.microbatch, a.stage) in schedule.recompute
            full, kept = c.activation_bytes, c.input_bytes if rec else c.activation_bytes
            if a.kind == F:
                events.append((t1, kept))
            elif rec and a.kind in (B, I):
                events.append((t0, full - kept))
            if a.kind in (W, B, OFFLOAD):
                events.append((t1, -full))
            elif a.kind == RELOAD:
                events.append((t0, full))
        level = peak = 0.0
        for _, delta in sorted((round(t, 9), d) for t, d in events):  # sums of floats: ties
            level += delta
            peak = max(peak, level)
        peaks.append(peak)
    return tuple(peaks)


def measure(schedule: Schedule, costs) -> dict:
    """simulate() under `costs`: makespan, idle and span idle per rank (recomputation counts
    as idle: it is work done twice), bubble (idle / (pp * makespan)), peak bytes per rank."""
    res = simulate(schedule, action_times(costs, schedule.recompute))
    plain = action_times(costs)
    idle, span_idle = [], []
    for spans in res.spans:
        computes = [(a, t0, t1) for a, t0, t1 in spans if a.kind in COMPUTE]
        useful = sum(plain(a) for a, _, _ in computes)
        idle.append(res.makespan - useful)
        span_idle.append(max(t1 for *_, t1 in computes) - min(t0 for _, t0, _ in computes) - useful)
    return {"makespan": res.makespan, "idle": tuple(idle), "span_idle": tuple(span_idle),
            "bubble": sum(idle) / (len(idle) * res.makespan), "peak_bytes": peak_bytes(schedule, res, costs)}


# --- the schedule of a plan ---------------------------------------------------------------

def to_schedule(orders, decisions, split: bool, name: str = "optimal") -> Schedule:
    """The Schedule of per-rank compute `orders` (Actions) and per-rank `decisions`: sends and
    receives from from_compute_orders, an OFFLOAD after each offloaded pair's F (and its
    send), its RELOAD right before the compute ahead of its backward, the recomputed pairs."""
    K, _ = backward_kinds(split)
    pp, microbatches = len(orders), len(decisions[0])
    base = from_compute_orders(name, pp, microbatches, 1, orders)
    actions = []
    for r, acts in enumerate(base.actions):
        acts = list(acts)
        for m in (m for m, d in enumerate(decisions[r]) if d == OFFLOADED):
            send = Action(SEND_F, m, r)
            acts.insert(acts.index(send if send in acts else Action(F, m, r)) + 1, Action(OFFLOAD, m, r))
            host = orders[r][orders[r].index(Action(K, m, r)) - 1]
            acts.insert(acts.index(host), Action(RELOAD, m, r))
        actions.append(tuple(acts))
    recompute = frozenset((m, r) for r, ds in enumerate(decisions) for m, d in enumerate(ds)
                          if d == RECOMPUTED)
    return replace(base, actions=tuple(actions), recompute=recompute)




# --- the API -------------------------------------------------------------------------------

def check_budget(pp: int, microbatches: int, costs, budget_bytes) -> tuple[list[float], bool]:
    """(each rank's budget, whether every stage has split backward costs); ValueError when no
    schedule can fit (a stage's one micro-batch exceeds its budget) or the sizes disagree."""
    if pp < 1 or microbatches < 1:
        raise ValueError(f"need pp >= 1 and microbatches >= 1, got {pp}, {microbatches}")
    if len(costs) != pp:
        raise ValueError(f"need one StageCosts per stage: {len(costs)} for pp={pp} (one stage per rank)")
    budgets = list(budget_bytes) if isinstance(budget_bytes, (list, tuple)) else [budget_bytes] * pp
    if len(budgets) != pp:
        raise ValueError(f"budget_bytes: one number, or one per rank ({pp}); got {len(budgets)}")
    for s, (c, budget) in enumerate(zip(costs, budgets)):
        if budget < c.activation_bytes:
            raise ValueError(
                f"budget_bytes={budget:g} on rank {s} is below one micro-batch's activations on "
                f"stage {s} ({c.activation_bytes:g} bytes, of which {c.input_bytes:g} are its input): "
                "its backward needs them all at once, even when recomputed; no schedule fits")
    return budgets, all(c.split for c in costs)


def solve(pp: int, microbatches: int, costs, budget_bytes, time_limit_s: float = 20.0,
          method: str = "auto") -> Plan:
    """The plan with the least makespan (ties: the least idle per rank) whose activations fit
    `budget_bytes` (bytes per rank: one number or one per rank) under `costs` (one StageCosts
    per stage; the backward is split into I and W when every stage has i and w). `method`:
    "milp", "heuristic", or "auto" (the MILP when pp * microbatches <= MILP_PAIRS). The MILP's
    horizon is the heuristic's makespan; the heuristic's plan stands when the MILP finds none
    within `time_limit_s`, or none better within budget under the real costs."""
    if method not in ("auto", "milp", "heuristic"):
        raise ValueError(f"method must be 'auto', 'milp' or 'heuristic', got {method!r}")
    budgets, split = check_budget(pp, microbatches, costs, budget_bytes)
    t0 = time.perf_counter()
    orders, decisions, objective = heuristic(pp, microbatches, costs, budgets, split)
    best = _planned(orders, decisions, costs, budgets, split) + (objective, "heuristic", "greedy")
    if method == "milp" or (method == "auto" and pp * microbatches <= MILP_PAIRS):
        from loomtrain.parallel.pipeline.optimal_milp import solve_milp  # imports scipy

        found = solve_milp(pp, microbatches, costs, budgets, split, (orders, decisions), time_limit_s)
        if found is None:
            best = best[:4] + ("milp found no plan within the horizon and time limit",)
        else:
            orders, decisions, objective, status = found
            schedule, got = _planned(orders, decisions, costs, budgets, split)
            fits = all(p <= b * (1 + 1e-9) for p, b in zip(got["peak_bytes"], budgets))
            if fits and _rank(got) <= _rank(best[1]):
                best = (schedule, got, objective, "milp", status)
            else:
                best = best[:4] + (f"milp ({status}) gave no better plan within budget",)
    best = _no_worse_than_baselines(pp, microbatches, costs, budgets, split, best)
    schedule, got, objective, used, status = best
    return Plan(schedule, got["makespan"], objective, got["idle"], got["span_idle"], got["bubble"],
                got["peak_bytes"], used, status, time.perf_counter() - t0)


def _planned(orders, decisions, costs, budgets, split) -> tuple[Schedule, dict]:
    schedule = to_schedule(orders, prune(orders, decisions, costs, split, budgets), split)
    return schedule, measure(schedule, costs)


def _no_worse_than_baselines(pp, microbatches, costs, budgets, split, best) -> tuple:
    """`best`, or a fixed-rule baseline (1F1B, ZB-H1 when split, made to fit by `_fitted`) that
    fits and ranks better. The search should never lose to them, but a MILP stopped by its time
    limit on a loaded machine, or the greedy heuristic, can (measured: 1F1B with offload beat a
    time-limited plan by 5% at half of ZB-H1's budget); the planner then returns the baseline."""
    baselines = {"1f1b": one_f_one_b(pp, microbatches)}
    if split:
        baselines["zb-h1"] = zb_h1(pp, microbatches)
    for name, schedule in baselines.items():
        schedule, fit = _fitted(schedule, costs, budgets)
        if fit == "does not fit":
            continue
        got = measure(schedule, costs)
        if _rank(got) < _rank(best[1]):
            best = (schedule, got, got["makespan"], "baseline",
                    f"{name} ({fit}) beat the search's plan ({best[3]}: {best[4]})")
    return best


def _rank(got: dict) -> tuple[float, float]:
    return round(got["makespan"], 9), round(sum(got["span_idle"]), 9)


def plan_for_config(pp: int, microbatches: int, costs, budget_bytes) -> Schedule:
    """schedule = "optimal": the runtime's entry, with the costs it measured in a profiling step."""
    return solve(pp, microbatches, costs, budget_bytes).schedule


def _fitted(schedule: Schedule, costs, budgets) -> tuple[Schedule, str]:
    """A baseline made to fit the budget by a fixed rule: as it is if its peak fits; else the
    smallest with_offload fraction k/M that fits (stages that copy); else every pair of the
    ranks over budget recomputed; else it as it is, marked as not fitting."""
    def fits(s):
        return all(p <= b * (1 + 1e-9) for p, b in zip(measure(s, costs)["peak_bytes"], budgets))
    if fits(schedule):
        return schedule, "as is"
    M = schedule.microbatches
    if all(c.offload is not None for c in costs) and fits(with_offload(schedule, 1.0)):
        # offloading more micro-batches never raises a peak: bisect for the least k that fits
        low, high = 0, M  # with_offload(k=low) does not fit, k=high does
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if fits(with_offload(schedule, mid / M)) else (mid, high)
        return with_offload(schedule, high / M), f"offload {high}/{M}"
    over = [r for r, (p, b) in enumerate(zip(measure(schedule, costs)["peak_bytes"], budgets)) if p > b]
    trial = replace(schedule, recompute=frozenset((m, r) for r in over for m in range(M)))
    return (trial, f"recompute ranks {over}") if fits(trial) else (schedule, "does not fit")


def compare(pp: int, microbatches: int, costs, budget_bytes, **solve_kwargs) -> dict:
    """Idle time of 1F1B, ZB-H1 (split costs only) and the optimal plan under one budget:
    {name: {makespan, idle (summed over ranks, within the makespan), span_idle (summed, each
    rank between its first and last compute), bubble, peak_bytes (max over ranks), fit}}."""
    budgets, split = check_budget(pp, microbatches, costs, budget_bytes)
    baselines = {"1f1b": one_f_one_b(pp, microbatches)}
    if split:
        baselines["zb-h1"] = zb_h1(pp, microbatches)
    rows = {}
    for name, schedule in baselines.items():
        schedule, fit = _fitted(schedule, costs, budgets)
        rows[name] = {**_summary(measure(schedule, costs)), "fit": fit}
    plan = solve(pp, microbatches, costs, budgets, **solve_kwargs)
    rows["optimal"] = {**_summary(measure(plan.schedule, costs)),
                       "fit": f"{plan.method} ({plan.status}, {plan.solve_s:.2f} s)"}
    return rows


def _summary(got: dict) -> dict:
    return {"makespan": got["makespan"], "idle": sum(got["idle"]), "span_idle": sum(got["span_idle"]),
            "bubble": got["bubble"], "peak_bytes": max(got["peak_bytes"])}
