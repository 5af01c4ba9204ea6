"""The layers of tensor parallelism (parallel/tensor.py applies them to a GPT or any model with
a plan, parallel/tensor_llama.py to a Llama): column- and row-parallel linear layers, the
vocabulary-parallel embedding and head, and sequence parallelism's split and LayerNorm.
Details: docs/tensor.md.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from loomtrain.parallel.placement import Placement
from loomtrain.models.config import padded_vocab
from loomtrain.parallel.tensor_comm import (CopyToTP, GatherFromSP, ReduceFromTP, ScatterToSP,
                                            SplitSeq, VocabParallelCrossEntropy)


class SequenceSplit(nn.Module):
    """After `inner`: keep my sequence chunk (enters a sequence-parallel region)."""

    traced_whole = True  # a leaf of automatic sequence parallelism's fx trace

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

    traced_whole = True  # a leaf of automatic sequence parallelism's fx trace

    def __init__(self, norm: nn.LayerNorm, mesh, axis: str):
        super().__init__(norm.normalized_shape, norm.eps, norm.elementwise_affine,
                         bias=norm.bias is not None)
        self.mesh, self.axis = mesh, axis
        self.weight, self.bias = norm.weight, norm.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def synced(p):
            return None if p is None else CopyToTP.apply(p, self.mesh, self.axis)
        return F.layer_norm(x, self.normalized_shape, synced(self.weight), synced(self.bias), self.eps)


def _piece(full: torch.Tensor, dim: int, index: torch.Tensor,
           length: int | None = None) -> nn.Parameter:
    """The parameter holding `full`'s entries `index` along `dim`, then zeros up to `length`
    (a padded vocabulary's rows), marked with its placement (checkpoints save the entries as
    part of the full tensor, not the padding; gradient norms count it on one rank)."""
    placement = Placement.of_index(tuple(full.shape), dim, index)
    p = nn.Parameter(placement.take(full.detach(), len(index) if length is None else length))
    p.tp_placement = placement
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
    share it (the Llama's q/k/v and gate/up: parallel/tensor_llama.py). `transposed`:
    `linear` keeps its weight as (in, out), as GPT-2's Conv1D does, and so does the piece, so
    its checkpoint names and layout stay the model's."""

    traced_whole = True  # a leaf of automatic sequence parallelism's fx trace

    def __init__(self, linear: nn.Module, rows: torch.Tensor, mesh, axis: str = "tp",
                 sequence_parallel: bool = False, enters: bool = True, transposed: bool = False):
        super().__init__()
        self.mesh, self.axis, self.sequence_parallel = mesh, axis, sequence_parallel
        self.enters, self.transposed = enters, transposed
        self.weight = _piece(linear.weight, 1 if transposed else 0, rows)
        self.bias = None if linear.bias is None else _piece(linear.bias, 0, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enters:
            enter = GatherFromSP if self.sequence_parallel else CopyToTP
            x = enter.apply(x, self.mesh, self.axis)
        return F.linear(x, self.weight.t() if self.transposed else self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """The columns `cols` (input features) of `linear`; the partial outputs are all-reduced,
    then the (replicated) bias is added once. `transposed`: as ColumnParallelLinear's."""

    traced_whole = True  # a leaf of automatic sequence parallelism's fx trace

    def __init__(self, linear: nn.Module, cols: torch.Tensor, mesh, axis: str = "tp",
                 sequence_parallel: bool = False, transposed: bool = False):
        super().__init__()
        self.mesh, self.axis, self.sequence_parallel = mesh, axis, sequence_parallel
        self.transposed = transposed
        self.weight = _piece(linear.weight, 0 if transposed else 1, cols)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leave = ScatterToSP if self.sequence_parallel else ReduceFromTP
        weight = self.weight.t() if self.transposed else self.weight
        y = leave.apply(F.linear(x, weight), self.mesh, self.axis)
        if self.bias is None:
            return y
        # under sequence parallelism the bias meets my sequence chunk only: sum its gradient
        return y + (CopyToTP.apply(self.bias, self.mesh, self.axis) if self.sequence_parallel
                    else self.bias)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the embedding table, stop - start = padded_vocab(V, tp) / tp: a
    token outside my range looks up zeros, and the all-reduce over tp sums the one rank's row
    that holds it. With `sequence_parallel`, a reduce-scatter instead: each rank keeps its
    chunk of the sequence (Megatron's embedding under sequence parallelism). When tp does not
    divide V, the rows from V on are padding: zeros no token looks up, outside the placement
    (checkpoints hold the V real rows); `vocab_rows` of mine are real."""

    traced_whole = True  # a leaf of automatic sequence parallelism's fx trace

    def __init__(self, embedding: nn.Embedding, mesh, axis: str = "tp",
                 sequence_parallel: bool = False):
        super().__init__()
        self.mesh, self.axis = mesh, axis
        self.leave = ScatterToSP if sequence_parallel else ReduceFromTP
        parts, rank = mesh.size(axis), mesh.local_rank(axis)
        vocab = embedding.num_embeddings
        rows = padded_vocab(vocab, parts) // parts
        self.start, self.stop = rank * rows, (rank + 1) * rows
        self.vocab_rows = max(0, min(self.stop, vocab) - self.start)
        self.weight = _piece(embedding.weight, 0, self.real_rows(), rows)

    def real_rows(self) -> torch.Tensor:
        return torch.arange(self.start, self.start + self.vocab_rows)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.stop)
        rows = F.embedding((idx - self.start).masked_fill(outside, 0), self.weight)
        return self.leave.apply(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.mesh, self.axis)


class VocabParallelHead(nn.Module):
    """The output head over my vocabulary range, `embedding`'s: tied to its rows, or with an
    untied `head`, that head's own rows of the range. Returns my slice of the logits,
    (..., padded_vocab(V, tp) / tp); `vocab_parallel_loss_sum` takes it from there. The
    padded rows' logits are -inf, not computed: they never win an argmax, the softmax gives
    them 0, so the loss is the unpadded one and no gradient reaches those rows (they stay
    zero). Megatron leaves them as trained logits of classes no target names."""

    traced_whole = True  # a leaf of automatic sequence parallelism's fx trace

    def __init__(self, embedding: VocabParallelEmbedding, sequence_parallel: bool = False,
                 head: nn.Linear | None = None):
        super().__init__()
        self.weight = embedding.weight if head is None else _piece(
            head.weight, 0, embedding.real_rows(), embedding.stop - embedding.start)
        self.mesh, self.axis, self.start = embedding.mesh, embedding.axis, embedding.start
        self.vocab_rows = embedding.vocab_rows
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        enter = GatherFromSP if self.sequence_parallel else CopyToTP
        x = enter.apply(x, self.mesh, self.axis)
        padding = self.weight.shape[0] - self.vocab_rows
        if not padding:
            return F.linear(x, self.weight)
        logits = F.linear(x, self.weight[:self.vocab_rows])
        return F.pad(logits, (0, padding), value=float("-inf"))


def vocab_parallel_loss_sum(logits: torch.Tensor, targets: torch.Tensor, head: VocabParallelHead,
                            ignore_index: int = -100) -> torch.Tensor:
    """`token_loss_sum` for the logits slice a `VocabParallelHead` returns (the same on every
    tp rank)."""
    return VocabParallelCrossEntropy.apply(logits, targets, head.start, ignore_index,
                                            head.mesh, head.axis)


def _contiguous(n: int, rank: int, parts: int, what: str) -> torch.Tensor:
    size = _split(n, parts, what)
    return torch.arange(rank * size, (rank + 1) * size)
