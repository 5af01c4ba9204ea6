"""The [sparsity] section in the trainer: `SparseTraining` runs a step's gradient (plain, SAM
or ZO-SAM), masks it, re-applies and updates the masks, and reports and saves them.

Its place in `trainer.train_step`: docs/sparsity.md, "What is sparse"; its metrics
(`forward_per_step`, `backward_per_step`, `density`, `density_per_layer`): "What is
measured"; the masks in checkpoints: "Checkpoints and export".
"""

from __future__ import annotations

from pathlib import Path

import torch

from loomtrain.errors import CheckpointError, ConfigError
from loomtrain.parallel.zero.optimizer import ShardedOptimizer
from loomtrain.sparsity.sam import SharpnessAware
from loomtrain.sparsity.sparsifier import KEY, Sparsifier, whole_layers
from loomtrain.train import checkpoint
from loomtrain.zeroth.perturb import parameter_indices


class SparseTraining:
    def __init__(self, model, optimizer, cfg, mesh):
        s = cfg.sparsity
        self.model, self.optimizer = model, optimizer
        self.sparsifier = None
        sharded = optimizer if isinstance(optimizer, ShardedOptimizer) else None
        if s.method != "none":  # the whole model's layers: the same masks under any split
            self.sparsifier = Sparsifier(model, s, cfg.run.seed, cfg.train.steps,
                                         whole_layers(cfg), mesh, sharded)
        self.sam = None
        if s.sam != "none":
            masks = self.sparsifier.masks_by_param if self.sparsifier else dict
            mask_gradients = self.sparsifier.mask_gradients if self.sparsifier else lambda: None
            self.sam = SharpnessAware(s.sam, getattr(model, "module", model), s.rho, mesh, "dp",
                                      cfg.run.seed, s.zo_eps, mask_gradients, masks, sharded,
                                      whole_indices(cfg) if s.sam == "zo-sam" else None)
        if s.sparse_comm and not hasattr(model, "set_gradient_masks"):
            raise ConfigError("sparsity.sparse_comm=true needs the sparse-aware data-parallel engine "
                              "(set_gradient_masks: DataParallel, or the sharded engine of ZeRO "
                              "and bf16), which this run's model is not wrapped in; set "
                              "sparsity.sparse_comm=false")
        self.sparse_comm = s.sparse_comm
        self._engine_version: int | None = None  # the masks' version the engine holds
        self.t = 0
        self._dense: dict[str, torch.Tensor] | None = None
        self._steps = self._forwards = self._backwards = 0

    # --- the step ---
    def before_step(self, step: int) -> None:
        """Step `step` (from 0) begins: it is optimizer step t = step + 1."""
        self.t = step + 1
        if not self.sparse_comm:
            return
        dense = self.sparsifier.needs_dense_gradient(self.t)
        wanted = None if dense else self.sparsifier.version
        if wanted != self._engine_version:
            self.model.set_gradient_masks(None if dense else self.sparsifier.masks_by_param())
            self._engine_version = wanted

    def gradient(self, forward_backward, forward_loss) -> torch.Tensor:
        """The step's gradient in `.grad`, masked; returns this rank's loss sum to log."""
        def counted_backward():
            self._forwards, self._backwards = self._forwards + 1, self._backwards + 1
            return forward_backward()

        def counted_forward():
            self._forwards += 1
            return forward_loss()

        loss_sum = (self.sam.gradient(self.t, counted_backward, counted_forward)
                    if self.sam is not None else counted_backward())
        if self.sparsifier is not None:
            if self.sparsifier.needs_dense_gradient(self.t):
                self._dense = self.sparsifier.dense_gradients()
            self.sparsifier.mask_gradients()
        return loss_sum

    def after_step(self, stepped: bool) -> None:
        self._steps += 1
        s = self.sparsifier
        if s is None:
            return
        s.apply()
        if s.update_due(self.t) and (stepped or self._dense is None):
            s.reset_optimizer_state(self.optimizer, s.update(self.t, self._dense))
        self._dense = None

    # --- reporting ---
    def metrics(self, per_layer: bool) -> dict:
        """The figures since the previous call (docs/sparsity.md)."""
        steps = max(1, self._steps)
        rec = {"forward_per_step": round(self._forwards / steps, 4),
               "backward_per_step": round(self._backwards / steps, 4)}
        self._steps = self._forwards = self._backwards = 0
        if self.sparsifier is not None:
            rec["density"] = round(self.sparsifier.density(), 6)
            if per_layer:
                rec["density_per_layer"] = {k: round(v, 6) for k, v in
                                            self.sparsifier.density_per_layer().items()}
        return rec

    # --- checkpoints ---
    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.sparsifier.state_dict() if self.sparsifier is not None else {}

    def placeholders(self, path: Path) -> dict[str, torch.Tensor]:
        """Tensors for checkpoint `path`'s masks to be loaded into (`checkpoint.load`'s
        `extra`); CheckpointError if it holds none, or masks of other shapes."""
        if self.sparsifier is None:
            return {}
        saved = checkpoint.read_metadata(path).state_dict_metadata
        if not any(k.startswith(KEY) for k in saved):
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds no sparsity masks: its run trained densely "
                f"(sparsity.method=\"none\"); to start sparse training from its weights, begin a "
                f"new run with train.init_from={str(path)!r}")
        mine = self.sparsifier.state_dict()
        for key, tensor in mine.items():
            if key not in saved or tuple(saved[key].size) != tuple(tensor.shape):
                raise CheckpointError(f"checkpoint {str(path)!r} does not match this run: its "
                                      f"sparsity masks lack {key!r} or have another shape")
        return {k: torch.empty_like(v) for k, v in mine.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.sparsifier is not None:
            self.sparsifier.load_state_dict(state)


def whole_indices(cfg) -> dict[str, int]:
    """The whole model's `parameter_indices` (built on the meta device): what seeds ZO-SAM's
    z of every parameter, so that a tp piece's or a pipeline stage's is the whole model's."""
    from loomtrain.train.task import build_task_model

    with torch.device("meta"):
        return parameter_indices(build_task_model(cfg))


def build_sparse_training(model, optimizer, cfg, mesh) -> SparseTraining | None:
    """None when [sparsity] asks for nothing (method and sam "none")."""
    s = cfg.sparsity
    if s.method == "none" and s.sam == "none":
        return None
    return SparseTraining(model, optimizer, cfg, mesh)
