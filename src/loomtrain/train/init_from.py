"""`[train] init_from = PATH`: a new run whose model starts from a checkpoint's weights, and
from nothing else of it; every rank reads the whole model before the run's layout splits it.

PATH (a loomtrain checkpoint, or a Hugging Face model folder: models/hf.py), the checks, the
cost and resume: docs/finetune.md, "train.init_from".
"""

from __future__ import annotations

from pathlib import Path

import torch

from loomtrain.errors import CheckpointError
from loomtrain.models.config import ModelConfig
from loomtrain.models.hf import from_hf, hf_keys, is_hf_folder
from loomtrain.train import checkpoint
from loomtrain.train.task import build_task_model

_KEY = "train.init_from"


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder `path` names: itself if it is one (or a Hugging Face model
    folder), else the newest complete checkpoint of the run folder `path`; verified (files
    present, whole and matching their checksums; a damaged newest one is refused, naming the
    intact one to give instead)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"{_KEY}={str(path)!r} does not exist; give a run folder (its newest checkpoint is "
            "used), a checkpoint folder (RUN_DIR/checkpoints/step_N) or a Hugging Face model "
            "folder (config.json and model.safetensors)")
    if is_hf_folder(path):
        return path
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


def hf_mismatch(cfg, found: Path) -> str | None:
    """How the [model] keys of the Hugging Face folder `found` differ from the run's (every
    differing key, with the folder's value to set), or None. seq_len and dropout are the run's
    (a GPT-2's seq_len at most its n_positions); a preset counts by the keys it sets."""
    run = {"seq_len": cfg.model.seq_len, "dropout": cfg.model.dropout}
    try:
        keys = hf_keys(found)
        theirs = ModelConfig(**{**keys, **run}).model_dump(exclude={"preset"})
    except ValueError as e:  # pydantic's ValidationError is one
        raise CheckpointError(f"{_KEY}: {e}") from None
    if keys["name"] == "gpt" and cfg.model.seq_len > keys["seq_len"]:
        return (f"model.seq_len={cfg.model.seq_len} exceeds the folder's n_positions="
                f"{keys['seq_len']}, the positions GPT-2 has embeddings for")
    ours = cfg.model.model_dump(exclude={"preset"})
    differ = [k for k in theirs if theirs[k] != ours[k]]
    if not differ:
        return None
    return ("its config.json gives " + ", ".join(f"model.{k}={theirs[k]!r} (this run: {ours[k]!r})"
                                                  for k in differ)
            + "; set them in the [model] section")


def model_mismatch(cfg, found: Path) -> str | None:
    """How the checkpoint's model tensors differ from those of the model `cfg` builds (the
    first name in sorted order whose shape differs or that one side lacks), or None; for a
    Hugging Face folder, how its [model] keys differ (`hf_mismatch`)."""
    if is_hf_folder(found):
        return hf_mismatch(cfg, found)
    with torch.device("meta"):
        model = build_task_model(cfg)
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    saved = {k.removeprefix("model."): list(m.size)
             for k, m in checkpoint.read_metadata(found).state_dict_metadata.items()
             if k.startswith("model.") and hasattr(m, "size")}
    for name in checkpoint.unsaved_buffers(model):
        saved.pop(name, None)
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
    if mismatch and is_hf_folder(found):
        raise CheckpointError(f"{_KEY}: Hugging Face model {str(found)!r} is another model than "
                              f"this run's: {mismatch}")
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
    not yet parallelized), bitwise (cast to the model's dtype from a Hugging Face folder's).
    Returns (the checkpoint folder, its step; 0 for a Hugging Face folder)."""
    found = checked_checkpoint(cfg)
    if is_hf_folder(found):
        _, state = from_hf(found)
        if "pos_emb.weight" in state:  # a GPT-2 run may be shorter than its n_positions
            state["pos_emb.weight"] = state["pos_emb.weight"][:cfg.model.seq_len]
        with torch.no_grad():
            model.load_state_dict(state, strict=True)
        return found, 0
    state = checkpoint.load_model_state(found, model)
    with torch.no_grad():
        model.load_state_dict(state, strict=True)
    return found, int(checkpoint.read_meta(found)["step"])
