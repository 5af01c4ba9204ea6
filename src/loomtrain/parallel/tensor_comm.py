"""The communication of tensor parallelism, as autograd functions over a mesh axis: each
does one collective forward and its conjugate backward (Megatron's `f` and `g`, Shoeybi et
al., arXiv 1909.08053, section 3; the all-gather / reduce-scatter pair of sequence
parallelism, Korthikanti et al., arXiv 2205.05198), and the vocabulary-parallel
cross-entropy. parallel/tensor.py builds the layers from them.
"""

from __future__ import annotations

import torch

from loomtrain import comm


def _gather_seq(x: torch.Tensor, mesh, axis: str) -> torch.Tensor:
    """(b, t/N, ...) on each rank -> (b, t, ...), chunks in rank order along dim 1."""
    n = mesh.size(axis)
    out = torch.empty((n,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x.contiguous(), mesh, axis)
    return out.movedim(0, 1).reshape(x.shape[0], n * x.shape[1], *x.shape[2:])


def _scatter_seq(x: torch.Tensor, mesh, axis: str) -> torch.Tensor:
    """(b, t, ...) partial sums on each rank -> my (b, t/N, ...) chunk of their sum."""
    n = mesh.size(axis)
    chunks = x.reshape(x.shape[0], n, x.shape[1] // n, *x.shape[2:]).movedim(1, 0).contiguous()
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, chunks, mesh, axis)
    return out


def _summed(x: torch.Tensor, mesh, axis: str) -> torch.Tensor:
    """`x` summed over the axis, in place when `x` is contiguous (as Megatron's `_reduce`).
    Safe because every caller hands over a tensor nothing else reads: forward, a row layer's
    F.linear output or the embedding's masked rows (autograd saves neither; `_conjugate`
    marks it dirty, so a later save would fail loudly); backward, the input gradient of the
    F.linear a `CopyToTP` feeds. The clone this replaces was a fresh activation-sized
    allocation per all-reduce: 1-3% of a step at d_model 384 (docs/tensor.md, Measured)."""
    out = x if x.is_contiguous() else x.contiguous()
    comm.all_reduce(out, mesh, axis)
    return out


def _my_chunk(x: torch.Tensor, mesh, axis: str) -> torch.Tensor:
    return x.chunk(mesh.size(axis), dim=1)[mesh.local_rank(axis)].contiguous()


def _conjugate(name: str, forward, backward, doc: str):
    """An autograd function of (x, mesh, axis) doing `forward` and, on the gradient,
    `backward` (each a function of (tensor, mesh, axis))."""

    # eager inside a compiled block (train.compile): dynamo cannot trace the collective of
    # either direction, so the whole function is one graph break, not a trace cut inside it
    # (torch.compiler.disable's lazy form: comm/collectives.py). `fwd` itself stays a plain
    # function: autograd.Function refuses keyword arguments to a wrapped forward (torch 2.13)
    @torch._disable_dynamo
    def eager(ctx, x, mesh, axis):
        ctx.mesh, ctx.axis = mesh, axis
        out = forward(x, mesh, axis)
        if out is x:  # changed in place (`_summed`): autograd must know
            ctx.mark_dirty(x)
        return out

    def fwd(ctx, x, mesh, axis):
        return eager(ctx, x, mesh, axis)

    def bwd(ctx, grad):
        return backward(grad, ctx.mesh, ctx.axis), None, None

    return type(name, (torch.autograd.Function,), {
        "__doc__": doc, "forward": staticmethod(fwd), "backward": staticmethod(bwd)})


CopyToTP = _conjugate("CopyToTP", lambda x, _m, _a: x.view_as(x), _summed,
                       "Identity forward; all-reduce of the gradient backward (Megatron's `f`).")
ReduceFromTP = _conjugate("ReduceFromTP", _summed, lambda g, _m, _a: g,
                           "All-reduce forward; identity backward (Megatron's `g`).")
GatherFromSP = _conjugate("GatherFromSP", _gather_seq, _scatter_seq,
                           "Sequence parallel: all-gather the sequence forward, reduce-scatter back.")
ScatterToSP = _conjugate("ScatterToSP", _scatter_seq, _gather_seq,
                          "Sequence parallel: reduce-scatter the sequence forward, all-gather back.")
SplitSeq = _conjugate("SplitSeq", _my_chunk, _gather_seq,
                       "Keep my chunk of a replicated (b, t, ...) tensor; all-gather the gradient.")


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy summed over tokens from vocabulary-sharded logits: three all-reduces of
    one number per token (max, sum of exponentials, target logit), never the full logits. A
    padded vocabulary's logits arrive as -inf (VocabParallelHead): exponentials of 0, so
    neither the loss nor the gradient sees them (a rank of padding only included: its -inf
    maximum loses the all-reduce)."""

    @staticmethod
    def forward(ctx, logits, targets, start, ignore_index, mesh, axis):
        logits = logits.float()
        width = logits.shape[-1]
        peak = logits.max(dim=-1).values
        comm.all_reduce(peak, mesh, axis, op="max")
        shifted = logits - peak.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        comm.all_reduce(total, mesh, axis)
        local = targets - start
        mine = (local >= 0) & (local < width)
        target = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
        target = target.masked_fill(~mine, 0.0)
        comm.all_reduce(target, mesh, axis)
        valid = targets != ignore_index
        loss = (total.log() - target).masked_fill(~valid, 0.0)
        ctx.save_for_backward(exp, total, local, mine, valid)
        return loss.sum()

    @staticmethod
    def backward(ctx, grad):
        exp, total, local, mine, valid = ctx.saved_tensors
        softmax = exp / total.unsqueeze(-1)  # d loss / d logits = softmax - one_hot(target)
        hit = (mine & valid).unsqueeze(-1)
        index = local.clamp(0, softmax.shape[-1] - 1).unsqueeze(-1)
        softmax.scatter_add_(-1, index, -hit.to(softmax.dtype))
        softmax.mul_(valid.unsqueeze(-1).to(softmax.dtype) * grad)
        return softmax, None, None, None, None, None


__all__ = ["CopyToTP", "GatherFromSP", "ReduceFromTP", "ScatterToSP", "SplitSeq",
           "VocabParallelCrossEntropy"]
