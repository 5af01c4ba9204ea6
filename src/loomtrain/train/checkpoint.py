"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, every rank writes its own part;
written atomically, and loaded without letting anything in the files run code.

Layout, what is saved, atomicity, resume and safe loading: docs/checkpoints.md.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from loomtrain import comm
from loomtrain.errors import CheckpointError, WriteError
from loomtrain.parallel.placement import Boxes
from loomtrain.parallel.state import PLAIN, StateLayout, persistent_buffers
from loomtrain.train import checksums
from loomtrain.train.dcp_write import not_saved, root_causes, write_state
from loomtrain.writes import writing

PARTIAL, TRASH = ".partial", ".trash"
_META = "loom.json"
_NAME = re.compile(r"step_\d{8}")
_DTYPES = {n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
# Every global a genuine DCP `.metadata` refers to (torch 2.13, listed by tracing
# `find_class` on real checkpoints). Exact names only: a module prefix would also admit
# anything reachable from it, e.g. `torch.distributed.checkpoint.filesystem` + `os.system`.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # looks a layout up by name
    "torch": {"Size"} | _DTYPES,
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a DCP metadata file never does")


def read_metadata(path: Path) -> Metadata:
    """DCP's `.metadata` of checkpoint `path`, unpickled safely; CheckpointError otherwise."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except OSError as err:
        raise CheckpointError(f"checkpoint {str(path)!r}: cannot read {file.name}: {err}") from None
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"checkpoint {str(path)!r}: refused to load {file.name}: {err}. "
                              "Only load checkpoints from sources you trust.") from None
    except Exception as err:  # a truncated or garbled pickle raises EOFError, ValueError, ...
        raise CheckpointError(f"checkpoint {str(path)!r}: {file.name} is damaged "
                              f"({type(err).__name__}: {err})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {file.name} is not DCP metadata")
    return metadata


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Published checkpoints, oldest first: every folder named `step_<8 digits>`, intact or
    damaged (only `publish`'s rename makes one, so each was complete once); never a
    `.partial` or `.trash` folder."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _NAME.fullmatch(p.name))


def newest(run_dir: Path, skip_damaged: bool = False, advice: str = "", warn: bool = True
           ) -> tuple[Path, list[str]]:
    """(the newest checkpoint of `run_dir`, verified; []). CheckpointError if there is none,
    or if it is damaged: naming it, why, and the newest intact one followed by `advice` (which
    may name that one's folder as {intact}). `skip_damaged`: (the newest intact one, one line
    per damaged newer one skipped, saying why), for the caller to print: never silent."""
    found = list_checkpoints(run_dir)
    if not found:
        raise CheckpointError(f"{str(run_dir)!r}: no checkpoint in {Path(run_dir) / 'checkpoints'}")
    damaged: list[str] = []
    for path in reversed(found):
        try:
            verify(path, warn=warn and (skip_damaged or not damaged))
        except CheckpointError as err:
            damaged.append(str(err))
            continue
        if damaged and not skip_damaged:
            raise CheckpointError(f"{damaged[0]}. The newest intact checkpoint is {path.name}"
                                  + (f": {advice.format(intact=path)}" if advice else ""))
        return path, [f"skipped: {why}; using {path.name}" for why in damaged]
    raise CheckpointError(f"{str(run_dir)!r}: no intact checkpoint: " + "; ".join(damaged))


def read_meta(path: Path) -> dict:
    """loom.json of checkpoint `path`, checked against its own checksum (checksums.py)."""
    file = Path(path) / _META
    if not file.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {_META} is missing")
    try:
        meta = json.loads(file.read_text())
        int(meta["step"]), int(meta["world"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {str(path)!r} has an unreadable {_META}: {err!r}") from None
    checksums.check_seal(path, _META, meta)
    return meta


_warned: set[str] = set()


def verify(path: Path, warn: bool = True) -> tuple[dict, Metadata]:
    """Checks checkpoint `path` before anything reads its tensors: loom.json, every file
    against its size and SHA-256 in loom.json, safe metadata, and every data file present and
    as long as the metadata says. Returns (loom.json, DCP metadata). A checkpoint written
    before checksums has no manifest: accepted, with a one-line warning (`warn`, once per
    process) that its bytes are unverified."""
    meta = read_meta(path)
    if not checksums.check(path, meta) and warn and str(path) not in _warned:
        _warned.add(str(path))
        print(f"warning: checkpoint {str(path)!r} has no checksums (written before loomtrain "
              "recorded them): its files are checked for presence and length only, changed "
              "bytes inside them would go unnoticed", file=sys.stderr)
    metadata = read_metadata(path)
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        name = info.relative_path
        if Path(name).name != name:  # metadata must not point outside its folder
            raise CheckpointError(f"checkpoint {str(path)!r}: metadata refers to file {name!r}")
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = Path(path) / name
        actual = file.stat().st_size if file.is_file() else None
        if actual is None or actual < size:
            state = "is missing" if actual is None else f"has {actual} of its {size} bytes"
            raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {name} {state}")
    return meta, metadata


def training_state(model, optimizer, for_saving: bool = True, layout: StateLayout = PLAIN) -> dict:
    """{"model": ..., "optim": ...} in the layout-independent form (parallel/state.py): the
    `layout` of the engine that wrapped the model (its component's `Built.layout`) says how,
    so checkpoints load across engines, stages and rank counts."""
    return layout.state(model, optimizer, for_saving)


def _rng_state(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """RNG state differs per rank (dropout masks once ranks diverge): keys name the rank."""
    state = {f"rng.rank{rank}.cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state(device)
    return state


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(path: Path) -> None:
    """Rename, then delete: a crash mid-delete leaves a `.trash` folder, never a damaged
    folder that still looks like a checkpoint."""
    if path.exists():
        trash = path.with_name(path.name.removesuffix(PARTIAL) + TRASH)
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def save(run_dir: Path, step: int, model, optimizer, mesh, keep: int, extra: dict,
         tensors: dict | None = None, layout: StateLayout = PLAIN) -> Path:
    """Collective: every rank calls it. Returns the published checkpoint folder. `tensors`:
    more entries under their own keys (the components' state: sparsity masks, a rank's
    compression residuals); `load`'s `extra` reads them back. `extra` (plain values) goes into
    loom.json. A write that fails (a full disk...) is a WriteError on every rank, and the
    checkpoint is not published: the older ones stay as they were."""
    final = step_dir(run_dir, step)
    partial = final.with_name(final.name + PARTIAL)
    if mesh.rank == 0:
        with writing(final.parent):
            final.parent.mkdir(parents=True, exist_ok=True)
            _discard(partial)  # what a crash during an earlier save of this step left
    comm.barrier(mesh)  # nobody writes into `partial` before it is clean
    state = {**training_state(model, optimizer, layout=layout),
             **_rng_state(mesh.rank, mesh.device), **(tensors or {})}
    write_state(state, partial, _SavePlanner(), remove=mesh.rank == 0)
    if mesh.rank == 0:
        meta = {"step": step, "world": mesh.world, "sizes": mesh.sizes, **extra}
        publish(run_dir, final, meta, keep)
    return final


def publish(run_dir: Path, final: Path, meta: dict, keep: int) -> None:
    """Once every part of `final`'s `.partial` folder is written (one process): loom.json with
    each file's size and SHA-256 (checksums.py), one rename to `final`, then all but the
    newest `keep` checkpoints and any leftover `.partial` or `.trash` folder deleted. A write
    that fails before the rename: WriteError, and the `.partial` folder is removed."""
    partial = final.with_name(final.name + PARTIAL)
    meta_file = partial / _META
    meta = checksums.sealed(meta, checksums.manifest(partial, skip=_META))
    try:
        with writing(meta_file):
            meta_file.write_text(json.dumps(meta, indent=1))
            _fsync(meta_file)
        with writing(final):
            _discard(final)  # a fresh run under torchrun may reuse a folder
            os.replace(partial, final)
    except WriteError as err:
        raise not_saved(partial, str(err), remove=True) from None
    with writing(final.parent):
        _fsync(final.parent)
        for old in list_checkpoints(run_dir)[:-keep]:
            _discard(old)
    for stale in [*final.parent.glob(f"*{PARTIAL}"), *final.parent.glob(f"*{TRASH}")]:
        shutil.rmtree(stale, ignore_errors=True)


def _lookup(state_dict: dict, index):
    """A sharded tensor's box by its offset, or None for anything else (DCP's own lookup)."""
    value = state_dict.get(index.fqn)
    return value.__get_tensor_shard__(index) if isinstance(value, Boxes) else None


class _SavePlanner(DefaultSavePlanner):
    """DCP's default, plus the boxes of sharded tensors (parallel/placement.py)."""

    def lookup_object(self, index):
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_object(index)


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor values with `torch.load(weights_only=False)`
    (torch 2.13, default_planner.py). Each value is first loaded with `weights_only=True`; the
    same bytes, proven to hold only allowed types, then go to DCP as usual."""

    def load_bytes(self, read_item, value) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            # torch wraps the reason in boilerplate paragraphs (and advice to retry unsafely)
            reason = [p.strip() for p in str(err).split("\n\n") if p.strip() and not
                      p.startswith(("Weights only load failed", "Check the documentation"))]
            raise CheckpointError(f"refused to load value {read_item.dest_index.fqn!r} "
                                  f"({' '.join(reason) or 'not plain data'}): the file is damaged "
                                  "or holds a pickle that would run code") from None
        value.seek(0)
        super().load_bytes(read_item, value)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        """DCP's own, less its first call, `_init_state_dict`: that materializes meta-device
        tensors (there are none here) and replaces every value of a type it does not know,
        such as a sharded `Boxes`, by None (torch 2.13, planner_helpers.py)."""
        self.original_state_dict = state_dict
        if self.flatten_sharded_tensors:
            state_dict = _flatten_sharded_tensors(state_dict)
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict)
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def lookup_tensor(self, index):
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_tensor(index)


class _SafeReader(dcp.FileSystemReader):
    """Serves metadata already read by `read_metadata`. `read_metadata` takes no `rank`
    argument, so DCP does not fall back to per-rank metadata files (read with plain pickle)."""

    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def _dcp_load(path: Path, state: dict, metadata: Metadata, no_dist: bool = False) -> None:
    try:
        with warnings.catch_warnings():  # no_dist is meant: DCP warns that it assumes so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=_SafeReader(path, metadata),
                     planner=_WeightsOnlyPlanner(), no_dist=no_dist)
    except CheckpointException as err:
        raise CheckpointError(f"checkpoint {str(path)!r} could not be loaded ({root_causes(err)}); "
                              "it is damaged or does not match this run's model and optimizer") from None


def init_optimizer_state(optimizer) -> None:
    """Create the optimizer's state tensors for DCP to load into: one step with zero
    gradients and learning rate 0 (torch's `_init_optim_state`, which skips optimizers whose
    parameters already have a `.grad`, as the engines' bucket views always are)."""
    if optimizer.state:
        return
    made = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                made.append(p)
            else:
                p.grad.zero_()
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    getattr(optimizer, "inner", optimizer).step()  # ZeRO: no publish needed, nothing moved
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for p in made:
        p.grad = None


def load(path: Path, model, optimizer, mesh, extra: dict | None = None,
         layout: StateLayout = PLAIN) -> dict:
    """Collective. Restores model, optimizer and this rank's RNG state; returns loom.json.
    On a one-rank `mesh`, DCP runs without a process group (the asynchronous parameter server
    loads alone while its workers wait). `extra`: more entries to read, {key: placeholder},
    replaced in place by the checkpoint's values. `layout`: as `save`'s."""
    meta, metadata = verify(path, warn=mesh.rank == 0)
    mismatch = layout.check(metadata.state_dict_metadata, model)
    if mismatch:
        raise CheckpointError(f"checkpoint {str(path)!r} does not match this run: {mismatch}")
    if layout.init_optimizer:
        init_optimizer_state(optimizer)
    state = layout.to_load(model, optimizer, metadata.state_dict_metadata)
    # a checkpoint written on CPU has no CUDA RNG state: restore what it holds
    rng = {k: v for k, v in _rng_state(mesh.rank, mesh.device).items() if k in metadata.state_dict_metadata}
    state.update(rng)
    state.update(extra or {})
    _dcp_load(path, state, metadata, no_dist=mesh.world == 1)
    for key in extra or {}:
        extra[key] = state[key]
    try:
        layout.load(model, optimizer, state)
    except (RuntimeError, KeyError, ValueError) as err:
        raise CheckpointError(f"checkpoint {str(path)!r} does not match this run: {err}") from None
    for key in rng:
        if key.endswith(".cuda"):
            torch.cuda.set_rng_state(state[key], mesh.device)
        else:
            torch.set_rng_state(state[key])
    return meta


def saved_tensors(path: Path, prefix: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{key: (shape, dtype)} of checkpoint `path`'s tensors whose key starts with `prefix`
    (what a component's `placeholders` needs to know)."""
    return {k: (tuple(m.size), m.properties.dtype)
            for k, m in read_metadata(path).state_dict_metadata.items()
            if k.startswith(prefix) and hasattr(m, "size")}


def load_model_state(path: Path, model=None) -> dict[str, torch.Tensor]:
    """Single process, no process group, no model needed: the model's tensors, consolidated
    from every rank's part into full CPU tensors (names without the `model.` prefix). With
    `model` (built on any device), less its non-persistent buffers (`unsaved_buffers`)."""
    state = load_tensors(path, "model.")
    if not state:
        raise CheckpointError(f"checkpoint {str(path)!r} holds no model tensors")
    left_out = unsaved_buffers(model)
    return {k: v for k, v in state.items() if k not in left_out}


def unsaved_buffers(model) -> set[str]:
    """Names of `model`'s non-persistent buffers (functions of the config: the llama's rope
    frequencies), which ZeRO checkpoints written before 2026-12-06 held: a checkpoint's
    tensors under these names are left out, not loaded."""
    if model is None:
        return set()
    return {n for n, _ in model.named_buffers()} - set(persistent_buffers(model))


def load_tensors(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Single process: every tensor of checkpoint `path` whose key starts with `prefix`, as
    full CPU tensors keyed without the prefix (empty if there is none)."""
    _, metadata = verify(path)
    state = {k: torch.empty(v.size, dtype=v.properties.dtype)
             for k, v in metadata.state_dict_metadata.items()
             if k.startswith(prefix) and hasattr(v, "size")}
    if state:
        _dcp_load(path, state, metadata, no_dist=True)
    return {k.removeprefix(prefix): v for k, v in state.items()}


def load_model_weights(path: Path, model) -> None:
    """Single process: load a checkpoint's model weights into `model` (export, generation)."""
    try:
        model.load_state_dict(load_model_state(path, model))
    except RuntimeError as err:
        raise CheckpointError(f"checkpoint {str(path)!r} does not match the model: {err}") from None
