"""A small pre-LN decoder-only transformer (GPT-2 style) with a tied output head.

Causal softmax attention through SDPA, or causal linear attention (models/linear_attention.py);
`forward(idx, cache)` decodes with a key/value cache. The loss lives in models/__init__.py.
Details: docs/training.md, "Models", and docs/generate.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from loomtrain.models.linear_attention import causal_linear_attention, default_decay, feature_map

ATTENTIONS = ("softmax", "linear")
# model.activation -> F.gelu's `approximate`: GPT-2 was trained with the tanh approximation
# (Hendrycks & Gimpel, arXiv 1606.08415, eq. 3; transformers' "gelu_new"), so its published
# weights need it
GELUS = {"gelu": "none", "gelu_tanh": "tanh"}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache=None,
           dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of (b, heads, t, head_dim) queries over the keys and values, after
    appending the new ones to the layer's `cache` if given (inference/shift.py calls it on
    head slices too)."""
    mask, causal = None, True
    if cache is not None:
        start, t = cache.length, q.shape[2]
        k, v = cache.append(k, v)
        # from an empty cache (prefill) the plain causal path; one new token sees every
        # cached one; t new tokens after `start` cached ones need the offset causal mask
        causal = start == 0
        if start and t > 1:
            mask = torch.arange(start + t, device=q.device) <= start + torch.arange(t, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout_p)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float, attention: str = "softmax",
                 linear_decay: bool = False):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        if linear_decay and attention != "linear":
            raise ValueError("linear_decay=True is a decay of linear attention; "
                             f"attention={attention!r}")
        self.n_heads = n_heads
        self.attention = attention
        # linear attention's per-head lambda_h (None: no decay); a buffer so it follows the
        # module's device, non-persistent because it is a function of n_heads, not a weight
        self.register_buffer("decay", default_decay(n_heads) if linear_decay else None,
                             persistent=False)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        # selective recomputation (Korthikanti et al., arXiv 2205.05198): the attention core's
        # saved tensors are dropped after forward and recomputed in backward
        self.recompute_core = False
        # sequence parallelism (parallel/sequence) installs its kernel here: core(q, k, v) of
        # (b, heads, t_local, head_dim) tensors -> the same shape; None: `attend`. Linear
        # attention hands it phi(q), phi(k), v, and the kernel reads `decay` from this module
        self.core = None

    def init_buffers(self) -> None:
        """Computes `decay` in place, on the CPU as the eager build does, for a model built on
        the meta device (train/materialize.py)."""
        if self.decay is not None:
            self.decay.copy_(default_decay(self.decay.numel()))

    def mix(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        """The heads' attention output before the output projection, (b, t, local width)."""
        qkv = self.qkv(x)
        # shapes from qkv's output, so a tensor-parallel qkv works: a slice of the heads, and
        # under sequence parallelism the whole sequence gathered from a chunk of it
        b, t = qkv.shape[:2]
        # (b, t, 3, heads, head_dim) -> 3 x (b, heads, t, head_dim); unpacked, not iterated,
        # so that torch.fx can trace it (parallel/sequence/auto.py)
        q, k, v = qkv.view(b, t, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        if self.attention == "linear":
            return self._linear(q, k, v, cache).transpose(1, 2).reshape(b, t, -1)
        dropout = self.dropout if self.training else 0.0
        if self.core is not None and cache is None:
            y = self.core(q, k, v)
        elif self.recompute_core and cache is None and torch.is_grad_enabled():
            y = checkpoint(attend, q, k, v, None, dropout, use_reentrant=False)
        else:
            y = attend(q, k, v, cache, dropout)
        return y.transpose(1, 2).reshape(b, t, -1)

    def _linear(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache) -> torch.Tensor:
        if cache is not None:
            # the cache would hold the d x (d+1) state per head, not keys and values
            raise NotImplementedError("decoding with a KV cache is not implemented for "
                                      'attention="linear"; run the whole sequence without a cache')
        q, k = feature_map(q), feature_map(k)
        if self.core is not None:
            return self.core(q, k, v)
        if self.recompute_core and torch.is_grad_enabled():
            return checkpoint(causal_linear_attention, q, k, v, self.decay, use_reentrant=False)
        return causal_linear_attention(q, k, v, self.decay)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        return self.proj(self.mix(x, cache))


class MLPBlock(nn.Module):
    def __init__(self, d_model: int, ratio: int, activation: str = "gelu"):
        super().__init__()
        if activation not in GELUS:
            raise ValueError(f"activation must be one of {tuple(GELUS)}, got {activation!r}")
        self.approximate = GELUS[activation]
        self.fc = nn.Linear(d_model, ratio * d_model)
        self.proj = nn.Linear(ratio * d_model, d_model)

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        """The GELU of fc's output `h` (inference/shift.py calls it on a slice of fc)."""
        return F.gelu(h, approximate=self.approximate)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.activate(self.fc(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.hidden(x))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int, dropout: float,
                 attention: str = "softmax", linear_decay: bool = False,
                 activation: str = "gelu"):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout, attention, linear_decay)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLPBlock(d_model, mlp_ratio, activation)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), cache))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int,
                 mlp_ratio: int = 4, dropout: float = 0.0, attention: str = "softmax",
                 linear_decay: bool = False, activation: str = "gelu"):
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, mlp_ratio, dropout, attention, linear_decay, activation)
            for _ in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied (GPT-2; Press & Wolf, arXiv 1608.05859)
        # under sequence parallelism: the global positions of the tokens `forward` gets
        self.position_ids: torch.Tensor | None = None
        self.apply(self._init)
        # GPT-2's scaled init of residual projections: std 0.02 / sqrt(2 * n_layers)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def embed(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Token plus position embeddings of `idx`, whose first token sits at position `start`."""
        positions = self.position_ids  # any number of tokens, each at a position < seq_len
        if positions is None:
            end = start + idx.shape[1]
            # torch._assert, not assert: the check stays in a torch.fx trace (auto.py)
            torch._assert(end <= self.seq_len, f"sequence of {end} tokens exceeds seq_len={self.seq_len}")
            positions = torch.arange(start, end, device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(positions))

    def forward(self, idx: torch.Tensor, cache=None) -> torch.Tensor:
        """Logits (b, t, vocab). With `cache`, `idx` continues the cached sequence (decoding)."""
        if cache is None:
            x = self.embed(idx)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))
        x = self.embed(idx, cache.length)
        for block, layer in zip(self.blocks, cache.layers):
            x = block(x, layer)
        cache.advance(idx.shape[1])
        return self.head(self.ln_f(x))
