"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, every rank writes its own part.

Layout: `RUN_DIR/checkpoints/step_00000100/` holds DCP's files plus `loom.json` (the step and
the mesh it was written on). Saving is atomic: everything is written to `step_N.partial/`,
and rank 0 renames it to `step_N/` only after DCP has gathered every rank's write result, so
a crash mid-save leaves only a `.partial` folder, which loading ignores and the next save
removes. Loading never unpickles arbitrary objects: tensors and small values go through
`torch.load(weights_only=True)` (DCP's own reader) and DCP's `.metadata` file through an
unpickler that accepts only DCP's metadata classes.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from loomtrain.errors import CheckpointError

PARTIAL = ".partial"
_META = "loom.json"
_SAFE_MODULES = ("torch.distributed.checkpoint.", "collections", "torch._utils")
_SAFE_NAMES = {("torch", "Size"), ("torch", "device"), ("builtins", "set"),
               ("builtins", "frozenset"), ("builtins", "slice")}
_TORCH_DTYPES = {n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
_TORCH_ENUMS = {n for n in dir(torch) if isinstance(getattr(torch, n), (torch.memory_format, torch.layout))}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` and nothing else (no arbitrary callables)."""

    def find_class(self, module: str, name: str):
        if (module.startswith(_SAFE_MODULES) or (module, name) in _SAFE_NAMES
                or (module == "torch" and name in _TORCH_DTYPES | _TORCH_ENUMS)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a `.partial` folder is never one)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir()
            if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(PARTIAL)
            and (p / _META).is_file() and (p / ".metadata").is_file()]
    return sorted(done, key=lambda p: p.name)


def read_meta(path: Path) -> dict:
    try:
        return json.loads((path / _META).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {str(path)!r} has an unreadable {_META}: {err}") from None


def training_state(model, optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save(run_dir: Path, step: int, model, optimizer, mesh, keep: int, extra: dict) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint folder."""
    final = step_dir(run_dir, step)
    partial = final.with_name(final.name + PARTIAL)
    if mesh.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    state = training_state(model, optimizer)
    # RNG state differs per rank (dropout masks): one key per rank
    state[f"rng.rank{mesh.rank}"] = torch.get_rng_state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(partial))
    if mesh.rank == 0:
        meta = {"step": step, "world": mesh.world, "sizes": mesh.sizes, **extra}
        (partial / _META).write_text(json.dumps(meta, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in (Path(run_dir) / "checkpoints").glob(f"*{PARTIAL}"):
            shutil.rmtree(stale, ignore_errors=True)
    return final


def load(path: Path, model, optimizer, mesh) -> dict:
    """Collective. Restores model, optimizer and this rank's RNG state; returns loom.json."""
    meta = read_meta(path)
    if meta.get("world") != mesh.world:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was written by {meta.get('world')} ranks; this run has "
            f"{mesh.world}. Resume with parallel.nproc={meta.get('world')}"
        )
    state = training_state(model, optimizer)
    state[f"rng.rank{mesh.rank}"] = torch.get_rng_state()
    try:
        dcp.load(state, storage_reader=SafeReader(path))
    except Exception as err:  # DCP raises CheckpointException wrapping per-rank failures
        raise CheckpointError(f"checkpoint {str(path)!r} could not be loaded: {err}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=StateDictOptions(strict=True))
    torch.set_rng_state(state[f"rng.rank{mesh.rank}"])
    return meta


def load_model_weights(path: Path, model) -> None:
    """Single process, no process group: the model part only (for export and generation)."""
    state = {"model": get_state_dict(model, [])[0]}
    try:
        dcp.load(state, storage_reader=SafeReader(path), no_dist=True)
    except Exception as err:
        raise CheckpointError(f"checkpoint {str(path)!r} could not be loaded: {err}") from None
    model.load_state_dict(state["model"])
