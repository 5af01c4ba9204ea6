"""Tensor parallelism over the mesh's `tp` axis, Megatron-style (Shoeybi et al., arXiv
1909.08053): column- and row-parallel linear pairs, one all-reduce each way per pair.

Also the vocabulary-parallel embedding, tied head and cross-entropy, and Megatron's sequence
parallelism (Korthikanti et al., arXiv 2205.05198). Details: docs/tensor.md.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn as nn
import torch.nn.functional as F

from loomtrain.parallel.placement import Placement
from loomtrain.parallel.tensor_comm import (CopyToTP, GatherFromSP, ReduceFromTP, ScatterToSP,
                                            SplitSeq, VocabParallelCrossEntropy)


class SequenceSplit(nn.Module):
    """After `inner`: keep my sequence chunk (enters a sequence-parallel region)."""

    def __init__(self, inner: nn.Module, mesh, axis: str):
        super().__init__()
        self.inner, self.mesh, self.axis = inner, mesh, axis

    def forward(self, x):
        return SplitSeq.apply(self.inner(x), self.mesh, self.axis)


class SequenceParallelLayerNorm(nn.LayerNorm):
    """A layer norm that sees only my chunk of the sequence: its weight and bias enter through
    Megatron's `f` (identity forward, all-reduce of the gradient over tp), so their gradients
    are whole sums on every tp rank when backward returns, whatever engine runs the step.
    (Megatron instead all-reduces these gradients in one bucket after backward; one small
    all-reduce per parameter inside backward keeps the dp/ZeRO engines unaware of tp.)"""

    def __init__(self, norm: nn.LayerNorm, mesh, axis: str):
        super().__init__(norm.normalized_shape, norm.eps, norm.elementwise_affine,
                         bias=norm.bias is not None)
        self.mesh, self.axis = mesh, axis
        self.weight, self.bias = norm.weight, norm.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def synced(p):
            return None if p is None else CopyToTP.apply(p, self.mesh, self.axis)
        return F.layer_norm(x, self.normalized_shape, synced(self.weight), synced(self.bias), self.eps)


def _piece(full: torch.Tensor, dim: int, index: torch.Tensor) -> nn.Parameter:
    """The parameter holding `full`'s entries `index` along `dim`, marked with its placement
    (checkpoints save it as part of the full tensor; gradient norms count it on one rank)."""
    p = nn.Parameter(full.detach().index_select(dim, index).clone())
    p.tp_placement = Placement.of_index(tuple(full.shape), dim, index)
    return p


def _split(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what} = {n} is not divisible by the tensor-parallel size {parts}; "
                         f"choose parallel.tp among the divisors of {n}")
    return n // parts


class ColumnParallelLinear(nn.Module):
    """The rows `rows` (output features) of `linear`; the input is replicated. `enters`: the
    layer enters the tensor-parallel region itself (Megatron's `f`, or the sequence
    all-gather); False when its input has entered already, once for sibling layers that
    share it (the Llama's q/k/v and gate/up: parallel/tensor_llama.py)."""

    def __init__(self, linear: nn.Linear, rows: torch.Tensor, mesh, axis: str = "tp",
                 sequence_parallel: bool = False, enters: bool = True):
        super().__init__()
        self.mesh, self.axis, self.sequence_parallel = mesh, axis, sequence_parallel
        self.enters = enters
        self.weight = _piece(linear.weight, 0, rows)
        self.bias = None if linear.bias is None else _piece(linear.bias, 0, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enters:
            enter = GatherFromSP if self.sequence_parallel else CopyToTP
            x = enter.apply(x, self.mesh, self.axis)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """The columns `cols` (input features) of `linear`; the partial outputs are all-reduced,
    then the (replicated) bias is added once."""

    def __init__(self, linear: nn.Linear, cols: torch.Tensor, mesh, axis: str = "tp",
                 sequence_parallel: bool = False):
        super().__init__()
        self.mesh, self.axis, self.sequence_parallel = mesh, axis, sequence_parallel
        self.weight = _piece(linear.weight, 1, cols)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leave = ScatterToSP if self.sequence_parallel else ReduceFromTP
        y = leave.apply(F.linear(x, self.weight), self.mesh, self.axis)
        if self.bias is None:
            return y
        # under sequence parallelism the bias meets my sequence chunk only: sum its gradient
        return y + (CopyToTP.apply(self.bias, self.mesh, self.axis) if self.sequence_parallel
                    else self.bias)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V/tp) of the embedding table: a token outside my range looks up
    zeros, and the all-reduce over tp sums the one rank's row that holds it. With
    `sequence_parallel`, a reduce-scatter instead: each rank keeps its chunk of the sequence
    (Megatron's embedding under sequence parallelism)."""

    def __init__(self, embedding: nn.Embedding, mesh, axis: str = "tp",
                 sequence_parallel: bool = False):
        super().__init__()
        self.mesh, self.axis = mesh, axis
        self.leave = ScatterToSP if sequence_parallel else ReduceFromTP
        parts, rank = mesh.size(axis), mesh.local_rank(axis)
        rows = _split(embedding.num_embeddings, parts, "the vocabulary size")
        self.start, self.stop = rank * rows, (rank + 1) * rows
        self.weight = _piece(embedding.weight, 0, torch.arange(self.start, self.stop))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.stop)
        rows = F.embedding((idx - self.start).masked_fill(outside, 0), self.weight)
        return self.leave.apply(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.mesh, self.axis)


class VocabParallelHead(nn.Module):
    """The output head over my vocabulary range, `embedding`'s: tied to its rows, or with an
    untied `head`, that head's own rows of the range. Returns my slice of the logits,
    (..., V/tp); `vocab_parallel_loss_sum` takes it from there."""

    def __init__(self, embedding: VocabParallelEmbedding, sequence_parallel: bool = False,
                 head: nn.Linear | None = None):
        super().__init__()
        self.weight = embedding.weight if head is None else _piece(
            head.weight, 0, torch.arange(embedding.start, embedding.stop))
        self.mesh, self.axis, self.start = embedding.mesh, embedding.axis, embedding.start
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        enter = GatherFromSP if self.sequence_parallel else CopyToTP
        return F.linear(enter.apply(x, self.mesh, self.axis), self.weight)


def vocab_parallel_loss_sum(logits: torch.Tensor, targets: torch.Tensor, head: VocabParallelHead,
                            ignore_index: int = -100) -> torch.Tensor:
    """`token_loss_sum` for the logits slice a `VocabParallelHead` returns (the same on every
    tp rank)."""
    return VocabParallelCrossEntropy.apply(logits, targets, head.start, ignore_index,
                                            head.mesh, head.axis)


def _contiguous(n: int, rank: int, parts: int, what: str) -> torch.Tensor:
    size = _split(n, parts, what)
    return torch.arange(rank * size, (rank + 1) * size)


def _qkv_rows(d_model: int, n_heads: int, rank: int, parts: int) -> torch.Tensor:
    """My heads' rows of a fused [q; k; v] projection: the same head range in each third."""
    _split(n_heads, parts, "the number of attention heads")
    mine = _contiguous(d_model, rank, parts, "d_model")
    return torch.cat([mine + j * d_model for j in range(3)])


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def parallelize_tensor(model: nn.Module, mesh, plan: dict[str, str] | None = None,
                       axis: str = "tp", vocab_parallel: bool = False,
                       sequence_parallel: bool = False) -> nn.Module:
    """Split `model` over the `axis` ranks in place and return it.

    Without `plan` the model must be loomtrain's GPT (every block's attention, heads split,
    and MLP become column/row pairs) or Llama (parallel/tensor_llama.py). A `plan` maps
    module-name patterns (fnmatch) to "column" or "row" for any model whose nn.Linear layers
    pair up that way (a column layer's output features, a row layer's input features split in
    contiguous ranges); the model's own code must work on the local widths.

    `vocab_parallel` (GPT or Llama) also splits the token embedding and the head over the
    vocabulary: the model then returns each rank's slice of the logits, for
    `vocab_parallel_loss_sum(logits, targets, model.head)`.

    `sequence_parallel` (GPT or Llama, with `vocab_parallel`): Megatron's sequence parallelism
    (Korthikanti et al., arXiv 2205.05198). Between the column/row pairs (layer norms,
    residuals, dropout) each rank keeps its 1/tp of the sequence; a column layer all-gathers
    the sequence and a row layer reduce-scatters it, in place of the two all-reduces (the
    same bytes). Parameters used on the local sequence only (layer norms, row biases) sum
    their gradients over tp inside backward (`SequenceParallelLayerNorm`).
    """
    parts, rank = mesh.size(axis), mesh.local_rank(axis)
    if parts == 1:
        return model
    if plan is None:
        from loomtrain.models.gpt import GPT
        from loomtrain.models.llama import Llama
        if not isinstance(model, (GPT, Llama)):
            raise ValueError(f"parallelize_tensor needs a plan for {type(model).__name__} "
                             "(names of its column- and row-parallel nn.Linear layers)")
        if sequence_parallel and not vocab_parallel:
            raise ValueError("sequence_parallel needs vocab_parallel: the head must take the "
                             "gathered sequence as a vocabulary-parallel layer")
        if isinstance(model, Llama):
            from loomtrain.parallel.tensor_llama import parallelize_llama
            return parallelize_llama(model, mesh, axis, vocab_parallel, sequence_parallel)
        if sequence_parallel:
            _split(model.seq_len, parts, "the sequence length")
        sp = sequence_parallel
        for block in model.blocks:
            attn, mlp = block.attn, block.mlp
            d = attn.proj.in_features
            attn.qkv = ColumnParallelLinear(attn.qkv, _qkv_rows(d, attn.n_heads, rank, parts),
                                            mesh, axis, sp)
            attn.proj = RowParallelLinear(attn.proj, _contiguous(d, rank, parts, "d_model"),
                                          mesh, axis, sp)
            attn.n_heads //= parts
            hidden = mlp.fc.out_features
            mine = _contiguous(hidden, rank, parts, "the MLP's hidden width")
            mlp.fc = ColumnParallelLinear(mlp.fc, mine, mesh, axis, sp)
            mlp.proj = RowParallelLinear(mlp.proj, mine, mesh, axis, sp)
            if sp:
                block.ln1 = SequenceParallelLayerNorm(block.ln1, mesh, axis)
                block.ln2 = SequenceParallelLayerNorm(block.ln2, mesh, axis)
        if vocab_parallel:
            model.tok_emb = VocabParallelEmbedding(model.tok_emb, mesh, axis)
            model.head = VocabParallelHead(model.tok_emb, sp)
        if sp:
            model.drop = SequenceSplit(model.drop, mesh, axis)
            model.ln_f = SequenceParallelLayerNorm(model.ln_f, mesh, axis)
        return model
    if vocab_parallel or sequence_parallel:
        raise ValueError("vocab_parallel and sequence_parallel are built for loomtrain's GPT "
                         "and Llama only; a plan splits nn.Linear layers into column/row pairs")
    for kind in plan.values():
        if kind not in ("column", "row"):
            raise ValueError(f"tensor-parallel plan: {kind!r} is not 'column' or 'row'")
    for name, module in list(model.named_modules()):
        kind = next((k for pattern, k in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if kind is None:
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(f"tensor-parallel plan: {name} is a {type(module).__name__}, "
                             "not an nn.Linear")
        if kind == "column":
            rows = _contiguous(module.out_features, rank, parts, f"{name}.out_features")
            _set(model, name, ColumnParallelLinear(module, rows, mesh, axis))
        else:
            cols = _contiguous(module.in_features, rank, parts, f"{name}.in_features")
            _set(model, name, RowParallelLinear(module, cols, mesh, axis))
    return model


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "VocabParallelHead", "SequenceParallelLayerNorm", "parallelize_tensor",
           "vocab_parallel_loss_sum"]
