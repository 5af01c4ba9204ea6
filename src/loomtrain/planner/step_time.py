"""Step time from per-stage costs, in closed form: gpipe and 1f1b (Huang et al. 2019; Narayanan
et al. 2021, sec. 2.2.1), interleaved (sec. 2.2.2), zb-h1 (Qi et al. 2024, arXiv 2401.10241,
sec. 2.1), plus what cannot hide. The event simulator (simulate.py) times the same StepCosts
action by action to check it. Formulas: docs/planner.md, "Step time".
"""

from __future__ import annotations

from loomtrain.planner.plan import StepCosts


def _fb(s) -> float:
    return s.forward_s + s.backward_input_s + s.backward_weight_s + s.recompute_s


def step_time(costs: StepCosts) -> dict[str, float]:
    """The step's parts in seconds (their sum is the step time): compute, tp_cp_comm (the
    blocking collectives inside compute: tp's, cp's, ep's all-to-alls), bubble, zero3_gather,
    offload, grad_sync, optimizer."""
    p, m, v, st = costs.pp, costs.microbatches, costs.virtual_stages, costs.stages
    fb = [_fb(s) for s in st]
    ranks = [[i for i in range(len(st)) if i % p == r] for r in range(p)]
    per_rank = [sum(fb[i] for i in mine) for mine in ranks]
    busiest = max(range(p), key=lambda r: per_rank[r])
    work = m * per_rank[busiest]
    send = st[0].send_s if p > 1 else 0.0
    if p == 1:
        total = work
    elif costs.schedule == "interleaved":
        total = work + (p - 1) * sum(fb) / len(fb) + 2 * (p * v - 1) * send
    elif costs.schedule == "zb-h1":
        mean = [sum(getattr(s, k) for s in st) / len(st)
                for k in ("forward_s", "backward_input_s", "backward_weight_s")]
        total = work + (p - 1) * max(0.0, mean[0] + mean[1] - mean[2]) + 2 * (p - 1) * send
    else:
        total = (m - 1) * max(fb) + sum(fb) + 2 * (p - 1) * send
    total = work + costs.bubble_scale * (total - work)
    comm = m * sum(st[i].forward_comm_s + st[i].backward_comm_s for i in ranks[busiest])
    hide = costs.grad_sync_overlaps
    # ZeRO-3: the prefetched gathers and every microbatch's reduce-scatter share the comm
    # stream beside all m microbatches' compute; the first gather (half: before the first
    # forward) always waits
    gather = 0.0
    for r, mine in enumerate(ranks):
        g = sum(st[i].param_gather_s for i in mine)
        if g:
            comm_s = m * g + sum(st[i].grad_sync_s for i in mine)
            gather = max(gather, max(0.0, comm_s - m * per_rank[r]) + g / 2 if hide else comm_s)
    offload = m * max(sum(max(0.0, 2 * st[i].offload_s - fb[i]) for i in mine) for mine in ranks)
    mean_b = sum(s.backward_input_s + s.backward_weight_s + s.recompute_s for s in st) / len(st)
    sync = 0.0
    for r, mine in enumerate(ranks):
        if any(st[i].param_gather_s for i in mine):
            continue  # counted with the gathers
        need = sum(st[i].grad_sync_s for i in mine)
        if hide:  # bucketed, beside the last microbatch's backward
            need = max(0.0, need - sum(st[i].backward_input_s + st[i].backward_weight_s
                                       for i in mine))
        sync = max(sync, need - r * mean_b)
    return {"compute": work - comm, "tp_cp_comm": comm, "bubble": total - work,
            "zero3_gather": gather, "offload": offload, "grad_sync": max(0.0, sync),
            "optimizer": costs.optimizer_s}
