"""A zeroth-order run's part of `loom train --dry-run`: no gradients and no replica engine
(the seed-and-scalar all-gather over dp replaces it), the method's state, and every probe
forward's collectives as those of a forward-only pass, the one validation runs. Formulas:
docs/dry-run.md, "Zeroth-order runs"; docs/zeroth.md for the bytes.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

from loomtrain.activations import FP32_BYTES
from loomtrain.estimate import (Collective, DryRunPlan, MemoryEstimate, MemoryRow, all_reduce,
                                metered)
from loomtrain.parallel.placement import placement_of
from loomtrain.zeroth import OPTIMIZERS, STATE_PER_PARAMETER, ZOOptimizer
from loomtrain.zeroth.distributed import LOSS_BYTES, loss_broadcast_bytes, pair_exchange_bytes

def setting(cfg, key: str):
    """optim.`key`, or when unset the default of the method's constructor."""
    value = getattr(cfg.optim, key)
    if value is not None:
        return value
    for cls in (OPTIMIZERS[cfg.optim.name], ZOOptimizer):
        if key in inspect.signature(cls.__init__).parameters:
            return inspect.signature(cls.__init__).parameters[key].default
    raise AssertionError(f"no default for optim.{key}")


def pooled(plan: DryRunPlan) -> bool:
    """Whether a rank loads several dp ranks' rows (data.balance's pool): the dp ranks are
    then one replica, which exchanges no pairs and adds its loss sums over dp x cp."""
    return plan.loaded > 1


def estimate_zeroth(plan: DryRunPlan) -> None:
    """The `Zeroth` component's hook, first in the apply order: it stands in for the replica
    engine (the dp pairs' all-gather; `plan.replicated` keeps the backprop engines out), and
    once every other hook and its later additions have run (so the split model and the
    forward-only collectives are known), it sets the memory and the step's collectives."""
    n = setting(plan.cfg, "n_perturbations")
    dp = plan.cfg.parallel.dp_size
    if dp > 1 and not pooled(plan):
        pairs = pair_exchange_bytes(dp, n)
        plan.reductions = [Collective("probe pairs (seed, scalar)", "all_gather", "dp", dp,
                                      pairs["payload"], pairs["wire"],
                                      algorithm="ring_all_gather")]
    plan.replicated = True
    # the split components' hooks run after this one and queue their own later additions
    # (tp's collectives, once the pipeline's cut is known): queuing _finish from a later
    # addition puts it after all of theirs
    plan.later.append(lambda plan: plan.later.append(lambda plan: _finish(plan, n)))


def probe_forwards(name: str, n_perturbations: int) -> int:
    """Forwards a step runs per micro-batch: 2K, MeZO-SVRG's minibatch steps 4K (theta and
    the snapshot; a refresh runs 2K per batch of its large batch: `refresh_forwards`)."""
    return 2 * n_perturbations * (2 if name == "mezo-svrg" else 1)


def refresh_forwards(n_perturbations: int, svrg_batches: int) -> int:
    """Forwards a MeZO-SVRG refresh runs per micro-batch of a batch: 2K for each of its
    svrg_batches batches."""
    return 2 * n_perturbations * svrg_batches


def _finish(plan: DryRunPlan, n_perturbations: int) -> None:
    cfg = plan.cfg
    name = cfg.optim.name
    forwards = probe_forwards(name, n_perturbations)
    # the forward-only collectives (tp, cp, pp sends) are named "validation ..." and run
    # once per evaluation forward; a probe forward of a micro-batch is one such forward
    validation = [c for c in plan.collectives if c.purpose.startswith("validation ")]
    probes = _probes(plan, validation, forwards, "probe ", 1)
    if name == "mezo-svrg":
        probes += _refresh(plan, validation, n_perturbations, forwards)
    probes += method_collectives(plan)
    plan.collectives = probes + validation
    params = plan.parameters * FP32_BYTES
    plan.memory = MemoryEstimate(params, 0, 0, 0)  # nothing is saved for a backward
    states = STATE_PER_PARAMETER[name]
    plan.memory_rows += [
        MemoryRow("forward", plan.activations(), "at most what a backprop step saves of one "
                  "micro-batch: a probe's forward frees each layer's tensors after use"),
        MemoryRow(f"{name} state", states * params, f"{states} fp32 tensor(s) per trained "
                  "parameter (at most all of this rank's)")]


