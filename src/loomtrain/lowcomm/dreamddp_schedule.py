"""DreamDDP's schedule (pure): which iteration of the H-step period syncs each unit (layer),
chosen by a branch and bound to minimize the communication the backward does not hide.

Tang et al., arXiv 2502.11058, section on scheduling. The cost model, the search and how it
differs from the paper's: docs/lowcomm-dreamddp.md, "The schedule".
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

DEFAULT_BUDGET = 100_000  # nodes: ~1 s of Python at most, once per run


@dataclass(frozen=True)
class Plan:
    """A schedule: `iteration[u]` in 0..H-1 for every unit u (backward order), its predicted
    exposed seconds per period, the naive schedule's, and whether the search was exhaustive."""

    iteration: tuple[int, ...]
    exposed_s: float
    naive_exposed_s: float
    exact: bool


def exposed_s(backward_s, comm_s, iteration, iterations: int, latency_s: float = 0.0) -> float:
    """Seconds of communication not hidden by the backward, summed over the H iterations of
    a period, for units in backward order assigned to `iteration`."""
    ready = list(accumulate(backward_s))
    end = ready[-1] if ready else 0.0
    free = [None] * iterations  # when each iteration's link has sent what was queued on it
    for r, c, k in zip(ready, comm_s, iteration):
        free[k] = max(free[k] or 0.0, r) + c
    return sum(max(0.0, f + latency_s - end) for f in free if f is not None)


def backward_order(ready_s) -> tuple[list[int], list[float]]:
    """(the units in backward order, each one's backward seconds) from the time each unit's
    gradients were complete, counted from the start of the backward."""
    order = sorted(range(len(ready_s)), key=lambda u: ready_s[u])
    done = [0.0] + [ready_s[u] for u in order]
    return order, [b - a for a, b in zip(done, done[1:])]


def naive(units: int, iterations: int) -> tuple[int, ...]:
    """Every unit in the period's last iteration: local SGD's timing, with DreamDDP's overlap."""
    return (iterations - 1,) * units


def plan(backward_s, comm_s, iterations: int, latency_s: float = 0.0,
         budget: int = DEFAULT_BUDGET) -> Plan:
    """The schedule of least exposed time found (lowcomm-dreamddp.md): exact within `budget`."""
    if iterations < 1:
        raise ValueError(f"need at least one iteration per period, got {iterations}")
    n = len(backward_s)
    if len(comm_s) != n:
        raise ValueError(f"{n} backward times but {len(comm_s)} communication times")
    ready = list(accumulate(backward_s))
    # an iteration's link is exposed past `end`: the backward's end less the latency
    end = (ready[-1] if n else 0.0) - latency_s
    # a unit's all-reduce ends at r_u + c_u at the earliest, wherever it goes
    need = [max(0.0, r + c - end) for r, c in zip(ready, comm_s)]
    need_after = list(accumulate(reversed(need + [0.0]), max))[::-1]  # max over units >= u
    naive_plan = naive(n, iterations)
    naive_cost = exposed_s(backward_s, comm_s, naive_plan, iterations, latency_s)
    best = [naive_cost, naive_plan]
    free, exposed, assign = [0.0] * iterations, [0.0] * iterations, [0] * n
    nodes = 0
    comm_after = list(accumulate(reversed(list(comm_s) + [0.0])))[::-1]  # sum over units >= u
    hideable_after = list(accumulate(reversed([min(c, max(0.0, end - r))
                                               for r, c in zip(ready, comm_s)]
                                              + [0.0])))[::-1]

    def _left_at_least(u: int, used: int) -> float:
        """A lower bound on what units u.. add to the exposed time. An iteration's exposed
        time f - end is at least the link's work after `end`, so the units left add at least
        their comm less what they do before `end`: at most each one's own window (end - r_v),
        and at most the link time left before `end` from r_u on. Also, each of them alone
        ends at r_v + c_v at the earliest."""
        capacity = (sum(max(0.0, end - max(f, ready[u])) for f in free[:used])
                    + (iterations - used) * max(0.0, end - ready[u]))
        by_work = comm_after[u] - min(capacity, hideable_after[u])
        return max(by_work, need_after[u] - max(exposed))

    def visit(u: int, used: int, cost: float) -> bool:
        """Extend `assign` from unit u; False once the budget is spent."""
        nonlocal nodes
        if u == n:
            if cost < best[0]:
                best[0], best[1] = cost, tuple(assign)
            return True
        if cost + _left_at_least(u, used) >= best[0]:
            return True
        nodes += 1
        if nodes > budget:
            return False
        options = range(min(used + 1, iterations))
        for k in sorted(options, key=lambda k: max(free[k], ready[u])):
            old_free, old_exposed = free[k], exposed[k]
            free[k] = max(old_free, ready[u]) + comm_s[u]
            exposed[k] = max(0.0, free[k] - end)
            assign[u] = k
            done = visit(u + 1, max(used, k + 1), cost + exposed[k] - old_exposed)
            free[k], exposed[k] = old_free, old_exposed
            if not done:
                return False
        return True

    exact = visit(0, 0, 0.0)
    return Plan(best[1], exposed_s(backward_s, comm_s, best[1], iterations, latency_s),
                naive_cost, exact)


def shared_last(iteration, shared, iterations: int) -> tuple[int, ...]:
    """`iteration` (per unit) with the `shared` units in the period's last iteration: those
    holding a tensor that several pipeline stages hold, each stage planning its own units,
    whose copies must sync at the same iteration on every stage. The H iterations of a
    period are alike in the cost (`exposed_s` sums over them), so where the shared units
    share an iteration it trades labels with the last, at no cost; otherwise they move there."""
    last = iterations - 1
    at = {iteration[u] for u in shared}
    if len(at) == 1:
        k = at.pop()
        swap = {k: last, last: k}
        return tuple(swap.get(k, k) for k in iteration)
    return tuple(last if u in shared else k for u, k in enumerate(iteration))


def fit_alpha_beta(samples) -> tuple[float, float]:
    """(alpha seconds per op, seconds per wire byte) of measured (wire bytes, seconds) pairs:
    least squares of seconds = alpha + bytes x beta, each clamped at 0 (a noisy fit must not
    predict negative times). With one distinct size, all of it is alpha."""
    samples = list(samples)
    if not samples:
        return 0.0, 0.0
    n = len(samples)
    mean_x = sum(x for x, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    var = sum((x - mean_x) ** 2 for x, _ in samples)
    if var == 0:
        return max(0.0, mean_y), 0.0
    beta = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in samples) / var)
    return max(0.0, mean_y - beta * mean_x), beta
