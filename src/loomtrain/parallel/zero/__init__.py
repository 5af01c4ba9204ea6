"""ZeRO stages 1-3 over the dp axis, flat or hierarchical, with prefetch, offload and bf16
(Rajbhandari et al., arXiv 1910.02054).

    model, optimizer = shard(model, optimizer, mesh, stage=3)   # gradient_reduce="mean", as DDP

The files, the formulas and the measurements: docs/zero.md.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn as nn

from loomtrain.parallel.data import broadcast_state, check_gradient_reduce
from loomtrain.parallel.placement import dp_axis_of
from loomtrain.parallel.zero.engine import ShardedDataParallel
from loomtrain.parallel.zero.flat import FlatUnit, ShardPlan
from loomtrain.parallel.zero.layout import unit_layout
from loomtrain.parallel.zero.optimizer import ShardedOptimizer

ROOT = "root"


def make_plan(mesh, stage: int, hierarchical: bool = False, optimizer_shard: str = "node",
              compute_dtype: torch.dtype = torch.float32, offload: bool = False,
              axis: str = "dp") -> ShardPlan:
    """Stage 0 (only used with bf16) shards nothing: the one-rank axis "self", gradients
    all-reduced over `axis`. Hierarchical: shard inside the node ("dp.local"), replicate
    across nodes ("dp.cross"); `optimizer_shard="dp"` also splits the optimizer state across
    nodes. `axis`: the ranks that hold replicas of the model, "dp", or "dpcp" under context
    parallelism, whose peers hold the same replica (as TorchTitan's FSDP shards over dp x cp;
    hierarchical: "dpcp.local" and "dpcp.cross", its ranks on one node and across nodes)."""
    assert 0 <= stage <= 3 and optimizer_shard in ("node", "dp"), (stage, optimizer_shard)
    if stage == 0:
        shard_axis, replica_axis = "self", axis
    elif hierarchical:
        shard_axis, replica_axis = f"{axis}.local", f"{axis}.cross"
    else:
        shard_axis, replica_axis = axis, "self"
    return ShardPlan(
        stage=max(stage, 1), shard_axis=shard_axis, replica_axis=replica_axis,
        shard_ranks=mesh.size(shard_axis), shard_index=mesh.local_rank(shard_axis),
        replica_ranks=mesh.size(replica_axis), replica_index=mesh.local_rank(replica_axis),
        optimizer_over_replicas=hierarchical and optimizer_shard == "dp",
        compute_dtype=compute_dtype, offload=offload,
        host=torch.device("cpu") if offload else mesh.device)


def find_units(model: nn.Module, patterns: list[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The modules that become units, in registration order. Default: every element of the
    outermost nn.ModuleLists (a GPT's transformer blocks; `layers`/`h` in Hugging Face models).
    `patterns`: fnmatch patterns of module names instead ("blocks.*", "encoder.layer.*")."""
    found = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(prefix + ".") for prefix, _ in found):
            continue  # the root, or inside a unit already found: units do not nest
        if patterns:
            if any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
                found.append((name, module))
        elif isinstance(module, nn.ModuleList):
            found.extend((f"{name}.{child_name}", child) for child_name, child in module.named_children())
    if patterns and not found:
        raise ValueError(f"no module of the model matches the unit patterns {patterns}")
    return found


def assign_parameters(model: nn.Module, units: list[tuple[str, nn.Module]]) -> dict[str, list]:
    """{unit name or ROOT: [(name, parameter), ...]} for every trainable parameter, in
    registration order, under its first name. A parameter reachable from more than one unit,
    or also from outside all units (a tied embedding and output head), goes to the root unit,
    which stays gathered for the whole forward and backward."""
    homes: dict[nn.Parameter, set] = {}
    first: dict[nn.Parameter, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        unit = next((u for u, _ in units if name.startswith(u + ".")), ROOT)
        homes.setdefault(p, set()).add(unit)
        first.setdefault(p, name)
    out: dict[str, list] = {u: [] for u, _ in units} | {ROOT: []}
    for p, name in first.items():
        if p.requires_grad:
            where = homes[p]
            out[next(iter(where)) if len(where) == 1 else ROOT].append((name, p))
    return out


def shard(model: nn.Module, optimizer: torch.optim.Optimizer, mesh, stage: int, *,
          hierarchical: bool = False, optimizer_shard: str = "node", prefetch: int = 1,
          offload_optimizer: bool = False, compute_dtype: torch.dtype = torch.float32,
          units: list[str] | None = None, gradient_reduce: str = "mean",
          axis: str = "dp") -> tuple[ShardedDataParallel, ShardedOptimizer]:
    """Wrap `model` and `optimizer` for ZeRO `stage` over the mesh's dp axis (`axis`: "dpcp"
    under context parallelism, `make_plan`).

    The model's parameters keep their identity; their storage moves into flat buffers (and,
    for stage 3, is empty between uses). `units`: module name patterns, see `find_units`.
    `gradient_reduce`: "mean" (default) divides the gradient summed over the dp ranks by
    their number (hierarchical: every rank of every node), the gradient of torch DDP and
    FSDP2, so a loop whose loss is averaged over each rank's own batch trains as it does
    there; "sum" keeps the sum, for a loss already divided by the global token count (the
    trainer's). ValueError for any other value.
    """
    check_gradient_reduce(gradient_reduce)
    plan = make_plan(mesh, stage, hierarchical, optimizer_shard, compute_dtype, offload_optimizer,
                     axis)
    broadcast_state(model, mesh, axis)
    # parameters replicated over a sub-axis of dp (an expert's weights over "edp") shard there,
    # in a unit of their own beside their module's
    plans = {axis: plan}
    named = find_units(model, units)
    modules = dict(named)
    flat_units, root = [], None
    for unit_name, params in assign_parameters(model, named).items():
        for sub in dict.fromkeys(dp_axis_of(p, axis) for _, p in params):
            if sub not in plans:
                plans[sub] = make_plan(mesh, stage, hierarchical, optimizer_shard, compute_dtype,
                                       offload_optimizer, sub)
            mine = [(n, p) for n, p in params if dp_axis_of(p, axis) == sub]
            name = unit_name if sub == axis else f"{unit_name}.{sub}"
            if unit_name == ROOT and sub != axis:
                raise ValueError(f"{mine[0][0]} is replicated over {sub!r} only and lies "
                                 "outside every ZeRO unit: give parallel.shard_units patterns "
                                 "whose modules hold it")
            flat = FlatUnit(unit_layout(name, [(n, tuple(p.shape)) for n, p in mine],
                                        plans[sub].shard_ranks * plans[sub].replica_ranks),
                            [p for _, p in mine], modules.get(unit_name, model), plans[sub],
                            mesh.device)
            if unit_name == ROOT:
                root = flat
            else:
                flat_units.append(flat)
    engine = ShardedDataParallel(model, mesh, plan, flat_units, root, prefetch, gradient_reduce)
    return engine, ShardedOptimizer(optimizer, engine)


__all__ = ["ShardedDataParallel", "ShardedOptimizer", "assign_parameters", "find_units",
           "make_plan", "shard"]
