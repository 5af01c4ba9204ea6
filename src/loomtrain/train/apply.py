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
    built = build(model, mesh, cfg, make_optimizer, components)
    return built.model, built.optimizer, built.loss_sum


def build(model, mesh, cfg, make_optimizer, components=None) -> Built:
    """`parallelize`, keeping what the run needs: the components that applied
    (`Built.applied`: those without a stage first, then in stage order; the loop calls their
    hooks in this order), their runtime parts and the checkpoint layout."""
    components = components if components is not None else type(cfg).components or COMPONENTS
    built = Built(model=model, mesh=mesh, cfg=cfg, loss_sum=token_loss_sum)
    order = sorted(components, key=lambda c: -1 if c.stage is None else c.stage)
    built.applied = [c for c in order if c.applies(cfg)]
    for component in order:
        if component.stage is None:
            continue
        if component.stage > OPTIMIZER and built.optimizer is None:
            built.optimizer = make_optimizer(built.model)
        if component.applies(cfg):
            component.apply(built)
    if built.optimizer is None:
        built.optimizer = make_optimizer(built.model)
    return built
