"""Sparsity without processes (sparsity/): per-layer densities, masks, N:M in every group, the
cubic schedule, SET/RigL at exactly constant density, the Sparsifier on every model, masks
held through optimizer steps, SAM/ZO-SAM pass counts and bitwise restoration, and the
[sparsity] config's refusals."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn as nn

from conftest import tiny_tree
from loomtrain.errors import ConfigError
from loomtrain.models import build_classifier, build_model, token_loss_sum
from loomtrain.sparsity import (SharpnessAware, Sparsifier, active_count, cosine_fraction,
                                cubic_density, erk_densities, magnitude_mask, nm_group_counts,
                                nm_mask, pack_mask, random_mask, rigl_update, set_update,
                                sparse_layers, swap_count, unpack_mask)
from loomtrain.models.config import ModelConfig
from loomtrain.sparsity.config import SparsityConfig
from loomtrain.train.config import config_from_dict


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one torch thread is faster than two that contend on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(name: str = "gpt", **kw) -> nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(name="mlp" if name in ("mlp", "digits") else "gpt", d_model=16, n_layers=2,
                      n_heads=2, seq_len=8, vocab_size=32, **kw)
    return build_classifier(cfg, 64, 10) if name == "digits" else build_model(cfg)


def test_erk_densities_meet_the_budget_and_favour_small_layers():
    shapes = [(16, 48), (48, 16), (64, 16), (16, 64), (10, 16)]
    numel = [math.prod(s) for s in shapes]
    for density in (0.5, 0.2, 0.1):
        d = erk_densities(shapes, density)
        assert sum(x * n for x, n in zip(d, numel)) == pytest.approx(density * sum(numel))
        # ERK's ratio (n_in + n_out) / (n_in n_out) orders them: (10, 16) is the densest
        assert d[4] == max(d) and d[0] == pytest.approx(d[1]) and d[2] == pytest.approx(d[3])
    # a tiny layer next to big ones would exceed 1: it is made dense, the others take the rest
    d = erk_densities([(2, 2), (512, 512)], 0.5)
    assert d[0] == 1.0 and 4 + d[1] * 512 * 512 == pytest.approx(0.5 * (4 + 512 * 512))


def test_masks_keep_exact_counts_and_break_ties_by_index():
    gen = torch.Generator().manual_seed(3)
    mask = random_mask((7, 9), 20, gen)
    assert mask.dtype == torch.bool and int(mask.sum()) == 20
    w = torch.tensor([[0.5, -2.0, 1.0, 1.0], [0.0, 3.0, -1.0, 0.1]])
    kept = magnitude_mask(w, 4)
    assert kept.flatten().nonzero().flatten().tolist() == [1, 2, 3, 5]  # 1.0 three times: first two
    allowed = torch.tensor([[True, False, True, True], [True, False, True, True]])
    assert magnitude_mask(w, 2, allowed).flatten().nonzero().flatten().tolist() == [2, 3]
    assert active_count(100, 0.333) == 33 and active_count(5, 0.01) == 1
    for shape in [(3, 5), (8, 8), (1, 17)]:
        m = torch.rand(shape) > 0.5
        assert torch.equal(unpack_mask(pack_mask(m), shape), m)
        assert pack_mask(m).numel() == -(-m.numel() // 8)


@pytest.mark.parametrize("n, m", [(2, 4), (1, 4), (3, 8), (1, 2)])
def test_nm_pattern_valid_in_every_group(n, m):
    w = torch.randn(24, 32)
    mask = nm_mask(w, n, m)
    assert (nm_group_counts(mask, m) == n).all()
    groups, kept = w.abs().reshape(-1, m), mask.reshape(-1, m)
    # every kept magnitude is at least every dropped one of its group
    low = groups.masked_fill(~kept, float("inf")).min(dim=1).values
    high = groups.masked_fill(kept, -1.0).max(dim=1).values
    assert (low >= high).all()


def test_cubic_schedule_and_cosine_fraction():
    assert cubic_density(0, 0.1, 10, 50) == 1.0 and cubic_density(10, 0.1, 10, 50) == 1.0
    assert cubic_density(50, 0.1, 10, 50) == pytest.approx(0.1) == cubic_density(90, 0.1, 10, 50)
    values = [cubic_density(t, 0.1, 10, 50) for t in range(10, 51)]
    assert all(a > b for a, b in zip(values, values[1:]))
    # Zhu & Gupta: most of the pruning early; at the midpoint (1 - 0.5)^3 of the gap is left
    assert cubic_density(30, 0.1, 10, 50) == pytest.approx(0.1 + 0.9 / 8)
    assert cosine_fraction(0, 0.3, 100) == pytest.approx(0.3)
    assert cosine_fraction(50, 0.3, 100) == pytest.approx(0.15)
    assert cosine_fraction(100, 0.3, 100) == 0.0 == cosine_fraction(120, 0.3, 100)
    assert swap_count(10, 12, 0.5) == 2  # no more than the inactive positions


def test_set_and_rigl_keep_the_count_and_follow_their_rules():
    torch.manual_seed(1)
    w = torch.randn(16, 16)
    mask = random_mask(w.shape, 64, torch.Generator().manual_seed(0))
    w = w * mask
    for _ in range(20):
        grad = torch.randn(16, 16)
        new = rigl_update(w, mask, 8, grad)
        assert int(new.sum()) == 64
        dropped, grown = mask & ~new, new & ~mask
        survivors = w.abs()[mask & new]
        assert int(dropped.sum()) == int(grown.sum()) <= 8
        if dropped.any():
            assert w.abs()[dropped].max() <= survivors.min()  # the smallest were dropped
            # the grown are the largest |grad| among what the drop left inactive
            assert grad.abs()[grown].min() >= grad.abs()[~new & ~mask].max()
        mask, w = new, w.masked_fill(~new, 0.0) + grown * 0.01
    gen = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    a, b = set_update(w, mask, 8, gen(5)), set_update(w, mask, 8, gen(5))
    assert torch.equal(a, b) and int(a.sum()) == 64 and not torch.equal(a, set_update(w, mask, 8, gen(6)))


def test_scope_is_every_untied_linear_weight():
    gpt = _model("gpt")
    names = [n for n, _ in sparse_layers(gpt)]
    assert names == [f"blocks.{i}.{x}.weight" for i in range(2)
                     for x in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]  # the head is tied
    assert [n for n, _ in sparse_layers(_model("gpt", attention="linear"))] == names
    assert "head.weight" in [n for n, _ in sparse_layers(_model("mlp"))]
    assert [n for n, _ in sparse_layers(_model("digits"))][0] == "embed.weight"


@pytest.mark.parametrize("name", ["gpt", "mlp", "digits"])
def test_nm_sparsifier_on_every_model(name):
    model = _model(name)
    sparsifier = Sparsifier(model, SparsityConfig(method="nm", n=2, m=4), seed=0, total_steps=10)
    for layer, p in sparsifier.layers:
        mask = sparsifier.masks[layer]
        assert (nm_group_counts(mask, 4) == 2).all(), layer
        assert (p[~mask] == 0).all()
    assert sparsifier.density() == 0.5


def _stepped(model, sparsifier, steps: int, x, y, optimizer=None):
    """`steps` plain AdamW steps with the sparsifier's hooks (the trainer's order)."""
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for t in range(1, steps + 1):
        optimizer.zero_grad()
        token_loss_sum(model(x), y).backward()
        dense = sparsifier.dense_gradients() if sparsifier.needs_dense_gradient(t) else None
        sparsifier.mask_gradients()
        optimizer.step()
        sparsifier.apply()
        if sparsifier.update_due(t):
            sparsifier.reset_optimizer_state(optimizer, sparsifier.update(t, dense))
    return optimizer


def test_static_masks_hold_through_steps_and_rigl_set_keep_density():
    x, y = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    model = _model()
    sparsifier = Sparsifier(model, SparsityConfig(method="static", density=0.2), 0, 10)
    before = {k: m.clone() for k, m in sparsifier.masks.items()}
    opt = _stepped(model, sparsifier, 5, x, y)
    for name, p in sparsifier.layers:
        assert torch.equal(sparsifier.masks[name], before[name])
        assert (p[~before[name]] == 0).all() and (p[before[name]] != 0).all()
        # zero gradient and zero moments where masked: the optimizer itself moves nothing there
        assert (opt.state[p]["exp_avg"][~before[name]] == 0).all()
    for method in ("set", "rigl"):
        model = _model()
        cfg = SparsityConfig(method=method, density=0.2, update_every=1, end_step=9)
        sparsifier = Sparsifier(model, cfg, 0, 12)
        counts = {k: int(m.sum()) for k, m in sparsifier.masks.items()}
        start = {k: m.clone() for k, m in sparsifier.masks.items()}
        _stepped(model, sparsifier, 12, x, y)
        assert {k: int(m.sum()) for k, m in sparsifier.masks.items()} == counts
        assert sparsifier.version > 0
        assert any(not torch.equal(start[k], m) for k, m in sparsifier.masks.items())
        assert all((p[~sparsifier.masks[k]] == 0).all() for k, p in sparsifier.layers)


def test_pruning_follows_the_cubic_schedule():
    model = _model()
    cfg = SparsityConfig(method="prune", density=0.1, distribution="uniform", start_step=2,
                         end_step=11, update_every=3)
    sparsifier = Sparsifier(model, cfg, 0, 20)
    assert sparsifier.density() == 1.0
    for t in range(1, 16):
        before = {k: m.clone() for k, m in sparsifier.masks.items()}
        with torch.no_grad():  # the weights move between updates, as training moves them
            for _, p in sparsifier.layers:
                p.add_(torch.randn_like(p), alpha=0.01)
        sparsifier.apply()
        if sparsifier.update_due(t):
            sparsifier.update(t)
        due = [u for u in (2, 5, 8, 11) if u <= t]  # start, every 3, and the end
        expected = {name: active_count(p.numel(), cubic_density(due[-1], 0.1, 2, 11)) if due
                    else p.numel() for name, p in sparsifier.layers}
        assert {k: int(m.sum()) for k, m in sparsifier.masks.items()} == expected, t
        assert all(not (m & ~before[k]).any() for k, m in sparsifier.masks.items())  # only shrinks
    assert sparsifier.density() == pytest.approx(0.1, abs=1e-3)


class _Solo:
    """A one-rank mesh: every collective over it is a no-op."""
    device = torch.device("cpu")

    def size(self, axis):
        return 1


def test_sam_and_zo_sam_passes_masks_and_bitwise_restore():
    x, y = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    model = _model()
    sparsifier = Sparsifier(model, SparsityConfig(method="static", density=0.3), 0, 10)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    for kind, forwards, backwards in (("sam", 2, 2), ("zo-sam", 3, 1)):
        sam = SharpnessAware(kind, model, 0.05, _Solo(), seed=0,
                             mask_gradients=sparsifier.mask_gradients, masks=sparsifier.masks_by_param)
        count = {"f": 0, "b": 0}
        seen = []

        def forward_backward():
            count["f"] += 1
            count["b"] += 1
            # the perturbed point keeps the sparse pattern
            seen.append(all((p[~sparsifier.masks[n]] == 0).all() for n, p in sparsifier.layers))
            seen.append(sum(float((p.detach() - weights[n]).norm() ** 2)
                            for n, p in model.named_parameters()))
            loss = token_loss_sum(model(x), y)
            (loss / 32).backward()
            return loss.detach().double()

        def forward_loss():
            count["f"] += 1
            return token_loss_sum(model(x), y).double()

        model.zero_grad()
        loss = sam.gradient(1, forward_backward, forward_loss)
        assert (count["f"], count["b"]) == (forwards, backwards), kind
        assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters()), kind
        assert seen[-2] is True and seen[-1] ** 0.5 == pytest.approx(0.05, rel=1e-3), kind  # ||e|| = rho
        assert math.isfinite(float(loss))


@pytest.mark.parametrize("sections, says", [
    ({"sparsity": {"density": 0.2}}, "sparsity.density is not read by sparsity.method='none'"),
    ({"sparsity": {"method": "nm", "density": 0.2}}, "sparsity.density is not read"),
    ({"sparsity": {"method": "static", "update_every": 5}}, "sparsity.update_every is not read"),
    ({"sparsity": {"method": "rigl", "start_step": 5}}, "sparsity.start_step is not read"),
    ({"sparsity": {"method": "nm", "n": 4, "m": 4}}, "sparsity.n=4 must be less than"),
    ({"sparsity": {"method": "nm", "m": 3}}, "sparsity.m=3 must divide model.d_model = 32"),
    # the llama's SwiGLU width is one more input width the groups run along
    ({"sparsity": {"method": "nm"}, "model": {"name": "llama", "n_heads": 4, "ffn_hidden": 90}},
     "sparsity.m=4 must divide the 90 inputs of blocks.0.mlp.down_proj.weight"),
    ({"sparsity": {"method": "prune", "schedule": "cosine"}}, "not a schedule of"),
    ({"sparsity": {"method": "prune", "start_step": 15}}, "must be before sparsity.end_step=15"),
    ({"sparsity": {"method": "set", "end_step": 50}}, "after the last step"),
    ({"sparsity": {"rho": 0.1}}, 'sparsity.sam="none"'),
    ({"sparsity": {"sam": "sam", "zo_eps": 0.01}}, "sparsity.zo_eps is the probe step"),
    ({"sparsity": {"sparse_comm": True}}, "choose a sparsity method"),
    ({"sparsity": {"method": "static"}, "compression": {"method": "topk"}}, "compression.method"),
    ({"sparsity": {"method": "static"}, "lowcomm": {"algorithm": "local_sgd"}}, "lowcomm.algorithm"),
    ({"sparsity": {"method": "magnitude"}}, "sparsity.method"),
])
def test_config_refusals(tmp_path, corpus, sections, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        config_from_dict(tiny_tree(tmp_path, corpus, **sections))


def test_config_accepts_each_method_with_sam(tmp_path, corpus):
    for method in ("none", "static", "nm", "prune", "set", "rigl"):
        for sam in ("none", "sam", "zo-sam"):
            cfg = config_from_dict(tiny_tree(tmp_path, corpus, parallel={"nproc": 2},
                                             sparsity={"method": method, "sam": sam}))
            assert (cfg.sparsity.method, cfg.sparsity.sam) == (method, sam)
    for parallel, train in (({"zero_stage": 1}, {}), ({"zero_stage": 3}, {"precision": "bf16"}),
                            ({"zero_stage": 2, "tp": 2, "nproc": 4, "hierarchical": True,
                              "ranks_per_node": 2, "offload_optimizer": True}, {})):
        for sparse_comm in (False, True):  # and packs the kept entries (zero/sparse.py)
            cfg = config_from_dict(tiny_tree(
                tmp_path, corpus, parallel={"nproc": 2, **parallel}, train=train,
                sparsity={"method": "rigl", "sam": "sam", "sparse_comm": sparse_comm}))
            assert cfg.sparsity.sparse_comm == sparse_comm  # the sharded engine runs them
    digits = config_from_dict(tiny_tree(tmp_path, corpus, data={"source": "digits"},
                                        model={"name": "mlp"},
                                        sparsity={"method": "rigl", "schedule": "constant"}))
    assert digits.sparsity.schedule == "constant"


def test_cpu_kernel_script_runs():
    """benchmarks/sparse_kernels.py --quick: one JSON line with times and sizes per density."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "sparse_kernels.py"
    out = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    rows = result["layers"]
    assert {r["density"] for r in rows} == {0.5, 0.2, 0.1}
    for r in rows:
        assert r["dense_ms"] > 0 and r["csr_ms"] > 0
        assert r["csr_bytes"] < r["dense_bytes"] or r["density"] == 0.5
    assert "semi_structured" in result


