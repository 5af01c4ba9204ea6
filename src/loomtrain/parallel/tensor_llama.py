"""Tensor parallelism for the Llama family (models/llama.py), Megatron-style (Shoeybi et al.,
arXiv 1909.08053): q_proj, gate_proj and up_proj column-split, o_proj and down_proj row-split,
one entry into the tensor-parallel region per block half (after ln1, after ln2) shared by the
sibling column layers, the vocabulary-parallel embedding and head (tied or not), and
Megatron's sequence parallelism (Korthikanti et al., arXiv 2205.05198).

Grouped-query attention: k_proj and v_proj are split by kv heads when tp divides n_kv_heads;
when tp is a multiple of n_kv_heads instead, every rank keeps k_proj and v_proj whole and uses
the rows of the one kv head its query heads read (Megatron replicates the kv heads the same
way). Details: docs/models.md, "Tensor parallel".

A mixture-of-experts feed-forward (models/moe.py) stays whole on every tp rank, the experts
unsplit (Megatron-Core's expert tensor-parallel size 1): without sequence parallelism every
rank runs it on the same tokens; with it, on its own piece of the sequence
(`SequenceParallelMoE`). docs/moe.md, "Tensor parallelism".
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from loomtrain.models.moe import MoE
from loomtrain.parallel.tensor_layers import (ColumnParallelLinear, RowParallelLinear,
                                              VocabParallelEmbedding, VocabParallelHead,
                                              _contiguous, _split)
from loomtrain.parallel.tensor_comm import CopyToTP, GatherFromSP, ReduceFromTP


def kv_layout(n_heads: int, n_kv_heads: int, parts: int) -> str:
    """"split" when `parts` divides the kv heads, "replicated" when it is a multiple of them;
    ValueError otherwise (a rank's query heads would read parts of two kv heads' groups)."""
    _split(n_heads, parts, "the number of attention heads")
    if n_kv_heads % parts == 0:
        return "split"
    if parts % n_kv_heads == 0:
        return "replicated"
    raise ValueError(f"the number of kv heads = {n_kv_heads} and the tensor-parallel size "
                     f"{parts}: one must divide the other (kv heads split when tp divides "
                     "them, replicated when tp is a multiple of them)")


class TensorParallelRMSNorm(nn.RMSNorm):
    """An RMSNorm (the same `weight`, replicated on every tp rank) that may
    - see part of what the whole model sees (1/tp of the sequence, or my heads only for
      q_norm/k_norm): `partial` sends its weight through Megatron's `f`, so the weight's
      gradient is the sum over tp when backward returns (as SequenceParallelLayerNorm);
    - feed column-parallel layers only (ln1 -> q/k/v, ln2 -> gate/up): `enter` (CopyToTP, or
      GatherFromSP under sequence parallelism) applied once to its output, so the sibling
      layers share one all-reduce backward (one all-gather forward) instead of one each."""

    def __init__(self, norm: nn.RMSNorm, mesh, axis: str, partial: bool, enter=None):
        super().__init__(norm.normalized_shape, norm.eps, norm.elementwise_affine)
        self.mesh, self.axis, self.partial, self.enter = mesh, axis, partial, enter
        self.weight = norm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.partial and weight is not None:
            weight = CopyToTP.apply(weight, self.mesh, self.axis)
        y = F.rms_norm(x, self.normalized_shape, weight, self.eps)
        return y if self.enter is None else self.enter.apply(y, self.mesh, self.axis)


class ReplicatedKVLinear(nn.Module):
    """k_proj or v_proj kept whole on every tp rank (tp a multiple of n_kv_heads), computing
    the rows [start, stop) (my kv head's). The weight passes Megatron's `f` before the rows
    are taken: each rank's gradient is zero outside its kv head's rows, and the all-reduce
    over tp adds the contributions of all the ranks whose query heads read each kv head, so
    every rank ends backward with the single process's gradient of the whole tensor. A
    replicated parameter (no placement): checkpoints save it whole, the gradient norm counts
    it once. The cost: each rank stores all n_kv_heads (Megatron stores the one it reads)
    and all-reduces their gradient, 2 * n_kv_heads * head_dim * d_model numbers per layer."""

    def __init__(self, linear: nn.Linear, start: int, stop: int, mesh, axis: str):
        super().__init__()
        self.mesh, self.axis, self.start, self.stop = mesh, axis, start, stop
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def mine(p):
            if p is None:
                return None
            return CopyToTP.apply(p, self.mesh, self.axis)[self.start:self.stop]
        return F.linear(x, mine(self.weight), mine(self.bias))


class PartialLinear(nn.Linear):
    """An nn.Linear (the same weight and bias, whole on every tp rank) that sees part of what
    the whole model sees (1/tp of the sequence): both enter through Megatron's `f` where its
    forward reads them, so their gradients are the sum over tp when backward returns, as
    TensorParallelRMSNorm's `partial` weight's."""

    def __init__(self, linear: nn.Linear, mesh, axis: str):
        super().__init__(linear.in_features, linear.out_features, linear.bias is not None,
                         device="meta")
        self.mesh, self.axis = mesh, axis
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else CopyToTP.apply(self.bias, self.mesh, self.axis)
        return F.linear(x, CopyToTP.apply(self.weight, self.mesh, self.axis), bias)


class SequenceParallelMoE(MoE):
    """A mixture of experts on this tp rank's 1/tp of every sequence (Megatron's sequence
    parallelism), routing its own tokens; `moe` otherwise (its submodules, parameters and
    state, under their names). What a whole sequence decides is agreed over tp:
    - every weight enters through Megatron's `f` (identity forward, all-reduce of the gradient
      backward) where its own module's forward reads it (`PartialLinear`, the experts'
      `weight_entry`, which expert parallelism's slice keeps), so each rank ends backward
      with the gradient of the whole sequences, and a ZeRO-3 unit inside the block has
      gathered it by then;
    - the balance loss's per-sequence counts (`whole_sequences`) are summed by Megatron's `g`
      (all-reduce forward, identity backward): every rank computes the whole sequences' loss
      from the sums, and its gradient reaches each rank's own tokens, the single process's."""

    def __init__(self, moe: MoE, mesh, axis: str):
        nn.Module.__init__(self)
        vars(self).update(vars(moe))  # moe's submodules, parameters and counts
        self.mesh, self.axis = mesh, axis
        linears = [(self.router, "gate"), (self, "shared_gate")]
        if self.shared is not None:
            linears += [(self.shared, name) for name in ("gate_proj", "up_proj", "down_proj")]
        for owner, name in linears:
            if getattr(owner, name) is not None:
                setattr(owner, name, PartialLinear(getattr(owner, name), mesh, axis))
        self.experts.weight_entry = partial(CopyToTP.apply, mesh=mesh, axis=axis)

    def whole_sequences(self, counts: torch.Tensor, t: int) -> tuple[torch.Tensor, int]:
        return ReduceFromTP.apply(counts, self.mesh, self.axis), t * self.mesh.size(self.axis)


def _split_attention(attn, rank: int, parts: int, mesh, axis: str, sp: bool) -> None:
    hd, layout = attn.head_dim, kv_layout(attn.n_heads, attn.n_kv_heads, parts)
    q_rows = _contiguous(attn.n_heads * hd, rank, parts, "q_proj's width")  # my heads' rows
    attn.q_proj = ColumnParallelLinear(attn.q_proj, q_rows, mesh, axis, sp, enters=False)
    if layout == "split":
        kv_rows = _contiguous(attn.n_kv_heads * hd, rank, parts, "the kv width")
        attn.k_proj = ColumnParallelLinear(attn.k_proj, kv_rows, mesh, axis, sp, enters=False)
        attn.v_proj = ColumnParallelLinear(attn.v_proj, kv_rows, mesh, axis, sp, enters=False)
        attn.n_kv_heads //= parts
    else:
        # the kv head of my query heads: they are all in one group (parts % n_kv_heads == 0)
        kv = rank * (attn.n_heads // parts) // (attn.n_heads // attn.n_kv_heads)
        attn.k_proj = ReplicatedKVLinear(attn.k_proj, kv * hd, (kv + 1) * hd, mesh, axis)
        attn.v_proj = ReplicatedKVLinear(attn.v_proj, kv * hd, (kv + 1) * hd, mesh, axis)
        attn.n_kv_heads = 1
    attn.o_proj = RowParallelLinear(attn.o_proj, q_rows, mesh, axis, sp)
    attn.n_heads //= parts
    if attn.q_norm is not None:  # each rank normalizes its heads only: sum the gradient
        attn.q_norm = TensorParallelRMSNorm(attn.q_norm, mesh, axis, partial=True)
        attn.k_norm = TensorParallelRMSNorm(attn.k_norm, mesh, axis, partial=True)


def parallelize_llama(model, mesh, axis: str, vocab_parallel: bool,
                      sequence_parallel: bool) -> nn.Module:
    """`parallelize_tensor` for a Llama (in place; returns it). `vocab_parallel` splits the
    embedding and the head (tied: the embedding's rows; untied: the head's own, by the same
    vocabulary range); the model then returns each rank's slice of the logits.
    `sequence_parallel` (with `vocab_parallel`) keeps 1/tp of the sequence between the column
    and row layers: the embedding reduce-scatters, the norms sum their weight gradients over
    tp. Rotary positions need nothing: attention runs on the gathered, whole sequence, whose
    positions are 0..t-1 (LlamaBlock counts them on ln1's output, the gathered sequence).
    A mixture-of-experts block keeps its feed-forward whole and its ln2 outside the region;
    under sequence parallelism the feed-forward becomes a `SequenceParallelMoE`."""
    parts, rank = mesh.size(axis), mesh.local_rank(axis)
    sp = sequence_parallel
    if sp:
        _split(model.seq_len, parts, "the sequence length")
    enter = GatherFromSP if sp else CopyToTP
    for block in model.blocks:
        _split_attention(block.attn, rank, parts, mesh, axis, sp)
        block.ln1 = TensorParallelRMSNorm(block.ln1, mesh, axis, partial=sp, enter=enter)
        mlp = block.mlp
        if isinstance(mlp, MoE):  # whole on every rank: ln2's output does not enter the region
            block.ln2 = TensorParallelRMSNorm(block.ln2, mesh, axis, partial=sp)
            if sp:
                block.mlp = SequenceParallelMoE(mlp, mesh, axis)
            continue
        mine = _contiguous(mlp.gate_proj.out_features, rank, parts, "the MLP's hidden width")
        mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, mine, mesh, axis, sp, enters=False)
        mlp.up_proj = ColumnParallelLinear(mlp.up_proj, mine, mesh, axis, sp, enters=False)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, mine, mesh, axis, sp)
        block.ln2 = TensorParallelRMSNorm(block.ln2, mesh, axis, partial=sp, enter=enter)
    if vocab_parallel:
        tied = model.head.weight is model.tok_emb.weight
        model.tok_emb = VocabParallelEmbedding(model.tok_emb, mesh, axis, sequence_parallel=sp)
        model.head = VocabParallelHead(model.tok_emb, sp, None if tied else model.head)
    if sp:
        model.ln_f = TensorParallelRMSNorm(model.ln_f, mesh, axis, partial=True)
    return model


__all__ = ["PartialLinear", "ReplicatedKVLinear", "SequenceParallelMoE", "TensorParallelRMSNorm",
           "kv_layout", "parallelize_llama"]
