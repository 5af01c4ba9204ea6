"""Checkpoints of low-communication runs: one model, one outer state, each replica's own
inner optimizer, written only where the replicas are synchronized.

The keys, resume and its limits: docs/lowcomm.md, "Checkpoints".
"""

from __future__ import annotations

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from loomtrain.parallel.state import REPLICA_KEY, StateLayout


def lowcomm_state(model, optimizer) -> dict:
    """{"model": ..., "optim": {"replica<R>": ...}, "lowcomm": ...} of `model` (a LocalSGD or
    DiLoCo wrapper): DCP saves from it, or loads into it."""
    model_sd, optim_sd = get_state_dict(model.module, optimizer)
    return {"model": model_sd, "optim": {f"replica{model.replica}": optim_sd},
            "lowcomm": model.outer_state()}


def load_lowcomm_state(model, optimizer, state: dict) -> None:
    """Put what DCP loaded into `state` (from `lowcomm_state`) into the model, the inner
    optimizer and the wrapper's outer state."""
    set_state_dict(model.module, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"][f"replica{model.replica}"],
                   options=StateDictOptions(strict=True))
    model.load_outer_state(state["lowcomm"])


class LowcommStateLayout(StateLayout):
    """One model, the outer state, each replica's own inner optimizer (this module)."""

    portable = False  # torch's own optimizer state dict, per replica

    def state(self, model, optimizer, for_saving: bool = True) -> dict:
        return lowcomm_state(model, optimizer)

    def load(self, model, optimizer, state: dict) -> None:
        load_lowcomm_state(model, optimizer, state)

    def check(self, keys, model) -> str | None:
        """The inner optimizer states must be one per replica of this run."""
        saved = {k.split(".")[1] for k in keys if k.startswith(REPLICA_KEY)}
        if not saved:
            return ("it was written without lowcomm.algorithm (one optimizer state for all "
                    "replicas); resume it with lowcomm.algorithm=\"none\"")
        if len(saved) != model.mesh.size(model.axis):
            return (f"it holds the optimizer states of {len(saved)} replicas, one each, and this "
                    f"run has {model.mesh.size(model.axis)}; resume it with parallel.dp={len(saved)}")
        return None


LOWCOMM = LowcommStateLayout()
