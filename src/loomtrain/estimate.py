"""What `loom train --dry-run` estimates, as records the components fill: `DryRunPlan`, which
the dry run (train/dryrun.py) hands to the `estimate` hook of every component that applies,
in the apply order; `MemoryEstimate` and `Collective`, its records; the unsharded defaults
(every rank holds everything; bucketed gradient all-reduces). Formulas: docs/dry-run.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from loomtrain.activations import FP32_BYTES, activation_bytes
from loomtrain.comm.collectives import choose_impl
from loomtrain.comm.meter import wire_bytes


@dataclass(frozen=True)
class MemoryRow:
    """A part of one rank's memory that a component adds to the total (an outer optimizer's
    state), with why, as the report prints it."""

    name: str
    nbytes: int
    why: str


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds, by what they are for."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    gathered_bytes: int = 0  # ZeRO-3: units gathered at once during a step
    in_flight_bytes: int = 0  # ZeRO: gradient buffers filled and reduced during backward
    host_bytes: int = 0  # the part of all the above kept in host memory (offload)
    rows: tuple[MemoryRow, ...] = ()  # the components' own parts, on the device

    @property
    def total_bytes(self) -> int:
        return (self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes
                + self.activation_bytes + self.gathered_bytes + self.in_flight_bytes
                + sum(r.nbytes for r in self.rows))

    @property
    def device_bytes(self) -> int:
        return self.total_bytes - self.host_bytes


@dataclass(frozen=True)
class Collective:
    """One collective of a step as the meter counts it: `calls` calls every `every_steps` steps."""

    purpose: str
    op: str
    axis: str
    ranks: int  # group size
    payload_bytes: int  # of one call
    wire_bytes: int  # what one rank sends in one call (comm/meter.py)
    every_steps: int = 1
    calls: int = 1  # per step it runs in
    algorithm: str = "ring_all_reduce"  # the formula the meter counts it with
    unit: str = ""  # the ZeRO unit it moves


def wire_bytes_per_step(collectives: list[Collective]) -> float:
    """Average wire bytes one rank sends per optimizer step."""
    return sum(c.wire_bytes * c.calls / c.every_steps for c in collectives)


# The formula the meter counts an op with, for the implementation comm/collectives.py runs:
# gloo's native reduce_scatter is a clone plus a full all-reduce and is counted as one.
_ALGORITHM = {("reduce_scatter", "ring"): "ring_reduce_scatter",
              ("reduce_scatter", "native"): "ring_all_reduce",
              ("all_gather", "ring"): "ring_all_gather", ("all_gather", "native"): "ring_all_gather",
              ("all_reduce", "native"): "ring_all_reduce", ("all_to_all", "native"): "all_to_all"}


def metered(purpose: str, op: str, axis: str, ranks: int, payload: int, calls: int = 1,
            unit: str = "", every: int = 1) -> Collective:
    """An op as comm/collectives.py runs it (`choose_impl`: native or ring) and meters it."""
    algorithm = _ALGORITHM[(op, choose_impl(op, payload, ranks))]
    return Collective(purpose, op, axis, ranks, payload, wire_bytes(algorithm, payload, ranks),
                      every, calls, algorithm, unit)


def optimizer_states(optimizer: str, momentum: float) -> int:
    """fp32 state tensors per parameter: AdamW keeps exp_avg and exp_avg_sq; SGD keeps a
    momentum buffer only when momentum (train.beta1) is non-zero, as torch.optim.SGD does.
    AdamW's per-tensor `step` scalars are left out (4 bytes per parameter tensor)."""
    if optimizer == "adamw":
        return 2
    if optimizer == "sgd":
        return 1 if momentum > 0 else 0
    raise AssertionError(f"no state count for optimizer {optimizer!r}")


def all_reduce(purpose: str, axis: str, ranks: int, payload: int, every: int = 1) -> Collective:
    """A ring all-reduce of `payload` bytes over `ranks` ranks, every `every` steps."""
    return Collective(purpose, "all_reduce", axis, ranks, payload,
                      wire_bytes("ring_all_reduce", payload, ranks), every)


def memory_per_rank(parameters: int, states_per_parameter: int, activations: int) -> MemoryEstimate:
    """Nothing sharded (ZeRO stage 0): every rank holds all parameters, a gradient for each
    (the engine's bucket buffers) and all optimizer state, in fp32."""
    p = parameters * FP32_BYTES
    return MemoryEstimate(p, p, states_per_parameter * p, activations)


