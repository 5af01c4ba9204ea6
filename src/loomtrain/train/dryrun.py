"""`loom train --dry-run`: resolve the config, build the mesh and the engine on a fake backend
in this one process, estimate memory per rank and the collectives of one optimizer step, and
train nothing (the single-process dry run of torchtitan's fake backend).

What it builds, where each estimate comes from, and the formulas: docs/dry-run.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from loomtrain.comm.meter import wire_bytes
from loomtrain.errors import ConfigError
from loomtrain.parallel.pipeline.estimate import (
    PipelineEstimate,
    PipelineSplit,
    gpt_activation_bytes,
    mlp_activation_bytes,
    pipeline_estimate,
    split_on_meta,
)
from loomtrain.parallel.tensor_estimate import tensor_activation_bytes, tensor_collectives
from loomtrain.parallel.zero import ROOT
from loomtrain.parallel.zero.estimate import (
    FP32_BYTES,
    Collective,
    MemoryEstimate,
    compute_bytes,
    zero_collectives,
    zero_eval_gathers,
    zero_memory_per_rank,
)
from loomtrain.parallel.zero.flat import ShardPlan

def activation_bytes(model_cfg, micro_batch: int, compute_bytes: int = FP32_BYTES) -> int:
    """One micro-batch's saved activations: accumulation runs micro-batches one after another,
    and each backward frees its graph, so only one is alive at a time."""
    m = model_cfg
    if m.name == "gpt":
        return gpt_activation_bytes(micro_batch, m.seq_len, m.d_model, m.n_layers, m.n_heads,
                                    m.mlp_ratio, m.vocab_size, compute_bytes)
    if m.name == "mlp":
        return mlp_activation_bytes(micro_batch, m.seq_len, m.d_model, m.n_layers,
                                    m.mlp_ratio, m.vocab_size, compute_bytes)
    raise AssertionError(f"no activation formula for model {m.name!r}")


def optimizer_states(optimizer: str, momentum: float) -> int:
    """fp32 state tensors per parameter: AdamW keeps exp_avg and exp_avg_sq; SGD keeps a
    momentum buffer only when momentum (train.beta1) is non-zero, as torch.optim.SGD does.
    AdamW's per-tensor `step` scalars are left out (4 bytes per parameter tensor)."""
    if optimizer == "adamw":
        return 2
    if optimizer == "sgd":
        return 1 if momentum > 0 else 0
    raise AssertionError(f"no state count for optimizer {optimizer!r}")


def memory_per_rank(parameters: int, states_per_parameter: int, activations: int) -> MemoryEstimate:
    """ZeRO stage 0: every rank holds all parameters, a gradient for each (the engine's bucket
    buffers) and all optimizer state, in fp32."""
    p = parameters * FP32_BYTES
    return MemoryEstimate(p, p, states_per_parameter * p, activations)


def _all_reduce(purpose: str, axis: str, ranks: int, payload: int, every: int = 1) -> Collective:
    return Collective(purpose, "all_reduce", axis, ranks, payload,
                      wire_bytes("ring_all_reduce", payload, ranks), every)


def gradient_all_reduces(bucket_payload_bytes: list[int], dp: int) -> list[Collective]:
    """One ring all-reduce over dp per gradient bucket, on the last micro-batch only (the
    others run under no_sync). On one dp rank the comm layer sends and counts nothing."""
    if dp == 1:
        return []
    n = len(bucket_payload_bytes)
    return [_all_reduce(f"gradient bucket {i + 1}/{n}", "dp", dp, size)
            for i, size in enumerate(bucket_payload_bytes)]


def trainer_collectives(world: int, dp: int, log_every: int, eval_every: int,
                        pp: int = 1) -> list[Collective]:
    """The trainer's own: the control all-reduce (2 float64: token count, stop flag) over the
    world every step, the loss (1 float64) over dp, then over pp (the last stage holds it), on
    logged steps, the validation (loss sum, token count: 2 float64) over dp, then pp, on
    evaluation steps. train/trainer.py; the last step is also logged and evaluated."""
    out = []
    if world > 1:
        out.append(_all_reduce("control (tokens, stop flag)", "world", world, 16))
    for purpose, payload, every in (("logged loss", 8, log_every), ("validation loss", 16, eval_every)):
        out += [_all_reduce(purpose, axis, n, payload, every)
                for axis, n in (("dp", dp), ("pp", pp)) if n > 1]
    return out


