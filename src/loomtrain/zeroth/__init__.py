"""Zeroth-order training: MeZO and its variants, with memory equal to inference, and a
distributed form that exchanges only seeds and scalars.

- perturb.py: seeds, z regenerated from them, the in-place per-module perturbation with
  bitwise restoration (`Perturber`), `projected_gradient`, sparse MeZO's thresholds;
- optimizers.py: the step split into probes -> (seed, scalar) pairs and a deterministic
  `apply(pairs)`; MeZO, ZO-momentum, ZO-Adam, sparse MeZO;
- svrg.py: MeZO-SVRG; helene.py: HELENE;
- distributed.py: the pair all-gather over the dp axis (`SeedScalarExchange`);
- memory.py: peak-memory measurement of inference, a MeZO step and backprop steps.
- train.py: `loom train` with a zeroth-order `[optim] name` (`train_zeroth`, called by
  train/run.py's train_loop; imported only there: it uses the trainer's pieces).
Guide: docs/zeroth.md.

A loop without the trainer:

    opt = build_zo_optimizer("mezo", model, lr=1e-4, eps=1e-3)
    for x, y in batches:
        loss = opt.step(lambda: loss_fn(model(x), y))               # one process
        loss = opt.step(lambda: ..., exchange=SeedScalarExchange(mesh))   # data parallel
MeZO-SVRG asks for a large-batch step every `svrg_every` steps:
        if opt.needs_refresh(): opt.refresh([fn_1, ..., fn_svrg_batches], exchange)
"""

from __future__ import annotations

import inspect
from typing import Iterable

import torch.nn as nn

from loomtrain.zeroth.distributed import SeedScalarExchange, pair_exchange_bytes
from loomtrain.zeroth.helene import Helene
from loomtrain.zeroth.optimizers import (
    MeZO,
    LocalExchange,
    Pair,
    Probe,
    SparseMeZO,
    ZOAdam,
    ZOMomentum,
    ZOOptimizer,
)
from loomtrain.zeroth.perturb import Perturber, mix_seed, step_seed
from loomtrain.zeroth.svrg import MeZOSVRG

OPTIMIZERS: dict[str, type[ZOOptimizer]] = {
    "mezo": MeZO, "zo-momentum": ZOMomentum, "zo-adam": ZOAdam, "sparse-mezo": SparseMeZO,
    "mezo-svrg": MeZOSVRG, "helene": Helene,
}

# per-parameter state each method keeps, in multiples of the trainable parameters
STATE_PER_PARAMETER = {name: len(cls.state_kinds) for name, cls in OPTIMIZERS.items()}


def hyper_keys(name: str) -> tuple[str, ...]:
    """The keyword arguments `build_zo_optimizer(name, ...)` accepts (for config validation)."""
    keys = set()
    for cls in (OPTIMIZERS[name], ZOOptimizer):
        keys |= set(inspect.signature(cls.__init__).parameters) - {"self", "perturber", "base"}
    return tuple(sorted(keys))


def build_zo_optimizer(name: str, model: nn.Module, params: Iterable[nn.Parameter] | None = None,
                       **hyper) -> ZOOptimizer:
    """The optimizer `name` over `params` of `model` (default: every parameter with
    requires_grad). `hyper`: `lr` (required), `eps`, `n_perturbations`, `seed`, and the
    method's own keys (its class's constructor); an unknown name or key is a ValueError."""
    if name not in OPTIMIZERS:
        raise ValueError(f"zeroth-order optimizer {name!r} is not one of {sorted(OPTIMIZERS)}")
    perturber = Perturber(model, params)
    try:
        return OPTIMIZERS[name](perturber, **hyper)
    except TypeError as err:
        raise ValueError(f"zeroth-order optimizer {name!r}: {err}") from None


__all__ = ["OPTIMIZERS", "STATE_PER_PARAMETER", "Helene", "LocalExchange", "MeZO", "MeZOSVRG",
           "Pair", "Perturber", "Probe", "SeedScalarExchange", "SparseMeZO", "ZOAdam",
           "ZOMomentum", "ZOOptimizer", "build_zo_optimizer", "hyper_keys", "mix_seed", "pair_exchange_bytes",
           "step_seed"]
