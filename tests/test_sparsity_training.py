"""Sparse training across processes and in `loom train` (sparsity/, the trainer, checkpoints,
export): SET and RigL masks identical on two data-parallel ranks that see different data; and
one world-2 spawn of trainer runs: static masks held (zero weights stay zero) and exported,
pruning at its per-step densities, SAM/ZO-SAM pass counts in the metrics, and resumes that
continue static, SET and RigL runs bitwise."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_tree
from harness import run_world
from loomtrain.models import build_model
from loomtrain.sparsity import Sparsifier, active_count, cubic_density, unpack_mask
from loomtrain.sparsity.sparsifier import KEY, layer_densities, sparse_layers
from loomtrain.train import checkpoint, export, trainer
from loomtrain.train.config import config_from_dict
from test_lowcomm import _losses, _runs


def _dynamic_masks(rank, world):
    """A GPT in the data-parallel engine, each rank on its own random rows; SET and RigL
    update every step. Returns, per method, the masks, each layer's count after every step,
    and the masks' version."""
    from loomtrain.mesh import build_mesh
    from loomtrain.models import token_loss_sum
    from loomtrain.parallel.data import DataParallel
    from loomtrain.sparsity.config import SparsityConfig

    mesh = build_mesh({"dp": world})
    out = {}
    for method in ("set", "rigl"):
        torch.manual_seed(rank)  # different weights per rank: the engine broadcasts rank 0's
        gpt = build_model(config_from_dict({"model": {"d_model": 16, "n_layers": 2, "n_heads": 2,
                                                      "seq_len": 8, "vocab_size": 32}}).model)
        model = DataParallel(gpt, mesh, bucket_mb=0.01)
        cfg = SparsityConfig(method=method, density=0.2, update_every=1, end_step=8)
        sparsifier = Sparsifier(model, cfg, seed=7, total_steps=10)
        optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-2)
        counts = []
        for t in range(1, 11):
            x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))  # this rank's rows
            token_loss_sum(model(x), y).backward()  # the engine all-reduces (mean)
            dense = sparsifier.dense_gradients() if sparsifier.needs_dense_gradient(t) else None
            sparsifier.mask_gradients()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            sparsifier.apply()
            if sparsifier.update_due(t):
                sparsifier.reset_optimizer_state(optimizer, sparsifier.update(t, dense))
            counts.append({k: int(m.sum()) for k, m in sparsifier.masks.items()})
        out[method] = (sparsifier.masks, counts, sparsifier.version)
    return out


def test_set_and_rigl_masks_equal_across_ranks_at_constant_density():
    ranks = run_world(_dynamic_masks, 2, timeout_s=120)
    for method in ("set", "rigl"):
        (masks0, counts0, version0), (masks1, counts1, version1) = ranks[0][method], ranks[1][method]
        assert version0 == version1 >= 5, method  # the masks moved at (nearly) every update
        assert masks0.keys() == masks1.keys()
        assert all(torch.equal(masks0[k], masks1[k]) for k in masks0), method
        assert all(c == counts0[0] for c in counts0) and counts0 == counts1, method


def _expected_prune(model_cfg, s, t: int) -> float:
    """The overall density after step t of `prune` with update_every 2 from step 0 to 6."""
    with torch.device("meta"):
        layers = sparse_layers(build_model(model_cfg))
    shapes = [tuple(p.shape) for _, p in layers]
    due = max(u for u in range(0, 7, s.update_every) if u <= t)
    final = layer_densities(shapes, s.density, s.distribution)
    kept = sum(active_count(p.numel(), cubic_density(due, d, 0, 6)) for (_, p), d in zip(layers, final))
    return kept / sum(p.numel() for _, p in layers)


