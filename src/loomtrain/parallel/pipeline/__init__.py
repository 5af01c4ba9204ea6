"""Pipeline parallelism over the mesh's `pp` axis (issue 5): schedules as pure functions, the
model cut into stages, a runtime that executes a schedule, a memory-budgeted schedule
("optimal") and an asynchronous one ("async"). The files and what each holds:
docs/pipeline.md.
"""

from __future__ import annotations

import torch

from loomtrain import comm
from loomtrain.errors import ConfigError
from loomtrain.models import token_loss_sum
from loomtrain.parallel.pipeline import schedules
from loomtrain.parallel.pipeline.runtime import PipelineRuntime
from loomtrain.parallel.pipeline.split import balance as balanced_bounds
from loomtrain.parallel.pipeline.split import (
    PipelineModule,
    layers_of,
    measured_costs,
    parameter_costs,
    shared_parameters,
    stage_shapes,
)


def _real(model) -> None:
    """The default `materialize`: the model was built with its values."""


def split(model, mesh, stages: int, sample: torch.Tensor, balance="params") -> tuple[PipelineModule, list, list]:
    """This rank's PipelineModule of `model` cut into `stages` stages (stage s on pp rank
    s % pp), the stage output shapes for an input like `sample` (one micro-batch) and the
    parameters several pp ranks hold, as [(local parameter or None, shape)]. `balance`:
    "params", "time" (each layer's forward and backward timed on `sample`, averaged over
    all ranks) or the first layer of every stage after the first."""
    pp = mesh.size("pp")
    layers = layers_of(model)
    if not isinstance(balance, str):
        bounds = [0, *balance, len(layers)]
    elif balance == "time":
        costs = torch.tensor(measured_costs(model, layers, sample), dtype=torch.float64, device=mesh.device)
        comm.all_reduce(costs, mesh, "world")  # every rank must cut at the same points
        bounds = balanced_bounds(costs.tolist(), stages)
    else:
        bounds = balanced_bounds(parameter_costs(model, layers), stages)
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


def split_model(model, mesh, cfg, materialize=_real) -> tuple[PipelineModule, list, list]:
    """`split` as the config says (cfg: the whole Config), materialized as in `pipeline`."""
    p = cfg.parallel
    return _split_real(model, mesh, p.pp * p.virtual_stages, _sample(cfg, mesh),
                       list(p.split_points) or p.pipeline_balance, materialize)


def _split_real(model, mesh, stages: int, sample, balance, materialize):
    """`split`, with this rank's stages real afterwards (`pipeline`)."""
    if balance == "time":  # timing runs every layer
        materialize(model)
    module, shapes, shared = split(model, mesh, stages, sample, balance)
    materialize(module)
    return module, shapes, shared


def _sample(cfg, mesh) -> torch.Tensor:
    """One micro-batch of this rank's tokens: 1/cp of each row under context parallelism."""
    tokens = cfg.model.seq_len // cfg.parallel.cp
    return torch.zeros((cfg.train.micro_batch, tokens), dtype=torch.long, device=mesh.device)


def build_schedule(cfg) -> schedules.Schedule:
    p = cfg.parallel
    schedule = schedules.build(p.schedule, p.pp, cfg.accumulation_steps, p.virtual_stages)
    if p.offload_activations > 0:
        schedule = schedules.with_offload(schedule, p.offload_activations)
    return schedule


def pipeline(model, mesh, schedule: schedules.Schedule, sample: torch.Tensor,
             balance="params", recompute: str = "none", materialize=_real) -> PipelineModule:
    """The pp-axis strategy: this rank's stages of `model` (any model `layers_of` can read:
    the GPT, the MLP, an `nn.Sequential`, one with `pipeline_layers()`, a Hugging Face
    decoder: pipeline/hf_layers.py), with the runtime that
    executes `schedule` over its stage modules as `.runtime`. `sample`: one micro-batch's
    input; `balance` as in `split`; `recompute`: "none", "full" or "selective" (the GPT's
    attention core). Wrap the result with the dp engine, then call
    `result.runtime.train_step(wrapped, batches, ...)` (the engine: `wrapped`).

    A model on the meta device is cut there; `materialize(module)` then makes the stages
    this rank keeps real, before the runtime reads them. Balanced by time, the layers are
    timed first: `materialize(model)` makes the whole model real before the cut, and the call
    after it must do nothing (as `Built.materialize`, called once, does)."""
    if recompute == "selective":
        for m in model.modules():
            if hasattr(m, "recompute_core"):
                m.recompute_core = True
    module, shapes, shared = _split_real(model, mesh, schedule.stages, sample, balance, materialize)
    module.runtime = PipelineRuntime(module.stage_modules(), mesh, schedule, shapes, shared,
                                     recompute, tuple(sample.shape))
    return module


