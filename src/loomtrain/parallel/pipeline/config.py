"""The pipeline components' keys and rules (docs/pipeline.md): the pipeline over pp, and its
asynchronous schedule (asynchronous.py), which composes with less."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loomtrain.component import (PIPELINE, REPLICATE, Built, Component, Refusal, Section, Switch,
                                 changed_keys)

# a pipeline setting set while parallel.pp = 1 is refused (it would be silently ignored);
# offload_activations at pp = 1 is parallel/offload.py's
_PIPELINE_ONLY = ("microbatches", "split_points", "virtual_stages")


class PipelineKeys(Section):
    pp: int = Field(1, ge=1)
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1", "optimal", "async"] = "1f1b"
    microbatches: int | None = Field(None, ge=1)  # None: global_batch / (dp * micro_batch)
    virtual_stages: int = Field(1, ge=1)  # stages per rank (interleaved: 2 or more)
    # parallel.recompute is the Recompute component's key (parallel/recompute.py); under a
    # pipeline the runtime recomputes each micro-batch
    # fraction of stashed (micro-batch, stage) pairs; at pp = 1 of the blocks (parallel/offload.py)
    offload_activations: float = Field(0.0, ge=0.0, le=1.0)
    pipeline_balance: Literal["params", "time"] = "params"  # what stages are balanced by
    split_points: list[int] = []  # first layer of stages 1.. (layers: embed, blocks, head)
    # schedule="optimal": each rank's activation memory limit (None: what 1F1B's busiest
    # rank stashes, measured); the plan keeps, offloads or recomputes each micro-batch to fit.
    # cp_method="auto": each rank's activation estimate for one micro-batch above which every
    # block is checkpointed (None: never)
    activation_budget_mb: float | None = Field(None, gt=0.0)
    # schedule="async": each stage steps after every micro-batch on stashed weights; "stash":
    # the train.optimizer as is (PipeDream), "nesterov": the delay-corrected Nesterov of
    # arXiv 2505.01099 with momentum async_momentum
    async_optimizer: Literal["stash", "nesterov"] = "nesterov"
    async_momentum: float = Field(0.99, ge=0.0, lt=1.0)


class Pipeline(Component):
    """The pipeline keys: a schedule's own rules, and a split that gives every stage at least
    one layer (the model's layers: embed, blocks, head)."""

    name = "pipeline"
    section, keys = "parallel", PipelineKeys
    switches = (Switch("parallel.pp", 1),)
    summary = "stages over pp, schedules as action lists (GPipe, 1F1B, interleaved, ZB-H1, optimal)"
    stage = PIPELINE

    @classmethod
    def apply(cls, built: Built) -> None:
        from loomtrain.parallel.pipeline import apply_pipeline, runtime_of

        # cut on the meta device (a model build_run built there); real before the runtime
        built.model = apply_pipeline(built.model, built.mesh, built.cfg, built.materialize,
                                     built.loss_sum)
        built.parts[cls.name] = runtime_of(built.model)

    @classmethod
    def estimate(cls, plan) -> None:
        from loomtrain.parallel.pipeline.estimate import estimate_pipeline

        estimate_pipeline(plan)

    @classmethod
    def forward_backward(cls, built: Built, batches, global_tokens: float, loss_fn):
        """The schedule over this rank's part of every micro-batch. The runtime runs the stage
        modules apply_pipeline gave it; built.model, the dp engine over them, is the step's
        gradient engine. Under context parallelism each micro-batch's context (its tokens'
        positions and documents) is restored before its forwards, which the schedule
        interleaves."""
        sequence = built.parts.get("context")
        local, contexts = [], []
        for batch in batches:
            local.append(built.local(batch))
            contexts.append(sequence.context_state() if sequence is not None else None)
        before = None if sequence is None else (lambda m: sequence.restore(contexts[m]))
        return built.parts[cls.name].train_step(built.model, local, global_tokens, loss_fn,
                                                before)

    @classmethod
    def forward_only(cls, built: Built, x):
        return (built.parts[cls.name].forward_only(x),)

    @classmethod
    def start_timeline(cls, built: Built, timeline) -> bool:
        built.parts[cls.name].spans = []  # the runtime records its actions
        return True

    @classmethod
    def write_timeline(cls, built: Built, timeline, run_dir, step: int, mesh) -> dict:
        """Every rank's actions, gathered; rank 0 writes them with the measured bubble."""
        runtime = built.parts[cls.name]
        ranks, s = runtime.gather_spans(), runtime.schedule
        bubble = timeline.bubble_of(ranks)
        if mesh.rank == 0:
            timeline.write_pipeline(run_dir / timeline.PIPELINE_JSON, ranks, step=step + 1,
                                    pp=s.pp, schedule=s.name, microbatches=s.microbatches,
                                    bubble_theory=runtime.bubble_theory())
        return {"bubble": bubble}
    @classmethod
    def validate(cls, cfg) -> None:
        p, m, t = cfg.parallel, cfg.model, cfg.train
        _check_optimal(p)
        _check_async_keys(p)
        if p.pp == 1:
            changed = [k for k in _PIPELINE_ONLY if k in p.model_fields_set
                       and k in changed_keys(p, _PIPELINE_ONLY)]
            if p.schedule in ("async", "optimal"):
                changed.append("schedule")
            if changed:
                raise ValueError(f"parallel.{changed[0]} is a pipeline setting: it needs "
                                 "parallel.pp > 1")
            return
        micro = t.global_batch // (p.dp_size * t.micro_batch)
        if p.microbatches is not None and p.microbatches != micro:
            raise ValueError(
                f"parallel.microbatches={p.microbatches} must equal train.global_batch / (dp * "
                f"train.micro_batch) = {t.global_batch}/({p.dp_size}*{t.micro_batch}) = {micro}; "
                f"set train.micro_batch={max(1, t.global_batch // (p.dp_size * p.microbatches))} "
                "(or leave parallel.microbatches unset)")
        if p.schedule == "interleaved":
            if p.virtual_stages < 2 or micro % p.pp:
                raise ValueError(
                    f'parallel.schedule="interleaved" needs parallel.virtual_stages >= 2 (got '
                    f"{p.virtual_stages}) and micro-batches divisible by parallel.pp={p.pp} "
                    f"(got {micro})")
        elif p.virtual_stages != 1:
            raise ValueError(f"parallel.virtual_stages={p.virtual_stages} is for "
                             f'parallel.schedule="interleaved" (got {p.schedule!r}); set it to 1')
        layers, stages = m.n_layers + 2, p.pp * p.virtual_stages
        if p.split_points:
            points = [0, *p.split_points, layers]
            if len(p.split_points) != stages - 1 or any(a >= b for a, b in zip(points, points[1:])):
                raise ValueError(
                    f"parallel.split_points={p.split_points} must be {stages - 1} increasing layer "
                    f"indices between 1 and {layers - 1} (the model has {layers} layers: embed, "
                    f"{m.n_layers} blocks, head; pp*virtual_stages = {stages} stages)")
        elif stages > layers:
            raise ValueError(f"parallel.pp*virtual_stages = {stages} stages exceed the model's "
                             f"{layers} layers (embed, {m.n_layers} blocks, head)")


class AsyncPipeline(Component):
    """schedule="async" steps its own optimizer on every stage (in ZeRO's engine: over this
    rank's slices) and runs its forwards on stashed weights, without recomputation or
    offload: its runtime owns the optimizer step."""

    stage = REPLICATE + 5  # after the dp engine: the optimizer is the runtime's

    @classmethod
    def apply(cls, built: Built) -> None:
        from loomtrain.parallel.zero.engine import ShardedDataParallel

        runtime = built.parts[Pipeline.name]
        if isinstance(built.model, ShardedDataParallel):  # ZeRO 1-3, or bf16
            runtime.shard(built.model)
        built.optimizer = runtime.optimizer

    @classmethod
    def estimate(cls, plan) -> None:
        from loomtrain.parallel.pipeline.async_estimate import estimate_async

        estimate_async(plan)

    @classmethod
    def train_step(cls, built: Built, batches, global_tokens: float, loss_fn):
        runtime = built.parts[Pipeline.name]
        loss_sum = runtime.train_step(built.model, batches, global_tokens, loss_fn)
        return loss_sum, runtime.grad_norm, runtime.stepped

    @classmethod
    def before_evaluate(cls, built: Built) -> None:
        """The micro-batches in flight complete, so that what is evaluated or saved has
        learnt from every micro-batch so far on every stage."""
        built.parts[Pipeline.name].drain()

    before_save = before_evaluate

    name = "async_pipeline"
    switches = (Switch("parallel.schedule", on=("async",)),)
    summary = "asynchronous pipeline with delay-corrected Nesterov (arXiv 2505.01099)"
    refuses = {
        "timeline": Refusal("it streams micro-batches across steps, and a timeline records one "
                            "step of a fixed schedule: set run.timeline_step=0", yet=False),
        **{other: Refusal("its stream takes the micro-batches as loaded and carries no "
                          "micro-batch's sequence context (the rank's tokens and positions, "
                          "the documents' masks) to its forwards, which run in later steps; "
                          "the synchronous schedules run it")
           for other in ("context", "packing")},
    }


def _check_optimal(p) -> None:
    """schedule="optimal" decides recomputation and offload per micro-batch itself."""
    if p.schedule != "optimal":
        if p.activation_budget_mb is not None and p.cp_method != "auto":
            raise ValueError('parallel.activation_budget_mb is for parallel.schedule="optimal" '
                             f'or parallel.cp_method="auto" (got schedule={p.schedule!r}, '
                             f"cp_method={p.cp_method!r})")
        return
    for key, default in (("recompute", "none"), ("offload_activations", 0.0)):
        if getattr(p, key) != default:
            raise ValueError(f'parallel.schedule="optimal" chooses recomputation and offload '
                             f"per micro-batch under parallel.activation_budget_mb: leave "
                             f"parallel.{key} at {default!r} (got {getattr(p, key)!r})")


def _check_async_keys(p) -> None:
    """The async schedule's keys mean nothing to the other schedules; it runs without
    recomputation or offload."""
    if p.schedule != "async":
        changed = changed_keys(p, ("async_optimizer", "async_momentum"))
        if changed:
            raise ValueError(f'parallel.{changed[0]} is for parallel.schedule="async" (got '
                             f"{p.schedule!r})")
        return
    for key, default in (("recompute", "none"), ("offload_activations", 0.0)):
        if getattr(p, key) != default:
            raise ValueError(f'parallel.schedule="async" runs with parallel.{key}={default!r} '
                             f"(got {getattr(p, key)!r}): each stage steps its own optimizer "
                             "after every micro-batch, on stashed weights")
