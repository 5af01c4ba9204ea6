"""The checkpoint layout of a zeroth-order run: the model, and under "optim" the optimizer's
`state_dict()` (plain values and its per-parameter tensors). A tensor-parallel piece, of the
model or of the optimizer's state, is saved as its box of the full tensor, as the plain
layout saves it (parallel/state.py); a pipeline stage saves its own parameters' names."""

from __future__ import annotations

from loomtrain.parallel.placement import Boxes, placement_of
from loomtrain.parallel.state import StateLayout, unboxed


class ZerothStateLayout(StateLayout):
    portable = False  # the optimizer's own state_dict(), read back by it
    init_optimizer = False  # a zeroth-order optimizer's state exists from its construction

    def state(self, model, optimizer, for_saving: bool = True) -> dict:
        placements = {name: placement_of(p) for name, p in model.named_parameters(remove_duplicate=False)}
        model_state = {k: _boxed(v, placements.get(k)) for k, v in model.state_dict().items()}
        optim = optimizer.state_dict()
        # the per-parameter tensors are keyed "<kind>.<parameter name>" (optimizers.py)
        optim["tensors"] = {k: _boxed(v, placements[k.partition(".")[2]])
                            for k, v in optim["tensors"].items()}
        return {"model": model_state, "optim": optim}

    def load(self, model, optimizer, state: dict) -> None:
        model.load_state_dict(unboxed(state["model"]), strict=True)
        optimizer.load_state_dict(unboxed(state["optim"]))


def _boxed(tensor, placement):
    """`tensor` itself, or as a box of its full tensor when it is a tensor-parallel piece."""
    return tensor if placement is None else Boxes.whole(tensor).placed(placement)


ZEROTH = ZerothStateLayout()
