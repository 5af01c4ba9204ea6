"""`loom export RUN_DIR --to safetensors`: the newest checkpoint's model, consolidated from
every rank's DCP shard into one `.safetensors` file that needs only `safetensors` to read;
`--to hf`: into a Hugging Face model folder (models/hf.py, docs/models.md).

Names, metadata, tied weights, sparse runs and the atomic write: docs/checkpoints.md, "Export".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from loomtrain.errors import CheckpointError, WriteError
from loomtrain.data.tokenizer import RUN_FILE
from loomtrain.models import build_model
from loomtrain.models.hf import to_hf
from loomtrain.sparsity.masks import unpack_mask
from loomtrain.sparsity.sparsifier import KEY
from loomtrain.train import checkpoint
from loomtrain.train.config import load_config
from loomtrain.train.task import is_classification
from loomtrain.writes import writing


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """{alias: source} for every parameter or buffer reachable under more than one name;
    the source is the first name in registration order (the one `state_dict` lists first)."""
    first: dict[int, str] = {}
    ties: dict[str, str] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        source = first.setdefault(id(tensor), name)
        if source != name:
            ties[name] = source
    return ties


def newest_of_run(run_dir: Path):
    """(RUN_DIR's newest intact checkpoint folder, the run's Config); CheckpointError if
    RUN_DIR is no run folder with a complete checkpoint."""
    if not checkpoint.list_checkpoints(run_dir):
        raise CheckpointError(f"export {str(run_dir)!r}: no complete checkpoint in {run_dir / 'checkpoints'}")
    if not (run_dir / "config.toml").is_file():
        raise CheckpointError(f"export {str(run_dir)!r}: no config.toml there; is it a loom run folder?")
    latest, _ = checkpoint.newest(run_dir, advice=f"export it by moving the damaged folder out of "
                                  f"{run_dir / 'checkpoints'}")
    return latest, load_config(run_dir / "config.toml")


def export_hf(run_dir: Path, out: Path | None = None) -> str:
    """Writes RUN_DIR's newest checkpoint as a Hugging Face model folder (default RUN_DIR/hf;
    models/hf.py `to_hf`), with the run's tokenizer.json when it has one; returns its path."""
    run_dir = Path(run_dir)
    latest, cfg = newest_of_run(run_dir)
    if is_classification(cfg):
        raise CheckpointError(f"export {str(run_dir)!r} --to hf: a digits classifier has no "
                              "Hugging Face causal-LM architecture")
    model = build_model(cfg.model)
    model.load_state_dict(checkpoint.load_model_state(latest, model), strict=True)
    tokenizer = run_dir / RUN_FILE
    out = Path(out) if out is not None else run_dir / "hf"
    try:
        with writing(out):  # a full disk: WriteError, exit 2
            to_hf(model, cfg.model, out, tokenizer if tokenizer.is_file() else None)
    except ValueError as e:  # an architecture transformers lacks (linear attention, ...)
        raise CheckpointError(f"export {str(run_dir)!r} --to hf: {e}") from None
    return str(out)


def export_safetensors(run_dir: Path, out: Path | None = None) -> str:
    """Writes RUN_DIR's newest checkpoint as one safetensors file (default
    RUN_DIR/model.safetensors); returns its path."""
    run_dir = Path(run_dir)
    latest, cfg = newest_of_run(run_dir)
    with torch.device("meta"):  # names and ties only: no memory, no initialization cost
        model = build_model(cfg.model)
    ties = tied_names(model)
    tensors = checkpoint.load_model_state(latest, model)
    for alias, source in ties.items():
        if alias not in tensors or source not in tensors:
            raise CheckpointError(f"checkpoint {str(latest)!r} lacks tied weight {alias!r} or {source!r}")
        if not torch.equal(tensors[alias], tensors[source]):
            raise CheckpointError(f"checkpoint {str(latest)!r}: tied weights {alias!r} and {source!r} differ")
    metadata = {
        "format": "pt",
        "loomtrain.checkpoint": latest.name,
        "loomtrain.step": str(checkpoint.read_meta(latest)["step"]),
        "loomtrain.model_config": json.dumps(cfg.model.model_dump()),
        "tied": json.dumps(ties),
    }
    masks = checkpoint.load_tensors(latest, KEY)  # packed bits, 8 weights per byte
    if masks:
        metadata["loomtrain.sparsity"] = json.dumps(
            {name: round(int(unpack_mask(bits, tensors[name].shape).sum()) / tensors[name].numel(), 6)
             for name, bits in masks.items()})
    out = Path(out) if out is not None else run_dir / "model.safetensors"
    tmp = out.with_name(out.name + ".tmp")
    try:
        with writing(out):  # a full disk: WriteError, exit 2; an older export stays whole
            out.parent.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, out)
    except WriteError:
        tmp.unlink(missing_ok=True)
        raise
    return str(out)
