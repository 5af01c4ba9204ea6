"""What the planner searches over (Plan), what the cost model hands the simulator
(StepCosts) and what it predicts (Estimate). Plain frozen data, no behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Plan:
    """One configuration of a step: the mesh (dp x pp x cp x tp = devices; ep, expert
    parallelism, a sub-axis of dp that splits a mixture of experts' experts), ZeRO, the
    pipeline's schedule, recompute and offload, precision, and DiLoCo's period.

    `micro_batch` is in sequences; each dp replica runs `microbatches` of them per step, so
    global_batch = dp * microbatches * micro_batch. `split`: layers per pipeline stage (pp *
    virtual_stages entries, embed and head counted as layers as pipeline/split.py does; None:
    even). `recompute_layers`: one flag per transformer block, overriding `recompute` per
    block (None: `recompute` everywhere); split_milp.py chooses both."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # dp ranks that split each MoE block's experts (parallel.ep; divides dp)
    zero_stage: int = 0
    hierarchical: bool = False  # ZeRO: shard inside the node, reduce across nodes (two levels)
    micro_batch: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str = "none"
    offload_optimizer: bool = False
    offload_activations: float = 0.0  # fraction of stashed activations sent to the host
    sequence_parallel: bool = False  # Megatron's: norms and dropout split over tp
    precision: str = "bf16"  # "bf16": bf16 compute, fp32 master weights and Adam; "fp32"
    diloco_h: int = 1  # inner steps between DiLoCo's outer syncs (1: every step, plain dp)
    split: tuple[int, ...] | None = None
    recompute_layers: tuple[bool, ...] | None = None

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def settings(self) -> dict:
        """The fields that differ from a plain single device, for tables and --json."""
        plain = Plan()
        return {k: v for k, v in self.__dict__.items() if v != getattr(plain, k)
                or k in ("dp", "tp", "pp", "cp", "zero_stage", "micro_batch", "microbatches")}


@dataclass(frozen=True)
class StageCosts:
    """One pipeline stage (a virtual stage with interleaving), per microbatch unless said.
    Times include the tp, cp and ep collectives on the critical path of that compute."""
    forward_s: float
    backward_input_s: float  # gradient w.r.t. the stage's input (zb-h1's I)
    backward_weight_s: float  # gradient w.r.t. its weights (zb-h1's W); B = I + W
    recompute_s: float  # the forward replayed before backward (0 without recompute)
    forward_comm_s: float  # the part of forward_s that is blocking tp/cp/ep communication
    backward_comm_s: float  # the part of backward_input_s + backward_weight_s that is tp/cp/ep comm
    send_s: float  # the activation (or its gradient) to the neighbouring stage
    grad_sync_s: float  # per step: the dp/ZeRO reduction of this stage's gradients
    param_gather_s: float  # per microbatch: ZeRO-3's all-gathers (forward and backward)
    offload_s: float  # per microbatch: activation offload copies, each way
    activation_bytes: int  # stash and output (but the last stage's) of one microbatch here


@dataclass(frozen=True)
class StepCosts:
    stages: tuple[StageCosts, ...]  # pp * virtual_stages entries; stage s on rank s % pp
    pp: int
    microbatches: int
    schedule: str
    virtual_stages: int
    optimizer_s: float  # the optimizer step on one device (after the gradients are in)
    grad_sync_overlaps: bool  # may a stage's gradient sync run beside later backward compute?
    # the pipeline bubble's share of its time still spent: < 1 where processes idle in the
    # bubble give their cores to the others (cpu-here with more processes than cores)
    bubble_scale: float = 1.0


@dataclass(frozen=True)
class Estimate:
    """The cost model's prediction for one plan. `memory` and `time` are breakdowns (bytes per
    device; seconds per step) whose parts docs/planner.md names; `comm_bytes` is wire bytes one
    device sends per step, by mesh axis."""
    plan: Plan
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float  # model FLOPs (no recompute) per device per second, / 1e12
    mfu: float  # model FLOPs / (step time x devices x peak)
    mem_per_device_bytes: int
    comm_bytes_per_step: int
    fits: bool
    memory: dict[str, int] = field(default_factory=dict)
    time: dict[str, float] = field(default_factory=dict)
    comm_bytes: dict[str, int] = field(default_factory=dict)
