"""Hugging Face checkpoints (models/hf.py): tiny transformers models built from configs (never
downloaded) with random weights give the logits of the loomtrain model `from_hf` makes of their
saved folder, and a loomtrain model written by `to_hf` loads in transformers with its logits.

Tolerance 1e-5 in fp32: the two implementations compute the same operations in different
orders (fused vs separate projections, SDPA vs transformers' attention), a few ulps of logits
of size ~1 after two layers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="Hugging Face interop tests need "
                                   "transformers: pip install transformers")

from loomtrain.models import build_model  # noqa: E402
from loomtrain.models.config import ModelConfig  # noqa: E402
from loomtrain.models.hf import from_hf, to_hf  # noqa: E402

TOL = 1e-5
LLAMA = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, intermediate_size=48, vocab_size=64, max_position_embeddings=64,
             rms_norm_eps=1e-6)
HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**LLAMA, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "llama-tied": lambda: transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(**LLAMA, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**LLAMA),
    # a window of 5 inside the 12-token test sequence: the mask matters
    "mistral": lambda: transformers.MistralConfig(**LLAMA, sliding_window=5),
    "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                            vocab_size=64, activation_function="gelu"),
}


def _hf_model(kind: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[kind]()).eval()
    with torch.no_grad():  # random norms and biases too, so a misplaced one shows
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def _loom_model(keys: dict, state: dict):
    model = build_model(ModelConfig(**{"seq_len": 16, **keys})).eval()
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("kind", HF_CONFIGS)
def test_from_hf_logits_equal_transformers(kind, tmp_path):
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path)
    keys, state = from_hf(tmp_path)
    ours = _loom_model(keys, state)
    with torch.no_grad():
        torch.testing.assert_close(ours(_tokens()), hf(_tokens()).logits, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", HF_CONFIGS)
def test_to_hf_loads_in_transformers_with_equal_logits(kind, tmp_path):
    keys, state = from_hf(_saved(kind, tmp_path / "src"))
    cfg = ModelConfig(**{"seq_len": 16, **keys})
    ours = _loom_model(keys, state)
    to_hf(ours, cfg, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(_tokens()).logits, ours(_tokens()), atol=TOL, rtol=0)
    assert type(back).__name__ == type(_hf_model(kind)).__name__


def _saved(kind: str, path):
    _hf_model(kind).save_pretrained(path)
    return path


def test_sharded_checkpoint_reads_as_the_single_file(tmp_path):
    hf = _hf_model("llama")
    hf.save_pretrained(tmp_path / "one")
    hf.save_pretrained(tmp_path / "shards", max_shard_size="20KB")
    assert (tmp_path / "shards" / "model.safetensors.index.json").is_file()
    keys, state = from_hf(tmp_path / "one")
    sharded_keys, sharded = from_hf(tmp_path / "shards")
    assert sharded_keys == keys and sharded.keys() == state.keys()
    assert all(torch.equal(sharded[k], state[k]) for k in state)


def test_unknown_architecture_is_refused(tmp_path):
    _saved("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["FalconForCausalLM"],
                                                      "model_type": "falcon"}))
    with pytest.raises(ValueError, match="FalconForCausalLM.*is not mapped"):
        from_hf(tmp_path)


def test_gelu_new_gpt2_is_refused(tmp_path):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2,
                                                              n_positions=8, vocab_size=32))
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="activation_function='gelu_new'"):
        from_hf(tmp_path)
