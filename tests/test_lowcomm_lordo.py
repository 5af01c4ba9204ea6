"""LoRDO (lowcomm/lordo.py, lowcomm/lowrank_adamw.py): the projected optimizer against AdamW,
its subspace and its memory on one process; the shared projection, a bitwise resume (world 2)
and learning on a quarter of the bytes (world 4); the config rules.

One spawn per world size."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from conftest import tiny_tree
from harness import run_world
from loomtrain.errors import ConfigError
from loomtrain.lowcomm import apply_lowcomm
from loomtrain.lowcomm.lordo import lowrank_adamw
from loomtrain.lowcomm.lowrank_adamw import oriented
from loomtrain.models import build_model, token_loss_sum
from loomtrain.optim import build_optimizer
from loomtrain.train.config import config_from_dict
from loomtrain.train.launch import init_distributed
from test_lowcomm import _losses, _runs

# the MLP language model: Linear and LayerNorm only, every row of its small embedding seen
# at every step (no coordinate with a zero or degenerate gradient for Adam to amplify noise in)
MLP = {"name": "mlp", "d_model": 16, "n_layers": 2, "seq_len": 16, "vocab_size": 64}


def _model_and_optimizer(rank: int, qh_weight: float, weight_decay: float = 0.1):
    cfg = config_from_dict({"model": MLP, "train": {"weight_decay": weight_decay, "lr": 3e-3}})
    torch.manual_seed(0)
    model = build_model(cfg.model)
    optimizer = lowrank_adamw(model, build_optimizer(model, cfg.train), rank)
    for group in optimizer.param_groups:
        group["qh_weight"] = qh_weight
    return model, optimizer, cfg


def _step(model, optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)
    (token_loss_sum(model(x), y) / y.numel()).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_full_rank_without_the_qh_term_is_adamw():
    """r = the shorter side, w = 1 and Q a random signed permutation: Adam is equivariant to
    signed permutations, so projecting, keeping the moments there and projecting back must
    give AdamW's steps; a transposed projection, a wrong orientation or a bias correction
    off by a step would not."""
    model, optimizer, cfg = _model_and_optimizer(rank=10**6, qh_weight=1.0)
    reference, initial = copy.deepcopy(model), copy.deepcopy(model)
    adamw = build_optimizer(reference, cfg.train)
    g = torch.Generator().manual_seed(1)
    for p, rank in optimizer.projected():
        assert rank == min(p.shape)
        signed = torch.zeros(rank, rank)
        signed[torch.randperm(rank, generator=g), torch.arange(rank)] = \
            torch.randint(0, 2, (rank,), generator=g) * 2.0 - 1
        optimizer.set_projection(p, signed)
    for step in range(10):
        _step(model, optimizer, step)
        _step(reference, adamw, step)
    # fp32 rounding in a different order (the step size applied after the back-projection):
    # measured 4.6e-7 relative to each tensor's largest entry after 10 steps; 1e-6 the bound,
    # where the 10 steps moved every matrix by ~1e-2 relative (not a vacuous comparison)
    with torch.no_grad():
        for (name, p), q, p0 in zip(model.named_parameters(), reference.parameters(),
                                    initial.parameters()):
            assert float((p - q).abs().max() / q.abs().max()) < 1e-6, name
            assert float((p - p0).abs().max() / q.abs().max()) > 1e-3, name


def test_the_qh_term_is_what_leaves_the_subspace():
    """Without weight decay, a step with w = 1 moves each projected matrix inside span(Q)
    only (LoRDO's "restricted trajectory"); the full-rank term moves it out of it."""
    for qh_weight, inside in ((1.0, True), (0.7, False)):
        model, optimizer, _ = _model_and_optimizer(rank=4, qh_weight=qh_weight, weight_decay=0.0)
        before = {p: p.detach().clone() for p, _ in optimizer.projected()}
        _step(model, optimizer, 0)
        for p, _ in optimizer.projected():
            q = optimizer.state[p]["projection"]
            assert q.shape[1] == 4
            moved = oriented(p.detach() - before[p])
            outside = float((moved - q @ (q.T @ moved)).norm() / moved.norm())
            # measured 1e-6 to 2e-6 with w = 1: the step recovered as (p + step) - p in fp32,
            # the step ~1e-2 of the entries; 0.24 to 0.34 with w = 0.7
            assert (outside < 1e-5) if inside else (outside > 0.1), (qh_weight, outside)


def test_the_state_is_rank_times_the_sides():
    """Per projected m x n matrix (m <= n): Q (m x r), u and v (r x n): r(m + 2n) numbers,
    against AdamW's 2mn."""
    model, optimizer, _ = _model_and_optimizer(rank=4, qh_weight=0.7)
    _step(model, optimizer, 0)
    projected = dict(optimizer.projected())
    assert len(projected) == 5  # two blocks' fc and proj, and the head
    for p, state in optimizer.state.items():
        numbers = sum(t.numel() for k, t in state.items() if k != "step")
        if p in projected:
            m, n = sorted(p.shape)
            assert numbers == 4 * (m + 2 * n), (p.shape, numbers)
            assert numbers < 2 * m * n / 3
        else:  # embeddings, biases, norms: AdamW's two moments
            assert numbers == 2 * p.numel()
    mine, adamw = optimizer.state_bytes()
    assert adamw == 2 * 4 * sum(p.numel() for p in model.parameters())
    # measured 0.431: rank 4 of sides of 16, and the 64 x 16 embedding keeps AdamW's moments
    assert mine / adamw < 0.45, (mine, adamw)


def _projections(tree) -> tuple[list[dict], dict]:
    """Drive the wrapper by hand (no trainer) for two periods on this replica's own random
    rows; the projections after step 1 (the initial ones) and after each sync."""
    cfg = config_from_dict(tree)
    mesh = init_distributed(cfg)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model)
    wrapped, optimizer = apply_lowcomm(model, build_optimizer(model, cfg.train), mesh,
                                       cfg.lowcomm, cfg.run.seed)
    g = torch.Generator().manual_seed(100 + mesh.local_rank("dp"))
    seen, h = [], cfg.lowcomm.inner_steps
    for step in range(1, 2 * h + 1):
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=g)
        y = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=g)
        (token_loss_sum(wrapped(x), y) / y.numel()).backward()
        wrapped.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        if wrapped.after_step(step) or step == 1:
            seen.append({n: q.clone() for n, q in wrapped.projections().items()})
    return seen, wrapped.metrics()


