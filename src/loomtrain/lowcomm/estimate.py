"""What the low-communication replicas keep and send per rank, for `loom train --dry-run`:
local SGD and DiLoCo (lowcomm/local_sgd.py, diloco.py), whole, split or run by the sharded
engine. Formulas: docs/dry-run.md,
"Low-communication replicas".
"""

from __future__ import annotations

import torch

from loomtrain.errors import ConfigError
from loomtrain.estimate import FP32_BYTES, Collective, DryRunPlan, MemoryRow, all_reduce, metered
from loomtrain.lowcomm.local_sgd import replica_axis, replica_shard_axis
from loomtrain.parallel.data import broadcast_state, broadcast_tensors
from loomtrain.parallel.zero import ROOT
from loomtrain.parallel.zero.config import Zero
from loomtrain.parallel.zero.estimate import compute_bytes, estimate_engine

MODELLED = ("local_sgd", "diloco")


def sync_collectives(algorithm: str, parameters: int, dp: int, inner_steps: int,
                     axis: str = "dp") -> list[Collective]:
    """The synchronization every `inner_steps` (H) steps: one ring all-reduce over the `dp`
    replicas (on `axis`) of the flat fp32 parameters (local SGD's average) or of the
    pseudo-gradient (DiLoCo's outer step), 4P bytes. The run's last step synchronizes too; on
    one replica nothing is sent."""
    if dp == 1:
        return []
    what = ("parameter average (local SGD" if algorithm == "local_sgd"
            else "pseudo-gradient (DiLoCo's outer step")
    return [all_reduce(f"{what}; also after the last step)", axis, dp, FP32_BYTES * parameters,
                       inner_steps)]


def outer_state_bytes(algorithm: str, parameters: int, outer_optimizer: str) -> int:
    """DiLoCo's own state: the global parameters theta (a flat fp32 copy) and, with Nesterov,
    the outer momentum (one per parameter); local SGD keeps none."""
    if algorithm == "local_sgd":
        return 0
    return FP32_BYTES * parameters * (2 if outer_optimizer == "nesterov" else 1)


def estimate_lowcomm(plan: DryRunPlan) -> None:
    """The replicas' part of the dry run (the `Lowcomm` component's hook): they take the dp
    axis's place, broadcast dp rank 0's weights, reduce no gradient (but inside a sharded
    replica), and synchronize every H steps; DiLoCo's outer state adds to the memory."""
    lc = plan.cfg.lowcomm
    if lc.algorithm not in MODELLED:
        raise ConfigError(f"loom train --dry-run does not model lowcomm.algorithm="
                          f"{lc.algorithm!r} yet (it models {' and '.join(map(repr, MODELLED))}): "
                          "run without --dry-run")
    if Zero.applies(plan.cfg):
        synced = _estimate_sharded(plan)
    else:
        broadcast_state(plan.model, plan.mesh, "dp")  # what LocalSGD sends first
        synced = plan.parameters
        plan.reductions = sync_collectives(lc.algorithm, synced, plan.cfg.parallel.dp_size,
                                           lc.inner_steps)
    outer = outer_state_bytes(lc.algorithm, synced, lc.outer_optimizer)
    if outer:
        momentum = " and the outer momentum" if lc.outer_optimizer == "nesterov" else ""
        plan.memory_rows.append(MemoryRow("outer optimizer", outer,
                                          f"diloco: the global parameters (fp32){momentum}"))
    plan.replicated = True


def _estimate_sharded(plan: DryRunPlan) -> int:
    """Replicas run by the sharded engine (lowcomm/local_sgd.py `replica_shard_axis`): the
    engine's own estimate over the replica's ranks, each step the replica's token count summed
    over them, and every H steps the sync of this rank's fp32 master slices over the replica
    axis, after which stages 1-2 gather the parameters as after an optimizer step (engine
    `publish`). Returns the elements this rank syncs."""
    lc, mesh = plan.cfg.lowcomm, plan.mesh
    shard_axis = replica_shard_axis(plan.cfg.parallel)
    broadcast_state(plan.model, mesh, shard_axis)  # what shard() sends first
    z = estimate_engine(plan, shard_axis)
    axis = replica_axis(z.plan)
    master = torch.empty(z.master_elements, device="meta")
    broadcast_tensors([master], mesh, axis)  # what LocalSGD sends first
    reductions = sync_collectives(lc.algorithm, z.master_elements, mesh.size(axis),
                                  lc.inner_steps, axis)
    if axis != "dp" and mesh.size("dp.local") > 1:  # LocalSGD.replica_tokens
        reductions.append(metered("replica tokens (its ranks' rows)", "all_reduce", "dp.local",
                                  mesh.size("dp.local"), 8))
    if z.plan.stage < 3 and z.plan.shard_ranks > 1:
        c = compute_bytes(z.plan)
        reductions += [metered("parameter all-gather after the sync", "all_gather",
                               z.plan.shard_axis, z.plan.shard_ranks, c * p, 1, name,
                               lc.inner_steps)
                       for name, p in z.units + ([(ROOT, z.root)] if z.root else [])]
    plan.reductions += reductions
    return z.master_elements
