"""parallel.zero_reshard="auto" decided at build (the Zero component, at pp > 1): each rank
weighs the dry run's estimate of its step with every unit held against the memory it may use,
and one all-reduce makes every rank run the same mode. The rule itself, pure: reshard.py.
"""

from __future__ import annotations

import sys

import torch

from loomtrain import comm
from loomtrain.parallel.zero.reshard import (
    MICRO_BATCH,
    STEP,
    capacity_bytes,
    choose_reshard,
    fixed_reshard,
    stage_layers,
)


def resolve_reshard(built, engine) -> str:
    """The mode `engine` runs under built's pipeline: `fixed_reshard`, else `choose_reshard`
    on this rank's step estimate and capacity, with one all-reduce (max) of the verdict over
    the world so that every rank runs the same mode; said once on stderr."""
    if built.cfg.parallel.schedule == "async":  # stashed forwards gather outside the hooks
        return STEP
    runtime = built.parts["pipeline"]
    fixed = fixed_reshard(built.cfg.parallel, engine.plan.shard_ranks, runtime.schedule)
    if fixed is not None:
        return fixed[0]
    need = _step_bytes(built, engine, runtime)
    have = capacity_bytes(built.mesh.device, built.mesh.ranks_per_node)
    over = torch.tensor([float(choose_reshard(need, have) == MICRO_BATCH)], device=built.mesh.device)
    comm.all_reduce(over, built.mesh, "world", op="max")
    mode = MICRO_BATCH if over.item() else STEP
    if built.mesh.rank == 0:
        print(f'loom: parallel.zero_reshard="auto" -> "{mode}": the step with every unit held '
              f"needs {need / 2**20:.1f} MiB on rank 0, which may use {have / 2**20:.1f} MiB; "
              f"{'some rank does not' if over.item() else 'every rank does'} fit",
              file=sys.stderr, flush=True)
    return mode


def _step_bytes(built, engine, runtime) -> int:
    """The dry run's memory estimate of this rank with every unit held: the engine's state and
    the activation peak of this rank over its simulated schedule (pipeline/estimate.py)."""
    from loomtrain.parallel.pipeline.estimate import simulated_peaks
    from loomtrain.parallel.zero.estimate import compute_bytes, zero_memory_per_rank
    from loomtrain.estimate import optimizer_states

    cfg, c = built.cfg, compute_bytes(engine.plan)
    m = cfg.model.model_copy(update={"seq_len": cfg.model.seq_len // cfg.parallel.cp})
    module = engine.module
    _, _, peaks = simulated_peaks(stage_layers(module), runtime.schedule, cfg, c, m)
    units = [(u.layout.name, u.layout.padded) for u in engine.units]
    root = engine.root.layout.padded if engine.root is not None else 0
    return zero_memory_per_rank(engine.plan, units, root,
                                optimizer_states(cfg.train.optimizer, cfg.train.beta1),
                                peaks[runtime.rank], cfg.parallel.prefetch, STEP).device_bytes