def test_sparse_comm_hands_the_engine_masks_when_they_change(tmp_path, corpus):
    """The trainer's side of the sparse-aware engine: masks (as {parameter: mask}) on the
    first step and after every change, None at RigL's update steps (their gradient must be
    all-reduced whole), nothing when nothing changed; refused without the engine."""
    from loomtrain.sparsity.training import SparseTraining

    class Engine(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module, self.calls = module, []

        def set_gradient_masks(self, masks):
            self.calls.append(None if masks is None else {p: m.clone() for p, m in masks.items()})

    cfg = config_from_dict(tiny_tree(tmp_path, corpus, model={"d_model": 16, "seq_len": 8},
                                     sparsity={"method": "rigl", "update_every": 2,
                                               "sparse_comm": True}))
    engine = Engine(build_model(cfg.model))
    optimizer = torch.optim.AdamW(engine.module.parameters())
    sparse = SparseTraining(engine, optimizer, cfg, _Solo())
    x, y = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    handed = []
    for step in range(6):  # t = 1..6: RigL updates after t = 2 and 4
        sparse.before_step(step)
        handed.append(len(engine.calls))
        sparse.gradient(lambda: token_loss_sum(engine.module(x), y).backward(), None)
        optimizer.step()
        sparse.after_step(True)
        optimizer.zero_grad()
    assert handed == [1, 2, 3, 4, 5, 6]  # t=1 masks, t=2 None, t=3 masks, ...
    assert [c is None for c in engine.calls] == [False, True, False, True, False, True]
    first, second = engine.calls[0], engine.calls[2]
    assert set(first) == {p for _, p in sparse.sparsifier.layers}
    assert any(not torch.equal(first[p], second[p]) for p in first)  # the update at t = 2
    with pytest.raises(ConfigError, match="sparse-aware data-parallel engine"):
        SparseTraining(engine.module, optimizer, cfg, _Solo())
