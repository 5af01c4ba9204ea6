"""The llama model (models/llama.py): its parts against their definitions, the presets'
published sizes, decoding, and the engines that run it against the single-process run."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import tomli_w
import torch
from pydantic import ValidationError

from conftest import refused, tiny_tree
from harness import run_world
from loomtrain.cli import main
from loomtrain.inference.kvcache import KVCache
from loomtrain.inference.run_dir import GenerateRequest, decode
from loomtrain.models import Llama, build_model
from loomtrain.models.config import ModelConfig, RopeScaling, ffn_width
from loomtrain.models.llama import rope_frequencies, rotate, window_mask
from loomtrain.train.init_record import record_init
from loomtrain.train.materialize import materialize
from loomtrain.train.metrics import read_metrics
from test_zero import _train_many

TINY = {"name": "llama", "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
        "seq_len": 32, "vocab_size": 256}


def _model(seed=0, **keys) -> Llama:
    torch.manual_seed(seed)
    return build_model(ModelConfig(**{**TINY, **keys}))


def test_shapes_and_the_default_ffn_width():
    model = _model()
    attn = model.blocks[0].attn
    assert attn.q_proj.weight.shape == (32, 32) and attn.k_proj.weight.shape == (16, 32)
    assert model.blocks[0].mlp.gate_proj.weight.shape == (88, 32)  # 8/3 * 32 up to 8s
    assert ffn_width(4096) == 11008  # Llama 2 7B's: 8/3 * 4096 up to a multiple of 256
    assert not any(m.bias is not None for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model(torch.randint(0, 256, (2, 32))).shape == (2, 32, 256)


def test_grouped_query_attention_is_multi_head_with_repeated_kv_weights():
    gqa, mha = _model(), _model(n_kv_heads=0)
    state = gqa.state_dict()
    for name, w in list(state.items()):
        if name.endswith(("k_proj.weight", "v_proj.weight")):  # kv head j serves q heads 2j, 2j+1
            state[name] = w.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    idx = torch.randint(0, 256, (2, 32))
    torch.testing.assert_close(gqa(idx), mha(idx), rtol=0, atol=1e-6)


def test_rotation_by_position_is_relative():
    inv_freq = rope_frequencies(8, 10000.0)
    x = torch.randn(1, 1, 5, 8)
    p = torch.arange(5)
    # rotating by a then by b is rotating by a + b; position 0 is the identity
    torch.testing.assert_close(rotate(rotate(x, p, inv_freq), p + 3, inv_freq),
                               rotate(x, 2 * p + 3, inv_freq))
    torch.testing.assert_close(rotate(x, torch.zeros(5), inv_freq), x)
    # q . k depends only on the offset of their positions
    q, k = torch.randn(8), torch.randn(8)
    def score(i, j):
        return (rotate(q.view(1, 1, 1, 8), torch.tensor([i]), inv_freq)
                * rotate(k.view(1, 1, 1, 8), torch.tensor([j]), inv_freq)).sum()
    torch.testing.assert_close(score(7, 3), score(104, 100))
    assert not torch.isclose(score(7, 3), score(7, 4))


def test_llama3_scaling_keeps_high_frequencies_and_divides_low_ones():
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position=8192)
    plain, scaled = rope_frequencies(128, 500000.0), rope_frequencies(128, 500000.0, scaling)
    wavelength = 2 * math.pi / plain.double()
    high, low = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert high.sum() > 0 and low.sum() > 0 and (~high & ~low).sum() > 0
    assert torch.equal(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8)
    band = ~high & ~low  # interpolated: between the divided and the kept frequency
    assert ((scaled[band] > plain[band] / 8) & (scaled[band] < plain[band])).all()


def test_sliding_window_hides_tokens_beyond_the_window():
    mask = window_mask(torch.arange(6), torch.arange(6), 3)
    assert mask[5].tolist() == [False, False, False, True, True, True]
    assert mask[1].tolist() == [True, True, False, False, False, False]
    model = _model(n_layers=1, sliding_window=4).eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 0] = (idx[0, 0] + 1) % 256
    delta = (model(idx) - model(changed)).abs().amax(dim=-1)[0]
    assert (delta[:4] > 0).all() and (delta[4:] == 0).all()  # one layer sees 4 tokens back


def test_tied_head_saves_one_vocabulary_matrix():
    untied, tied = _model(), _model(tie_embeddings=True)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(untied) - count(tied) == 256 * 32
    assert tied.head.weight is tied.tok_emb.weight


# the published totals (model cards: 1.24B, 3.21B, 8.03B, 70.6B, 0.49B, 7.24B), exact from
# the shapes: embeddings (twice when untied), per layer q, k, v, o, the three SwiGLU matrices
# and two norms, the final norm (tests/test_planner_cost.py holds the planner's shapes to them)
PRESET_PARAMETERS = {"llama3-1b": 1_235_814_400, "llama3-3b": 3_212_749_824,
                     "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
                     "qwen2-0.5b": 494_032_768, "mistral-7b": 7_241_732_096}


@pytest.mark.parametrize("preset,parameters", PRESET_PARAMETERS.items())
def test_preset_parameter_counts(preset, parameters):
    with torch.device("meta"):
        model = build_model(ModelConfig(preset=preset))
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_presets_yield_to_explicit_keys_and_the_config_refuses_mismatches():
    cfg = ModelConfig(preset="llama3-8b", n_layers=2, rope_scaling={"factor": 4.0})
    assert (cfg.name, cfg.n_layers, cfg.d_model, cfg.n_kv_heads) == ("llama", 2, 4096, 8)
    assert cfg.rope_scaling.factor == 4.0 and cfg.rope_scaling.original_max_position == 8192
    for keys, words in [({"name": "gpt", "n_kv_heads": 2}, "model.n_kv_heads=2 is a key of the llama"),
                        ({"name": "gpt", "preset": "llama3-8b"}, "model.preset='llama3-8b' is a key"),
                        ({**TINY, "n_kv_heads": 3}, "must divide model.n_heads=4"),
                        ({"preset": "llama9"}, "not a known shape"),
                        ({**TINY, "mlp_ratio": 2}, "model.ffn_hidden")]:
        with pytest.raises(ValidationError, match=words):
            ModelConfig(**keys)


def test_meta_build_materializes_as_the_eager_build():
    keys = {**TINY, "rope_scaling": {"factor": 8.0, "original_max_position": 16},
            "qk_norm": True, "qkv_bias": True}
    eager = _model(**keys)
    torch.manual_seed(0)
    meta, record = record_init(lambda: build_model(ModelConfig(**{**TINY, **keys})))
    materialize(meta, record, "cpu")
    for (name, a), b in zip(eager.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(eager.blocks[1].attn.inv_freq, meta.blocks[1].attn.inv_freq)


def test_decoding_with_the_cache_equals_the_full_forward():
    # every switch on, a window shorter than the sequence: the mask meets the cache's offset
    model = _model(qk_norm=True, qkv_bias=True, sliding_window=5).eval()
    idx = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(len(model.blocks), model.seq_len)
        parts = [model(idx[:, :8], cache), model(idx[:, 8:12], cache)]  # prefill, a chunk
        parts += [model(idx[:, i:i + 1], cache) for i in range(12, 20)]  # one token at a time
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)
    assert cache.layers[0].k.shape[1] == 2  # the cache holds the kv heads, not the q heads


ENGINES = {  # name -> (the [parallel] keys on 2 ranks, the single-process run it must equal)
    "dp2": ({}, "adamw"),
    "zero3": ({"zero_stage": 3}, "adamw"),
    "pp2_1f1b_selective": ({"pp": 2, "schedule": "1f1b", "recompute": "selective"}, "adamw"),
    "local_sgd": ({}, "sgd"),
}
# plain SGD (no momentum, no clipping): local SGD with H = 1 averages the replicas' updates,
# which is then the update of the averaged gradient (tests/test_lowcomm.py)
SGD = {"optimizer": "sgd", "beta1": 0.0, "grad_clip": 0.0, "lr": 0.5}


def test_engines_match_the_single_process_run(tmp_path, corpus):
    def tree(world, train=None, **sections):
        return tiny_tree(tmp_path, corpus, model=TINY, train={"steps": 12, **(train or {})},
                         parallel={"nproc": world, **sections.pop("parallel", {})}, **sections)
    references = dict(zip(("adamw", "sgd"), run_world(
        _train_many, 1, [tree(1), tree(1, SGD)], str(tmp_path / "w1"), timeout_s=240)[0]))
    trees = [tree(2, SGD if ref == "sgd" else None, parallel=keys,
                  lowcomm={"algorithm": "local_sgd"} if name == "local_sgd" else {})
             for name, (keys, ref) in ENGINES.items()]
    curves = run_world(_train_many, 2, trees, str(tmp_path / "w2"), timeout_s=240)[0]
    for reference in references.values():
        assert len(reference) == 12 and reference[-1] < reference[0] - 0.3  # it learns
    for (name, (_, ref)), losses in zip(ENGINES.items(), curves):
        # fp32 sums in another order (per-rank partial sums, then a reduction) differ in the
        # last bits; over 12 steps that stays far below 1e-4 relative, the bound of the GPT's
        # oracle (tests/test_data_parallel.py)
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, references[ref]))
        assert rel < 1e-4, (name, rel, losses, references[ref])


def test_loom_train_and_generate_a_llama_run(tmp_path, corpus, capsys):
    tree = tiny_tree(tmp_path, corpus, model=TINY, train={"steps": 3}, checkpoint={"every": 3})
    path = tmp_path / "llama.toml"
    path.write_text(tomli_w.dumps(tree))
    proc = subprocess.run([sys.executable, "-m", "loomtrain", "train", str(path), "--nproc", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "runs" / "t"
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
    out = decode(GenerateRequest(str(run_dir), "def ", 5, 0.0, None, 0))
    assert out["new_tokens"] == 5
    assert "model.n_heads=4: choose among [1, 2, 4]" in refused(
        capsys, ["generate", str(run_dir), "--tp", "3"])  # --tp 2: tests/test_generate.py
    assert 'cp_method="auto" rewrites the GPT' in refused(capsys, [
        "train", str(path), "--set", "parallel.cp=2", "--set", "parallel.cp_method=auto",
        "--nproc", "2"])
    assert main(["train", str(path), "--dry-run"]) == 0  # activations.py's llama formula
    assert "model: llama, " in capsys.readouterr().out
