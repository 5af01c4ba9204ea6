"""The backprop mode of the run loop (train/loop.py): the model built by its components, and
one step through their hooks (train/trainer.py `step`). One step: docs/training.md, "One step".
"""

from __future__ import annotations

from pathlib import Path

from loomtrain.optim import build_optimizer, lr_at, set_lr
from loomtrain.train import trainer
from loomtrain.train.apply import build_run
from loomtrain.train.batches import target_tokens
from loomtrain.train.loop import Stepped, SyncMode, SyncStep, train_sync


class BackpropMode(SyncMode):
    def __init__(self, cfg, mesh, data, fresh: bool):
        # the components take the model, built on the meta device, in the apply order: split,
        # then this rank's pieces made real, then wrapped, with its optimizer (built after the
        # split, rebuilt by ZeRO over this rank's shard) and the loss its outputs need; a fresh
        # run from train.init_from loads the whole model before the split. A checkpoint then
        # loads into the wrapped pair
        built, setup = build_run(cfg, mesh, lambda m: build_optimizer(m, cfg.train), fresh)
        super().__init__(built, data)
        self.init, parameters = setup.init, setup.parameters
        self.description = f"{data.description}; {parameters:,} parameters"
        self.tokens_per_step = cfg.train.global_batch * data.targets_per_row

    def run(self, step: int, work) -> Stepped:
        batches, global_tokens = work
        built, cfg = self.built, self.cfg
        lr = lr_at(step, cfg.train)
        set_lr(built.optimizer, lr)
        timeline = trainer.start_timeline(built, step)
        loss_tokens = trainer.first(c.loss_tokens(built, target_tokens(batches), global_tokens)
                                    for c in built.applied)
        loss_tokens = global_tokens if loss_tokens is None else loss_tokens
        built.step_tokens = loss_tokens
        for component in built.applied:
            component.before_step(built, step)
        loss_sum, grad_norm, stepped = trainer.step(built, batches, loss_tokens, cfg.train.grad_clip)
        done = step + 1
        for component in built.applied:
            component.after_step(built, done, done == cfg.train.steps, loss_sum, loss_tokens)
        figures = {}
        if timeline is not None:
            owner, recorder = timeline
            figures = owner.write_timeline(built, recorder, self.run_dir, step, self.mesh)
        return Stepped(stepped, self.tokens_per_step, figures=figures,
                       detail=SyncStep(loss_sum, global_tokens, lr,
                                       lambda: {"grad_norm": float(grad_norm)}))


def train_backprop(cfg, run_dir: Path, resume: Path | None, mesh, stop) -> int:
    """Every rank of a run with `optim.name = "backprop"` and no parameter server calls this
    (run.train_loop does)."""
    return train_sync(BackpropMode, cfg, run_dir, resume, mesh, stop)
