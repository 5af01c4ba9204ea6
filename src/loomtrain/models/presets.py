"""Named shapes of published Llama-family models for `model.preset` (models/config.py): a
preset sets these [model] keys, and keys given explicitly in the config override it.

Each entry is the model's published config.json on the Hugging Face Hub (the field names it
uses: hidden_size -> d_model, num_hidden_layers -> n_layers, num_attention_heads -> n_heads,
num_key_value_heads -> n_kv_heads, intermediate_size -> ffn_hidden, rms_norm_eps -> norm_eps,
tie_word_embeddings -> tie_embeddings, rope_scaling's original_max_position_embeddings ->
original_max_position). seq_len is the run's choice, not the preset's.
"""

from __future__ import annotations

# Llama 3.1's frequency scaling (meta-llama/Llama-3.1-8B config.json, "rope_type": "llama3")
_LLAMA31_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position": 8192}
# Llama 3.2 1B and 3B stretch the same 8192-token base further (their config.json)
_LLAMA32_SCALING = {**_LLAMA31_SCALING, "factor": 32.0}
_LLAMA3 = {"name": "llama", "vocab_size": 128256, "rope_theta": 500000.0, "norm_eps": 1e-5}

PRESETS: dict[str, dict] = {
    # a tiny model for tests and smoke runs, with grouped-query attention (2 heads per kv head)
    "llama-debug": {"name": "llama", "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                    "ffn_hidden": 176, "vocab_size": 256, "rope_theta": 10000.0,
                    "tie_embeddings": False},
    # meta-llama/Llama-3.2-1B
    "llama3-1b": {**_LLAMA3, "d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8,
                  "ffn_hidden": 8192, "rope_scaling": _LLAMA32_SCALING, "tie_embeddings": True},
    # meta-llama/Llama-3.2-3B
    "llama3-3b": {**_LLAMA3, "d_model": 3072, "n_layers": 28, "n_heads": 24, "n_kv_heads": 8,
                  "ffn_hidden": 8192, "rope_scaling": _LLAMA32_SCALING, "tie_embeddings": True},
    # meta-llama/Llama-3.1-8B
    "llama3-8b": {**_LLAMA3, "d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8,
                  "ffn_hidden": 14336, "rope_scaling": _LLAMA31_SCALING, "tie_embeddings": False},
    # meta-llama/Llama-3.1-70B
    "llama3-70b": {**_LLAMA3, "d_model": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8,
                   "ffn_hidden": 28672, "rope_scaling": _LLAMA31_SCALING,
                   "tie_embeddings": False},
    # Qwen/Qwen2-0.5B: biases on q, k and v (Qwen2's only structural difference from Llama)
    "qwen2-0.5b": {"name": "llama", "d_model": 896, "n_layers": 24, "n_heads": 14,
                   "n_kv_heads": 2, "ffn_hidden": 4864, "vocab_size": 151936,
                   "rope_theta": 1000000.0, "norm_eps": 1e-6, "tie_embeddings": True,
                   "qkv_bias": True},
    # mistralai/Mistral-7B-v0.1: attention over the last 4096 tokens (v0.2 and later drop it)
    "mistral-7b": {"name": "llama", "d_model": 4096, "n_layers": 32, "n_heads": 32,
                   "n_kv_heads": 8, "ffn_hidden": 14336, "vocab_size": 32000,
                   "rope_theta": 10000.0, "norm_eps": 1e-5, "tie_embeddings": False,
                   "sliding_window": 4096},
}


def with_preset(keys: dict) -> dict:
    """The [model] keys `keys` (as given) completed by the preset they name: a key given
    explicitly wins. Keys without a known preset come back unchanged (validation names it)."""
    preset = PRESETS.get(keys.get("preset"))
    if preset is None:
        return keys
    return {**preset, **keys}


__all__ = ["PRESETS", "with_preset"]
