"""Activation recomputation and offload outside the pipeline (parallel/recompute.py and
offload.py, issue 28): what a recomputed or offloaded block saves for backward on the device,
and dp, ZeRO-3, tensor and context parallelism with full and selective recomputation and with
offload against the single-process run (fp32, 12 steps, 1e-4); offload changes no bit."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_tree
from harness import run_world
from test_zero import _train_many

from loomtrain.errors import ConfigError
from loomtrain.models import build_model
from loomtrain.models.config import ModelConfig
from loomtrain.parallel.offload import BlockOffload
from loomtrain.parallel.pipeline.estimate import layer_activation_bytes
from loomtrain.parallel.recompute import (checkpoint_blocks, recompute_cores,
                                          recomputed_activation_bytes)
from loomtrain.train.config import config_from_dict
from loomtrain.train.trainer import token_loss_sum

LLAMA = {"name": "llama", "n_heads": 4, "n_kv_heads": 1}


def _saved_bytes_and_grads(model, x):
    """Bytes autograd saves for backward in one forward of `model`, and its gradients."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = token_loss_sum(model(x), x)
    loss.backward()
    return sum(saved), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("keys", [{}, LLAMA])
def test_recomputed_blocks_save_less_and_give_the_same_gradients(keys):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**{"d_model": 32, "n_layers": 2, "n_heads": 2,
                                       "seq_len": 16, **keys}))
    x = torch.randint(0, 256, (2, 16))
    full, selective = copy.deepcopy(model), copy.deepcopy(model)
    assert checkpoint_blocks(full) == 2 and recompute_cores(selective) == 2
    plain_bytes, plain = _saved_bytes_and_grads(model, x)
    full_bytes, full_grads = _saved_bytes_and_grads(full, x)
    selective_bytes, selective_grads = _saved_bytes_and_grads(selective, x)
    assert full_bytes < selective_bytes < plain_bytes, (full_bytes, selective_bytes, plain_bytes)
    for grads in (full_grads, selective_grads):  # the same operations again: the same bits
        for a, b in zip(plain, grads):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    with torch.no_grad():  # evaluation runs the blocks as they are
        torch.testing.assert_close(full(x), model(x), rtol=0, atol=0)


CASES = [  # (model, [parallel] on 2 ranks)
    ({}, {"recompute": "full"}),
    ({}, {"recompute": "full", "zero_stage": 3}),
    (LLAMA, {"recompute": "selective", "zero_stage": 3}),
    (LLAMA, {"recompute": "full", "tp": 2, "sequence_parallel": True}),
    ({}, {"recompute": "full", "cp": 2}),
]
OFFLOADED = [  # (model, [parallel] on 2 ranks, the offload_activations added), 4 steps each
    ({}, {}, 0.5),
    ({}, {"zero_stage": 3}, 1.0),
    (LLAMA, {"tp": 2, "sequence_parallel": True}, 0.5),
    (LLAMA, {"recompute": "selective", "zero_stage": 3}, 0.5),
    # the traced blocks of cp_method="auto", each checkpointed by its budget
    ({}, {"cp": 2, "cp_method": "auto", "activation_budget_mb": 0.01}, 0.5),
]


def test_engines_with_recomputation_follow_the_single_process_run(tmp_path, corpus):
    """... and each offloaded run equals its run without offload, loss for loss (the same
    tensors, copied out and back)."""
    def tree(model, parallel, world, steps=12):
        return tiny_tree(tmp_path, corpus, model=model, train={"steps": steps},
                         parallel={"nproc": world, **parallel})
    models = [{}, LLAMA]
    refs = run_world(_train_many, 1, [tree(m, {}, 1) for m in models], str(tmp_path / "w1"),
                     timeout_s=200)[0]
    pairs = [tree(m, {**p, **extra}, 2, 4) for m, p, f in OFFLOADED
             for extra in ({}, {"offload_activations": f})]
    curves = run_world(_train_many, 2, [tree(m, p, 2) for m, p in CASES] + pairs,
                       str(tmp_path / "w2"), timeout_s=300)[0]
    for (model, parallel), losses in zip(CASES, curves):
        reference = refs[models.index(model)]
        assert len(losses) == 12 and reference[-1] < reference[0] - 0.3
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        assert rel < 1e-4, (model, parallel, rel)
    offloaded = curves[len(CASES):]
    for i, (_, parallel, _) in enumerate(OFFLOADED):
        plain, offload = offloaded[2 * i], offloaded[2 * i + 1]
        assert len(plain) == 4 and offload == plain, parallel


def test_selective_recomputation_needs_attention():  # cp_method="auto": tests/test_config.py
    with pytest.raises(ConfigError, match='recomputes the attention core; model.name=.mlp.'):
        config_from_dict({"model": {"name": "mlp"}, "parallel": {"recompute": "selective"}})


def test_offload_of_no_block_is_refused():
    with pytest.raises(ConfigError, match=r"offloads round\(f x blocks\) = 0 of the model's 2 "
                                          r"blocks at parallel.pp=1: raise it above 0.25"):
        config_from_dict({"model": {"n_layers": 2}, "parallel": {"offload_activations": 0.2}})
