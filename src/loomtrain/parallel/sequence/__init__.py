"""Sequence and context parallelism over the mesh's `cp` axis (issue 6): ring attention,
DeepSpeed-Ulysses, LASP, dynamic hybrid dp x cp (`data.balance`) and automatic sequence
parallelism. The files and what each holds: docs/sequence.md.
"""

from __future__ import annotations

from loomtrain.parallel.sequence.runtime import SequenceRuntime, sequence_of


def resolve_method(cfg) -> str:
    """The kernel `cfg` (the whole Config) asks for: `parallel.cp_method`, by default ring
    attention for softmax and LASP for linear attention; "local" at cp = 1; "auto" under a
    pipeline, the kernel it chooses there."""
    if cfg.parallel.cp == 1:
        return "local"
    if cfg.parallel.cp_method == "auto" and cfg.parallel.pp > 1:
        return staged_kernel(cfg)
    if cfg.parallel.cp_method is not None:
        return cfg.parallel.cp_method
    return "lasp" if cfg.model.attention == "linear" else "ring"


def rows_axis(cfg) -> str | None:
    """The ranks that share each micro-batch's rows (`SharedRows.axis`), None where every rank
    holds whole rows: data.balance's pool over dp x cp deals the rows of every dp rank,
    context parallelism splits each row over cp."""
    if cfg.data.balance:
        return "dpcp"
    return "cp" if cfg.parallel.cp > 1 else None


def staged_kernel(cfg) -> str:
    """What cp_method="auto" runs under a pipeline: the kernel its plan would choose for these
    heads (auto.py `choose_method`), in the model's own attention modules, as "ring" and
    "ulysses" run there. A stage is a slice of the model that the pipeline runs layer by
    layer, not the model's traced forward, and the pipeline recomputes per micro-batch
    itself (docs/sequence-auto.md, "Under a pipeline")."""
    from loomtrain.parallel.sequence.auto import choose_method

    return choose_method([cfg.model.n_heads // cfg.parallel.tp], cfg.parallel.cp)


def apply_sequence(model, mesh, cfg):
    """The cp-axis strategy (also at cp = 1 when `data.packing` asks for document masks): the
    model's attention cores become the method's kernel; the runtime is left on the model as
    `model.sequence` for the trainer to shard each batch through. With `data.balance` the
    runtime is the dynamic hybrid one: every micro-step the whole dp x cp pool's rows are
    dealt by attention work. With `cp_method = "auto"` the model is replaced by its rewritten
    trace (auto.py), which carries the runtime (and its plan) the same way."""
    method = resolve_method(cfg)
    if method == "auto":  # the model's traced graph rewritten: its own attention calls
        from loomtrain.parallel.sequence.auto import auto_sequence

        budget = cfg.parallel.activation_budget_mb
        return auto_sequence(model, mesh, cfg.model.seq_len,
                             None if budget is None else int(budget * 2**20), cfg.train.micro_batch)
    if cfg.data.balance:
        from loomtrain.parallel.sequence.hybrid_runtime import HybridRuntime

        model.sequence = HybridRuntime(model, mesh, cfg.model.attention)
    else:
        model.sequence = SequenceRuntime(model, mesh, method, cfg.model.attention)
    return model


__all__ = ["SequenceRuntime", "apply_sequence", "resolve_method", "rows_axis", "sequence_of",
           "staged_kernel"]
