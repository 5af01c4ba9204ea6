"""What the ZeRO engine keeps and sends per rank, from its plan and unit lengths alone.

Pure functions of numbers, reported by `loom train --dry-run`; the formulas, their sources and
their checks against the meter: docs/dry-run.md, "ZeRO", and docs/zero.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loomtrain.comm.collectives import choose_impl
from loomtrain.comm.meter import wire_bytes
from loomtrain.parallel.zero import ROOT
from loomtrain.parallel.zero.flat import ShardPlan
from loomtrain.parallel.zero.layout import zero_memory

FP32_BYTES = 4


# The two records the dry run reports, for the sharded engine here and for plain data parallel
# (train/dryrun.py builds them too): kept here so that parallel/zero/ imports nothing of train/.
@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds, by what they are for."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    gathered_bytes: int = 0  # ZeRO-3: units gathered at once during a step
    in_flight_bytes: int = 0  # ZeRO: gradient buffers filled and reduced during backward
    host_bytes: int = 0  # the part of all the above kept in host memory (offload)

    @property
    def total_bytes(self) -> int:
        return (self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes
                + self.activation_bytes + self.gathered_bytes + self.in_flight_bytes)

    @property
    def device_bytes(self) -> int:
        return self.total_bytes - self.host_bytes


@dataclass(frozen=True)
class Collective:
    """One collective of a step as the meter counts it: `calls` calls every `every_steps` steps."""

    purpose: str
    op: str
    axis: str
    ranks: int  # group size
    payload_bytes: int  # of one call
    wire_bytes: int  # what one rank sends in one call (comm/meter.py)
    every_steps: int = 1
    calls: int = 1  # per step it runs in
    algorithm: str = "ring_all_reduce"  # the formula the meter counts it with
    unit: str = ""  # the ZeRO unit it moves


def wire_bytes_per_step(collectives: list[Collective]) -> float:
    """Average wire bytes one rank sends per optimizer step."""
    return sum(c.wire_bytes * c.calls / c.every_steps for c in collectives)


# The formula the meter counts an op with, for the implementation comm/collectives.py runs:
# gloo's native reduce_scatter is a clone plus a full all-reduce and is counted as one.
_ALGORITHM = {("reduce_scatter", "ring"): "ring_reduce_scatter",
              ("reduce_scatter", "native"): "ring_all_reduce",
              ("all_gather", "ring"): "ring_all_gather", ("all_gather", "native"): "ring_all_gather",
              ("all_reduce", "native"): "ring_all_reduce"}


def metered(purpose: str, op: str, axis: str, ranks: int, payload: int, calls: int = 1,
            unit: str = "", every: int = 1) -> Collective:
    """An op as comm/collectives.py runs it (`choose_impl`: native or ring) and meters it."""
    algorithm = _ALGORITHM[(op, choose_impl(op, payload, ranks))]
    return Collective(purpose, op, axis, ranks, payload, wire_bytes(algorithm, payload, ranks),
                      every, calls, algorithm, unit)


def compute_bytes(plan: ShardPlan) -> int:
    return torch.finfo(plan.compute_dtype).bits // 8


def zero_collectives(plan: ShardPlan, units: list[tuple[str, int]], root: int,
                     accumulation: int) -> list[Collective]:
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
    """
    n_shard, n_replica, c = plan.shard_ranks, plan.replica_ranks, compute_bytes(plan)
    everything = units + ([(ROOT, root)] if root else [])
    launch = units[::-1] + ([(ROOT, root)] if root else [])
    when = "every micro-batch" if plan.stage >= 2 else "last micro-batch"
    reductions = accumulation if plan.stage >= 2 else 1
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
    if plan.stage == 3 and n_shard > 1:
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
    norm_ranks = n_shard * n_replica if plan.optimizer_axis == "dp" else n_shard
    if norm_ranks > 1:
        out.append(metered("gradient norm (clip_grad_norm_)", "all_reduce", plan.optimizer_axis,
                           norm_ranks, 4))
    return out


def zero_eval_gathers(plan: ShardPlan, units: list[tuple[str, int]], root: int,
                      eval_microbatches: int, eval_every: int) -> list[Collective]:
    """Stage 3 evaluation: each of the `eval_microbatches` forwards (no backward follows)
    gathers every unit once."""
    if plan.stage < 3 or plan.shard_ranks == 1 or not eval_microbatches:
        return []
    c = compute_bytes(plan)
    return [metered("validation gathers, each unit per micro-batch", "all_gather", plan.shard_axis,
                    plan.shard_ranks, c * p, eval_microbatches, name, eval_every)
            for name, p in ([(ROOT, root)] if root else []) + units]


def gathered_bytes(plan: ShardPlan, units: list[tuple[str, int]], root: int, prefetch: int) -> int:
    """Stage 3: the root unit (gathered from the start of forward to the end of backward) and
    the unit computing with the `prefetch` units gathered ahead of it, c bytes per element:
    the largest run of 1 + prefetch consecutive units (engine.py `_pre_forward`/`_pre_backward`)."""
    if plan.stage < 3 or plan.shard_ranks == 1:
        return 0
    sizes = [p for _, p in units]
    k = min(1 + prefetch, len(sizes))
    window = max((sum(sizes[i:i + k]) for i in range(len(sizes) - k + 1)), default=0)
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
                         activations: int, prefetch: int) -> MemoryEstimate:
    """`layout.zero_memory` (persistent state, its docstring has the formulas) plus what lives
    only during a step: activations, gathered units and gradients in flight. With offload, the
    master weights, optimizer state and reduced gradient range (4P/S) are in host memory."""
    padded = [p for _, p in units] + ([root] if root else [])
    c = compute_bytes(plan)
    m = zero_memory(padded, plan.stage, plan.shard_ranks, plan.optimizer_ranks, states, c,
                    separate_master=c != FP32_BYTES or plan.offload,
                    separate_grad=plan.offload and plan.stage == 1)
    host = m.optimizer_bytes + 4 * sum(padded) // plan.optimizer_ranks if plan.offload else 0
    return MemoryEstimate(m.parameter_bytes, m.gradient_bytes, m.optimizer_bytes, activations,
                          gathered_bytes(plan, units, root, prefetch),
                          in_flight_bytes(plan, units, root), host)

