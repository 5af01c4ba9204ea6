"""`[train] init_from = PATH`: a new run whose model starts from a checkpoint's weights, and
from nothing else of it; every rank reads the whole model before the run's layout splits it.

PATH, the checks, the cost and resume: docs/finetune.md, "train.init_from".
"""

from __future__ import annotations

from pathlib import Path

import torch

from loomtrain.errors import CheckpointError
from loomtrain.train import checkpoint
from loomtrain.train.task import build_task_model

_KEY = "train.init_from"


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder `path` names: itself if it is one, else the newest complete
    checkpoint of the run folder `path`; verified (files present, whole and matching their
    checksums; a damaged newest one is refused, naming the intact one to give instead)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"{_KEY}={str(path)!r} does not exist; give a run folder (its newest checkpoint is "
            "used) or a checkpoint folder (RUN_DIR/checkpoints/step_N)")
    if (path / "loom.json").is_file() and (path / ".metadata").is_file():
        found = path
    else:
        if not checkpoint.list_checkpoints(path):
            raise CheckpointError(
                f"{_KEY}={str(path)!r} is neither a checkpoint folder (no loom.json and .metadata "
                "in it) nor a run folder with a complete checkpoint (nothing under "
                f"{str(path / 'checkpoints')!r}); give a run folder or RUN_DIR/checkpoints/step_N")
        found, _ = checkpoint.newest(path, advice=f"give {_KEY}=\"{{intact}}\" to start from it")
        return found
    checkpoint.verify(found)
    return found


def model_mismatch(cfg, found: Path) -> str | None:
    """How the checkpoint's model tensors differ from those of the model `cfg` builds (the
    first name in sorted order whose shape differs or that one side lacks), or None."""
    with torch.device("meta"):
        ours = {k: list(v.shape) for k, v in build_task_model(cfg).state_dict().items()}
    saved = {k.removeprefix("model."): list(m.size)
             for k, m in checkpoint.read_metadata(found).state_dict_metadata.items()
             if k.startswith("model.") and hasattr(m, "size")}
    for name in sorted(set(ours) | set(saved)):
        if ours.get(name) != saved.get(name):
            return (f"tensor {name!r} is {saved.get(name, 'absent')} in the checkpoint and "
                    f"{ours.get(name, 'absent')} in the model this config builds")
    return None


def checked_checkpoint(cfg) -> Path:
    """The checkpoint folder `train.init_from` resolves to, once its model tensors are found
    to be those of the model `cfg` builds (CheckpointError otherwise)."""
    found = resolve_checkpoint(cfg.train.init_from)
    mismatch = model_mismatch(cfg, found)
    if mismatch:
        raise CheckpointError(
            f"{_KEY}: checkpoint {str(found)!r} holds another model than this run's: {mismatch}. "
            "The [model] section (and data.source: \"digits\" builds a classifier) must be those "
            "of the run that wrote it, which its config.toml gives")
    return found


def resolve_init_from(cfg):
    """`cfg` with `train.init_from` replaced by the checked checkpoint folder it names."""
    train = cfg.train.model_copy(update={"init_from": str(checked_checkpoint(cfg))})
    return cfg.model_copy(update={"train": train})


def load_init_weights(model: torch.nn.Module, cfg) -> tuple[Path, int]:
    """Loads the weights `train.init_from` names into `model` (built by `build_task_model`,
    not yet parallelized), bitwise. Returns (the checkpoint folder, its step)."""
    found = checked_checkpoint(cfg)
    state = checkpoint.load_model_state(found)
    with torch.no_grad():
        model.load_state_dict(state, strict=True)
    return found, int(checkpoint.read_meta(found)["step"])
