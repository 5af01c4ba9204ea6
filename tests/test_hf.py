"""Hugging Face checkpoints (models/hf.py): tiny transformers models built from configs (never
downloaded) with random weights give the logits of the loomtrain model `from_hf` makes of their
saved folder, and a loomtrain model written by `to_hf` loads in transformers with its logits.

Tolerance 1e-5 in fp32: the two implementations compute the same operations in different
orders (fused vs separate projections, SDPA vs transformers' attention), a few ulps of logits
of size ~1 after two layers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="Hugging Face interop tests need "
                                   "transformers: pip install transformers")

from loomtrain.models import build_model  # noqa: E402
from loomtrain.models.config import ModelConfig  # noqa: E402
from loomtrain.models.hf import from_hf, hf_keys, to_hf  # noqa: E402

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
    # Qwen3's published head_dim (128) exceeds hidden_size / heads: here 16 > 32 / 4
    "qwen3-wide-heads": lambda: transformers.Qwen3Config(**{**LLAMA, "head_dim": 16}),
    # position interpolation: every rotary frequency / 4
    "llama-linear-rope": lambda: transformers.LlamaConfig(**LLAMA, rope_scaling={
        "rope_type": "linear", "factor": 4.0}),
    # a window of 5 inside the 12-token test sequence: the mask matters
    "mistral": lambda: transformers.MistralConfig(**LLAMA, sliding_window=5),
    # mixtures of experts: random routers over 4 experts, 2 per token, so every path is used
    "mixtral": lambda: transformers.MixtralConfig(**LLAMA, num_local_experts=4,
                                                  num_experts_per_tok=2),
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(
        **LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=48, decoder_sparse_step=2, norm_topk_prob=False),
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**LLAMA, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=24, norm_topk_prob=True),
    "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                            vocab_size=64, activation_function="gelu"),
    # the published GPT-2's activation, the tanh GELU (the exact one's logits: 1.1e-4 off here)
    "gpt2-gelu_new": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4,
                                                     n_positions=16, vocab_size=64,
                                                     activation_function="gelu_new"),
}


def _hf_model(kind: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[kind]()).eval()
    with torch.no_grad():  # random norms and biases too, so a misplaced one shows
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _saved(kind: str, path):
    _hf_model(kind).save_pretrained(path)
    return path


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


def _edited(kind: str, path, **changes):
    """The saved folder of `kind` with its config.json's keys updated by `changes`."""
    _saved(kind, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path


@pytest.mark.parametrize("name,activation", [("gelu", "gelu"), ("gelu_new", "gelu_tanh"),
                                             ("gelu_pytorch_tanh", "gelu_tanh")])
def test_gpt2_activations_map_to_the_gpt_s_gelus(name, activation, tmp_path):
    assert hf_keys(_edited("gpt2", tmp_path, activation_function=name))["activation"] == activation


def test_other_gpt2_activations_are_refused(tmp_path):
    with pytest.raises(ValueError, match="activation_function='relu' is not mapped.*gelu_new"):
        from_hf(_edited("gpt2", tmp_path, activation_function="relu"))


@pytest.mark.parametrize("kind", ["dynamic", "yarn", "longrope"])
def test_other_rope_types_are_refused_by_name(kind, tmp_path):
    with pytest.raises(ValueError, match=f"rope_type='{kind}' is not mapped"):
        from_hf(_edited("llama", tmp_path, rope_scaling=None, rope_parameters={
            "rope_type": kind, "factor": 2.0, "rope_theta": 10000.0}))


# a Llama whose vocabulary is the run's bpe:300 tokenizer's, for `loom train` to start from
RUN_LLAMA = dict(LLAMA, vocab_size=300, num_attention_heads=4, num_key_value_heads=2,
                 tie_word_embeddings=True)
RUN_MODEL = {"name": "llama", "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
             "ffn_hidden": 48, "norm_eps": 1e-6, "tie_embeddings": True, "seq_len": 32,
             "vocab_size": 300}


def _run_config(root, corpus, **model) -> str:
    from conftest import tiny_tree
    from loomtrain.train.config import config_from_dict, config_to_toml

    path = root / "run.toml"
    path.write_text(config_to_toml(config_from_dict(tiny_tree(
        root, corpus, model={**RUN_MODEL, **model}, data={"tokenizer": "bpe:300"},
        train={"steps": 2, "init_from": str(root / "hf_in")}, checkpoint={"every": 2}))))
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """A 2-step, 1-process `loom train` from a transformers Llama's folder, then exported by
    `loom export --to hf`: (run folder, export folder)."""
    root = tmp_path_factory.mktemp("hf_run")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**RUN_LLAMA)).save_pretrained(root / "hf_in")
    env = {**os.environ, "XDG_CACHE_HOME": str(root / "cache"), "OMP_NUM_THREADS": "1"}
    loom = [sys.executable, "-m", "loomtrain"]
    proc = subprocess.run([*loom, "train", _run_config(root, corpus)], capture_output=True, text=True,
                          timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    run_dir = root / "runs" / "t"
    proc = subprocess.run([*loom, "export", str(run_dir), "--to", "hf"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(run_dir / "hf")
    return run_dir, run_dir / "hf"


def test_export_to_hf_of_a_run_loads_in_transformers(trained):
    from loomtrain.train import checkpoint
    from loomtrain.train.config import load_config

    run_dir, out = trained
    model = build_model(load_config(run_dir / "config.toml").model).eval()
    model.load_state_dict(checkpoint.load_model_state(checkpoint.list_checkpoints(run_dir)[-1]))
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, model(tokens), atol=TOL, rtol=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer.encode("def f(x):\n    return x")) == "def f(x):\n    return x"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_init_from_a_hf_folder_starts_from_its_weights(trained):
    from loomtrain.train.config import load_config
    from loomtrain.train.init_from import load_init_weights

    run_dir, _ = trained
    cfg = load_config(run_dir / "config.toml")
    model = build_model(cfg.model).eval()
    assert load_init_weights(model, cfg) == (run_dir.parent.parent / "hf_in", 0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(run_dir.parent.parent / "hf_in").eval()
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=TOL, rtol=0)


def test_init_from_a_hf_folder_of_another_shape_is_refused(trained, corpus, tmp_path, capsys, monkeypatch):
    from conftest import refused

    run_dir, _ = trained
    monkeypatch.setenv("XDG_CACHE_HOME", str(run_dir.parent.parent / "cache"))
    (tmp_path / "hf_in").symlink_to(run_dir.parent.parent / "hf_in")
    err = refused(capsys, ["train", _run_config(tmp_path, corpus, d_model=64, qkv_bias=True)])
    assert "Hugging Face model" in err and "model.d_model=32 (this run: 64)" in err
    assert "model.qkv_bias=False (this run: True)" in err


@pytest.mark.parametrize("change, says", [
    ({"router": "sigmoid"}, "DeepSeek-V3"),
    ({"moe_every": 2}, "Mixtral's layers are all MoE"),
    ({"n_shared_experts": 1}, "shared experts without Qwen2-MoE's gate"),
])
def test_experts_no_hf_family_has_are_refused_on_export(change, says, tmp_path):
    cfg = ModelConfig(name="llama", d_model=32, n_layers=2, n_heads=4, seq_len=16, vocab_size=64,
                      n_experts=4, **change)
    with pytest.raises(ValueError, match=says):
        to_hf(build_model(cfg), cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_trained_routing_bias_is_refused_on_export(tmp_path):
    cfg = ModelConfig(name="llama", d_model=32, n_layers=2, n_heads=4, seq_len=16, vocab_size=64,
                      n_experts=4)
    model = build_model(cfg)
    model.blocks[1].mlp.router.expert_bias[0] = 0.01
    with pytest.raises(ValueError, match="blocks.1.mlp.router.expert_bias is not zero"):
        to_hf(model, cfg, tmp_path / "out")


def test_qwen_moe_dense_layers_by_list_are_refused(tmp_path):
    path = _edited("qwen3-moe", tmp_path, mlp_only_layers=[0])
    with pytest.raises(ValueError, match="mlp_only_layers"):
        hf_keys(path)
