"""What the ZeRO engine keeps and sends per rank, from its plan and unit lengths alone.

Pure functions of numbers, reported by `loom train --dry-run` (`estimate_zero`, which lays the
units out on the meta model); the formulas, their sources and their checks against the meter:
docs/dry-run.md, "ZeRO", and docs/zero.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from loomtrain.errors import ConfigError
from loomtrain.estimate import (  # wire_bytes_per_step: importable from here too
    FP32_BYTES,
    Collective,
    DryRunPlan,
    MemoryEstimate,
    metered,
    wire_bytes_per_step,
)
from loomtrain.parallel.data import broadcast_state
from loomtrain.parallel.placement import dp_axis_of
from loomtrain.parallel.zero import ROOT, assign_parameters, find_units, make_plan
from loomtrain.parallel.zero.flat import ShardPlan, optimizer_range
from loomtrain.parallel.zero.layout import unit_layout, zero_memory


def compute_bytes(plan: ShardPlan) -> int:
    return torch.finfo(plan.compute_dtype).bits // 8


def zero_collectives(plan: ShardPlan, units: list[tuple[str, int]], root: int,
                     accumulation: int, reshard: str | None = None, reruns: int = 0,
                     stages: int = 1) -> list[Collective]:
    """The engine's collectives in one optimizer step of `accumulation` micro-batches (A).

    L = shard ranks, C = replica ranks, c = compute bytes, p = a unit's padded length.
    Gradients (communication.py `GradReduction`), per unit in launch order, on the last
    micro-batch (stages 0-1: earlier ones accumulate under no_sync) or on every one (2-3):
    reduce_scatter of the fp32 unit (4p) over the shard axis, then, with C > 1, the shard
    (4p/L) all-reduced over the replica axis, or reduce-scattered when the optimizer state is
    split over the replicas too. Stage 3 (engine.py): every micro-batch gathers the root once
    (kept until the end of backward) and every other unit twice, for forward and for backward
    (cp each). After the step (`publish`): all_gather of the shard (cp/L) over the replica
    axis when the optimizer range is smaller than it, then of the unit (cp) over the shard
    axis for stages 1-2. `clip_grad_norm_`: one 4-byte all_reduce over the optimizer's group.
    A group of one rank sends and counts nothing.

    Inside a pipeline (`reshard` not None, engine.py `_holding`) stages 2-3 hold the step:
    each unit is reduced once per step. Stage 3 with reshard "step" gathers the root and every
    unit once, kept across the step's micro-batches; with "micro_batch" (zero/reshard.py) every
    unit twice per micro-batch (forward, backward), and once more per micro-batch its stage
    runs forward again (`reruns`, recompute="full": the rerun is a forward of its own), and the
    root once per backward of each of the rank's `stages` (freed at every backward's end, and
    by each forward without a backward: the first forward of a recomputed micro-batch).
    """
    n_shard, n_replica, c = plan.shard_ranks, plan.replica_ranks, compute_bytes(plan)
    everything = units + ([(ROOT, root)] if root else [])
    launch = units[::-1] + ([(ROOT, root)] if root else [])
    held = reshard is not None and plan.stage >= 2
    when = ("once per step (held)" if held else
            "every micro-batch" if plan.stage >= 2 else "last micro-batch")
    reductions = accumulation if plan.stage >= 2 and not held else 1
    out = []
    for name, p in launch:
        if n_shard > 1:
            out.append(metered(f"gradient reduce-scatter, each unit, {when}", "reduce_scatter",
                               plan.shard_axis, n_shard, 4 * p, reductions, name))
        if n_replica > 1:
            op = "reduce_scatter" if plan.optimizer_over_replicas else "all_reduce"
            part = " of the shard" if n_shard > 1 else ""
            out.append(metered(f"gradient {op.replace('_', '-')}{part}, each unit, {when}",
                               op, plan.replica_axis, n_replica, 4 * (p // n_shard), reductions, name))
    if plan.stage == 3 and n_shard > 1 and reshard == "step":
        out += [metered("unit gather, once per step (kept through the step)", "all_gather",
                        plan.shard_axis, n_shard, c * p, 1, name)
                for name, p in ([(ROOT, root)] if root else []) + units]
    elif plan.stage == 3 and n_shard > 1 and reshard == "micro_batch":
        if root:
            out.append(metered("root gather, every micro-batch of each stage (freed after its "
                               "backward)", "all_gather", plan.shard_axis, n_shard, c * root,
                               stages * (accumulation + reruns), ROOT))
        out += [metered("unit gather, forward and backward of every micro-batch (and its rerun)",
                        "all_gather", plan.shard_axis, n_shard, c * p, 2 * accumulation + reruns,
                        name) for name, p in units]
    elif plan.stage == 3 and n_shard > 1:
        if root:
            out.append(metered("root gather, every micro-batch (kept through backward)", "all_gather",
                               plan.shard_axis, n_shard, c * root, accumulation, ROOT))
        out += [metered("unit gather, forward and backward of every micro-batch", "all_gather",
                        plan.shard_axis, n_shard, c * p, 2 * accumulation, name) for name, p in units]
    if plan.optimizer_over_replicas and n_replica > 1:
        out += [metered("parameter all-gather of the shard after the step", "all_gather",
                        plan.replica_axis, n_replica, c * (p // n_shard), 1, name)
                for name, p in everything]
    if plan.stage < 3 and n_shard > 1:
        out += [metered("parameter all-gather after the step", "all_gather", plan.shard_axis,
                        n_shard, c * p, 1, name) for name, p in everything]
    norm_ranks = n_shard * n_replica if plan.optimizer_axis in ("dp", "dpcp") else n_shard
    if norm_ranks > 1:
        out.append(metered("gradient norm (clip_grad_norm_)", "all_reduce", plan.optimizer_axis,
                           norm_ranks, 4))
    return out


def zero_eval_gathers(plan: ShardPlan, units: list[tuple[str, int]], root: int,
                      eval_microbatches: int, eval_every: int, prefetch: int = 0,
                      calls: list[list[str]] | None = None) -> list[Collective]:
    """Stage 3 evaluation: each of the `eval_microbatches` forwards (no backward follows)
    gathers every unit once, as one call of the whole model. A pipeline rank runs each of its
    stages as a call of its own (`calls`: the unit names of each, in order): every call
    gathers the root, its own units, and the `prefetch` units after each of them in the
    rank's order and at its start (engine.py `_root_pre_forward`, `_pre_forward`), which the
    call's end frees unused; a later call gathers them again."""
    if plan.stage < 3 or plan.shard_ranks == 1 or not eval_microbatches:
        return []
    c, names = compute_bytes(plan), [name for name, _ in units]
    count = dict.fromkeys(names, 0)
    for call in calls or [names]:
        started = set(names[:prefetch])
        for name in call:
            i = names.index(name)
            started.update(names[i:i + 1 + prefetch])
        for name in started:
            count[name] += 1
    gathers = ([(ROOT, root, len(calls or [names]))] if root else []) + \
        [(name, p, count[name]) for name, p in units if count[name]]
    return [metered("validation gathers, each unit per micro-batch", "all_gather", plan.shard_axis,
                    plan.shard_ranks, c * p, n * eval_microbatches, name, eval_every)
            for name, p, n in gathers]


