"""The library API on Hugging Face models and any user model: `layers_of` cuts HF decoders
(Llama, Qwen2, Mistral, GPT-2) into pipeline layers that compute the model's logits, a
2-stage pipeline over a HF Llama and over GPT-2 (tied head) trains as one process does,
stage shapes come from a real micro-batch when the meta device cannot run a layer, and
tensor-parallel plans (the HF Llama and GPT-2 plans, fused projections as "column:N") are
checked and match the unsplit model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_world
from loomtrain.mesh import build_mesh
from loomtrain.parallel import GPT2_HF_PLAN, LLAMA_HF_PLAN
from loomtrain.parallel.data import DataParallel
from loomtrain.parallel.pipeline import pipeline, schedules
from loomtrain.parallel.pipeline.split import Layer, layers_of, stage_shapes
from loomtrain.parallel.tensor import fused_rows, parallelize_tensor

transformers = pytest.importorskip("transformers", reason="the Hugging Face API tests need transformers")

VOCAB, T = 64, 8
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


def _hf(kind: str, attn: str = "sdpa", **overrides) -> nn.Module:
    """A tiny HF decoder with fixed weights, in eval mode (no dropout)."""
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4,
                                         n_positions=32, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config).eval()
    configs = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}
    config_cls, model_cls = configs[kind]
    config = config_cls(**{**SMALL, **overrides})
    config._attn_implementation = attn
    return model_cls(config).eval()


def _tokens(seed: int, rows: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, T), generator=torch.Generator().manual_seed(seed))


# fp32 on one CPU: the layers run the model's own modules, the same ops in the same order; the
# mask and rotary tables are built the same way, so 1e-5 leaves room only for the eager and
# sdpa kernels' reduction order
@pytest.mark.parametrize("kind,attn,overrides", [
    ("llama", "sdpa", {}), ("llama", "eager", {}), ("qwen2", "sdpa", {}),
    ("mistral", "eager", {"sliding_window": 3}),  # the window is shorter than the sequence
    ("gpt2", "sdpa", {})])
def test_the_layers_of_a_hf_decoder_compute_its_logits(kind, attn, overrides):
    model = _hf(kind, attn, **overrides)
    x = _tokens(1)
    with torch.no_grad():
        y = x
        for layer in layers_of(model):
            y = layer.run(model, y)
        torch.testing.assert_close(y, model(x).logits, rtol=1e-5, atol=1e-5)
    names = [layer.name for layer in layers_of(model)]
    assert names[0] == "embed" and names[-1] == "head" and len(names) == 5


def test_hf_stage_shapes_are_the_hidden_states_and_the_logits():
    model = _hf("llama")
    layers = layers_of(model)
    shapes = stage_shapes(model, layers, [0, 2, len(layers)], _tokens(1))
    assert shapes == [(torch.Size([2, T, 32]), torch.float32), (torch.Size([2, T, VOCAB]), torch.float32)]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = [_tokens(10 * step + m) for m in range(4)]
    return [(t, t.roll(-1, dims=1)) for t in tokens]


# pipeline cases: (kind, config overrides). GPT-2 ties its head to the embedding: stage 0
# holds the embedding, stage 1 the head, one parameter whose gradient must be summed over both
# (found by identity, as for a tied Llama: split.shared_parameters)
PIPELINES = {"llama": ("llama", {}), "gpt2-tied": ("gpt2", {})}


def _hf_pipeline(rank, world):
    """Each case's HF model trained 2 steps on pp=2 (1F1B, 4 micro-batches): {case: (the
    last stage's losses, this rank's parameters)}."""
    mesh = build_mesh({"pp": world})
    results = {}
    for case, (kind, overrides) in PIPELINES.items():
        model = _hf(kind, **overrides)
        module = pipeline(model, mesh, schedules.build("1f1b", world, 4), _tokens(0))
        wrapped = DataParallel(module, mesh, gradient_reduce="sum")
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        losses = []
        for step in range(2):
            losses.append(float(module.runtime.train_step(wrapped, _batches(step), 4.0 * 2 * T, _loss)))
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        results[case] = losses, {k: v.clone() for k, v in module.state_dict().items()}
    return results


def _trained_on_one_process(model) -> list[float]:
    """`model` trained as `_hf_pipeline` trains it, in one process; its step losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for step in range(2):
        total = 0.0
        for x, y in _batches(step):
            loss = _loss(model(x).logits, y)
            (loss / (4.0 * 2 * T)).backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        expected.append(total)
    return expected


def test_hf_pipelines_tied_or_not_train_as_on_one_process():
    results = run_world(_hf_pipeline, 2, timeout_s=120)
    for case, (kind, overrides) in PIPELINES.items():
        model = _hf(kind, **overrides)
        expected = _trained_on_one_process(model)
        # fp32, the same ops split across two processes: sums of 64 token losses agree to 1e-5
        assert results[1][case][0] == pytest.approx(expected, rel=1e-5), case
        merged = {**results[0][case][1], **results[1][case][1]}
        assert set(merged) == set(model.state_dict()), case  # the rotary table is not saved
        # a tied weight is saved by both stages (embedding and head names): each copy must be
        # the single process's, which only the sum of both stages' gradients gives
        for name, value in model.state_dict().items():
            torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-5, msg=f"{case}: {name}")


class Routed(nn.Module):
    """Top-1 mixture-of-experts routing: `torch.nonzero` on the router's choice, which the
    meta device cannot run (its output size depends on the values)."""

    def __init__(self):
        super().__init__()
        self.router, self.experts = nn.Linear(4, 2), nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = torch.nonzero(choice == e).squeeze(-1)
            out[rows] = expert(x[rows])
        return out


