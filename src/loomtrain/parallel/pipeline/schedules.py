"""Pipeline schedules as pure functions: who computes what, in which order.

A schedule is the ordered list of actions of every pp rank. Stage `s` (of pp * V virtual
stages) lives on rank `s % pp` (Megatron's interleaved placement; with V = 1, stage = rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# compute
F, B, I, W = "F", "B", "I", "W"  # forward; full backward; backward for input; for weights
# communication (point to point, between the ranks of adjacent stages)
SEND_F, RECV_F = "SEND_F", "RECV_F"  # stage s's output -> stage s+1's input
SEND_B, RECV_B = "SEND_B", "RECV_B"  # gradient of stage s's input -> stage s-1's output
# host memory
OFFLOAD, RELOAD = "OFFLOAD", "RELOAD"  # stashed activations of (microbatch, stage) out / in
COMPUTE = (F, B, I, W)
KINDS = (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, OFFLOAD, RELOAD)


@dataclass(frozen=True)
class Action:
    kind: str
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.stage}"


@dataclass(frozen=True)
class Schedule:
    """`actions[r]`: rank r's actions in execution order. `recompute`: the (microbatch, stage)
    pairs whose forward keeps only the stage input and is recomputed before its backward."""
    name: str
    pp: int
    microbatches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]
    recompute: frozenset = field(default_factory=frozenset)

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages


def stage_rank(stage: int, pp: int) -> int:
    return stage % pp
