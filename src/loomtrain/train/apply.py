"""Builds a run's model, optimizer and loss from its components, in the apply order
(component.py: SPLIT, PIPELINE, CONTEXT, then the optimizer, PREPARE, REPLICATE); `build_run`
builds the model on the meta device and materializes this rank's pieces after the split."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loomtrain.component import OPTIMIZER, PIPELINE, Built
from loomtrain.models import token_loss_sum
from loomtrain.train.components import COMPONENTS
from loomtrain.train.init_from import load_init_weights
from loomtrain.train.init_record import record_init
from loomtrain.train.materialize import materialize
from loomtrain.train.task import build_task_model


def parallelize(model, mesh, cfg, make_optimizer, components=None):
    """(model, optimizer, loss_sum) for `cfg` (the whole Config). `make_optimizer(model)`
    builds the optimizer over the parameters this rank holds after the split; `loss_sum
    (logits, targets)` is the token-summed cross-entropy of what the wrapped model returns
    (a slice of the vocabulary under tensor parallelism)."""
    built = build(model, mesh, cfg, make_optimizer, components)
    return built.model, built.optimizer, built.loss_sum


def build(model, mesh, cfg, make_optimizer, components=None, materializer=None) -> Built:
    """`parallelize`, keeping what the run needs: the components that applied
    (`Built.applied`: those without a stage first, then in stage order; the loop calls their
    hooks in this order), their runtime parts and the checkpoint layout. With `materializer`
    (`model` is on the meta device: `build_run`) the split stages (SPLIT, PIPELINE) run on
    meta, and the model is materialized before any later stage (or by the pipeline, before
    its runtime reads the stages: `Built.materialize`)."""
    components = components if components is not None else type(cfg).components or COMPONENTS
    built = Built(model=model, mesh=mesh, cfg=cfg, loss_sum=token_loss_sum,
                  materializer=materializer)
    order = sorted(components, key=lambda c: -1 if c.stage is None else c.stage)
    built.applied = [c for c in order if c.applies(cfg)]
    for component in order:
        if component.stage is None:
            continue
        if component.stage > PIPELINE:
            built.materialize()
        if component.stage > OPTIMIZER and built.optimizer is None:
            built.optimizer = make_optimizer(built.model)
        if component.applies(cfg):
            component.apply(built)
    built.materialize()
    if built.optimizer is None:
        built.optimizer = make_optimizer(built.model)
    return built


@dataclass
class Setup:
    """How `build_run` built the model."""

    parameters: int  # the whole model's
    model_bytes: int  # the whole model's tensors
    peak_bytes: int  # the most bytes of model tensors this rank held at once while building
    init: tuple[Path, int] | None = None  # train.init_from's (checkpoint folder, step), if loaded


def build_run(cfg, mesh, make_optimizer, init_from: bool = True,
              components=None) -> tuple[Built, Setup]:
    """The model of `cfg` (train/task.py), initialized from torch's current random state, built
    by `build` on `mesh.device`: on the meta device, split, then this rank's pieces only are
    materialized, bitwise those of an eager build then split (train/materialize.py). With
    `init_from` and `train.init_from` set, every rank builds the whole model and loads the
    checkpoint's weights into it before the split (docs/finetune.md)."""
    if init_from and cfg.train.init_from is not None:
        model = build_task_model(cfg).to(mesh.device)
        size = sum(p.numel() * p.element_size() for p in (*model.parameters(), *model.buffers()))
        setup = Setup(_parameters(model), size, size, load_init_weights(model, cfg))
        return build(model, mesh, cfg, make_optimizer, components), setup
    model, record = record_init(lambda: build_task_model(cfg))
    setup = Setup(_parameters(model), record.model_bytes, 0)

    def materializer(split) -> None:
        setup.peak_bytes = materialize(split, record, mesh.device)

    return build(model, mesh, cfg, make_optimizer, components, materializer), setup


def _parameters(model) -> int:
    return sum(p.numel() for p in dict.fromkeys(model.parameters()))
