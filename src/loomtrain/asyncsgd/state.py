"""Checkpoints of the asynchronous parameter server (`[async] mode = "ps"`), and resuming them.

The server alone writes them, in the trainer's layout: the model, its optimizer and the
server's state (its version, each worker's step, the policy's state). What is saved, when, the
cost, resume and sharded servers: docs/async.md, "Checkpoints and resume" and "Sharded servers".
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import torch

from loomtrain.errors import CheckpointError
from loomtrain.mesh import AXES
from loomtrain.train import checkpoint
from loomtrain.train.dcp_write import write_state
from loomtrain.writes import writing

SERVER_STATE = "server_state"  # the DCP key of the server's state blob
_TENSOR = "server_tensor."  # the DCP keys of its tensors; (_TENSOR, key) marks one in the blob


def save(run_dir: Path, step: int, model, optimizer, state: dict | None, keep: int,
         extra: dict) -> Path:
    """One process: the model, the optimizer and `state` (plain data and tensors) as
    checkpoint step_N, published by one rename; returns its folder. `optimizer` and `state`
    None: the model alone (sharded servers' final model)."""
    final = checkpoint.step_dir(run_dir, step)
    partial = final.with_name(final.name + checkpoint.PARTIAL)
    with writing(final.parent):
        final.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(partial, ignore_errors=True)  # what a crash during an earlier save left
    tensors: dict[str, torch.Tensor] = {}
    if optimizer is None:
        values = {"model": checkpoint.training_state(model, [])["model"]}
    else:
        values = checkpoint.training_state(model, optimizer)
    if state is not None:
        blob = io.BytesIO()
        torch.save(_pack(state, tensors), blob)
        values.update({SERVER_STATE: blob.getvalue(), **tensors})
    write_state(values, partial, no_dist=True)  # one process; a failed write: WriteError
    checkpoint.publish(run_dir, final, {"step": step, "world": 1, "sizes": dict.fromkeys(AXES, 1),
                                        "server_only": True, **extra}, keep)
    return final


def restore(path: Path, model, optimizer, policy, mesh) -> dict:
    """One process (`mesh` of one rank): loads the model and the optimizer in place and
    returns the saved state, {"server": ..., "metrics": ...}, once `policy` has accepted its
    part (CheckpointError otherwise)."""
    saved = {SERVER_STATE: b""}
    saved.update({k: torch.empty(m.size, dtype=m.properties.dtype)
                  for k, m in checkpoint.read_metadata(path).state_dict_metadata.items()
                  if k.startswith(_TENSOR) and hasattr(m, "size")})
    checkpoint.load(path, model, optimizer, mesh, saved)
    try:
        state = _unpack(torch.load(io.BytesIO(saved[SERVER_STATE]), weights_only=True), saved)
    except Exception as err:  # a garbled blob raises UnpicklingError, EOFError, KeyError, ...
        raise CheckpointError(f"checkpoint {str(path)!r}: the server's state is damaged "
                              f"({type(err).__name__}: {err})") from None
    policy.load_state_dict(state["server"]["policy"])
    return state


def _pack(tree, tensors: dict):
    """`tree` (dicts, lists, tuples, plain values, tensors) with each tensor moved into
    `tensors` under a DCP key and replaced by the marker (_TENSOR, key)."""
    if torch.is_tensor(tree):
        key = f"{_TENSOR}{len(tensors)}"
        tensors[key] = tree
        return (_TENSOR, key)
    if isinstance(tree, dict):
        return {k: _pack(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_pack(v, tensors) for v in tree)
    return tree


def _unpack(tree, tensors: dict):
    """`_pack` undone: each marker replaced by its tensor."""
    if isinstance(tree, tuple) and len(tree) == 2 and tree[0] == _TENSOR:
        return tensors[tree[1]]
    if isinstance(tree, dict):
        return {k: _unpack(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_unpack(v, tensors) for v in tree)
    return tree


def check_resume(cfg, path: Path) -> None:
    """Refuses (CheckpointError) to resume from checkpoint `path` a run it does not fit: one
    written by synchronous training into async.mode="ps" or the reverse, and for the parameter
    server another number of workers, another policy, another model shape, or a checkpoint
    without the server's state. Reads loom.json and DCP's metadata only."""
    meta, metadata = checkpoint.read_meta(path), checkpoint.read_metadata(path)
    ps = cfg.asgd.mode == "ps"
    if ps and cfg.asgd.servers > 1:
        raise CheckpointError(
            f"--resume: this run has async.servers={cfg.asgd.servers}: sharded parameter servers "
            "cannot resume (they keep independent versions, so no checkpoint holds a consistent "
            "state of all of them; only their final model is saved). Start a new run, or resume "
            "with async.servers=1 from a checkpoint a one-server run wrote")
    if "async" not in meta:
        if not ps:
            return
        written, problems = 'synchronous training (async.mode="none")', ['this run has async.mode="ps"']
    else:
        written = (f'the parameter server (async.mode="ps") with async.policy={meta["async"]!r} '
                   f'and {meta["workers"]} workers')
        problems = [] if ps else ['this run has async.mode="none"']
    if ps and "async" in meta:
        workers = cfg.parallel.nproc - cfg.asgd.servers
        if meta["workers"] != workers:
            problems.append(f"this run has {workers} workers (parallel.nproc={cfg.parallel.nproc})")
        if meta["async"] != cfg.asgd.policy:
            problems.append(f"this run has async.policy={cfg.asgd.policy!r}")
        if SERVER_STATE not in metadata.state_dict_metadata:
            why = (f"by {meta['servers']} sharded servers" if meta.get("servers", 1) > 1
                   else "before server checkpoints existed")
            problems.append(f"it holds the final model only, without the server's state (written "
                            f"{why}): it cannot be resumed")
        problems += _model_mismatch(cfg, metadata)
    if problems:
        raise CheckpointError(
            f"--resume: checkpoint {str(path)!r} was written by {written}, and "
            f"{'; '.join(problems)}. Resume with the settings of the run that wrote it (its "
            "config.toml, without --set overrides of these keys), or start a new run; nothing "
            "in the run folder was changed")


def _model_mismatch(cfg, metadata) -> list[str]:
    """The first model tensor whose name or shape differs between the checkpoint and the model
    `cfg` builds (on the meta device: no memory, no initialization)."""
    from loomtrain.models import build_model

    with torch.device("meta"):
        ours = {k: list(v.shape) for k, v in build_model(cfg.model).state_dict().items()}
    saved = {k.removeprefix("model."): list(m.size)
             for k, m in metadata.state_dict_metadata.items()
             if k.startswith("model.") and hasattr(m, "size")}
    for name in sorted(set(ours) | set(saved)):
        if ours.get(name) != saved.get(name):
            return [f"the model differs (the [model] section): tensor {name!r} is "
                    f"{saved.get(name, 'absent')} in the checkpoint and {ours.get(name, 'absent')} "
                    "in this run"]
    return []