def _world2(rank, world, jobs, root, tree):
    return _runs(rank, world, jobs, root), _projections(tree)


def test_world2_shared_projections_and_resume(tmp_path, corpus):
    lordo = {"algorithm": "lordo", "inner_steps": 2, "rank": 4}
    # 8 steps with dropout (the per-rank RNG matters), checkpoints every 4
    h2 = tiny_tree(tmp_path, corpus, parallel={"nproc": 2}, lowcomm=lordo,
                   model={"dropout": 0.1}, train={"steps": 8}, checkpoint={"every": 4})
    jobs = [("h2", h2, None, False),
            ("h2_stopped", h2, 4, False),  # stops after step 4, a sync and a checkpoint
            ("h2_stopped", h2, None, True)]
    direct = tiny_tree(tmp_path, corpus, parallel={"nproc": 2}, lowcomm=lordo)
    results = run_world(_world2, 2, jobs, str(tmp_path / "w2"), direct, timeout_s=300)
    out = results[0][0]

    # (a) the projections: identical bits on both replicas at every point (the initial ones
    # from the averaged first gradient, then from each averaged pseudo-gradient), orthonormal
    # columns, rank 4 (the model's matrices are 32 x 32 to 32 x 128: shorter side 32)
    (seen0, metrics0), (seen1, _) = results[0][1], results[1][1]
    matrices = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    assert len(seen0) == 3
    assert seen0[0].keys() == {f"blocks.{b}.{m}.weight" for b in (0, 1) for m in matrices}
    for mine, other in zip(seen0, seen1):
        for name, q in mine.items():
            assert torch.equal(q, other[name]), name
            assert q.shape == (32, 4)
            assert torch.allclose(q.T @ q, torch.eye(4), atol=1e-5), name  # measured 1.2e-6
    for name in seen0[0]:  # every sync computes new ones
        assert not torch.equal(seen0[0][name], seen0[1][name])
        assert not torch.equal(seen0[1][name], seen0[2][name])
    # the top-4 singular subspace holds the most of the pseudo-gradient that any 4-dimensional
    # one can (Eckart-Young), more than the projection the period ran in; the full-rank
    # term leaves part of it outside that one. Measured 0.811 and 0.742

    assert 0 < metrics0["lordo_captured_before"] < metrics0["lordo_captured"] <= 1 + 1e-6

    # (e) resume at a sync: each replica's moments and projections, the RNG: bitwise
    reference = _losses(out["h2"][0])
    records, saved = out["h2_stopped"]
    assert saved == ["step_00000004", "step_00000008"]
    assert _losses(records) == reference  # == on floats
    assert reference[-1] < reference[0]
    # what the checkpoint holds: the projections once, each replica's moments at r x n
    meta = FileSystemReader(str(tmp_path / "w2" / "h2_stopped" / "checkpoints" / "step_00000004"))
    sizes = {k: tuple(v.size) for k, v in meta.read_metadata().state_dict_metadata.items()
             if hasattr(v, "size")}
    assert sizes["lowcomm.projection.blocks.0.mlp.fc.weight"] == (32, 4)
    for replica in (0, 1):  # fc is 128 x 32: projected on its 32 side, moments 4 x 128
        assert sizes[f"optim.replica{replica}.state.blocks.0.mlp.fc.weight.exp_avg"] == (4, 128)