# --- building on the fake backend -------------------------------------------------------------


def _check_data(cfg) -> str:
    """The corpus the run would read, and whether it holds one window for train and val."""
    from loomtrain.train.task import check_task_data

    return check_task_data(cfg)


def uses_zero(cfg) -> bool:
    """The sharded engine runs it (`loomtrain.train.apply.parallelize`)."""
    return cfg.parallel.zero_stage > 0 or cfg.train.precision == "bf16"


@dataclass(frozen=True)
class ZeroLayout:
    plan: ShardPlan
    units: list[tuple[str, int]]  # (name, padded length), forward order, root excluded
    root: int  # padded length of the root unit, 0 if empty


def _zero_layout(model, mesh, cfg) -> ZeroLayout:
    """The plan and unit lengths `shard()` would build, from shapes only (a meta model)."""
    from loomtrain.parallel.zero import assign_parameters, find_units, make_plan
    from loomtrain.parallel.zero.layout import unit_layout

    p = cfg.parallel
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    plan = make_plan(mesh, p.zero_stage, p.hierarchical, p.optimizer_shard, dtype,
                     p.offload_optimizer)
    try:
        named = find_units(model, list(p.shard_units) or None)
    except ValueError as err:
        raise ConfigError(f"parallel.shard_units={list(p.shard_units)!r}: {err}") from None
    multiple = plan.shard_ranks * plan.replica_ranks  # as shard() pads: every rank of dp
    units, root = [], 0
    for name, params in assign_parameters(model, named).items():
        if params:
            padded = unit_layout(name, [(n, tuple(x.shape)) for n, x in params], multiple).padded
            if name == ROOT:
                root = padded
            else:
                units.append((name, padded))
    return ZeroLayout(plan, units, root)


@dataclass(frozen=True)
class _Built:
    layout: str
    model_parameters: int  # the whole model's
    parameters: int  # rank 0's
    buckets: list[int]  # DataParallel's gradient bucket bytes
    zero: ZeroLayout | None
    broadcast_wire_bytes: int
    pipeline: PipelineSplit | None


