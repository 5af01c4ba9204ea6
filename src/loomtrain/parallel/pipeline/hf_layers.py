"""Hugging Face decoder models read as pipeline layers (embed, each decoder layer, final norm
and head), found by structure, not by class: Llama-style models (Llama, Qwen2, Mistral:
`model.embed_tokens`, `model.layers`, `model.norm`, `model.rotary_emb`, `lm_head`) and GPT-2
(`transformer.wte/wpe/h/ln_f`, `lm_head`). A stage passes only the hidden state between
layers, so each layer callable rebuilds what its decoder layer needs from it: positions
0..t-1, the causal mask and, for Llama-style layers, the rotary (cos, sin). Limits:
docs/pipeline.md, "Hugging Face models".
"""

from __future__ import annotations

import torch
import torch.nn as nn

from loomtrain.parallel.pipeline.layer import Layer


def causal_mask(x: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The additive (1, 1, t, t) mask of `x` (batch, t, d): query i sees keys j <= i (and
    i - j < `window`, a sliding-window layer's). Explicit rather than None: eager attention
    treats a missing mask as "see everything"."""
    t = x.shape[1]
    i = torch.arange(t, device=x.device)
    seen = i[None, :] <= i[:, None]
    if window is not None:
        seen &= i[:, None] - i[None, :] < window
    mask = torch.zeros(t, t, dtype=x.dtype, device=x.device)
    return mask.masked_fill(~seen, torch.finfo(x.dtype).min)[None, None]


def _positions(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[1], device=x.device)[None]


def _hidden(out):
    """A decoder layer's hidden state (transformers < 5 returned a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def _llama_style(model: nn.Module) -> list[Layer]:
    window = getattr(model.config, "sliding_window", None)

    def block(m, x, i):
        inner = m.model
        layer = inner.layers[i]
        full = getattr(layer, "attention_type", None) == "full_attention"
        positions = _positions(x)
        return _hidden(layer(x, attention_mask=causal_mask(x, None if full else window),
                             position_ids=positions,
                             position_embeddings=inner.rotary_emb(x, positions)))

    blocks = [Layer(f"model.layers.{i}", (f"model.layers.{i}", "model.rotary_emb"),
                    lambda m, x, i=i: block(m, x, i)) for i in range(len(model.model.layers))]
    return [Layer("embed", ("model.embed_tokens",), lambda m, x: m.model.embed_tokens(x)),
            *blocks,
            Layer("head", ("model.norm", "lm_head"), lambda m, x: m.lm_head(m.model.norm(x)))]


def _gpt2(model: nn.Module) -> list[Layer]:
    def embed(m, idx):
        t = m.transformer
        return t.drop(t.wte(idx) + t.wpe(_positions(idx)))

    blocks = [Layer(f"transformer.h.{i}", (f"transformer.h.{i}",),
                    lambda m, x, i=i: _hidden(m.transformer.h[i](x, attention_mask=causal_mask(x))))
              for i in range(len(model.transformer.h))]
    return [Layer("embed", ("transformer.wte", "transformer.wpe", "transformer.drop"), embed),
            *blocks,
            Layer("head", ("transformer.ln_f", "lm_head"),
                  lambda m, x: m.lm_head(m.transformer.ln_f(x)))]


def _has(module: nn.Module, *names: str) -> bool:
    return all(hasattr(module, n) for n in names)


def hf_layers(model: nn.Module) -> list[Layer] | None:
    """`model`'s layers if it has a Hugging Face decoder's structure, else None."""
    if not hasattr(model, "lm_head"):
        return None
    inner = getattr(model, "model", None)
    if inner is not None and _has(inner, "embed_tokens", "layers", "norm", "rotary_emb"):
        if getattr(model.config, "final_logit_softcapping", None) is not None:
            raise TypeError(f"{type(model).__name__} soft-caps its logits outside its layers "
                            "(Gemma 2): define pipeline_layers() for it")
        return _llama_style(model)
    inner = getattr(model, "transformer", None)
    if inner is not None and _has(inner, "wte", "wpe", "h", "ln_f", "drop"):
        return _gpt2(model)
    return None
