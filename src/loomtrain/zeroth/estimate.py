"""A zeroth-order run's part of `loom train --dry-run`: no gradients and no replica engine
(the seed-and-scalar all-gather over dp replaces it), the method's state, and every probe
forward's collectives as those of a forward-only pass, the one validation runs. Formulas:
docs/dry-run.md, "Zeroth-order runs"; docs/zeroth.md for the bytes.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

from loomtrain.activations import FP32_BYTES
from loomtrain.estimate import Collective, DryRunPlan, MemoryEstimate, MemoryRow, all_reduce
from loomtrain.zeroth import STATE_PER_PARAMETER, ZOOptimizer
from loomtrain.zeroth.distributed import LOSS_BYTES, loss_broadcast_bytes, pair_exchange_bytes

_DEFAULT_PERTURBATIONS = inspect.signature(ZOOptimizer).parameters["n_perturbations"].default


def estimate_zeroth(plan: DryRunPlan) -> None:
    """The `Zeroth` component's hook, first in the apply order: it stands in for the replica
    engine (the dp pairs' all-gather; `plan.replicated` keeps the backprop engines out), and
    once every other hook and its later additions have run (so the split model and the
    forward-only collectives are known), it sets the memory and the step's collectives."""
    n = plan.cfg.optim.n_perturbations or _DEFAULT_PERTURBATIONS
    dp = plan.cfg.parallel.dp_size
    if dp > 1:
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
    the snapshot; a refresh runs 2K per batch of its large batch, not estimated here)."""
    return 2 * n_perturbations * (2 if name == "mezo-svrg" else 1)


def _finish(plan: DryRunPlan, n_perturbations: int) -> None:
    cfg = plan.cfg
    p, name = cfg.parallel, cfg.optim.name
    forwards = probe_forwards(name, n_perturbations)
    per_step = forwards * cfg.accumulation_steps
    # the forward-only collectives (tp, cp, pp sends) are named "validation ..." and run
    # once per evaluation forward; a probe forward of a micro-batch is one such forward
    validation = [c for c in plan.collectives if c.purpose.startswith("validation ")]
    probes = [replace(c, purpose="probe " + c.purpose.removeprefix("validation "),
                      calls=c.calls // plan.eval_forwards * per_step, every_steps=1)
              for c in validation + plan.eval_collectives]
    if p.cp > 1:  # one loss per probe forward, its micro-batches summed first
        probes.append(replace(all_reduce("probe loss sums", "cp", p.cp, LOSS_BYTES),
                              calls=forwards))
    if p.pp > 1:
        sent = loss_broadcast_bytes(p.pp, 0, 1)
        probes.append(Collective("probe loss from the last stage", "zo_loss", "pp", p.pp,
                                 LOSS_BYTES, sent["wire"], calls=forwards,
                                 algorithm="tree_broadcast"))
    plan.collectives = probes + validation
    params = plan.parameters * FP32_BYTES
    plan.memory = MemoryEstimate(params, 0, 0, 0)  # nothing is saved for a backward
    states = STATE_PER_PARAMETER[name]
    plan.memory_rows += [
        MemoryRow("forward", plan.activations(), "at most what a backprop step saves of one "
                  "micro-batch: a probe's forward frees each layer's tensors after use"),
        MemoryRow(f"{name} state", states * params, f"{states} fp32 tensor(s) per trained "
                  "parameter (at most all of this rank's)")]