def test_world2_trainer_masks_schedule_passes_export_and_resume(tmp_path, corpus):
    def tree(sparsity, **sections):
        return tiny_tree(tmp_path, corpus, parallel={"nproc": 2}, sparsity=sparsity,
                         model={"d_model": 16, "seq_len": 16}, run={"eval_every": 4},
                         **{"train": {"global_batch": 4, "steps": 8}, **sections})

    static = {"method": "static", "density": 0.2}
    rigl = {"method": "rigl", "density": 0.2, "update_every": 2}
    dst = dict(checkpoint={"every": 4})
    prune = {"method": "prune", "density": 0.2, "update_every": 2, "end_step": 6}
    jobs = [("static", tree(static, train={"global_batch": 4, "steps": 6}), None, False),
            ("static_stopped", tree(static, train={"global_batch": 4, "steps": 6}), 3, False),
            ("static_stopped", tree(static, train={"global_batch": 4, "steps": 6}), None, True),
            ("rigl", tree(rigl, **dst), None, False),
            ("rigl_stopped", tree(rigl, **dst), 4, False),  # after the update of step 4
            ("rigl_stopped", tree(rigl, **dst), None, True),
            ("set", tree({**rigl, "method": "set"}, **dst), None, False),
            ("set_stopped", tree({**rigl, "method": "set"}, **dst), 3, False),  # between updates
            ("set_stopped", tree({**rigl, "method": "set"}, **dst), None, True),
            ("prune", tree(prune), None, False),
            ("rigl_sam", tree({**rigl, "sam": "sam"}, train={"global_batch": 4, "steps": 4}), None, False),
            ("rigl_zosam", tree({**rigl, "sam": "zo-sam"}, train={"global_batch": 4, "steps": 4}),
             None, False)]
    root = tmp_path / "w2"
    out = run_world(_runs, 2, jobs, str(root), timeout_s=240)[0]

    # resume: the masks, the weights and the optimizer state come back, so the continued runs
    # are bitwise the unstopped ones (a resume that lost the masks would train the masked
    # weights densely, one that lost RigL's or SET's changes would hold other masks)
    for name in ("static", "rigl", "set"):
        records, saved = out[f"{name}_stopped"]
        assert _losses(records) == _losses(out[name][0]), name
        assert [r["density"] for r in records] == [r["density"] for r in out[name][0]], name

    # static: every masked weight is exactly zero in the final checkpoint, the masks are the
    # ones the seed draws, and the export says the densities and holds the zeros
    run_dir = root / "static"
    final = checkpoint.list_checkpoints(run_dir)[-1]
    weights = checkpoint.load_model_state(final)
    masks = checkpoint.load_tensors(final, KEY)
    cfg = config_from_dict(jobs[0][1])
    drawn = Sparsifier(build_model(cfg.model), cfg.sparsity, cfg.run.seed, cfg.train.steps)
    assert sorted(masks) == sorted(drawn.masks)
    for name, bits in masks.items():
        mask = unpack_mask(bits, weights[name].shape)
        assert torch.equal(mask, drawn.masks[name]), name
        assert (weights[name][~mask] == 0).all() and (weights[name][mask] != 0).all(), name
    from safetensors import safe_open

    trainer.write_config(run_dir, cfg)  # what `loom train` writes; `_loop` alone does not
    with safe_open(export.export_safetensors(run_dir), "pt") as f:
        densities = json.loads(f.metadata()["loomtrain.sparsity"])
        assert (f.get_tensor("blocks.0.mlp.fc.weight") == weights["blocks.0.mlp.fc.weight"]).all()
    assert densities == pytest.approx(drawn.density_per_layer(), abs=1e-6)
    records = out["static"][0]
    assert all(abs(r["density"] - 0.2) < 0.01 for r in records)
    assert [r["step"] for r in records if "density_per_layer" in r] == [4, 6]  # evaluated

    # gradual pruning: each step's density is the cubic schedule's at its last update
    cfg = config_from_dict(jobs[9][1])
    densities = [r["density"] for r in out["prune"][0]]
    assert densities == pytest.approx([_expected_prune(cfg.model, cfg.sparsity, t)
                                       for t in range(1, 9)], abs=1e-6)
    assert densities[0] > 0.5 and abs(densities[-1] - 0.2) < 0.01

    # passes per step: plain 1 backward, SAM 2, ZO-SAM 1 (plus its two probe forwards)
    for name, forwards, backwards in (("rigl", 1, 1), ("rigl_sam", 2, 2), ("rigl_zosam", 3, 1)):
        records = out[name][0]
        assert all((r["forward_per_step"], r["backward_per_step"]) == (forwards, backwards)
                   for r in records), name
        assert records[-1]["loss"] < records[0]["loss"], name
        assert all(abs(r["density"] - records[0]["density"]) == 0 for r in records), name


def test_sparse_comm_in_loom_train_equals_dense_communication(tmp_path, corpus):
    # static masks at world 2: all-reducing only the kept entries sums the same two values per
    # entry as the dense all-reduce (a + b = b + a), so the runs agree bitwise, on a fraction of
    # the gradient bytes (parallel/sparse_dp.py)
    def tree(sparse_comm):
        return tiny_tree(tmp_path, corpus, parallel={"nproc": 2}, train={"steps": 6},
                         sparsity={"method": "static", "density": 0.2, "sparse_comm": sparse_comm})
    jobs = [("dense_comm", tree(False), None, False), ("sparse_comm", tree(True), None, False)]
    out = run_world(_runs, 2, jobs, str(tmp_path / "runs"), timeout_s=150)[0]
    dense, sparse = out["dense_comm"][0], out["sparse_comm"][0]
    assert _losses(sparse) == _losses(dense)
    assert all(r["sparse_comm_ratio"] > 1.5 for r in sparse)  # dense-equivalent over sent
    assert "sparse_comm_ratio" not in dense[0]
    sent = [r["comm_bytes"]["total"] for r in sparse[1:]]  # the first step also syncs masks
    assert max(sent) < 0.75 * min(r["comm_bytes"]["total"] for r in dense[1:])
