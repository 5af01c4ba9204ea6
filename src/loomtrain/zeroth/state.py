"""The checkpoint layout of a zeroth-order run: the whole model, and under "optim" the
optimizer's `state_dict()` (plain values and its per-parameter tensors)."""

from __future__ import annotations

from loomtrain.parallel.state import StateLayout


class ZerothStateLayout(StateLayout):
    portable = False  # the optimizer's own state_dict(), read back by it
    init_optimizer = False  # a zeroth-order optimizer's state exists from its construction

    def state(self, model, optimizer, for_saving: bool = True) -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load(self, model, optimizer, state: dict) -> None:
        model.load_state_dict(state["model"], strict=True)
        optimizer.load_state_dict(state["optim"])


ZEROTH = ZerothStateLayout()
