"""Tensor-parallel decoding with its all-reduces hidden behind nano-batches.

Two nano-batches run as interleaved streams, one computing while the other's all-reduce is in
flight (the nano-batching of NanoFlow, Zhu et al., arXiv 2408.12757). The schedule and its
limits: docs/generate.md, "Cutting the communication of tensor-parallel decoding".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _biased(y: torch.Tensor, bias) -> torch.Tensor:
    return y if bias is None else y + bias


def _stream(model, idx: torch.Tensor, cache, reduce):
    """One nano-batch through the model; yields after each reduce it launches; returns the
    logits. `reduce(t)` sums `t` over tp in place and returns something to `wait()` on."""
    x = model.embed(idx, cache.length)
    for block, layer in zip(model.blocks, cache.layers):
        attn, mlp = block.attn, block.mlp
        y = F.linear(attn.mix(block.ln1(x), layer), attn.proj.weight)
        pending = reduce(y)
        yield
        pending.wait()
        x = x + _biased(y, attn.proj.bias)
        y = F.linear(mlp.hidden(block.ln2(x)), mlp.proj.weight)
        pending = reduce(y)
        yield
        pending.wait()
        x = x + _biased(y, mlp.proj.bias)
    cache.advance(idx.shape[1])
    return model.head(model.ln_f(x))


def staged_forward(model, idx: torch.Tensor, caches: list, reduce) -> torch.Tensor:
    """Logits of `idx` (b, t) continuing the cached sequences: the batch cut into
    len(caches) nano-batches (rows in order, `tensor_split`), cache i holding nano-batch i,
    run as interleaved streams."""
    parts = idx.tensor_split(len(caches), dim=0)
    streams = [_stream(model, part, cache, reduce) for part, cache in zip(parts, caches)]
    logits: list = [None] * len(streams)
    live = list(range(len(streams)))
    while live:
        for i in list(live):
            try:
                next(streams[i])
            except StopIteration as finished:
                logits[i] = finished.value
                live.remove(i)
    return torch.cat(logits, dim=0)


__all__ = ["staged_forward"]
