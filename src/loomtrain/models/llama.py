"""The Llama decoder (Touvron et al., arXiv 2302.13971; Llama 3, arXiv 2407.21783): pre-norm
blocks with RMSNorm, rotary position embeddings (with Llama 3's frequency scaling), grouped-query
attention and a SwiGLU MLP, no biases. Switches cover the close relatives: q/k/v biases
(Qwen2), RMSNorm of q and k per head (Qwen3), sliding-window attention (Mistral).

It keeps the GPT's module conventions (models/gpt.py: `tok_emb`, `blocks`, `ln_f`, `head`;
`attn.core`, `attn.recompute_core`, `position_ids`, `forward(idx, cache)`, `embed`) so the
engines that walk those names run it; the names inside a block are Hugging Face's (`q_proj`,
`gate_proj`, ...). docs/models.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from loomtrain.models.moe import GroupedExperts, MoE, is_moe_layer
from loomtrain.models.swiglu import SwiGLU


def rope_frequencies(head_dim: int, theta: float, scaling=None) -> torch.Tensor:
    """RoPE's inverse frequencies theta^(-2i/head_dim), i < head_dim/2 (Su et al., arXiv
    2104.09864, eq. 15), in fp32. With `scaling` (a RopeScaling) of rope_type "linear",
    position interpolation (Chen et al., arXiv 2306.15595): every frequency divided by
    `factor`, as positions would be. Of rope_type "llama3", Llama 3.1's rule: a
    frequency whose wavelength is shorter than original_max_position / high_freq_factor is
    kept, one longer than original_max_position / low_freq_factor is divided by `factor`, and
    the band between is interpolated linearly in original_max_position / wavelength."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is not None and scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None:
        wavelength = 2 * math.pi / inv_freq
        # 0 at the low-frequency edge, 1 at the high one, clamped outside the band
        smooth = ((scaling.original_max_position / wavelength - scaling.low_freq_factor)
                  / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0.0, 1.0)
        inv_freq = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return inv_freq.float()


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x (b, heads, t, head_dim) rotated by the angles positions * inv_freq, pairing dimension
    i with i + head_dim/2 (the Hugging Face layout, `rotate_half`, so its q_proj/k_proj
    weights load unpermuted). Angles in fp32: a bf16 angle at position 10^4 is off by ~40."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # (t, head_dim/2)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + turned.float() * sin).to(x.dtype)


def window_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int) -> torch.Tensor:
    """(t_q, t_k) True where a query may see a key: causal, and within the last `window` tokens
    (itself included; Mistral's sliding window, Jiang et al., arXiv 2310.06825); 0: no window."""
    offset = q_positions[:, None] - k_positions[None, :]
    return (offset >= 0) & (offset < window) if window else offset >= 0


def attend_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache=None,
                   window: int = 0) -> torch.Tensor:
    """Causal attention of (b, heads, t, head_dim) queries over (b, kv_heads, t, head_dim) keys
    and values, after appending them to the layer's `cache` (inference/kvcache.py) if given: the
    cache holds kv_heads heads, not heads (grouped-query attention's memory saving). Each kv
    head serves heads/kv_heads consecutive query heads."""
    start = cache.length if cache is not None else 0
    if cache is not None:
        k, v = cache.append(k, v)
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    t = q.shape[2]
    if not window and start == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = window_mask(torch.arange(start, start + t, device=q.device),
                       torch.arange(start + t, device=q.device), window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, kv_heads, t, d) -> (b, heads, t, d), each kv head repeated for its group."""
    return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, theta: float, scaling,
                 qkv_bias: bool, qk_norm: bool, window: int, eps: float, head_dim: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = head_dim or d_model // n_heads  # Qwen3's may exceed d_model / n_heads
        self.theta, self.scaling, self.window = theta, scaling, window
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=eps) if qk_norm else None
        # a function of the config, not a weight: non-persistent, remade by init_buffers after
        # a build on the meta device (train/materialize.py)
        self.register_buffer("inv_freq", rope_frequencies(self.head_dim, theta, scaling),
                             persistent=False)
        # as the GPT's CausalSelfAttention: selective recomputation of the core, and the
        # sequence-parallel kernel core(q, k, v) on (b, heads, t, head_dim), k and v with
        # kv_heads heads (the kernel repeats them, or sends them unrepeated)
        self.recompute_core = False
        self.core = None

    def init_buffers(self) -> None:
        """Computes `inv_freq` in place, on the CPU as the eager build does, for a model built
        on the meta device (train/materialize.py)."""
        self.inv_freq.copy_(rope_frequencies(self.head_dim, self.theta, self.scaling))

    @property
    def proj(self) -> nn.Module:
        """The output projection under the GPT's name (inference/nanobatch.py walks it)."""
        return self.o_proj

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cache=None) -> torch.Tensor:
        return self.o_proj(self.mix(x, cache, positions))

    def mix(self, x: torch.Tensor, cache=None, positions: torch.Tensor | None = None):
        """The heads' attention output before o_proj, (b, t, local width). `positions`: the
        tokens' positions; None: consecutive from the cache's length (0 without one), counted
        on x, which under Megatron sequence parallelism is the gathered sequence."""
        b, t = x.shape[:2]
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + t, device=x.device)
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:  # Qwen3 normalizes each head before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, positions, self.inv_freq), rotate(k, positions, self.inv_freq)
        if self.core is not None and cache is None:  # it masks the window and groups kv
            y = self.core(q, k, v)
        elif self.recompute_core and cache is None and torch.is_grad_enabled():
            y = checkpoint(attend_grouped, q, k, v, None, self.window, use_reentrant=False)
        else:
            y = attend_grouped(q, k, v, cache, self.window)
        return y.transpose(1, 2).reshape(b, t, -1)