def gathered_bytes(plan: ShardPlan, units: list[tuple[str, int]], root: int, prefetch: int,
                   reshard: str | None = None, calls: list[list[str]] | None = None) -> int:
    """Stage 3: the root unit (gathered from the start of forward to the end of backward) and
    the unit computing with the `prefetch` units gathered ahead of it, c bytes per element:
    the largest run of 1 + prefetch consecutive units (engine.py `_pre_forward`/`_pre_backward`),
    inside one of `calls` (the unit names of each stage of a pipeline rank, whose
    "micro_batch" prefetch stays in the stage; None: one call of every unit). Inside a
    pipeline with reshard "step" every unit stays gathered through the step."""
    if plan.stage < 3 or plan.shard_ranks == 1:
        return 0
    sizes = dict(units)
    if reshard == "step":
        return compute_bytes(plan) * (root + sum(sizes.values()))
    window = 0
    for call in calls or [list(sizes)]:
        run = [sizes[name] for name in call]
        k = min(1 + prefetch, len(run))
        window = max([window] + [sum(run[i:i + k]) for i in range(len(run) - k + 1)])
    return compute_bytes(plan) * (root + window)


def in_flight_bytes(plan: ShardPlan, units: list[tuple[str, int]], root: int) -> int:
    """Peak bytes of gradient buffers during backward, outside the persistent ones.

    Read from engine.py, flat.py and communication.py. A unit's buffer (cp) is allocated at its
    pre-backward; the root's at the start of backward, and it launches last. At the launch of
    unit t (in launch order: blocks in reverse, then the root) these are alive:
      new(p_t)       stages 2-3: the fp32 source 4p (the buffer itself in fp32; a copy, with
                     the bf16 buffer 2p still referenced, in bf16) + the shard output 4p/L;
                     stages 0-1: 2p for bf16 (added into the fp32 accumulator, which is
                     reduced in place), nothing for fp32 (.grad are views of it)
      prev(p_{t-1})  stages 2-3: 4p + 4p/L, the previous reduction, constructed before
                     `ReductionQueue.launched` advances it (then its source is freed)
      older(p_{t-2}) stages 2-3 with C > 1: 4p/L, the one before, in its replica phase
      root           cR while the root is not yet launched (not for stages 0-1 in fp32)
    The peak is the largest sum over the launches; between launches less is alive (the next
    unit's buffer is smaller than its new()). So up to three units' reductions at once.
    """
    n_shard, c = plan.shard_ranks, compute_bytes(plan)
    if plan.stage == 1 and c == FP32_BYTES:
        return 0
    order = [p for _, p in units[::-1]] + ([root] if root else [])
    if plan.stage == 1:
        def new(p): return c * p
        def prev(p): return 0
        def older(p): return 0
    else:
        def new(p): return (4 * p if c == FP32_BYTES else c * p + 4 * p) + 4 * (p // n_shard)
        def prev(p): return 4 * p + 4 * (p // n_shard)
        def older(p): return 4 * (p // n_shard) if plan.replica_ranks > 1 else 0
    peak = 0
    for t, p in enumerate(order):
        alive = new(p) + (prev(order[t - 1]) if t >= 1 else 0) + (older(order[t - 2]) if t >= 2 else 0)
        if root and t < len(order) - 1:
            alive += c * root
        peak = max(peak, alive)
    return peak


def zero_memory_per_rank(plan: ShardPlan, units: list[tuple[str, int]], root: int, states: int,
                         activations: int, prefetch: int, reshard: str | None = None,
                         calls: list[list[str]] | None = None) -> MemoryEstimate:
    """`layout.zero_memory` (persistent state, its docstring has the formulas) plus what lives
    only during a step: activations, gathered units and gradients in flight. With offload, the
    master weights, optimizer state and reduced gradient range (4P/S) are in host memory.
    Inside a pipeline (`reshard` not None), stages 2-3 hold every unit's unreduced fp32
    gradient (4P, `FlatUnit.held`) through the step, with either reshard, counted with the
    gradients in flight; `gathered_bytes` says which units are gathered at once."""
    padded = [p for _, p in units] + ([root] if root else [])
    c = compute_bytes(plan)
    m = zero_memory(padded, plan.stage, plan.shard_ranks, plan.optimizer_ranks, states, c,
                    separate_master=c != FP32_BYTES or plan.offload,
                    separate_grad=plan.offload and plan.stage == 1)
    host = m.optimizer_bytes + 4 * sum(padded) // plan.optimizer_ranks if plan.offload else 0
    return MemoryEstimate(m.parameter_bytes, m.gradient_bytes, m.optimizer_bytes, activations,
                          gathered_bytes(plan, units, root, prefetch, reshard, calls),
                          in_flight_bytes(plan, units, root)
                          + (4 * sum(padded) if reshard and plan.stage >= 2 else 0), host)



@dataclass(frozen=True)
class ZeroLayout:
    plan: ShardPlan
    units: list[tuple[str, int]]  # (name, padded length), forward order, root excluded
    root: int  # padded length of the root unit, 0 if empty
    reshard: str | None = None  # inside a pipeline: the mode of parallel.zero_reshard
    reshard_why: str = ""  # how "auto" (or the setting) decided it
    # the units of parameters replicated over a sub-axis of dp (experts: "edp", or "edpcp"),
    # their plan
    apart: tuple[ShardPlan, list[tuple[str, int]]] | None = None
    # the parameters' elements in this rank's optimizer ranges (its fp32 master weights
    # without the padding): what a sharded replica syncs (lowcomm/estimate.py)
    master_elements: int = 0


def zero_layout(model, mesh, cfg, axis: str | None = None) -> ZeroLayout:
    """The plan and unit lengths `shard()` would build, from shapes only (a meta model).
    `axis`: the one `shard()` is given, "dp" ("dpcp" under cp) by default."""
    p = cfg.parallel
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    replicas = "dpcp" if p.cp > 1 else "dp"
    plan = make_plan(mesh, p.zero_stage, p.hierarchical, p.optimizer_shard, dtype,
                     p.offload_optimizer, axis or replicas)
    try:
        named = find_units(model, list(p.shard_units) or None)
    except ValueError as err:
        raise ConfigError(f"parallel.shard_units={list(p.shard_units)!r}: {err}") from None
    units, root, apart, master = [], 0, [], 0
    for name, params in assign_parameters(model, named).items():
        mine = [(n, x) for n, x in params if dp_axis_of(x, replicas) == replicas]
        if mine:  # padded as shard() pads: to every rank of its plan
            layout = unit_layout(name, [(n, tuple(x.shape)) for n, x in mine],
                                 plan.shard_ranks * plan.replica_ranks)
            own = optimizer_range(layout.range(plan.shard_index, plan.shard_ranks), plan)
            master += sum(piece.numel for piece in layout.slices(*own))
            if name == ROOT:
                root = layout.padded
            else:
                units.append((name, layout.padded))
        experts = [(n, x) for n, x in params if dp_axis_of(x, replicas) != replicas]
        if experts:  # over edp ("edpcp" under cp); hierarchical: inside the node, across nodes
            sub_axis = dp_axis_of(experts[0][1], replicas)
            sub = make_plan(mesh, p.zero_stage, p.hierarchical, p.optimizer_shard, dtype,
                            p.offload_optimizer, sub_axis)
            apart.append((f"{name}.{sub_axis}", unit_layout(
                f"{name}.{sub_axis}", [(n, tuple(x.shape)) for n, x in experts],
                sub.shard_ranks * sub.replica_ranks).padded))
    return ZeroLayout(plan, units, root, apart=(sub, apart) if apart else None,
                      master_elements=master)


def estimate_zero(plan: DryRunPlan) -> None:
    """The sharded engine's part of the dry run (the `Zero` component's hook): its layout of
    the meta model, its memory per rank and its collectives (docs/dry-run.md, "ZeRO")."""
    broadcast_state(plan.model, plan.mesh, "dp")  # what shard() sends first
    estimate_engine(plan)


def estimate_engine(plan: DryRunPlan, axis: str | None = None) -> ZeroLayout:
    """The engine's layout over `axis` (zero_layout's), its memory per rank, its collectives
    and its evaluation's gathers, into `plan`; returns the layout."""
    cfg = plan.cfg
    z = zero_layout(plan.model, plan.mesh, cfg, axis)
    pipe = plan.parts.get("pipeline")
    calls = None if pipe is None else [  # this rank's stages, each a forward call of its own
        [x for x in pipe.split.stage_layers[s] if x in dict(z.units)]
        for s in range(0, pipe.schedule.stages, pipe.schedule.pp)]
    if pipe is not None:
        mode, why = _reshard(plan, z, pipe.schedule)
        z = replace(z, reshard=mode, reshard_why=why)
    p = cfg.parallel
    plan.memory = with_experts(zero_memory_per_rank(
        z.plan, z.units, z.root, plan.optimizer_states, plan.activations(), p.prefetch, z.reshard,
        calls), z, plan.optimizer_states, p.prefetch)
    plan.reductions = zero_collectives(
        z.plan, z.units, z.root, cfg.accumulation_steps, z.reshard,
        cfg.accumulation_steps if p.recompute == "full" else 0, len(calls or [None]))
    if z.apart is not None:  # the experts' units over edp; one gradient norm, over dp (x cp)
        sub, apart = z.apart
        plan.reductions = [c for c in plan.reductions + zero_collectives(
            sub, apart, 0, cfg.accumulation_steps, z.reshard) if not c.purpose.startswith(
                "gradient norm")]
        axis = z.plan.data_axis
        plan.reductions.append(metered("gradient norm (clip_grad_norm_)", "all_reduce", axis,
                                       plan.mesh.size(axis), 4))
    plan.eval_collectives += zero_eval_gathers(z.plan, z.units, z.root, plan.eval_forwards,
                                               cfg.run.eval_every, cfg.parallel.prefetch, calls)
    plan.parts["zero"] = z
    plan.replicated = True
    return z


def with_experts(memory: MemoryEstimate, z: ZeroLayout, states: int,
                 prefetch: int) -> MemoryEstimate:
    """`memory` (of the units over dp) with the experts' units over edp (`z.apart`) added:
    their parameters, gradients and optimizer state as `zero_memory` keeps them over edp's
    ranks (in host memory when offloaded, as the others'), and under stage 3 the gathered
    window in the engine's order of units, each block's unit then its experts' (zero/__init__.py
    `shard`): engine.py's `_pre_forward` prefetches after each of a block's units, so a block's
    units are gathered with the `prefetch` units after them. Not counted: the experts'
    gradient buffers in flight (in_flight_bytes models one plan's units)."""
    if z.apart is None:
        return memory
    sub, apart = z.apart
    own = zero_memory_per_rank(sub, apart, 0, states, 0, 0)
    gathered = memory.gathered_bytes
    if z.plan.stage == 3 and z.plan.shard_ranks > 1:  # edp of one rank: experts held whole
        experts = {name.removesuffix(".edp"): p * (sub.shard_ranks > 1) for name, p in apart}
        blocks = [[p] + ([experts[name]] if name in experts else []) for name, p in z.units]
        order = [p for units in blocks for p in units]
        window = start = 0
        for units in blocks:
            window = max(window, sum(order[start:start + len(units) + prefetch]))
            start += len(units)
        gathered = compute_bytes(z.plan) * (z.root + window)
    return replace(memory, parameter_bytes=memory.parameter_bytes + own.parameter_bytes,
                   gradient_bytes=memory.gradient_bytes + own.gradient_bytes,
                   optimizer_bytes=memory.optimizer_bytes + own.optimizer_bytes,
                   gathered_bytes=gathered, host_bytes=memory.host_bytes + own.host_bytes)


def _reshard(plan: DryRunPlan, z: ZeroLayout, schedule) -> tuple[str, str]:
    """(mode, why) of parallel.zero_reshard as rank 0 would run it (zero/reshard.py): "auto"
    weighs rank 0's estimate with every unit held against this machine's capacity for one
    rank (at build every rank weighs its own, and one that does not fit decides for all)."""
    from loomtrain.parallel.zero.reshard import STEP, capacity_bytes, choose_reshard, fixed_reshard

    cfg = plan.cfg
    fixed = fixed_reshard(cfg.parallel, z.plan.shard_ranks, schedule)
    if fixed is not None:
        return fixed
    need = zero_memory_per_rank(z.plan, z.units, z.root, plan.optimizer_states,
                                plan.activations(), cfg.parallel.prefetch, STEP).device_bytes
    cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        return STEP, (f"auto: decided at build; no CUDA device here to weigh rank 0's "
                      f"{need:,} B with every unit held (shown: step)")
    have = capacity_bytes(torch.device("cuda" if cuda else "cpu"), plan.mesh.ranks_per_node)
    return choose_reshard(need, have), (f"auto: rank 0's step with every unit held needs "
                                        f"{need:,} B, one rank may use {have:,} B here")