def _build_on_fake_backend(cfg) -> _Built:
    """Rank 0's view of the real mesh and engine over a fake world of parallel.nproc ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from loomtrain.mesh import build_mesh
    from loomtrain.models import build_model
    from loomtrain.parallel import apply_tensor_parallel
    from loomtrain.parallel.data import apply_data_parallel, broadcast_state

    assert not dist.is_initialized(), "the dry run builds its own (fake) process group"
    p = cfg.parallel
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p.nproc)
    try:
        try:
            # the layout does not depend on the device; cpu needs no GPU here
            mesh = build_mesh({"pp": p.pp, "dp": p.dp_size, "cp": p.cp, "tp": p.tp},
                              ranks_per_node=p.ranks_per_node, device="cpu")
        except ValueError as err:
            raise ConfigError(f"parallel.ranks_per_node={p.ranks_per_node}: {err}") from None
        with torch.device("meta"):
            model = build_model(cfg.model)
        whole = sum(x.numel() for x in dict.fromkeys(model.parameters()))
        model, _ = apply_tensor_parallel(model, mesh, cfg)  # this rank's pieces, as parallelize
        split = None
        if p.pp > 1:  # then this rank's stages, as parallelize
            model, split = split_on_meta(model, mesh, cfg)
        buckets, zero = [], None
        if uses_zero(cfg):
            zero = _zero_layout(model, mesh, cfg)
            broadcast_state(model, mesh, "dp")  # what shard() sends first
        else:
            engine = apply_data_parallel(model, mesh, p)
            buckets = [b.buffer.numel() * b.buffer.element_size() for b in engine.buckets]
        parameters = sum(x.numel() for x in dict.fromkeys(model.parameters()))
        layout = mesh.describe()
        if mesh.nodes > 1:
            local, cross = (_ranks(mesh.group_ranks(f"dp.{s}")) for s in ("local", "cross"))
            layout += f"\n  rank 0's dp sub-groups: node-local {local}, cross-node {cross}"
        return _Built(layout, whole, parameters, buckets, zero,
                      mesh.meter.total("wire_bytes", op="broadcast"), split)
    finally:
        dist.destroy_process_group()


def _ranks(ranks: list[int]) -> str:
    if len(ranks) <= 8:
        return str(ranks)
    return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


@dataclass(frozen=True)
class DryRun:
    data: str
    layout: str
    model_parameters: int  # the whole model's
    parameters: int  # rank 0's (its tp pieces, its pipeline stages)
    bucket_bytes: list[int]  # DataParallel (stage 0, fp32); [] with ZeRO
    zero: ZeroLayout | None  # the sharded engine's plan and units; None for DataParallel
    broadcast_wire_bytes: int
    memory: MemoryEstimate
    engine: list[Collective]  # the engine's: gradient buckets, or ZeRO's reductions and gathers
    collectives: list[Collective]  # the engine's, then the trainer's own, then evaluation's
    pipeline: PipelineEstimate | None = None


def estimate(cfg) -> DryRun:
    """Everything `loom train --dry-run` reports, as numbers."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    # the estimates below model the dp, tp and pp axes
    if p.cp > 1:
        raise ConfigError(f"loom train --dry-run does not model context parallelism yet "
                          f"(parallel.cp={p.cp}): run without --dry-run, or with parallel.cp=1 "
                          "to see the other axes")
    if cfg.lowcomm.algorithm != "none":  # it would report a gradient all-reduce every step
        raise ConfigError(f"loom train --dry-run does not model low-communication replicas yet "
                          f"(lowcomm.algorithm={cfg.lowcomm.algorithm!r}): run without --dry-run")
    data = _check_data(cfg)
    schedule = _pipeline_schedule(cfg) if p.pp > 1 else None
    built = _build_on_fake_backend(cfg)
    states = optimizer_states(t.optimizer, t.beta1)
    own = trainer_collectives(p.nproc, p.dp_size, cfg.run.log_every, cfg.run.eval_every, p.pp)
    z = built.zero
    c = FP32_BYTES if z is None else compute_bytes(z.plan)
    # trainer.evaluate: every rank runs ceil(eval_batches / dp) forwards, so that ZeRO-3's
    # gathers (and the tp collectives, the pipeline's sends) match on every rank
    forwards = -(-cfg.run.eval_batches // p.dp_size)
    pipe = None
    if schedule is not None:
        pipe = pipeline_estimate(built.pipeline, schedule, cfg, c, forwards)
        activations = pipe.peaks[0]
    elif p.tp > 1:
        activations = tensor_activation_bytes(m, t.micro_batch, p.tp, p.sequence_parallel, c)
    else:
        activations = activation_bytes(m, t.micro_batch, c)
    if z is None:
        memory = memory_per_rank(built.parameters, states, activations)
        engine = gradient_all_reduces(built.buckets, p.dp_size)
        evals = []
    else:
        memory = zero_memory_per_rank(z.plan, z.units, z.root, states, activations, p.prefetch)
        engine = zero_collectives(z.plan, z.units, z.root, cfg.accumulation_steps)
        evals = zero_eval_gathers(z.plan, z.units, z.root, forwards, cfg.run.eval_every)
    engine = engine + tensor_collectives(m, t.micro_batch, p.tp, p.sequence_parallel,
                                         cfg.accumulation_steps, c, forwards, cfg.run.eval_every)
    if pipe is not None:
        engine, evals = engine + pipe.collectives, evals + pipe.eval_sends
    return DryRun(data, built.layout, built.model_parameters, built.parameters, built.buckets, z,
                  built.broadcast_wire_bytes, memory, engine, engine + own + evals, pipe)


def _pipeline_schedule(cfg):
    """The schedule the runtime would run, or the config's schedule refused by name."""
    from loomtrain.parallel.pipeline import build_schedule

    try:
        return build_schedule(cfg)
    except ValueError as err:
        raise ConfigError(f"parallel.schedule={cfg.parallel.schedule!r}: {err}") from None
