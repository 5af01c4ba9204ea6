"""Causal linear attention (models/linear_attention.py) and the GPT built on it: the chunked
kernel against the quadratic reference, gradients, training, and the config keys."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from loomtrain.models import GPT, build_model, token_loss_sum
from loomtrain.models.linear_attention import (causal_linear_attention, default_decay,
                                               document_starts, feature_map,
                                               naive_linear_attention)
from loomtrain.models.config import ModelConfig
from loomtrain.train.config import Config

B, H, T, D = 2, 3, 24, 8
# row 0: a boundary at 8 (a chunk edge for chunks of 4 and 8) and one at 13 (inside chunks);
# row 1: one document, then a one-token document at the end
DOCS = torch.tensor([[0] * 8 + [1] * 5 + [2] * 11, [7] * 23 + [3]])


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    return feature_map(q), feature_map(k), v


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("decayed", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_equals_the_quadratic_form_in_value_and_gradient(decayed, packed):
    decay = default_decay(H) if decayed else None
    docs = DOCS if packed else None
    q, k, v = _inputs()
    upstream = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(9))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    reference = naive_linear_attention(*leaves, decay, docs)
    reference.backward(upstream)
    want = [x.grad for x in leaves]
    # 1: one token per chunk (pure recurrence); 5: does not divide 24; 64: one chunk
    for chunk in (1, 4, 5, 8, 64):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = causal_linear_attention(*leaves, decay, docs, chunk)
        out.backward(upstream)
        # fp32 sums of <= 24 positive terms regrouped by chunk: ~1e-7 relative rounding
        assert _relative(out, reference) < 1e-5, chunk
        for got, expected in zip((x.grad for x in leaves), want):
            assert _relative(got, expected) < 1e-5, chunk


def test_documents_do_not_see_each_other():
    q, k, v = _inputs()
    out = causal_linear_attention(q, k, v, default_decay(H), DOCS, chunk=5)
    v2 = v.clone()
    v2[0, :, :8] += 1.0  # only document 0 of row 0 changes
    out2 = causal_linear_attention(q, k, v2, default_decay(H), DOCS, chunk=5)
    assert torch.equal(out[0, :, 8:], out2[0, :, 8:]) and torch.equal(out[1], out2[1])
    assert not torch.allclose(out[0, :, :8], out2[0, :, :8])


def test_a_document_id_that_returns_is_refused():
    with pytest.raises(AssertionError, match="two separate runs"):
        document_starts(torch.tensor([[0, 0, 1, 1, 0]]))


def _tiny_gpt(**kwargs) -> GPT:
    torch.manual_seed(0)
    return GPT(32, 16, 32, 2, 4, **kwargs)


def test_softmax_gpt_is_unchanged_by_the_new_keys():
    x = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    plain, explicit = _tiny_gpt(), _tiny_gpt(attention="softmax", linear_decay=False)
    assert torch.equal(plain(x), explicit(x))
    # same parameters as the softmax GPT, and the decays are no checkpoint entry
    linear = _tiny_gpt(attention="linear", linear_decay=True)
    assert linear.state_dict().keys() == plain.state_dict().keys()
    assert linear.blocks[0].attn.decay.shape == (4,)


def test_linear_gpt_learns_and_its_paths_agree():
    model = _tiny_gpt(attention="linear", linear_decay=True)
    x = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(2))
    inputs, targets = x[:, :-1], x[:, 1:]
    # the hook receives phi(q), phi(k) (positive) and wins over the built-in kernel
    seen = []

    def core(q, k, v):
        seen.append(bool((q > 0).all() and (k > 0).all()))
        return causal_linear_attention(q, k, v, model.blocks[0].attn.decay, chunk=3)
    reference = model(inputs)
    for block in model.blocks:
        block.attn.core = core
    assert torch.allclose(model(inputs), reference, atol=1e-6) and seen == [True, True]
    for block in model.blocks:
        block.attn.core, block.attn.recompute_core = None, True
    assert torch.allclose(model(inputs), reference, atol=1e-6)
    with pytest.raises(NotImplementedError, match="KV cache"):
        model.blocks[0].attn(torch.zeros(1, 1, 32), cache=object())

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = token_loss_sum(model(inputs), targets) / targets.numel()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # a fixed batch: memorizing it takes the loss from ln(32) = 3.47 well down
    assert losses[-1] < 0.6 * losses[0], losses


def test_config_keys():
    cfg = ModelConfig(attention="linear", linear_decay=True, d_model=32, n_heads=2, n_layers=1)
    model = build_model(cfg)
    assert model.blocks[0].attn.attention == "linear" and model.blocks[0].attn.decay is not None
    assert build_model(ModelConfig(d_model=32, n_heads=2, n_layers=1)).blocks[0].attn.decay is None
    for bad, message in (({"attention": "relu"}, "'softmax' or 'linear'"),
                         ({"linear_decay": True}, "needs model.attention=\"linear\""),
                         ({"name": "mlp", "attention": "linear"}, "is the GPT's attention")):
        with pytest.raises(ValidationError, match=message):
            ModelConfig(**bad)
    with pytest.raises(ValidationError, match="model.linear_decay=true is not supported yet"):
        Config.model_validate({"model": {"attention": "linear", "linear_decay": True},
                               "parallel": {"nproc": 2, "tp": 2}})
