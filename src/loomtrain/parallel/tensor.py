"""Tensor parallelism over the mesh's `tp` axis, Megatron-style (Shoeybi et al., arXiv
1909.08053): column- and row-parallel linear pairs, one all-reduce each way per pair.

Also the vocabulary-parallel embedding, tied head and cross-entropy, and Megatron's sequence
parallelism (Korthikanti et al., arXiv 2205.05198). Details: docs/tensor.md.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from loomtrain.parallel.tensor_layers import (  # noqa: F401 (the API's names)
    ColumnParallelLinear, RowParallelLinear, SequenceParallelLayerNorm, SequenceSplit,
    VocabParallelEmbedding, VocabParallelHead, _contiguous, _split, vocab_parallel_loss_sum)
from loomtrain.parallel.tensor_plan import (GPT2_HF_PLAN, LLAMA_HF_PLAN, apply_plan,  # noqa: F401
                                            fused_rows)


def _qkv_rows(d_model: int, n_heads: int, rank: int, parts: int) -> torch.Tensor:
    """My heads' rows of a fused [q; k; v] projection: the same head range in each third."""
    _split(n_heads, parts, "the number of attention heads")
    return fused_rows(3 * d_model, 3, rank, parts, "d_model")


def parallelize_tensor(model: nn.Module, mesh, plan: dict[str, str] | None = None,
                       axis: str = "tp", vocab_parallel: bool = False,
                       sequence_parallel: bool = False) -> nn.Module:
    """Split `model` over the `axis` ranks in place and return it.

    Without `plan` the model must be loomtrain's GPT (every block's attention, heads split,
    and MLP become column/row pairs) or Llama (parallel/tensor_llama.py). A `plan` maps
    module-name patterns (fnmatch) to "column", "row" or "column:N" for any model whose
    nn.Linear (or GPT-2's Conv1D) layers pair up that way (a column layer's output features, a row layer's input
    features split in contiguous ranges; "column:N" a fused output of N parts, each split);
    the model's own code must work on the local widths. Hugging Face Llama-style decoders:
    `LLAMA_HF_PLAN`; GPT-2: `GPT2_HF_PLAN`. How a plan is checked: parallel/tensor_plan.py.

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
    return apply_plan(model, mesh, axis, plan)


__all__ = ["GPT2_HF_PLAN", "LLAMA_HF_PLAN", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "VocabParallelHead", "SequenceParallelLayerNorm", "parallelize_tensor",
           "vocab_parallel_loss_sum"]
