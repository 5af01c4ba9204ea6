"""parallel.zero_reshard: whether ZeRO-3 keeps its units gathered through a pipelined step.

Inside a pipeline the engine holds each step's gradients and reduce-scatters them once
(engine.py `_holding`). "step" also keeps every stage-3 unit gathered from its first forward
to the end of the step: one gather per unit per step, the whole stage in memory (FSDP2 under
torch's pipelining with reshard_after_forward=False, TorchTitan's default with pp). "micro_batch"
frees each unit after its forward and gathers it again for its backward, on every micro-batch,
as outside a pipeline (reshard_after_forward=True): only the prefetch window is gathered.
"auto" decides once at build, by `choose_reshard`, the same on every rank (reshard_auto.py). docs/zero.md,
"Inside a pipeline".
"""

from __future__ import annotations

import os

import torch

STEP, MICRO_BATCH = "step", "micro_batch"


def choose_reshard(step_bytes: int, capacity_bytes: int) -> str:
    """"auto"'s rule: keep the units through the step when the memory estimate of a step with
    every unit held (`step_bytes`, the dry run's) fits what the rank may use."""
    return STEP if step_bytes <= capacity_bytes else MICRO_BATCH


def capacity_bytes(device: torch.device, local_ranks: int) -> int:
    """The memory one rank may use: on CUDA the device's total memory; on CPU the machine's
    available memory (MemAvailable) shared by the ranks of the node."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return _available_host_bytes() // max(local_ranks, 1)


def _available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # no /proc (macOS)


def stage_layers(module) -> list[list[str]]:
    """The layer names of every stage of a PipelineModule (all ranks' stages)."""
    b = module.bounds
    return [[x.name for x in module.layers[b[s]:b[s + 1]]] for s in range(len(b) - 1)]


def stage_calls(module) -> list[list[str]]:
    """The module paths of each of this rank's stages: the units one stage call runs."""
    b = module.bounds
    return [[path for x in module.layers[b[s]:b[s + 1]] for path in x.owns]
            for s in module.stages]


def defers_weight_grads(schedule) -> bool:
    """Whether any rank of `schedule` splits a backward into I and W (zero-bubble, a planned
    schedule): the same answer on every rank."""
    from loomtrain.parallel.pipeline.schedules import I

    return any(a.kind == I for row in schedule.actions for a in row)


def fixed_reshard(p, shard_ranks: int, schedule) -> tuple[str, str] | None:
    """(mode, why) where no memory needs weighing, alike on every rank: the setting when given;
    "step" where nothing is gathered (stages 1-2, one shard rank) or where W computes weight
    gradients after a backward, which would find its units freed. None: "auto" weighs."""
    if p.zero_reshard != "auto":
        return p.zero_reshard, "as set"
    if p.zero_stage < 3 or shard_ranks == 1:
        return STEP, "nothing is gathered"
    if p.schedule == "async":
        return STEP, "the asynchronous pipeline gathers each forward's units into its stash"
    if defers_weight_grads(schedule):
        return STEP, "the schedule's deferred weight gradients (W) need the units gathered"
    return None
