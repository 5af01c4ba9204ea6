"""How a built model and optimizer are laid out in a checkpoint: `StateLayout`, and the plain
layout of the unsharded engines (docs/checkpoints.md).

Every layout writes the layout-independent form: full tensor names, and boxes of the full
tensors for pieces (parallel/placement.py), so a checkpoint loads across engines, stages and
rank counts. The engine that wraps the model picks the layout (its component sets
`Built.layout`); train/checkpoint.py only asks the layout.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from loomtrain.parallel.placement import Boxes, placement_of

REPLICA_KEY = "optim.replica"  # per-replica optimizer states (low-communication runs)


class StateLayout:
    """The plain layout: torch's unsharded state dicts of the (possibly DataParallel-wrapped)
    model and its optimizer, tensor-parallel pieces as boxes of the full tensors."""

    init_optimizer = True  # create the optimizer's state before loading into it
    # "optim" holds each parameter's state under its names and the param groups as
    # `hyperparameters` saves them: what the plain and ZeRO layouts share, and load from
    # each other
    portable = True

    def state(self, model, optimizer, for_saving: bool = True) -> dict:
        """{"model": ..., "optim": ...}: what DCP saves from, or loads into."""
        module = getattr(model, "module", model)
        model_sd, optim_sd = get_state_dict(module, optimizer)
        for name, p in module.named_parameters(remove_duplicate=False):
            placement = placement_of(p)
            if placement is None:
                continue
            model_sd[name] = Boxes.whole(model_sd[name]).placed(placement)
            if name not in optim_sd["state"]:
                continue
            # get_state_dict hands out the optimizer's own per-parameter dicts: box a copy
            state = optim_sd["state"][name] = dict(optim_sd["state"][name])
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == p.shape:
                    state[key] = Boxes.whole(value).placed(placement)
        if optim_sd:  # the parameter server's model alone has no optimizer
            optim_sd["param_groups"] = hyperparameters(optim_sd["param_groups"])
        if optim_sd and for_saving:
            for first, names in aliases(module).items():
                optim_sd["state"].update({n: optim_sd["state"][first] for n in names
                                          if first in optim_sd["state"]})
        return {"model": model_sd, "optim": optim_sd}

    def to_load(self, model, optimizer, keys) -> dict:
        """What DCP loads into from a checkpoint with DCP keys `keys`: `state(...,
        for_saving=False)`, with the param groups as that checkpoint holds them
        (`groups_to_load`)."""
        state = self.state(model, optimizer, for_saving=False)
        if self.portable:
            state["optim"]["param_groups"] = groups_to_load(keys)
        return state

    def load(self, model, optimizer, state: dict) -> None:
        """Put what DCP loaded into `state` (from `to_load`) into the model and the
        optimizer."""
        module = getattr(model, "module", model)
        optim = unboxed(state["optim"])
        own = get_state_dict(module, optimizer)[1]["param_groups"]
        optim["param_groups"] = [{**g, **saved, "params": g["params"]} for g, saved in
                                 zip(own, loaded_groups(optim["param_groups"],
                                                        [g["params"] for g in own]))]
        set_state_dict(module, optimizer, model_state_dict=unboxed(state["model"]),
                       optim_state_dict=optim, options=StateDictOptions(strict=True))

    def check(self, keys, model) -> str | None:
        """Why a checkpoint with DCP keys `keys` cannot load into this layout, or None."""
        saved = {k.split(".")[1] for k in keys if k.startswith(REPLICA_KEY)}
        if saved:
            return (f"it holds the optimizer states of {len(saved)} low-communication replicas "
                    "(lowcomm.algorithm was set); resume it with the lowcomm.algorithm it was "
                    "written by (its config.toml says which)")
        module = getattr(model, "module", model)
        if self.portable and isinstance(module, torch.nn.Module):  # keys alone: nothing to check
            return _unsaved_alias(keys, module)
        return None


PLAIN = StateLayout()


def aliases(module: torch.nn.Module) -> dict[str, list[str]]:
    """First name of each parameter -> all its names (the GPT's tied embedding and head:
    both names are saved, so a pipeline stage that holds one of them finds it)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {v[0]: v for v in names.values()}


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `state_dict` holds, by name: not the non-persistent ones, functions of the
    config (the llama's rope frequencies), which the plain layout does not save either."""
    return {f"{prefix}.{name}" if prefix else name: b
            for prefix, m in module.named_modules() for name, b in m._buffers.items()
            if b is not None and name not in m._non_persistent_buffers_set}


def hyperparameters(groups: list[dict]) -> list[dict]:
    """torch's param groups as saved: each group's hyperparameters, by the group's index,
    without its parameters' names (those differ between layouts and pipeline ranks, and DCP
    keeps one rank's copy of a key every rank writes). Every layout builds the same groups in
    the same order (optim.py)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def groups_to_load(keys) -> dict:
    """Placeholders for the checkpoint's param groups (DCP keys `keys`), in whichever form it
    holds them: by group index ("optim.param_groups.0.lr"; with "params" lists before
    2026-12-06) or, written by a pipeline before then, by parameter name
    ("optim.param_groups.blocks.0.ln1.weight.lr")."""
    return {k[len(_GROUPS):]: None for k in keys if k.startswith(_GROUPS)}


def loaded_groups(loaded: dict | list, names: list[list[str]]) -> list[dict]:
    """The hyperparameters that `groups_to_load`'s placeholders, filled, hold for each of this
    optimizer's groups (`names`: each group's parameter names): by index, or by the first of
    its parameters the checkpoint names; {} for a group it has nothing for."""
    if isinstance(loaded, list):  # `hyperparameters` itself, filled in place (lowcomm's)
        return loaded
    saved: dict[str, dict] = {}
    for key, value in loaded.items():
        owner, _, field = key.rpartition(".")
        if field != "params":
            saved.setdefault(owner, {})[field] = value
    if all(owner.isdigit() for owner in saved):
        return [saved.get(str(i), {}) for i in range(len(names))]
    return [next((saved[n] for n in group if n in saved), {}) for group in names]


def _unsaved_alias(keys, module) -> str | None:
    """A checkpoint written before 2026-12-06 kept a tied parameter's optimizer state under
    its first name only: a pipeline's last stage, which holds the GPT's head without its
    embedding, finds none for it."""
    stated = {k[len(_STATE):].rpartition(".")[0] for k in keys if k.startswith(_STATE)}
    missing = [n for n, p in module.named_parameters()
               if p.requires_grad and n not in stated and f"model.{n}" in keys]
    if not stated or not missing:
        return None
    return (f"it holds no optimizer state for {missing[0]}: it was written before 2026-12-06, "
            "when a tied parameter's optimizer state was saved under its first name only, "
            "which a pipeline stage holding the other name does not find; resume it with "
            "the parallel.pp it was written with (or a layout without a pipeline), or start "
            "from its weights with train.init_from")


_GROUPS, _STATE = "optim.param_groups.", "optim.state."


def unboxed(tree):
    """The state dict with every `Boxes` replaced by the local tensor its views filled."""
    if isinstance(tree, dict):
        return {k: unboxed(v) for k, v in tree.items()}
    return tree.local if isinstance(tree, Boxes) else tree
