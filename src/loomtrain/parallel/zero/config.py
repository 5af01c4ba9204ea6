"""The ZeRO component's keys and rules (docs/zero.md), and bf16 mixed precision, which the
same sharded engine runs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loomtrain.component import REPLICATE, Built, Component, EngineTimeline, Section, Switch


class ZeroKeys(Section):
    zero_stage: int = Field(0, ge=0, le=3)
    hierarchical: bool = False  # ZeRO: shard inside the node, reduce across nodes in two levels
    optimizer_shard: Literal["node", "dp"] = "node"  # hierarchical: optimizer state split over
    prefetch: int = Field(1, ge=0)  # stage 3: units gathered ahead of the one computing
    offload_optimizer: bool = False  # ZeRO: master weights and optimizer state in host memory
    shard_units: list[str] = []  # ZeRO units as module-name patterns; empty: ModuleList children
    # stage 3 inside a pipeline: units kept gathered through the step ("step"), or freed after
    # each forward and backward ("micro_batch"); "auto": "step" where it fits (zero/reshard.py)
    zero_reshard: Literal["auto", "step", "micro_batch"] = "auto"


class Zero(EngineTimeline, Component):
    """ZeRO stages 1-3, flat or hierarchical; its keys need a stage (shard_units also serves
    bf16, which runs in the same engine)."""

    name = "zero"
    section, keys = "parallel", ZeroKeys
    switches = (Switch("parallel.zero_stage", 0),)
    summary = "optimizer state, gradients and parameters sharded over dp (flat or hierarchical)"
    stage = REPLICATE + 1

    @classmethod
    def applies(cls, cfg) -> bool:
        """The sharded engine also runs bf16 at stage 0."""
        return cfg.parallel.zero_stage > 0 or cfg.train.precision == "bf16"

    @classmethod
    def apply(cls, built: Built) -> None:
        if built.replicated:
            return
        # context-parallel peers hold the same replica, each with the gradient of its own
        # tokens: shard (and sum) over dp x cp, as apply_data_parallel does
        shard_built(built, "dpcp" if built.cfg.parallel.cp > 1 else "dp")

    @classmethod
    def after_update(cls, built: Built, stepped: bool) -> None:
        """The gradient shards' memory goes back until the next backward's reductions land
        (zero_grad with set_to_none; the trainer's own zero_grad keeps `.grad` in place, for
        DataParallel's bucket views)."""
        from loomtrain.parallel.zero.optimizer import ShardedOptimizer

        if isinstance(built.optimizer, ShardedOptimizer):
            built.optimizer.zero_grad(set_to_none=True)

    @classmethod
    def metrics(cls, built: Built, evaluated: bool) -> dict:
        """The engine's sparse-communication figures (sparsity.sparse_comm; none without)."""
        from loomtrain.parallel.zero.engine import ShardedDataParallel

        return built.model.metrics() if isinstance(built.model, ShardedDataParallel) else {}

    @classmethod
    def estimate(cls, plan) -> None:
        from loomtrain.parallel.zero.estimate import estimate_zero

        if not plan.replicated:
            estimate_zero(plan)

    @classmethod
    def validate(cls, cfg) -> None:
        p = cfg.parallel
        engine = p.zero_stage > 0 or cfg.train.precision == "bf16"  # the sharded engine runs these
        for key, needs in (("hierarchical", p.zero_stage > 0),
                           ("offload_optimizer", p.zero_stage > 0), ("shard_units", engine)):
            if getattr(p, key) and not needs:
                also = ' (or train.precision="bf16")' if key == "shard_units" else ""
                raise ValueError(f"parallel.{key}={getattr(p, key)!r} needs ZeRO: set "
                                 f"parallel.zero_stage to 1, 2 or 3{also}")
        _check_reshard(p)
        if p.optimizer_shard == "dp" and not p.hierarchical:
            raise ValueError(
                'parallel.optimizer_shard="dp" splits the optimizer state across nodes in '
                "hierarchical ZeRO; set parallel.hierarchical=true (flat ZeRO already splits it "
                "over all dp ranks)")


def _check_reshard(p) -> None:
    """zero_reshard chooses between two ways of running stage 3 inside a pipeline."""
    if p.zero_reshard == "auto":
        return
    if p.pp == 1 or p.zero_stage < 3:
        raise ValueError(
            f"parallel.zero_reshard={p.zero_reshard!r} chooses whether ZeRO-3 keeps its units "
            "gathered through a pipelined step; it needs parallel.pp > 1 and "
            f"parallel.zero_stage=3 (got pp={p.pp}, zero_stage={p.zero_stage}): outside a "
            "pipeline every unit is already freed after its forward and gathered again for its "
            "backward, and stages 1-2 gather nothing. Leave it at \"auto\"")
    if p.zero_reshard == "micro_batch" and p.schedule == "async":
        raise ValueError('parallel.zero_reshard="micro_batch" has no meaning with '
                         'parallel.schedule="async": each forward gathers the units into its own '
                         'stash of weights and frees them after its backward; leave it "auto"')
    if p.zero_reshard == "micro_batch" and p.schedule in ("zb-h1", "optimal"):
        raise ValueError(
            f'parallel.zero_reshard="micro_batch" with parallel.schedule={p.schedule!r} is not '
            "built yet: the schedule computes weight gradients (W) after the backward that "
            'frees the units. Use schedule "gpipe", "1f1b" or "interleaved", or '
            'zero_reshard="step"')


def shard_built(built: Built, axis: str) -> None:
    """Wrap `built`'s model and optimizer in the sharded engine over `axis` with the
    [parallel] keys and train.precision: the ZeRO component's engine over the dp ranks, and
    lowcomm's inside each of its replicas (lowcomm/sharded.py)."""
    import torch

    from loomtrain.errors import ConfigError
    from loomtrain.parallel.zero import shard
    from loomtrain.parallel.zero.state import ZERO

    p = built.cfg.parallel
    dtype = torch.bfloat16 if built.cfg.train.precision == "bf16" else torch.float32
    try:  # "sum": the trainer's loss is already divided by the global token count
        built.model, built.optimizer = shard(
            built.model, built.optimizer, built.mesh, p.zero_stage,
            hierarchical=p.hierarchical, optimizer_shard=p.optimizer_shard,
            prefetch=p.prefetch, offload_optimizer=p.offload_optimizer, compute_dtype=dtype,
            units=list(p.shard_units) or None, gradient_reduce="sum", axis=axis)
    except ValueError as err:  # a unit pattern that matches nothing, an unsupported optimizer
        raise ConfigError(f"parallel.zero_stage={p.zero_stage}: {err}") from None
    if p.pp > 1:
        from loomtrain.parallel.zero.reshard import stage_calls
        from loomtrain.parallel.zero.reshard_auto import resolve_reshard

        engine = built.model
        engine.pipeline(resolve_reshard(built, engine), stage_calls(engine.module))
    built.replicated, built.layout = True, ZERO


class BF16(Component):
    """bfloat16 compute with fp32 master weights, gradients reduced in fp32 (train.precision)."""

    name = "bf16"
    switches = (Switch("train.precision", "fp32"),)
    summary = "bf16 compute, fp32 master weights and reductions (the sharded engine)"

    @classmethod
    def estimate(cls, plan) -> None:
        plan.compute_bytes = 2  # activations, gathered units and buffers in bfloat16
