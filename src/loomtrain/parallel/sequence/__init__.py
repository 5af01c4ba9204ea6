"""Sequence and context parallelism over the mesh's `cp` axis (issue 6).

context.py     layouts (contiguous, zig-zag), the Ring of cp peers, the per-batch SeqContext
               (global positions, documents) and position-based masks
ring.py        ring attention: exact causal softmax attention, K/V blocks around the ring
ulysses.py     DeepSpeed-Ulysses: all-to-all from sequence-sharded to head-sharded and back
lasp.py        linear-attention sequence parallelism: only the d x (d+1) state travels
               (lasp_comm.py: their all-gather, and its reduce-scatter in backward)
balance.py     pure: variable-length sequences dealt to ranks, long ones split across
               several, so that every rank's attention work is even (the ByteScale idea)
hybrid.py      pure: a micro-step's documents as each pool rank's token positions
runtime.py     SequenceRuntime: shards each batch's rows, installs the kernels in the model
hybrid_runtime.py  HybridRuntime (data.balance): the pool's rows dealt by hybrid.py, rings
               among the ranks that share a document
auto.py        cp_method="auto": the model's traced attention calls and positions rewritten
               into these kernels, activation checkpointing chosen for the context length
"""

from __future__ import annotations

from loomtrain.parallel.sequence.runtime import SequenceRuntime, sequence_of


def resolve_method(cfg) -> str:
    """The kernel `cfg` (the whole Config) asks for: `parallel.cp_method`, by default ring
    attention for softmax and LASP for linear attention; "local" at cp = 1."""
    if cfg.parallel.cp == 1:
        return "local"
    if cfg.parallel.cp_method is not None:
        return cfg.parallel.cp_method
    return "lasp" if cfg.model.attention == "linear" else "ring"


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


__all__ = ["SequenceRuntime", "apply_sequence", "resolve_method", "sequence_of"]