def test_stage_shapes_come_from_a_real_micro_batch_when_meta_cannot_run_a_layer():
    model = nn.Sequential(nn.Linear(3, 4), Routed(), nn.Linear(4, 5))
    with pytest.raises((NotImplementedError, RuntimeError)):
        copy.deepcopy(model).to("meta")(torch.zeros(6, 3, device="meta"))
    layers = layers_of(model)
    assert stage_shapes(model, layers, [0, 2, 3], torch.randn(6, 3)) == [
        (torch.Size([6, 4]), torch.float32), (torch.Size([6, 5]), torch.float32)]
    with torch.device("meta"):
        on_meta = nn.Sequential(nn.Linear(3, 4), Routed(), nn.Linear(4, 5))
    assert stage_shapes(on_meta, layers_of(on_meta), [0, 2, 3], torch.randn(6, 3))[1] == (
        torch.Size([6, 5]), torch.float32)


class FusedMLP(nn.Module):
    """Phi-3's MLP: gate and up in one fused projection."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Linear(6, 2 * 8), nn.Linear(8, 5)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def _refused(make, plan, mesh) -> str:
    with pytest.raises(ValueError) as err:
        parallelize_tensor(make(), mesh, plan)
    return str(err.value)


def _tensor_plans(rank, world):
    """On tp=2: the fused MLP split by column:2 and the HF Llama by LLAMA_HF_PLAN against the
    unsplit models (outputs and, for the fused MLP, gradients), then the refusals."""
    mesh = build_mesh({"tp": world})
    torch.manual_seed(0)
    reference = FusedMLP()
    model = parallelize_tensor(copy.deepcopy(reference), mesh,
                               {"gate_up_proj": "column:2", "down_proj": "row"})
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    out, expected = model(x), reference(x)
    out.square().sum().backward()
    expected.square().sum().backward()
    mine = torch.arange(rank * 4, (rank + 1) * 4)
    rows = torch.cat([mine, mine + 8])  # my quarter of gate, my quarter of up
    checks = [torch.allclose(out, expected, atol=1e-6),
              torch.allclose(model.gate_up_proj.weight.grad, reference.gate_up_proj.weight.grad[rows], atol=1e-6),
              torch.allclose(model.down_proj.weight.grad, reference.down_proj.weight.grad[:, mine], atol=1e-6)]
    llama = _hf("llama")
    split = parallelize_tensor(copy.deepcopy(llama), mesh, LLAMA_HF_PLAN)
    tokens = _tokens(3)
    with torch.no_grad():
        checks.append(torch.allclose(split(tokens).logits, llama(tokens).logits, atol=1e-5))
    checks += _gpt2_split(rank, world, mesh, tokens)
    messages = [
        _refused(FusedMLP, {"gate_up_proj": "column", "down_proj": "row"}, mesh),
        _refused(FusedMLP, {"gate_up_proj": "column:2", "*.nowhere": "row"}, mesh),
        _refused(lambda: _hf("llama", num_attention_heads=3, num_key_value_heads=3, hidden_size=24),
                 LLAMA_HF_PLAN, mesh),
        _refused(FusedMLP, {"gate_up_proj": "column:x"}, mesh),
        _refused(lambda: _hf("gpt2"), {**GPT2_HF_PLAN, "*.attn.c_attn": "column"}, mesh),
        _refused(FusedMLP, {"gate_up_proj": "column:2", "down_proj": "row", "": "row"}, mesh)]
    return checks, messages


def _gpt2_split(rank, world, mesh, tokens) -> list[bool]:
    """GPT-2 split by GPT2_HF_PLAN (Conv1D layers, c_attn as column:3) against the unsplit
    model: the logits, and c_attn's weight gradient, (in, out) as Conv1D keeps it, equal to
    the columns of my q, k and v heads."""
    reference = _hf("gpt2")
    split = parallelize_tensor(copy.deepcopy(reference), mesh, GPT2_HF_PLAN)
    out, expected = split(tokens).logits, reference(tokens).logits
    out.square().sum().backward()
    expected.square().sum().backward()
    mine = fused_rows(3 * 32, 3, rank, world, "c_attn")
    got = split.transformer.h[0].attn.c_attn.weight.grad
    want = reference.transformer.h[0].attn.c_attn.weight.grad[:, mine]
    # fp32: the split sums the heads' contributions in another order; on gradients of size
    # ~0.7 the differences measured 4e-7
    return [torch.allclose(out, expected, atol=1e-5),
            got.shape == want.shape and torch.allclose(got, want, atol=1e-5)]


def test_tensor_plans_split_fused_and_hf_models_and_refuse_what_cannot_run():
    checks, messages = run_world(_tensor_plans, 2, timeout_s=120)[0]
    assert all(checks), checks
    assert "fused" in messages[0] and "column:N" in messages[0]
    assert "'*.nowhere' splits no module" in messages[1]
    assert "num_heads = 3 is not divisible by the tensor-parallel size 2" in messages[2]
    assert "'column:x'" in messages[3]
    assert "transformer.h.0.attn.c_attn looks like a fused projection" in messages[4]
    assert "is a FusedMLP, not an nn.Linear or a Conv1D" in messages[5]


def test_a_model_layers_of_cannot_read_is_refused_naming_hf_decoders():
    with pytest.raises(TypeError, match="Hugging Face decoder"):
        layers_of(nn.Linear(2, 2))
    assert isinstance(layers_of(nn.Sequential(nn.Linear(2, 2)))[0], Layer)