def gradient_all_reduces(bucket_payload_bytes: list[int], dp: int,
                         axis: str = "dp") -> list[Collective]:
    """One ring all-reduce over dp per gradient bucket, on the last micro-batch only (the
    others run under no_sync); under context parallelism over "dpcp", the dp x cp ranks that
    hold a replica (`dp` counts them). On one rank the comm layer sends and counts nothing."""
    if dp == 1:
        return []
    n = len(bucket_payload_bytes)
    return [all_reduce(f"gradient bucket {i + 1}/{n}", axis, dp, size)
            for i, size in enumerate(bucket_payload_bytes)]


@dataclass
class DryRunPlan:
    """Rank 0's run as the dry run builds it, on the meta device over a fake process group,
    and what each component that applies adds in its `estimate` hook, in the apply order: it
    may replace the model (a split keeps this rank's part), set the activations, replace the
    memory estimate (a sharding engine) or add rows to it, add collectives, keep a record of
    its own in `parts` (under its name), or refuse with a ConfigError."""

    cfg: Any
    mesh: Any  # the real mesh, over the fake group
    model: Any  # meta device: shapes, no storage
    optimizer_states: int  # fp32 state tensors per parameter of train.optimizer
    eval_forwards: int  # forwards per rank and evaluation: ceil(eval_batches / dp)
    loaded: int = 1  # the dp ranks whose rows this rank loads (data.balance's pool: all)
    compute_bytes: int = FP32_BYTES  # per activation element
    activation_bytes: int | None = None  # one rank's peak; None: the model's, one micro-batch
    memory: MemoryEstimate | None = None  # None: nothing sharded (memory_per_rank)
    memory_rows: list[MemoryRow] = field(default_factory=list)  # added to the memory's total
    reductions: list[Collective] = field(default_factory=list)  # the replica engine's, first
    collectives: list[Collective] = field(default_factory=list)  # the other axes', every step
    eval_collectives: list[Collective] = field(default_factory=list)  # each evaluation's
    bucket_bytes: list[int] = field(default_factory=list)  # the replica engine's gradient buckets
    replicated: bool = False  # a replica engine has estimated (the first that applies)
    parts: dict[str, Any] = field(default_factory=dict)  # each component's own record
    layers: list[str] | None = None  # the layers this rank runs, when a pipeline cut them
    # what a component adds once every hook has run, as it needs a later one's cut (the
    # layers a pipeline rank keeps): called in order with the plan
    later: list[Callable[["DryRunPlan"], None]] = field(default_factory=list)

    @property
    def local_model(self):
        """The [model] keys as one rank runs them: its seq_len / cp tokens of every row."""
        cp = self.cfg.parallel.cp
        m = self.cfg.model
        return m.model_copy(update={"seq_len": m.seq_len // cp}) if cp > 1 else m

    @property
    def parameters(self) -> int:
        """The parameters this rank holds (tied ones once)."""
        return sum(x.numel() for x in dict.fromkeys(self.model.parameters()))

    def activations(self) -> int:
        """The activation bytes of one rank: a component's, else one micro-batch of the model."""
        if self.activation_bytes is not None:
            return self.activation_bytes
        return activation_bytes(self.local_model, self.cfg.train.micro_batch, self.compute_bytes)

    def memory_estimate(self) -> MemoryEstimate:
        """The memory per rank: the sharding engine's, or nothing sharded; with the rows."""
        memory = self.memory or memory_per_rank(self.parameters, self.optimizer_states,
                                                self.activations())
        return replace(memory, rows=tuple(self.memory_rows))


def recomputed_microbatches(plan: DryRunPlan) -> int:
    """How many of a step's micro-batches rank 0 runs forward again in their backward: every
    one under recompute="full", the pairs of rank 0's stage a planned schedule (optimal)
    chose to recompute."""
    pipe = plan.parts.get("pipeline")
    if pipe is not None and pipe.schedule.recompute:
        return sum(s % pipe.schedule.pp == 0 for _, s in pipe.schedule.recompute)
    return plan.cfg.accumulation_steps if plan.cfg.parallel.recompute == "full" else 0
