"""Pipeline parallelism over the mesh's `pp` axis (issue 5).

schedules.py   pure functions: (pp, microbatches, virtual stages) -> the ordered actions of
               every rank, and a simulator that checks and times them
optimal.py     schedule = "optimal": the order and each pair's keep/offload/recompute under
               a per-rank memory budget (MILP in optimal_milp.py, greedy in optimal_heuristic.py)
split.py       the model cut into stages (balanced by parameters or measured time)
runtime.py     executes a schedule: point-to-point sends overlapped with compute, the loss
               on the last stage, gradient accumulation, recomputation and offload
"""

from __future__ import annotations

import torch

from loomtrain import comm
from loomtrain.parallel.pipeline import schedules
from loomtrain.parallel.pipeline.runtime import PipelineRuntime
from loomtrain.parallel.pipeline.split import (
    PipelineModule,
    balance,
    layers_of,
    measured_costs,
    parameter_costs,
    shared_parameters,
    stage_shapes,
)


def split_model(model, mesh, cfg) -> tuple[PipelineModule, list, list]:
    """This rank's PipelineModule of `model` (cfg: the whole Config), the stage output
    shapes for one micro-batch and the parameters several pp ranks hold, as
    [(local parameter or None, shape)]."""
    p = cfg.parallel
    pp, stages = p.pp, p.pp * p.virtual_stages
    layers = layers_of(model)
    sample = torch.zeros((cfg.train.micro_batch, cfg.model.seq_len), dtype=torch.long, device=mesh.device)
    if p.split_points:
        bounds = [0, *p.split_points, len(layers)]
    elif p.pipeline_balance == "time":
        costs = torch.tensor(measured_costs(model, layers, sample), dtype=torch.float64, device=mesh.device)
        comm.all_reduce(costs, mesh, "world")  # every rank must cut at the same points
        bounds = balance(costs.tolist(), stages)
    else:
        bounds = balance(parameter_costs(model, layers), stages)
    shapes = stage_shapes(model, layers, bounds, sample)
    shared_names = shared_parameters(model, layers, bounds, pp)
    params = dict(model.named_parameters())
    for name, ranks in shared_names.items():
        params[name].pp_copies = len(ranks)
    rank = mesh.local_rank("pp")
    module = PipelineModule(model, layers, bounds, [s for s in range(stages) if s % pp == rank])
    mine = {id(q) for q in module.parameters()}
    shared = [(params[n] if id(params[n]) in mine else None, params[n].shape) for n in shared_names]
    return module, shapes, shared


def build_schedule(cfg) -> schedules.Schedule:
    p = cfg.parallel
    schedule = schedules.build(p.schedule, p.pp, cfg.accumulation_steps, p.virtual_stages)
    if p.offload_activations > 0:
        schedule = schedules.with_offload(schedule, p.offload_activations)
    return schedule


def apply_pipeline(model, mesh, cfg) -> PipelineModule:
    """The pp-axis strategy: this rank's stages of `model`, with its runtime as `.runtime`."""
    module, shapes, shared = split_model(model, mesh, cfg)
    module.runtime = PipelineRuntime(module, mesh, build_schedule(cfg), shapes, shared,
                                     cfg.parallel.recompute)
    return module


def runtime_of(model) -> PipelineRuntime | None:
    """The pipeline runtime of a (possibly dp-wrapped) model, or None without pp."""
    return getattr(getattr(model, "module", model), "runtime", None)