def test_world4_lordo_learns_on_about_a_quarter_of_the_bytes(tmp_path, corpus):
    """LoRDO with H = 4 and rank 8 against synchronous DP with AdamW, on the same 20 steps of
    the same rows, with the paper's outer step (the average)."""
    trees = [tiny_tree(tmp_path, corpus, parallel={"nproc": 4}, lowcomm=lowcomm)
             for lowcomm in ({}, {"algorithm": "lordo", "inner_steps": 4, "rank": 8})]
    jobs = [(name, t, None, False) for name, t in zip(("dp", "lordo"), trees)]
    out = run_world(_runs, 4, jobs, str(tmp_path / "w4"), timeout_s=300)[0]
    dp, lordo = (_losses(out[name][0]) for name in ("dp", "lordo"))
    assert lordo[-1] < lordo[0] - 0.3, lordo  # it learns
    assert lordo[-1] < dp[-1] * 1.15, (lordo, dp)  # measured 5.48 -> 4.22, DP's 4.06
    sent = {name: sum(r["comm_bytes"].get("all_reduce", 0) for r in out[name][0])
            for name in ("dp", "lordo")}
    # DP sends the model's P parameters every step; LoRDO every 4th, plus once the gradient
    # of its projected matrices (the initial projections): (5 P + L) / (20 P) with L the 8
    # block matrices' 24,576 of the tiny GPT's 34,688 parameters, 0.2854; the 24 bytes of
    # control and logged loss per step, in both, raise it a little: measured 0.28555
    model = build_model(config_from_dict(trees[0]).model)
    params = sum(p.numel() for p in model.parameters())
    projected = sum(p.numel() for n, p in model.named_parameters() if n.startswith("blocks")
                    and p.dim() == 2)
    expected = (5 * params + projected) / (20 * params)
    ratio = sent["lordo"] / sent["dp"]
    assert expected <= ratio < expected + 1e-3, (ratio, expected, sent)
    # the optimizer state, as logged: measured 0.498 of AdamW's (rank 8 of sides of 32; the
    # 256 x 32 embedding, tied to the head, keeps AdamW's moments)
    last = out["lordo"][0][-1]
    assert last["lordo_rank"] == 8
    assert last["lordo_state_bytes"] < 0.6 * last["lordo_adamw_state_bytes"], last


@pytest.mark.parametrize("lowcomm,train,why", [
    ({"algorithm": "lordo"}, {"optimizer": "sgd"}, 'set train.optimizer="adamw"'),
    ({"algorithm": "lordo", "outer_momentum": 0.5}, {}, 'outer_optimizer="sgd" has none'),
])
def test_config_refuses_what_lordo_cannot_run(tmp_path, corpus, lowcomm, train, why):
    with pytest.raises(ConfigError, match="lowcomm") as err:
        config_from_dict(tiny_tree(tmp_path, corpus, lowcomm=lowcomm, train=train))
    assert why in str(err.value), str(err.value)


def test_config_lordo_defaults_to_the_papers_average(tmp_path, corpus):
    def lowcomm(**keys):
        return config_from_dict(tiny_tree(tmp_path, corpus, lowcomm={"algorithm": "lordo", **keys},
                                          parallel={"nproc": 2})).lowcomm

    assert (lowcomm().outer_optimizer, lowcomm().outer_lr) == ("sgd", 1.0)
    assert lowcomm(outer_lr=0.8).outer_lr == 0.8
    nesterov = lowcomm(outer_optimizer="nesterov")
    assert (nesterov.outer_lr, nesterov.outer_momentum) == (0.7, 0.9)  # DiLoCo's
    assert lowcomm(rank=4, inner_steps=8).rank == 4
    diloco = config_from_dict(tiny_tree(tmp_path, corpus, lowcomm={"algorithm": "diloco"})).lowcomm
    assert (diloco.outer_optimizer, diloco.outer_lr) == ("nesterov", 0.7)  # unchanged
