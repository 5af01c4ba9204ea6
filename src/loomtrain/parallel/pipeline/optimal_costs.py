"""What the planners of schedule = "optimal" share (optimal.py, optimal_heuristic.py,
optimal_milp.py): one stage's costs (`StageCosts`), the decision a plan takes for each
(micro-batch, stage) pair (keep, offload or recompute its activations), which backward needs
the activations and which action releases them (`backward_kinds`), and each action's duration
under the costs (`action_times`, simulate()'s `times`). optimal.py's docstring states what
every plan assumes.
"""

from __future__ import annotations

from dataclasses import dataclass

from loomtrain.parallel.pipeline.schedules import (
    B, F, I, OFFLOAD, RELOAD, SEND_B, SEND_F, W, Action)

KEEP, OFFLOADED, RECOMPUTED = "keep", "offload", "recompute"


@dataclass(frozen=True)
class StageCosts:
    """One stage's costs for one micro-batch, in seconds and bytes. `b`: the whole backward;
    `i` and `w`: its split into zero-bubble's I and W (b = i + w when b is not given).
    `offload`, `reload`: copy times of the pair's activations (None: this stage does not
    offload); `recompute`: the forward run again inside the backward (default f);
    `activation_bytes`: what the pair stashes from F to its backward; `input_bytes`: what stays
    when it is recomputed (the stage input); `send`: latency of a message leaving the stage."""
    f: float
    b: float | None = None
    i: float | None = None
    w: float | None = None
    offload: float | None = None
    reload: float | None = None
    recompute: float | None = None
    activation_bytes: float = 1.0
    input_bytes: float = 0.0
    send: float = 0.0

    def __post_init__(self):
        if self.b is None and not self.split:
            raise ValueError(f"StageCosts needs the backward time: b, or i and w (got {self})")
        if (self.offload is None) != (self.reload is None):
            raise ValueError(f"StageCosts: give both offload and reload, or neither (got {self})")
        if any(t is not None and t <= 0 for t in (self.f, self.b, self.i, self.w, self.recompute)):
            raise ValueError(f"StageCosts: compute times must be > 0 (got {self})")
        if any(t is not None and t < 0 for t in (self.offload, self.reload, self.send)):
            raise ValueError(f"StageCosts: copy and send times must be >= 0 (got {self})")
        if not 0 <= self.input_bytes <= self.activation_bytes:
            raise ValueError(f"StageCosts: need 0 <= input_bytes <= activation_bytes (got {self})")

    @property
    def split(self) -> bool:
        return self.i is not None and self.w is not None

    def backward(self, split: bool) -> float:
        if split:
            return self.i
        return self.b if self.b is not None else self.i + self.w

    @property
    def recompute_s(self) -> float:
        return self.f if self.recompute is None else self.recompute

    def copies_hide(self, split: bool) -> bool:
        """Whether this stage may offload in the model: an offload and a reload fit together
        inside any one compute, so each copy ends within the compute it overlaps."""
        if self.offload is None:
            return False
        shortest = min([self.f, self.backward(split)] + ([self.w] if split else []))
        return self.offload + self.reload <= shortest


def backward_kinds(split: bool) -> tuple[str, str]:
    """(K, R): the backward that needs the activations and the action that releases them."""
    return (I, W) if split else (B, B)


def action_times(costs, recompute=frozenset()):
    """simulate()'s `times`: each action's duration on its stage, a recomputed pair's
    backward (B or I) longer by its recompute."""
    def duration(a: Action) -> float:
        c = costs[a.stage]
        extra = c.recompute_s if (a.microbatch, a.stage) in recompute else 0.0
        return {F: c.f, B: c.backward(False) + extra, I: (c.i or 0.0) + extra, W: c.w or 0.0,
                SEND_F: c.send, SEND_B: c.send, OFFLOAD: c.offload or 0.0,
                RELOAD: c.reload or 0.0}.get(a.kind, 0.0)
    return duration
