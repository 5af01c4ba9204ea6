"""Zeroth-order training: MeZO and its variants (ZO-momentum, ZO-Adam, sparse MeZO, MeZO-SVRG,
HELENE), with memory equal to inference, and a distributed form that exchanges only seeds
and scalars. `build_zo_optimizer` makes one; train.py (`loom train` with a zeroth-order
`[optim] name`) is imported only by train/run.py, as it uses the trainer's pieces.
Guide, the module map and a loop without the trainer: docs/zeroth.md.
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
                       whole: dict[str, int] | None = None, mesh=None, **hyper) -> ZOOptimizer:
    """The optimizer `name` over `params` of `model` (default: every parameter with
    requires_grad). `whole`: for this rank's part of a split model, the whole model's
    `parameter_indices` (perturb.py), and `mesh` its mesh. `hyper`: `lr` (required), `eps`, `n_perturbations`,
    `seed`, and the method's own keys (its class's constructor); an unknown name or key is a
    ValueError."""
    if name not in OPTIMIZERS:
        raise ValueError(f"zeroth-order optimizer {name!r} is not one of {sorted(OPTIMIZERS)}")
    perturber = Perturber(model, params, whole, mesh)
    try:
        return OPTIMIZERS[name](perturber, **hyper)
    except TypeError as err:
        raise ValueError(f"zeroth-order optimizer {name!r}: {err}") from None


__all__ = ["OPTIMIZERS", "STATE_PER_PARAMETER", "Helene", "LocalExchange", "MeZO", "MeZOSVRG",
           "Pair", "Perturber", "Probe", "SeedScalarExchange", "SparseMeZO", "ZOAdam",
           "ZOMomentum", "ZOOptimizer", "build_zo_optimizer", "hyper_keys", "mix_seed", "pair_exchange_bytes",
           "step_seed"]
