"""Autoregressive decoding of loomtrain's GPT, whole or split over a `tp` mesh axis.

    out = generate(model, prompt, max_new_tokens=64, temperature=0.8, top_k=40, seed=1)

A prefill fills the KV cache, then one token per step. Why the head stays replicated, how the
ranks agree without communicating, `compress` and `overlap`: docs/generate.md.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from loomtrain import comm
from loomtrain.comm.quantized import CHUNK
from loomtrain.inference.kvcache import KVCache
from loomtrain.inference.nanobatch import staged_forward
from loomtrain.parallel.tensor import RowParallelLinear

COMPRESS = ("none", "int8")


def tp_axis(model: nn.Module):
    """(mesh, axis) the model's row-parallel layers reduce over, or (None, None) unsplit."""
    row = next((m for m in model.modules() if isinstance(m, RowParallelLinear)), None)
    return (None, None) if row is None else (row.mesh, row.axis)


class Decoder:
    """The state of one batch being decoded: the model, its KV caches, its reduce."""

    def __init__(self, model: nn.Module, compress: str | None = None, overlap: bool = False,
                 chunk: int = CHUNK):
        compress = compress or "none"
        if compress not in COMPRESS:
            raise ValueError(f"compress={compress!r}: choose one of {COMPRESS}")
        if not isinstance(model.head, nn.Linear):
            raise ValueError("decoding needs the replicated output head: split the model with "
                             "parallelize_tensor(model, mesh) without vocab_parallel")
        self.model, self.overlap = model, overlap
        self.mesh, self.axis = tp_axis(model)
        self.staged = compress == "int8" or overlap
        self.caches = [KVCache(len(model.blocks), model.seq_len) for _ in range(2 if overlap else 1)]
        self.chunk = chunk
        if self.mesh is None:
            self.reduce = _no_reduce
        else:
            self.reduce = self._exact if compress == "none" else self._int8

    @property
    def length(self) -> int:
        return self.caches[0].length

    def _exact(self, t: torch.Tensor):
        return comm.all_reduce(t, self.mesh, self.axis, async_op=True)

    def _int8(self, t: torch.Tensor):
        return comm.quantized_all_reduce(t, self.mesh, self.axis, self.chunk, async_op=True)

    @torch.no_grad()
    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (b, t, vocab) of `idx` (b, t), which continues the cached sequences."""
        if self.overlap and idx.shape[0] < 2:
            raise ValueError("overlap splits the batch into two nano-batches: it needs at "
                             f"least 2 sequences, got {idx.shape[0]}")
        if not self.staged:
            return self.model(idx, self.caches[0])
        return staged_forward(self.model, idx, self.caches, self.reduce)


class _Summed:
    def wait(self) -> None:
        pass


def _no_reduce(_t: torch.Tensor) -> _Summed:  # an unsplit model: nothing to sum
    return _Summed()


def pick_next(logits: torch.Tensor, temperature: float, top_k: int | None,
              generator: torch.Generator) -> torch.Tensor:
    """The next token (b, 1) from last-position logits (b, vocab): the argmax at temperature
    0, else a draw from softmax(logits / temperature) over the `top_k` largest."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    scaled = logits.float() / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.multinomial(scaled.softmax(dim=-1), 1, generator=generator)


def _check_agreement(tokens: torch.Tensor, mesh, axis: str) -> None:
    """Every tp rank must hold the same tokens; one all-gather at the end checks it."""
    everyone = torch.empty((mesh.size(axis),) + tuple(tokens.shape), dtype=tokens.dtype)
    comm.all_gather(everyone, tokens.contiguous(), mesh, axis)
    if not bool((everyone == tokens).all()):
        raise RuntimeError(f"tensor-parallel ranks decoded different tokens on axis {axis!r}: "
                           "their logits were not bit-identical (different kernels or "
                           "hardware per rank?)")


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, seed: int = 0,
             compress: str | None = None, overlap: bool = False) -> torch.Tensor:
    """`prompt` (b, t) token ids followed by up to `max_new_tokens` new ones, (b, t + n),
    n = min(max_new_tokens, seq_len - t). Every tp rank calls it with the same arguments and
    returns the same tokens. Greedy at temperature 0; otherwise sampling (top-k if given)
    from a generator seeded with `seed`, identical on every rank and in a single process."""
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be (batch, tokens) with at least one token, got {tuple(prompt.shape)}")
    if prompt.shape[1] > model.seq_len:
        raise ValueError(f"prompt of {prompt.shape[1]} tokens exceeds seq_len={model.seq_len}")
    model.eval()
    decoder = Decoder(model, compress, overlap)
    generator = torch.Generator().manual_seed(seed)
    steps = min(max_new_tokens, model.seq_len - prompt.shape[1])
    tokens = [prompt]
    logits = decoder(prompt)[:, -1]
    for i in range(steps):
        tokens.append(pick_next(logits, temperature, top_k, generator))
        if i + 1 < steps:
            logits = decoder(tokens[-1])[:, -1]
    out = torch.cat(tokens, dim=1)
    if decoder.mesh is not None:
        _check_agreement(out, decoder.mesh, decoder.axis)
    return out


__all__ = ["COMPRESS", "Decoder", "generate", "pick_next", "tp_axis"]
