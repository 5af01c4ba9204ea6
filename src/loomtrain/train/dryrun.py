"""`loom train --dry-run`: resolve the config, build the mesh and the meta model on a fake
backend in this one process, let every component that applies add its estimates (its
`estimate` hook, in the apply order), and train nothing (the single-process dry run of
torchtitan's fake backend). The trainer's own collectives are added here.

What it builds, where each estimate comes from, and the formulas: docs/dry-run.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from loomtrain.activations import (  # importable from here too (tests, benchmarks/)
    activation_bytes,
    gpt_activation_bytes,
    llama_activation_bytes,
    mlp_activation_bytes,
)
from loomtrain.errors import ConfigError
from loomtrain.estimate import (  # gradient_all_reduces: importable from here too
    Collective,
    DryRunPlan,
    MemoryEstimate,
    all_reduce,
    gradient_all_reduces,
    memory_per_rank,
    optimizer_states,
)
from loomtrain.train.components import COMPONENTS
from loomtrain.train.trainer import ranks_loaded

__all__ = ["DryRun", "activation_bytes", "estimate", "gpt_activation_bytes",
           "gradient_all_reduces", "llama_activation_bytes", "memory_per_rank",
           "mlp_activation_bytes", "optimizer_states", "trainer_collectives"]


def trainer_collectives(world: int, dp: int, log_every: int, eval_every: int,
                        pp: int = 1, cp: int = 1) -> list[Collective]:
    """The trainer's own: the control all-reduce (2 float64: token count, stop flag) over the
    world every step, the loss (1 float64) over dp, cp, then pp (the last stage holds it), on
    logged steps, the validation (loss sum, token count: 2 float64) over dp, cp, then pp, on
    evaluation steps. train/trainer.py; the last step is also logged and evaluated."""
    out = []
    if world > 1:
        out.append(all_reduce("control (tokens, stop flag)", "world", world, 16))
    for purpose, payload, every in (("logged loss", 8, log_every), ("validation loss", 16, eval_every)):
        out += [all_reduce(purpose, axis, n, payload, every)
                for axis, n in (("dp", dp), ("cp", cp), ("pp", pp)) if n > 1]
    return out


@dataclass(frozen=True)
class DryRun:
    data: str
    layout: str
    model_parameters: int  # the whole model's
    parameters: int  # rank 0's (after every split)
    bucket_bytes: list[int]  # the replica engine's gradient buckets; [] when not bucketed
    broadcast_wire_bytes: int
    memory: MemoryEstimate
    reductions: list[Collective]  # the replica engine's, every step (gradient buckets, ...)
    engine: list[Collective]  # the reductions, then the other axes' (tp, pp) of every step
    collectives: list[Collective]  # the engine's, then the trainer's own, then evaluation's
    parts: dict[str, Any]  # each component's own record (or None), by its name

    def __getattr__(self, name: str) -> Any:
        """A component's record by its name: `est.zero` (the sharded layout), `est.pipeline`
        (the pipeline's estimate); None where it did not apply."""
        parts = self.__dict__.get("parts", {})
        if name in parts:
            return parts[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def estimate(cfg) -> DryRun:
    """Everything `loom train --dry-run` reports, as numbers."""
    p, r = cfg.parallel, cfg.run
    data = _check_data(cfg)
    components = type(cfg).components or COMPONENTS
    order = sorted(components, key=lambda c: -1 if c.stage is None else c.stage)
    plan, layout, whole, broadcast = _estimate_on_fake_backend(
        cfg, [c for c in order if c.applies(cfg)])
    engine = plan.reductions + plan.collectives
    own = trainer_collectives(p.nproc, p.dp_size, r.log_every, r.eval_every, p.pp, p.cp)
    parts = {c.name: plan.parts.get(c.name) for c in components}
    return DryRun(data, layout, whole, plan.parameters, plan.bucket_bytes, broadcast,
                  plan.memory_estimate(), plan.reductions, engine,
                  engine + own + plan.eval_collectives, parts)


def _check_data(cfg) -> str:
    """The corpus the run would read, and whether it holds one window for train and val."""
    from loomtrain.train.task import check_task_data

    return check_task_data(cfg)


def _estimate_on_fake_backend(cfg, components) -> tuple[DryRunPlan, str, int, int]:
    """(the plan the components filled, the mesh layout, the whole model's parameters, what
    rank 0 broadcast), as rank 0 of a fake world of parallel.nproc ranks sees them."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from loomtrain.mesh import build_mesh
    from loomtrain.models import build_model

    assert not dist.is_initialized(), "the dry run builds its own (fake) process group"
    p, t = cfg.parallel, cfg.train
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p.nproc)
    try:
        try:
            # the layout does not depend on the device; cpu needs no GPU here
            mesh = build_mesh({"pp": p.pp, "dp": p.dp_size, "cp": p.cp, "tp": p.tp, "ep": p.ep},
                              ranks_per_node=p.ranks_per_node, device="cpu")
        except ValueError as err:
            raise ConfigError(f"parallel.ranks_per_node={p.ranks_per_node}: {err}") from None
        with torch.device("meta"):
            model = build_model(cfg.model)
        # trainer.validate: every rank runs ceil(eval_batches / dp) forwards, so that the
        # collectives of an evaluation forward match on every rank
        plan = DryRunPlan(cfg, mesh, model, optimizer_states(t.optimizer, t.beta1),
                          eval_forwards=-(-cfg.run.eval_batches // p.dp_size),
                          loaded=len(ranks_loaded(components, cfg, mesh)))
        whole = plan.parameters
        for component in components:
            component.estimate(plan)
        for add in plan.later:
            add(plan)
        layout = mesh.describe()
        if mesh.nodes > 1:
            local, cross = (_ranks(mesh.group_ranks(f"dp.{s}")) for s in ("local", "cross"))
            layout += f"\n  rank 0's dp sub-groups: node-local {local}, cross-node {cross}"
        return plan, layout, whole, mesh.meter.total("wire_bytes", op="broadcast")
    finally:
        dist.destroy_process_group()


def _ranks(ranks: list[int]) -> str:
    if len(ranks) <= 8:
        return str(ranks)
    return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"
