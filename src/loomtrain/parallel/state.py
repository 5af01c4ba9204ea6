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
    # pipeline ranks hold different parameters: the optimizer's param groups are keyed by
    # parameter name (DCP keeps one copy of a key that several ranks write)
    groups_by_name = False

    def state(self, model, optimizer, for_saving: bool = True) -> dict:
        """{"model": ..., "optim": ...}: what DCP saves from, or loads into."""
        module = getattr(model, "module", model)
        model_sd, optim_sd = get_state_dict(module, optimizer)
        if self.groups_by_name:
            optim_sd["param_groups"] = _groups_by_name(optim_sd["param_groups"])
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
        return {"model": model_sd, "optim": optim_sd}

    def load(self, model, optimizer, state: dict) -> None:
        """Put what DCP loaded into `state` (from `state(..., for_saving=False)`) into the
        model and the optimizer."""
        module = getattr(model, "module", model)
        optim = unboxed(state["optim"])
        if isinstance(optim["param_groups"], dict):
            optim["param_groups"] = _groups_as_list(optim["param_groups"],
                                                    get_state_dict(module, optimizer)[1]["param_groups"])
        set_state_dict(module, optimizer, model_state_dict=unboxed(state["model"]),
                       optim_state_dict=optim, options=StateDictOptions(strict=True))

    def check(self, keys, model) -> str | None:
        """Why a checkpoint with DCP keys `keys` cannot load into this layout, or None."""
        saved = {k.split(".")[1] for k in keys if k.startswith(REPLICA_KEY)}
        if saved:
            return (f"it holds the optimizer states of {len(saved)} low-communication replicas "
                    "(lowcomm.algorithm was set); resume it with the lowcomm.algorithm it was "
                    "written by (its config.toml says which)")
        return None


class GroupedStateLayout(StateLayout):
    """The plain layout with the param groups keyed by parameter name (pipeline stages)."""

    groups_by_name = True


PLAIN = StateLayout()


def _groups_by_name(groups: list[dict]) -> dict[str, dict]:
    """The optimizer's param groups keyed by parameter name, {name: hyperparameters}: DCP
    keeps one copy of a key that several ranks write, and pipeline ranks' lists of groups
    ("param_groups.0.params", ...) differ, while their parameter names do not collide."""
    return {name: {k: v for k, v in g.items() if k != "params"} for g in groups for name in g["params"]}


def _groups_as_list(by_name: dict[str, dict], template: list[dict]) -> list[dict]:
    """`_groups_by_name` undone along this optimizer's own grouping (`template`)."""
    return [{**by_name[g["params"][0]], "params": g["params"]} if g["params"] else g for g in template]


def unboxed(tree):
    """The state dict with every `Boxes` replaced by the local tensor its views filled."""
    if isinstance(tree, dict):
        return {k: unboxed(v) for k, v in tree.items()}
    return tree.local if isinstance(tree, Boxes) else tree
