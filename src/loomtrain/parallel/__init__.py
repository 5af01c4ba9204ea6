"""The synchronous parallel strategies, each a function over one mesh axis (data, zero,
tensor, pipeline, sequence); their components (*/config.py) apply them in the order of
loomtrain/component.py, through train/apply.py."""

from __future__ import annotations

import torch

from loomtrain.errors import ConfigError
from loomtrain.models import token_loss_sum
from loomtrain.parallel.tensor_plan import GPT2_HF_PLAN, LLAMA_HF_PLAN  # noqa: F401 (the API's names)


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