def apply_pipeline(model, mesh, cfg, materialize=_real, loss_sum=token_loss_sum) -> PipelineModule:
    """`pipeline` as the config says; `loss_sum(logits, targets)`: the run's loss (the
    vocabulary-parallel one under tensor parallelism), which the optimal schedule's profile
    runs on the last stage."""
    p = cfg.parallel
    if p.schedule == "async":  # its runtime steps its own optimizer after every micro-batch
        from loomtrain.parallel.pipeline.asynchronous import build_async_runtime

        module, shapes, shared = split_model(model, mesh, cfg, materialize)
        module.runtime = build_async_runtime(module, mesh, cfg, shapes, shared)
    elif p.schedule == "optimal":
        module = _optimal_pipeline(model, mesh, cfg, materialize, loss_sum)
    else:
        module = pipeline(model, mesh, build_schedule(cfg), _sample(cfg, mesh),
                          list(p.split_points) or p.pipeline_balance, p.recompute, materialize)
    if cfg.train.precision == "bf16":  # the sharded engine computes in bf16: so do the stages
        module.runtime.shapes = [(shape, torch.bfloat16 if dtype.is_floating_point else dtype)
                                 for shape, dtype in module.runtime.shapes]
    return module


def _optimal_pipeline(model, mesh, cfg, materialize, loss_sum) -> PipelineModule:
    """schedule="optimal": the stages' costs measured on one micro-batch (profile.py), the
    plan solved on global rank 0 (a time-limited MILP's answer depends on timing: ranks
    solving apart could disagree) and sent to every rank. The runtime is built with ZB-H1,
    which sets up the weight-gradient deferral a plan's I and W actions need."""
    from loomtrain.parallel.pipeline.optimal import check_budget, plan_for_config
    from loomtrain.parallel.pipeline.optimal_costs import StageCosts
    from loomtrain.parallel.pipeline.profile import profile_stages

    p, microbatches = cfg.parallel, cfg.accumulation_steps
    module, shapes, shared = split_model(model, mesh, cfg, materialize)
    module.runtime = PipelineRuntime(module.stage_modules(), mesh,
                                     schedules.build("zb-h1", p.pp, microbatches), shapes, shared,
                                     sample_shape=tuple(_sample(cfg, mesh).shape))
    targets = torch.randint(0, cfg.model.vocab_size, _sample(cfg, mesh).shape, device=mesh.device)
    table = profile_stages(module.runtime, _sample(cfg, mesh),
                           lambda logits: loss_sum(logits, targets))
    costs = [StageCosts(f=t["f"], b=t["b"], i=t["i"], w=t["w"], offload=t["offload"],
                        reload=t["reload"], activation_bytes=t["act"],
                        input_bytes=min(t["input"], t["act"])) for t in table]
    budget = optimal_budget(p, microbatches, costs)
    try:  # on every rank: a budget no schedule fits stops them all, not rank 0 alone
        check_budget(p.pp, microbatches, costs, budget)
    except ValueError as err:
        raise ConfigError(f"parallel.activation_budget_mb={p.activation_budget_mb}: {err} "
                          "(measured on this machine; raise the budget)") from None
    plan = plan_for_config(p.pp, microbatches, costs, budget) if mesh.rank == 0 else None
    module.runtime.use(broadcast_schedule(plan, mesh))
    module.runtime.costs = costs
    return module


def optimal_budget(p, microbatches: int, costs) -> float:
    """schedule="optimal"'s activation bytes per rank: parallel.activation_budget_mb, else
    what 1F1B's busiest rank stashes (`one_f_one_b_peak`)."""
    if p.activation_budget_mb is not None:
        return p.activation_budget_mb * 2**20
    return one_f_one_b_peak(costs, p.pp, microbatches)


def one_f_one_b_peak(costs, pp: int, microbatches: int) -> float:
    """The activation bytes 1F1B's busiest rank stashes: rank r keeps min(pp - r, M)
    micro-batches of its stage. The optimal schedule's default budget."""
    return max(min(pp - r, microbatches) * c.activation_bytes for r, c in enumerate(costs))


def broadcast_schedule(schedule: schedules.Schedule | None, mesh) -> schedules.Schedule:
    """Global rank 0's `schedule` on every rank (None elsewhere), as a tensor of actions."""
    header = torch.zeros(4, dtype=torch.int64, device=mesh.device)
    if mesh.rank == 0:
        rows = [[r, schedules.KINDS.index(a.kind), a.microbatch, a.stage]
                for r, actions in enumerate(schedule.actions) for a in actions]
        rows += [[-1, -1, m, s] for m, s in sorted(schedule.recompute)]
        table = torch.tensor(rows, dtype=torch.int64, device=mesh.device)
        header[:] = torch.tensor([len(rows), schedule.pp, schedule.microbatches,
                                  schedule.virtual_stages])
    comm.broadcast(header, mesh, "world")
    n, pp, microbatches, virtual = header.tolist()
    if mesh.rank != 0:
        table = torch.empty((n, 4), dtype=torch.int64, device=mesh.device)
    comm.broadcast(table, mesh, "world")
    actions = [[] for _ in range(pp)]
    recompute = set()
    for r, kind, m, s in table.tolist():
        if r < 0:
            recompute.add((m, s))
        else:
            actions[r].append(schedules.Action(schedules.KINDS[kind], m, s))
    return schedules.Schedule("optimal", pp, microbatches, virtual,
                              tuple(map(tuple, actions)), frozenset(recompute))


def runtime_of(model) -> PipelineRuntime | None:
    """The pipeline runtime of a (possibly dp-wrapped) model, or None without pp."""
    return getattr(getattr(model, "module", model), "runtime", None)
