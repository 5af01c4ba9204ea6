"""What the low-communication replicas keep and send per rank, for `loom train --dry-run`:
local SGD and DiLoCo (lowcomm/local_sgd.py, diloco.py). Formulas: docs/dry-run.md,
"Low-communication replicas".
"""

from __future__ import annotations

from loomtrain.errors import ConfigError
from loomtrain.estimate import FP32_BYTES, Collective, DryRunPlan, MemoryRow, all_reduce
from loomtrain.parallel.data import broadcast_state

MODELLED = ("local_sgd", "diloco")


def sync_collectives(algorithm: str, parameters: int, dp: int,
                     inner_steps: int) -> list[Collective]:
    """The synchronization every `inner_steps` (H) steps: one ring all-reduce over dp of the
    flat fp32 parameters (local SGD's average) or of the pseudo-gradient (DiLoCo's outer
    step), 4P bytes. The run's last step synchronizes too; on one dp rank nothing is sent."""
    if dp == 1:
        return []
    what = ("parameter average (local SGD" if algorithm == "local_sgd"
            else "pseudo-gradient (DiLoCo's outer step")
    return [all_reduce(f"{what}; also after the last step)", "dp", dp, FP32_BYTES * parameters,
                       inner_steps)]


def outer_state_bytes(algorithm: str, parameters: int, outer_optimizer: str) -> int:
    """DiLoCo's own state: the global parameters theta (a flat fp32 copy) and, with Nesterov,
    the outer momentum (one per parameter); local SGD keeps none."""
    if algorithm == "local_sgd":
        return 0
    return FP32_BYTES * parameters * (2 if outer_optimizer == "nesterov" else 1)


def estimate_lowcomm(plan: DryRunPlan) -> None:
    """The replicas' part of the dry run (the `Lowcomm` component's hook): they take the dp
    axis's place, broadcast dp rank 0's weights, reduce no gradient, and synchronize every H
    steps; DiLoCo's outer state adds to the memory."""
    lc = plan.cfg.lowcomm
    if lc.algorithm not in MODELLED:
        raise ConfigError(f"loom train --dry-run does not model lowcomm.algorithm="
                          f"{lc.algorithm!r} yet (it models {' and '.join(map(repr, MODELLED))}): "
                          "run without --dry-run")
    p, precision = plan.cfg.parallel, plan.cfg.train.precision
    if p.zero_stage or precision == "bf16":
        what = f"parallel.zero_stage={p.zero_stage}" if p.zero_stage else 'train.precision="bf16"'
        raise ConfigError(f"loom train --dry-run does not model low-communication replicas run "
                          f"by the sharded engine ({what} with lowcomm.algorithm="
                          f"{lc.algorithm!r}) yet: run without --dry-run")
    broadcast_state(plan.model, plan.mesh, "dp")  # what LocalSGD sends first
    parameters = plan.parameters
    plan.reductions = sync_collectives(lc.algorithm, parameters, plan.cfg.parallel.dp_size,
                                       lc.inner_steps)
    outer = outer_state_bytes(lc.algorithm, parameters, lc.outer_optimizer)
    if outer:
        momentum = " and the outer momentum" if lc.outer_optimizer == "nesterov" else ""
        plan.memory_rows.append(MemoryRow("outer optimizer", outer,
                                          f"diloco: the global parameters (fp32){momentum}"))
    plan.replicated = True
