"""Builds a run's model, optimizer and loss from its components, in the apply order
(component.py: SPLIT, PIPELINE, CONTEXT, then the optimizer, PREPARE, REPLICATE)."""

from __future__ import annotations

from loomtrain.component import OPTIMIZER, Built
from loomtrain.models import token_loss_sum
from loomtrain.train.components import COMPONENTS


def parallelize(model, mesh, cfg, make_optimizer, components=None):
    """(model, optimizer, loss_sum) for `cfg` (the whole Config). `make_optimizer(model)`
    builds the optimizer over the parameters this rank holds after the split; `loss_sum
    (logits, targets)` is the token-summed cross-entropy of what the wrapped model returns
    (a slice of the vocabulary under tensor parallelism)."""
    components = components if components is not None else type(cfg).components or COMPONENTS
    built = Built(model=model, mesh=mesh, cfg=cfg, loss_sum=token_loss_sum)
    staged = sorted((c for c in components if c.stage is not None), key=lambda c: c.stage)
    for component in staged:
        if component.stage > OPTIMIZER and built.optimizer is None:
            built.optimizer = make_optimizer(built.model)
        if component.applies(cfg):
            component.apply(built)
    if built.optimizer is None:
        built.optimizer = make_optimizer(built.model)
    return built.model, built.optimizer, built.loss_sum