class LlamaBlock(nn.Module):
    """Attention then the feed-forward, each after an RMSNorm and added to the residual; the
    feed-forward is a mixture of experts (models/moe.py) in the blocks `moe` says."""

    def __init__(self, cfg, moe: bool = False):
        super().__init__()
        self.ln1 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.rope_theta,
                              cfg.rope_scaling, cfg.qkv_bias, cfg.qk_norm, cfg.sliding_window,
                              cfg.norm_eps, cfg.head_dim)
        self.ln2 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MoE(cfg) if moe else SwiGLU(cfg.d_model, cfg.ffn_width)

    def forward(self, x: torch.Tensor, cache=None, positions: torch.Tensor | None = None):
        """`positions`: the tokens' positions; None (as a pipeline stage calls it): consecutive
        from the cache's length, counted on ln1's output (under Megatron sequence parallelism
        ln1 gathers the sequence: tensor_llama.py)."""
        x = x + self.attn(self.ln1(x), positions, cache)
        return x + self.mlp(self.ln2(x))


class Llama(nn.Module):
    """Built from a ModelConfig with name "llama" (models/config.py)."""

    def __init__(self, cfg):
        super().__init__()
        self.seq_len = cfg.seq_len
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(cfg, is_moe_layer(cfg, i))
                                    for i in range(cfg.n_layers))
        self.ln_f = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # under sequence parallelism: the global positions of the tokens `forward` gets
        self.position_ids: torch.Tensor | None = None
        self.apply(self._init)
        # output projections scaled as the GPT's (GPT-2): std 0.02 / sqrt(2 * n_layers), so the
        # residual stream's variance does not grow with depth
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))
        if cfg.tie_embeddings:  # after init: the embedding's N(0, 0.02) is the shared value
            self.head.weight = self.tok_emb.weight

    @staticmethod
    def _init(module: nn.Module) -> None:
        """Llama's N(0, 0.02) for every matrix and the embedding; zero biases (Qwen2's q/k/v);
        RMSNorm weights keep torch's ones."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, GroupedExperts):
            for p in module.parameters():
                nn.init.normal_(p, mean=0.0, std=0.02)

    def embed(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Token embeddings of `idx` (positions enter through the rotation, in attention);
        `start` is the GPT's signature, unused here."""
        return self.tok_emb(idx)

    def positions(self, t: int, start: int, device) -> torch.Tensor:
        """The positions of `t` tokens after `start` ones: `position_ids` when set (global
        positions of this rank's chunk under sequence parallelism)."""
        if self.position_ids is not None:
            return self.position_ids
        torch._assert(start + t <= self.seq_len, f"sequence of {start + t} tokens exceeds "
                      f"seq_len={self.seq_len}")
        return torch.arange(start, start + t, device=device)

    def forward(self, idx: torch.Tensor, cache=None) -> torch.Tensor:
        """Logits (b, t, vocab). With `cache`, `idx` continues the cached sequence (decoding)."""
        start = cache.length if cache is not None else 0
        positions = self.positions(idx.shape[1], start, idx.device)
        x = self.embed(idx, start)
        layers = cache.layers if cache is not None else [None] * len(self.blocks)
        for block, layer in zip(self.blocks, layers):
            x = block(x, layer, positions)
        if cache is not None:
            cache.advance(idx.shape[1])
        return self.head(self.ln_f(x))


__all__ = ["Llama", "LlamaBlock", "attend_grouped", "expand_kv", "rope_frequencies", "rotate",
           "window_mask"]
