"""Shift Parallelism for serving: one loaded GPT decodes each batch either tensor-parallel or
Ulysses sequence-parallel, chosen per batch by the tokens in flight (Hidayetoglu et al.,
Snowflake, arXiv 2509.16495).

Both modes share one KV-cache layout, and the tp path reads views of the full weights:
docs/generate.md, "Shift Parallelism (serving)".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loomtrain import comm
from loomtrain.inference.kvcache import KVCache
from loomtrain.models.gpt import GPT, attend

MODES = ("tp", "sp")


@dataclass(frozen=True)
class HeadSlice:
    """One block's tensor-parallel slice for rank r: views of the block's full weights."""

    q: tuple  # (weight rows, bias rows) of my heads' queries
    k: tuple
    v: tuple
    proj_w: torch.Tensor  # proj.weight[:, my columns] (strided view)
    fc: tuple  # (fc.weight rows, fc.bias rows): my slice of the MLP hidden width
    mlp_proj_w: torch.Tensor  # mlp.proj.weight[:, my columns]

    def tensors(self) -> list[torch.Tensor]:
        return [*self.q, *self.k, *self.v, self.proj_w, *self.fc, self.mlp_proj_w]


def _head_slice(block, rank: int, parts: int) -> HeadSlice:
    attn, mlp = block.attn, block.mlp
    d, hidden = attn.proj.in_features, mlp.fc.out_features
    w, b = attn.qkv.weight.detach(), attn.qkv.bias.detach()
    lo, hi = rank * d // parts, (rank + 1) * d // parts
    third = lambda j: (w[j * d + lo:j * d + hi], b[j * d + lo:j * d + hi])  # noqa: E731
    flo, fhi = rank * hidden // parts, (rank + 1) * hidden // parts
    return HeadSlice(q=third(0), k=third(1), v=third(2),
                     proj_w=attn.proj.weight.detach()[:, lo:hi],
                     fc=(mlp.fc.weight.detach()[flo:fhi], mlp.fc.bias.detach()[flo:fhi]),
                     mlp_proj_w=mlp.proj.weight.detach()[:, flo:fhi])


def _heads(x: torch.Tensor, b: int, t: int, n_heads: int) -> torch.Tensor:
    """(b * t, n_heads * head_dim) or (b, t, ...) -> (b, n_heads, t, head_dim)."""
    return x.reshape(b, t, n_heads, -1).transpose(1, 2)


class ShiftServer:
    """Serves a full `GPT` on every rank of `mesh`'s `axis`, in "tp" when a batch brings
    fewer than `threshold_tokens` new tokens, else in "sp" (docs/generate.md)."""

    def __init__(self, model: GPT, mesh, threshold_tokens: int, axis: str = "tp"):
        self.model, self.mesh, self.axis = model.eval(), mesh, axis
        self.parts, self.rank = mesh.size(axis), mesh.local_rank(axis)
        if model.blocks[0].attn.attention != "softmax":  # both modes run softmax `attend`
            raise ValueError("ShiftServer serves softmax attention; the model has "
                             f"attention={model.blocks[0].attn.attention!r}")
        self.n_heads = model.blocks[0].attn.n_heads
        if self.n_heads % self.parts:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by the {axis} size "
                             f"{self.parts}: both modes split the heads")
        if threshold_tokens < 1:
            raise ValueError(f"threshold_tokens={threshold_tokens}: give at least 1")
        self.threshold_tokens = threshold_tokens
        self.local_heads = self.n_heads // self.parts
        self.slices = [_head_slice(block, self.rank, self.parts) for block in model.blocks]

    def new_cache(self) -> KVCache:
        return KVCache(len(self.model.blocks), self.model.seq_len)

    def mode_for(self, new_tokens: int) -> str:
        """The pure switching rule: tokens in flight below the threshold -> "tp"."""
        return "tp" if new_tokens < self.threshold_tokens else "sp"

    @torch.no_grad()
    def step(self, idx: torch.Tensor, cache: KVCache, mode: str | None = None) -> torch.Tensor:
        """Logits (b, t, vocab) of `idx` (b, t) continuing `cache`'s sequences, the same on
        every rank; `mode` forces "tp" or "sp" (for measurement), else `mode_for(b * t)`."""
        mode = mode or self.mode_for(idx.numel())
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: choose one of {MODES}")
        x = (self._tp if mode == "tp" else self._sp)(idx, cache)
        cache.advance(idx.shape[1])
        return self.model.head(self.model.ln_f(x))

    def _tp(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        b, t = idx.shape
        x = self.model.embed(idx, cache.length)
        for block, mine, layer in zip(self.model.blocks, self.slices, cache.layers):
            h = block.ln1(x)
            q, k, v = (_heads(F.linear(h, *wb), b, t, self.local_heads)
                       for wb in (mine.q, mine.k, mine.v))
            y = attend(q, k, v, layer).transpose(1, 2).reshape(b, t, -1)
            x = x + self._summed(F.linear(y, mine.proj_w), block.attn.proj.bias)
            y = F.linear(block.mlp.activate(F.linear(block.ln2(x), *mine.fc)), mine.mlp_proj_w)
            x = x + self._summed(y, block.mlp.proj.bias)
        return x

    def _summed(self, partial: torch.Tensor, bias) -> torch.Tensor:
        comm.all_reduce(partial, self.mesh, self.axis)  # F.linear's fresh output: in place
        return partial if bias is None else partial + bias

    def _sp(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        b, t = idx.shape
        n, total = self.parts, idx.numel()
        chunk = -(-total // n)
        # embed everything (a table lookup), then keep my chunk of the flattened tokens
        x = self.model.embed(idx, cache.length).reshape(total, -1)
        x = F.pad(x, (0, 0, 0, n * chunk - total))[self.rank * chunk:(self.rank + 1) * chunk]
        d = x.shape[-1]
        for block, layer in zip(self.model.blocks, cache.layers):
            attn = block.attn
            qkv = attn.qkv(block.ln1(x)).view(chunk, 3, n, d // n)
            # (my tokens, q/k/v, head group j, width) -> group j to rank j
            send = qkv.permute(2, 0, 1, 3).contiguous()
            got = torch.empty_like(send)  # (token chunk i from rank i, ..., my heads)
            comm.all_to_all(got, send, self.mesh, self.axis)
            q, k, v = (_heads(z, b, t, self.local_heads)
                       for z in got.reshape(n * chunk, 3, d // n)[:total].unbind(1))
            y = attend(q, k, v, layer).transpose(1, 2).reshape(total, d // n)
            send = F.pad(y, (0, 0, 0, n * chunk - total)).view(n, chunk, d // n)
            got = torch.empty_like(send)  # (head group i from rank i, my tokens, width)
            comm.all_to_all(got, send, self.mesh, self.axis)
            x = x + attn.proj(got.permute(1, 0, 2).reshape(chunk, d))
            x = x + block.mlp(block.ln2(x))
        everyone = torch.empty((n, chunk, d), dtype=x.dtype)
        comm.all_gather(everyone, x.contiguous(), self.mesh, self.axis)
        return everyone.reshape(n * chunk, d)[:total].view(b, t, d)

    @torch.no_grad()
    def serve(self, groups: list[list["Request"]], mode: str | None = None) -> "Served":
        """Greedy-decode a trace, group by group (static batching): a group's requests, all
        arriving together with prompts of equal length, are prefilled as one batch (b x t
        tokens in flight: large, "sp" above the threshold), then decoded together one token
        per request per step (b tokens in flight: small, "tp") until each has its
        `new_tokens`; the group's batch runs to its longest request. `mode` forces one mode
        throughout. Returns each request's new tokens and every step's (mode, tokens, s)."""
        outputs, steps, latency_s = [], [], []
        for group in groups:
            lengths = {len(r.prompt) for r in group}
            if len(lengths) != 1:
                raise ValueError(f"a group is prefilled as one batch: its prompts need one "
                                 f"length, got {sorted(lengths)}")
            most = max(r.new_tokens for r in group)
            if lengths.pop() + most > self.model.seq_len:
                raise ValueError(f"prompt plus {most} new tokens exceeds seq_len={self.model.seq_len}")
            start = time.perf_counter()
            cache, idx, new = self.new_cache(), torch.stack([r.prompt for r in group]), []
            for _ in range(most):
                in_flight, chosen = idx.numel(), mode or self.mode_for(idx.numel())
                t0 = time.perf_counter()
                idx = self.step(idx, cache, chosen)[:, -1:].argmax(-1)
                steps.append((chosen, in_flight, time.perf_counter() - t0))
                new.append(idx)
            tokens = torch.cat(new, dim=1)
            latency_s.append(time.perf_counter() - start)
            outputs += [tokens[i, :r.new_tokens] for i, r in enumerate(group)]
        return Served(outputs, steps, latency_s)


@dataclass(frozen=True)
class Request:
    prompt: torch.Tensor  # (t,) token ids
    new_tokens: int


@dataclass(frozen=True)
class Served:
    tokens: list  # per request, in trace order: its new tokens (new_tokens,)
    steps: list  # per step: (mode, new tokens in flight, seconds)
    group_latency_s: list  # per group: prefill start to its last token


__all__ = ["MODES", "HeadSlice", "Request", "Served", "ShiftServer"]
