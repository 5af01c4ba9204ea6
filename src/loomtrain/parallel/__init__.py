"""Parallel strategies, each a function over one mesh axis; `parallelize` composes them.

Order (TorchTitan's): tensor parallel, pipeline split and context parallel come first as
they land (issues 4-6); data parallel or ZeRO over the dp axis last, since it shards whatever
parameters the other axes left on this rank.
"""

from __future__ import annotations

import torch

from loomtrain.errors import ConfigError


def parallelize(model, optimizer, mesh, cfg):
    """(model, optimizer) wrapped for `cfg` (the whole Config): DataParallel for ZeRO stage 0
    in fp32, else the sharded engine (stage 0 with bf16 runs there too: it shards nothing)."""
    from loomtrain.parallel.data import apply_data_parallel
    from loomtrain.parallel.zero import shard

    p = cfg.parallel
    if p.zero_stage == 0 and cfg.train.precision == "fp32":
        return apply_data_parallel(model, mesh, p), optimizer
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    try:
        return shard(model, optimizer, mesh, p.zero_stage, hierarchical=p.hierarchical,
                     optimizer_shard=p.optimizer_shard, prefetch=p.prefetch,
                     offload_optimizer=p.offload_optimizer, compute_dtype=dtype,
                     units=list(p.shard_units) or None)
    except ValueError as err:  # a unit pattern that matches nothing, an unsupported optimizer
        raise ConfigError(f"parallel.zero_stage={p.zero_stage}: {err}") from None


def check_units(cfg) -> None:
    """Refuse `parallel.shard_units` patterns that match no module, before any process starts
    (the model is built on the meta device: shapes only)."""
    if not cfg.parallel.shard_units:
        return
    from loomtrain.models import build_model
    from loomtrain.parallel.zero import find_units

    with torch.device("meta"):
        model = build_model(cfg.model)
    try:
        find_units(model, list(cfg.parallel.shard_units))
    except ValueError as err:
        names = ", ".join(n for n, _ in model.named_modules() if n.count(".") <= 1 and n)
        raise ConfigError(f"parallel.shard_units: {err}; the model's modules include: {names}") from None
