"""Parallel strategies, each a function over one mesh axis; `parallelize` composes them.

Order (TorchTitan's): tensor parallel first, then the pipeline split (this rank keeps its
stages), then context parallel (the attention kernels, parallel/sequence); data parallel or
ZeRO over the dp axis last (over dp and cp together when cp > 1: context-parallel peers hold
the same replica), since it shards whatever parameters the other axes left on this rank. The optimizer is built after tensor
parallelism (which makes new, smaller parameters) and before the dp engine (ZeRO rebuilds it
over its shard). With `lowcomm.algorithm` set, the low-communication replicas (lowcomm/) take
the dp engine's place: no gradient all-reduce, a synchronization every `inner_steps` steps.
"""

from __future__ import annotations

import torch

from loomtrain.errors import ConfigError
from loomtrain.models import token_loss_sum


def parallelize(model, mesh, cfg, make_optimizer):
    """(model, optimizer, loss_sum) for `cfg` (the whole Config). `make_optimizer(model)`
    builds the optimizer; `loss_sum(logits, targets)` is the token-summed cross-entropy of
    what the wrapped model returns (a slice of the vocabulary under tensor parallelism)."""
    model, loss_sum = apply_tensor_parallel(model, mesh, cfg)
    if cfg.parallel.pp > 1:
        from loomtrain.parallel.pipeline import apply_pipeline

        model = apply_pipeline(model, mesh, cfg)
    if cfg.parallel.cp > 1 or cfg.data.packing:
        from loomtrain.parallel.sequence import apply_sequence

        model = apply_sequence(model, mesh, cfg)
    optimizer = make_optimizer(model)
    compressor = build_compression(cfg)
    if cfg.lowcomm.algorithm != "none":  # config validation: dp only, fp32, no ZeRO
        from loomtrain.lowcomm import apply_lowcomm

        model, optimizer = apply_lowcomm(model, optimizer, mesh, cfg.lowcomm, cfg.run.seed)
        if compressor is not None:  # applies_to="pseudo_gradients": DiLoCo's outer all-reduce
            model.compressor = compressor
        return model, optimizer, loss_sum
    from loomtrain.parallel.data import apply_data_parallel
    from loomtrain.parallel.zero import shard

    p = cfg.parallel
    if p.zero_stage == 0 and cfg.train.precision == "fp32":
        return apply_data_parallel(model, mesh, p, compressor), optimizer, loss_sum
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    try:  # "sum": the trainer's loss is already divided by the global token count
        model, optimizer = shard(model, optimizer, mesh, p.zero_stage, hierarchical=p.hierarchical,
                                 optimizer_shard=p.optimizer_shard, prefetch=p.prefetch,
                                 offload_optimizer=p.offload_optimizer, compute_dtype=dtype,
                                 units=list(p.shard_units) or None, gradient_reduce="sum")
    except ValueError as err:  # a unit pattern that matches nothing, an unsupported optimizer
        raise ConfigError(f"parallel.zero_stage={p.zero_stage}: {err}") from None
    return model, optimizer, loss_sum


def build_compression(cfg):
    """The `[compression]` section's compressor, or None (config validation has checked where
    it applies). Error feedback defaults to on, except for int8 (its error is small)."""
    c = cfg.compression
    if c.method == "none":
        return None
    from loomtrain.comm.compress import build_compressor

    error_feedback = c.error_feedback if c.error_feedback is not None else c.method != "int8"
    return build_compressor(c.method, c.ratio, c.rank, error_feedback, cfg.run.seed,
                            scheme=cfg.comm.sparse_allreduce)


# the MLP model's blocks split Megatron-style; its head and embedding stay whole
MLP_PLAN = {"blocks.*.fc": "column", "blocks.*.proj": "row"}


def apply_tensor_parallel(model, mesh, cfg):
    """The tp-axis strategy: the GPT split with a vocabulary-parallel embedding, head and loss
    (and, with `parallel.sequence_parallel`, Megatron's sequence parallelism); the MLP model
    through `MLP_PLAN`. Returns (model, loss_sum)."""
    from loomtrain.parallel.tensor import parallelize_tensor, vocab_parallel_loss_sum

    if cfg.parallel.tp == 1:
        return model, token_loss_sum
    if cfg.model.name == "mlp":
        return parallelize_tensor(model, mesh, plan=MLP_PLAN), token_loss_sum
    model = parallelize_tensor(model, mesh, vocab_parallel=True,
                               sequence_parallel=cfg.parallel.sequence_parallel)
    head = model.head
    return model, lambda logits, targets: vocab_parallel_loss_sum(logits, targets, head)


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