def _probes(plan: DryRunPlan, validation: list[Collective], forwards: int, prefix: str,
            every: int) -> list[Collective]:
    """The collectives of `forwards` probe forwards of every micro-batch, every `every`
    steps: each forward-only pass's, then one loss per forward (its micro-batches summed
    first) added over cp (over dp x cp for a pool) and broadcast over pp."""
    p = plan.cfg.parallel
    per_step = forwards * plan.cfg.accumulation_steps
    out = [replace(c, purpose=prefix + c.purpose.removeprefix("validation "),
                   calls=c.calls // plan.eval_forwards * per_step, every_steps=every)
           for c in validation + plan.eval_collectives]
    axis, ranks = ("dpcp", p.dp_size * p.cp) if pooled(plan) else ("cp", p.cp)
    if ranks > 1:
        out.append(replace(all_reduce(f"{prefix}loss sums", axis, ranks, LOSS_BYTES, every),
                           calls=forwards))
    if p.pp > 1:
        sent = loss_broadcast_bytes(p.pp, 0, 1)
        out.append(Collective(f"{prefix}loss from the last stage", "zo_loss", "pp", p.pp,
                              LOSS_BYTES, sent["wire"], every, forwards, "tree_broadcast"))
    return out


def _refresh(plan: DryRunPlan, validation: list[Collective], n_perturbations: int,
             forwards: int) -> list[Collective]:
    """MeZO-SVRG's refresh, on steps 1, E + 1, 2E + 1, ... (E = svrg_every): its large
    batch's probe forwards in place of a minibatch step's, listed as the forwards beyond
    those (every E steps, so that a refresh step's total and the average per step are
    exact); its pairs' all-gather is a minibatch step's. A large batch of one batch runs
    fewer forwards than a minibatch step: nothing is listed, and a refresh step is
    overcounted by the difference."""
    extra = refresh_forwards(n_perturbations, setting(plan.cfg, "svrg_batches")) - forwards
    if extra <= 0:
        return []
    every = setting(plan.cfg, "svrg_every")
    return _probes(plan, validation, extra, "refresh: the large batch's further probe ",
                   every)


def method_collectives(plan: DryRunPlan) -> list[Collective]:
    """What a method adds over tp for the whole tensors of this rank's split pieces
    (split.py): sparse MeZO gathers each split trainable tensor to take its threshold,
    after every mask_every-th step; HELENE adds the split tensors' sums of h for their
    clipping floors, in one all-reduce of a float64 each, every step. (Sparse MeZO's
    first thresholds and the pieces' indices are gathered once, at the start.)"""
    cfg, tp = plan.cfg, plan.cfg.parallel.tp
    name = cfg.optim.name
    if tp == 1 or name not in ("sparse-mezo", "helene"):
        return []
    split = [p for p in _trainable(plan) if placement_of(p) is not None]
    if name == "helene":
        return [all_reduce("HELENE clipping floors: the split tensors' sums of h", "tp", tp,
                           8 * len(split))] if split else []
    every = setting(cfg, "mask_every")
    return [metered("sparse MeZO thresholds: a split tensor's whole, from its tp pieces",
                    "all_gather", "tp", tp, tp * p.numel() * FP32_BYTES, every=every)
            for p in split]


def _trainable(plan: DryRunPlan) -> list:
    """This rank's trainable parameters (optim.trainable) of the split meta model, each once."""
    import torch

    from loomtrain.train.task import build_task_model
    from loomtrain.zeroth.trainable import select_trainable

    with torch.device("meta"):  # its names check the patterns, as the run's do
        whole = build_task_model(plan.cfg)
    return select_trainable(plan.model, plan.cfg.optim.trainable, whole)
