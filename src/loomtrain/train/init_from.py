"""`[train] init_from = PATH`: a new run whose model starts from a checkpoint's weights.

The run is otherwise fresh: step 0, a new optimizer (no moments), the LR schedule from its
warmup, the data from its first batch; nothing but the model's tensors is read (not the
optimizer, the step, the RNG states, nor low-communication or parameter-server state).

PATH is a run folder (its newest complete checkpoint is used) or one checkpoint folder
(`RUN_DIR/checkpoints/step_N`), written by the synchronous trainer (train/checkpoint.py) or
by the asynchronous parameter server (asyncsgd/state.py, `"server_only"` in its loom.json):
both keep the model as DCP entries "model.<name>" of whole, unsharded tensors, whatever the
engine, tensor/pipeline split, ZeRO stage or rank count that wrote them.

How: every rank reads the whole model (DCP without a process group, as `loom export` does:
`checkpoint.load_model_state`) into its freshly built model, before `parallelize` splits
(tp, pp) or shards (ZeRO) it. So any layout of the new run starts from any layout of the old
one: the resharding is the one every run already does from its initial weights. Cost: each
rank reads the checkpoint's model tensors once and holds them as full CPU tensors until they
are copied (4 bytes per parameter, once, at the start).

Checks (`resolve_init_from`, called by the CLI before any process starts or any file is
written; CheckpointError, exit 2): PATH exists and resolves to a complete checkpoint, which
`checkpoint.verify` accepts, whose model tensors have the names and shapes of the model this
config builds (compared on the meta device: no memory, no initialization). The resolved
checkpoint folder replaces PATH in the run's config.toml, so the run names exactly the
weights it started from even after the source run has written newer checkpoints.

`--resume` of such a run loads its own checkpoints and never reads `init_from` again (the
checkpoint it names may be gone by then).
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
    checkpoint of the run folder `path`; verified (files present and whole)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"{_KEY}={str(path)!r} does not exist; give a run folder (its newest checkpoint is "
            "used) or a checkpoint folder (RUN_DIR/checkpoints/step_N)")
    if (path / "loom.json").is_file() and (path / ".metadata").is_file():
        found = path
    else:
        done = checkpoint.list_checkpoints(path)
        if not done:
            raise CheckpointError(
                f"{_KEY}={str(path)!r} is neither a checkpoint folder (no loom.json and .metadata "
                "in it) nor a run folder with a complete checkpoint (nothing under "
                f"{str(path / 'checkpoints')!r}); give a run folder or RUN_DIR/checkpoints/step_N")
        found = done[-1]
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
