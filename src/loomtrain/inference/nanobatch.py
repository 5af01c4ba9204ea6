"""Tensor-parallel decoding with its all-reduces hidden behind nano-batches.

Under tensor parallelism each block ends its attention and its MLP with an all-reduce of
the row-parallel layer's partial sums, and the next computation needs the sum: decoding a
batch alternates computing and communicating, each idle while the other runs. Split the
batch into two nano-batches and run them as two interleaved streams: nano-batch A launches
its all-reduce asynchronously, and B computes its attention (or MLP) while A's sum is in
flight; then B launches its own, and A, its sum arrived, goes on. The communication of one
nano-batch hides behind the computation of the other (the nano-batching of NanoFlow, Zhu et
al., arXiv 2408.12757; ISO, Xiao & Su, arXiv 2409.11155, splits one sequence in two
instead, which helps the prefill but not the one-token decode steps).

Each stream is a generator over the whole model that yields right after launching a
reduce; `staged_forward` advances the streams in a fixed round robin, so every rank issues
the collectives in the same order, as collectives require. A stream computes with the same
operations as the model's own forward (`embed`, the attention's `mix`, the MLP's `hidden`,
the row layer's matmul, its reduce, its bias), so only the reduce is swappable: the exact
all-reduce, or comm's int8 one. With a single stream this is the plain forward with that
reduce (how `compress="int8"` runs without overlap). Dropout must be off (eval mode).
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
