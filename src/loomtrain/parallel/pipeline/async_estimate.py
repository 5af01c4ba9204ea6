"""What the asynchronous pipeline (asynchronous.py) keeps and sends per rank in a steady-state
step, for `loom train --dry-run`: the stream's activations and stashed weight versions, its
sends, and the dp engine's reductions once per update (M per step) instead of once per step.
Formulas: docs/dry-run.md, "The asynchronous pipeline".
"""

from __future__ import annotations

from dataclasses import replace

from loomtrain.estimate import FP32_BYTES, Collective, DryRunPlan, MemoryRow
from loomtrain.parallel.pipeline import schedules as S


def async_schedule(pp: int, microbatches: int) -> S.Schedule:
    """A steady-state step of the stream as an action list: on every rank M forwards, each
    followed by a backward (of an older micro-batch: `step_actions`), with 1F1B's sends and
    receives, which are the step's; named "async"."""
    one_f_one_b = S.build("1f1b", pp, microbatches)
    return replace(one_f_one_b, name="async")


def stream_states(cfg, states: int) -> int:
    """fp32 state tensors per parameter of the optimizer the runtime steps (nesterov.py):
    DelayedNesterov keeps its momentum, and Adam's second moment with train.optimizer =
    "adamw"; "stash" steps train.optimizer (`states`, as counted for it)."""
    if cfg.parallel.async_optimizer == "stash":
        return states
    return 2 if cfg.train.optimizer == "adamw" else 1


def stream_depth(rank: int, pp: int) -> int:
    """Micro-batches rank `rank` holds at once in the stream: the pp-1-rank in flight and the
    one whose forward just ran (F(g + w) comes before B(g)): its activations and weight
    versions (docs/pipeline.md, "Weight stashing")."""
    return pp - rank


def stream_peaks(memory, pp: int) -> list[int]:
    """Each pp rank's activation peak: `stream_depth` micro-batches of its stage (StageMemory
    of each stage; one stage per rank), whatever M is, as the stream carries them across
    steps."""
    return [stream_depth(r, pp) * (memory[r].stashed + memory[r].held) for r in range(pp)]


def per_update(reductions: list[Collective], microbatches: int) -> list[Collective]:
    """The dp engine's reductions of one update (the whole-step ones of a held step), M
    times a step: the stream updates after every micro-batch's backward."""
    return [replace(c, calls=c.calls * microbatches,
                    purpose=c.purpose.split(",")[0] + ", every update") for c in reductions]


def estimate_async(plan: DryRunPlan) -> None:
    """The AsyncPipeline component's hook, after the dp engine's: its reductions per update,
    and the stashed weight versions of rank 0 (pp of them) as a memory row. In ZeRO's engine
    (`zero_async_reductions`): stage 3 gathers each unit into the stash at every forward and
    keeps nothing gathered otherwise."""
    cfg, m = plan.cfg, plan.cfg.accumulation_steps
    depth = stream_depth(0, cfg.parallel.pp)
    zero = plan.parts.get("zero")
    if zero is None:
        plan.reductions = per_update(plan.reductions, m)
        copy = FP32_BYTES * plan.parameters
        what = "fp32 parameters"
    else:
        plan.reductions = zero_async_reductions(zero, m, _tied_on_rank(plan))
        from loomtrain.parallel.zero.estimate import compute_bytes

        elements = sum(n for _, n in zero.units) + zero.root
        copy, what = compute_bytes(zero.plan) * elements, "units, padded, in the compute dtype"
        plan.memory = replace(plan.memory, gathered_bytes=0,
                              in_flight_bytes=copy + 2 * FP32_BYTES * max(
                                  [n for _, n in zero.units] + [zero.root]))
    plan.memory_rows.append(MemoryRow(
        "stashed weights", depth * copy,
        f"{depth} weight version(s) of pp rank 0's stages ({what}), each from a forward to "
        "its backward"))


def zero_async_reductions(zero, microbatches: int, tied: int) -> list[Collective]:
    """ZeRO's collectives in a steady-state step of the stream: per update, as a held step's
    once (`zero_collectives(..., reshard="step")`: each unit reduced, stage 3 gathering each
    unit once, which is the stash's gather at the forward, the parameters published after the
    step), plus one 4-byte norm all-reduce per tied parameter held (each clipped by its own
    norm)."""
    from loomtrain.parallel.zero.estimate import zero_collectives

    out = []
    for c in per_update(zero_collectives(zero.plan, zero.units, zero.root, 1, reshard="step"),
                        microbatches):
        if c.purpose.startswith("gradient norm"):
            c = replace(c, calls=c.calls * (1 + tied))
        out.append(c)
    return out


def _tied_on_rank(plan: DryRunPlan) -> int:
    pipe = plan.parts["pipeline"]
    return sum(0 in ranks for _, _, ranks in pipe.split.shared)
