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


TP_SP = {"tp": 2, "sequence_parallel": True}
@pytest.mark.parametrize("fraction,recompute", [(0.5, "none"), (1.0, "none"),
                                               (0.75, "selective"), (1.0, "full")])
def test_offloaded_blocks_leave_the_device_and_give_the_same_gradients(fraction, recompute):
    """The stash counts the offloaded blocks' saved bytes while on the device (each copy
    waited for where it starts): one block's in its forward, two in the backward (the one
    it runs, the one reloaded ahead), the dry run's `recomputed_activation_bytes` terms."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=4, n_heads=2, seq_len=16)
    model, x = build_model(cfg), torch.randint(0, 256, (2, 16))
    offloaded = copy.deepcopy(model)
    if recompute != "none":
        (checkpoint_blocks if recompute == "full" else recompute_cores)(offloaded)
    offload = BlockOffload(offloaded, fraction, torch.device("cpu"))
    offload.stash.synchronous = True
    _, plain = _saved_bytes_and_grads(model, x)
    _, grads = _saved_bytes_and_grads(offloaded, x)
    for a, b in zip(plain, grads):  # copies out and back: the same bits
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    n = round(fraction * 4)
    assert offload.count == n and offload.stash.live_bytes == 0 and not offload.stash._pairs
    block = layer_activation_bytes(cfg, "blocks.0", 2, 4)
    kept = {"full": 4 * 2 * 16 * 32, "selective": block - 4 * 2 * 16 * 2}.get(recompute, block)
    assert offload.stash.peak_bytes == 2 * kept, (offload.stash.peak_bytes, kept)
    embed = layer_activation_bytes(cfg, "embed", 2, 4)
    device = recomputed_activation_bytes(cfg, 2, 4, recompute, offloaded=n)
    assert device == recomputed_activation_bytes(cfg, 2, 4, recompute) - n * kept or \
        device == embed + 2 * kept + (block - kept if recompute == "full" else 0)


def test_two_offloaded_graphs_alive_at_once_stay_apart():
    """Two forwards, then their backwards: each graph reloads and releases its own pairs."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=32, n_layers=4, n_heads=2, seq_len=16))
    batches = [torch.randint(0, 256, (2, 16)) for _ in range(2)]
    plain = copy.deepcopy(model)
    for x in batches:
        token_loss_sum(plain(x), x).backward()
    offload = BlockOffload(model, 1.0, torch.device("cpu"))
    for loss in [token_loss_sum(model(x), x) for x in batches]:
        loss.backward()
    assert not offload.stash._pairs
    for a, b in zip(plain.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)


CASES = [  # (model, [parallel] on 2 ranks)
    ({}, {"recompute": "full"}),
    ({}, {"recompute": "full", "zero_stage": 3}),
    (LLAMA, {"recompute": "selective", "zero_stage": 3}),
    (LLAMA, {"recompute": "full", **TP_SP}),
    ({}, {"recompute": "full", "cp": 2}),
    ({}, {}),
    ({}, {"zero_stage": 3}),
    (LLAMA, TP_SP),
]
OFFLOADED = [  # (model, [parallel] with offload_activations, the case of CASES without it)
    ({}, {"offload_activations": 0.5}, 5),
    ({}, {"zero_stage": 3, "offload_activations": 1.0}, 6),
    (LLAMA, {**TP_SP, "offload_activations": 0.5}, 7),
    (LLAMA, {"recompute": "selective", "zero_stage": 3, "offload_activations": 0.5}, 2),
]


def test_engines_with_recomputation_follow_the_single_process_run(tmp_path, corpus):
    def tree(model, parallel, world):
        return tiny_tree(tmp_path, corpus, model=model, train={"steps": 12},
                         parallel={"nproc": world, **parallel})
    models = [{}, LLAMA]
    refs = run_world(_train_many, 1, [tree(m, {}, 1) for m in models], str(tmp_path / "w1"),
                     timeout_s=200)[0]
    cases = CASES + [(m, p) for m, p, _ in OFFLOADED]
    curves = run_world(_train_many, 2, [tree(m, p, 2) for m, p in cases], str(tmp_path / "w2"),
                       timeout_s=300)[0]
    for (model, parallel), losses in zip(cases, curves):
        reference = refs[models.index(model)]
        assert len(losses) == 12 and reference[-1] < reference[0] - 0.3
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        assert rel < 1e-4, (model, parallel, rel)
    for (_, parallel, base), losses in zip(OFFLOADED, curves[len(CASES):]):
        assert losses == curves[base], parallel  # the same tensors, copied out and back


def test_selective_recomputation_needs_attention():  # cp_method="auto": tests/test_config.py
    with pytest.raises(ConfigError, match='recomputes the attention core; model.name=.mlp.'):
        config_from_dict({"model": {"name": "mlp"}, "parallel": {"recompute": "selective"}})
