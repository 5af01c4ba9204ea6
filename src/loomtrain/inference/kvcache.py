"""The key/value cache of autoregressive decoding (Vaswani et al., arXiv 1706.03762, section
3.2.3): every layer's keys and values, kept so that a step computes one token, not t.

Buffers are allocated at the first append from the layer's shapes, so a tensor-parallel layer
caches its own heads only. Details: docs/generate.md, "How it works".
"""

from __future__ import annotations

import torch


class LayerKV:
    """One layer's keys and values; `length` is the owner's (tokens before this step)."""

    def __init__(self, owner: "KVCache"):
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.owner.length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store (b, heads, t, head_dim) keys and values after the cached ones; return all
        of them, the new included (views of the buffers, no copy)."""
        start, end = self.length, self.length + k.shape[2]
        if self.k is None:
            shape = (*k.shape[:2], self.owner.max_len, k.shape[3])
            self.k = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.v = torch.empty(shape, dtype=v.dtype, device=v.device)
        assert end <= self.owner.max_len, f"cache of {self.owner.max_len} tokens overflows"
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """The cache of a whole model: `layers[i]` goes to block i. `max_len` is the model's
    context (its position table): decoding stops there (inference/decoder.py)."""

    def __init__(self, n_layers: int, max_len: int):
        self.max_len = max_len
        self.length = 0
        self.layers = [LayerKV(self) for _ in range(n_layers)]

    def advance(self, t: int) -> None:
        self.length += t

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers
                   for t in (layer.k, layer.v) if t is not None)


__all__ = ["KVCache", "LayerKV"]
