"""HPSGD (lowcomm/hpsgd.py): synchronous DP when nothing is left in flight, convergence and
DP's bytes with one step in flight, the overlap in a written timeline, resume, config.

One spawn per world size: world 2 runs the parity, timeline and resume cases, world 4 the
convergence and bytes case."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from conftest import tiny_tree
from harness import run_world
from loomtrain import comm
from loomtrain.errors import ConfigError
from loomtrain.lowcomm.hpsgd import HPSGD
from loomtrain.mesh import build_mesh
from loomtrain.timeline import hidden_s
from loomtrain.train.config import config_from_dict
from test_lowcomm import _losses, _rel, _runs

SGD = {"optimizer": "sgd", "beta1": 0.0, "grad_clip": 0.0, "lr": 0.5}  # as test_lowcomm.py
# the simulated link of the timeline runs: 2 nodes of 1 rank; the tiny GPT's 34,688 fp32
# parameters all-reduced at world 2 send 138,752 bytes: 111 ms at 0.01 Gbit/s, several times
# the step's forward and backward here
LINK = {"parallel": {"nproc": 2, "ranks_per_node": 1},
        "comm": {"inter_node_gbps": 0.01, "inter_node_latency_ms": 0.0},
        "train": {"steps": 4}, "run": {"timeline_step": 3}}


def hpsgd(overlap_steps: int) -> dict:
    return {"algorithm": "hpsgd", "overlap_steps": overlap_steps}


def _runs_then_drain(rank, world, jobs, root):
    """`_runs`, then the wrapper alone in this world: returns (rank 0's runs, whether every
    replica holds the same parameters before and after `end_period`, the syncs merged)."""
    out = _runs(rank, world, jobs, root)
    torch.manual_seed(100 + rank)  # each rank its own rows (and initial weights, broadcast away)
    mesh = build_mesh({"dp": world})
    model = HPSGD(nn.Linear(8, 4), mesh, overlap_steps=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(1, 6):
        model(torch.randn(16, 8)).square().mean().backward()
        model.clip_grad_norm_(0.0)
        optimizer.step()
        optimizer.zero_grad()
        model.after_step(step)

    def identical() -> bool:
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        every = torch.empty(world * flat.numel())
        comm.all_gather(every, flat, mesh, "dp")
        return all(torch.equal(row, flat) for row in every.view(world, -1))
    before = identical()  # each replica: G plus its own change of step 5, in flight
    model.end_period()
    return out, before, identical(), model.syncs


def test_world2_parity_timeline_and_resume(tmp_path, corpus):
    def tree(lowcomm=None, **sections):
        sections.setdefault("parallel", {"nproc": 2})
        return tiny_tree(tmp_path, corpus, lowcomm=lowcomm or {}, **sections)

    # HPSGD with dropout (the per-rank RNG matters) and AdamW: 8 steps, checkpoints every 4
    h = dict(lowcomm=hpsgd(1), model={"dropout": 0.1}, train={"steps": 8}, checkpoint={"every": 4})
    jobs = [("dp_sgd", tree(train=SGD), None, False),
            ("hpsgd0_sgd", tree(hpsgd(0), train=SGD), None, False),
            ("hpsgd1_sgd", tree(hpsgd(1), train=SGD), None, False),
            ("link0", tree(hpsgd(0), **LINK), None, False),
            ("link1", tree(hpsgd(1), **LINK), None, False),
            ("h", tree(**h), None, False),
            ("h_stopped", tree(**h), 4, False),  # stops after step 4, at a checkpoint
            ("h_stopped", tree(**h), None, True),
            ("h_mid", tree(**h), 3, False),  # stops after step 3, a sync in flight
            ("h_mid", tree(**h), None, True)]
    root = tmp_path / "w2"
    out = run_world(_runs, 2, jobs, str(root), timeout_s=300)[0]

    # (a) nothing in flight, plain SGD: synchronous DP. G + mean_i(x - lr g_i - x) against
    # x - lr mean_i(g_i), equal but for fp32 rounding order; measured 2.4e-7 relative
    dp, sync = _losses(out["dp_sgd"][0]), _losses(out["hpsgd0_sgd"][0])
    assert len(dp) == 20 and dp[-1] < dp[0] - 0.3  # it learns
    assert _rel(sync, dp) < 1e-6, (sync, dp)
    assert {r["hpsgd_staleness"] for r in out["hpsgd0_sgd"][0]} == {0}
    # one step in flight: the same first step (nothing stale yet), then a different path
    stale = _losses(out["hpsgd1_sgd"][0])
    assert stale[0] == sync[0] and stale[1:] != sync[1:]
    assert [r["hpsgd_staleness"] for r in out["hpsgd1_sgd"][0]] == [0] + [1] * 19

    # (c) the timeline of step 3: the all-reduce of step 2's change runs during step 3's
    # forward and backward with one step in flight, and after them when waited for at once
    spans = {name: json.loads((root / name / "timeline.json").read_text())["spans"]
             for name in ("link0", "link1")}
    computed = [s for s in spans["link1"] if s["name"] == "forward+backward step 3"]
    synced = [s for s in spans["link1"] if s["name"] == "all_reduce change of step 2"]
    assert len(computed) == len(synced) == 1, spans["link1"]
    assert synced[0]["start_s"] < computed[0]["end_s"], spans["link1"]
    # the all-reduce's seconds that overlap computation (waits excluded): measured 18 ms, the
    # step's forward, backward and optimizer step, of the 111 ms
    hidden = hidden_s(spans["link1"], "reduce")
    assert hidden > 0.0, spans["link1"]
    assert hidden_s(spans["link0"], "reduce") == 0.0, spans["link0"]  # issued after compute
    # the seconds waited for the sync (the exposed part) on the timeline step, rank 0
    wait = {name: out[name][0][2]["hpsgd_sync_wait_s"] for name in ("link0", "link1")}
    assert wait["link0"] > 0.09, wait  # the 111 ms delay less its launch: measured 0.110
    assert wait["link1"] < wait["link0"] - 0.5 * hidden, (wait, hidden)  # measured 0.092

    # (e) resume at a checkpoint: the sync drained there in both runs, each replica's own
    # AdamW state and RNG restored: bitwise
    reference = _losses(out["h"][0])
    records, saved = out["h_stopped"]
    assert saved == ["step_00000004", "step_00000008"]
    assert _losses(records) == reference  # == on floats
    # a stop between checkpoints drains the sync of step 3 early (no staleness at step 4)
    losses = _losses(out["h_mid"][0])
    assert losses[:3] == reference[:3] and losses[3:] != reference[3:]
    assert losses[-1] < losses[0]


def test_world4_one_step_stale_learns_like_dp_on_dp_bytes(tmp_path, corpus):
    """(b), (d): AdamW, 20 steps of the same rows: synchronous DP, HPSGD waiting at once, and
    HPSGD with one step in flight; then the wrapper alone: end_period leaves one model."""
    names = ("dp", "hpsgd0", "hpsgd1")
    trees = [tiny_tree(tmp_path, corpus, parallel={"nproc": 4}, lowcomm=lowcomm)
             for lowcomm in ({}, hpsgd(0), hpsgd(1))]
    jobs = [(name, t, None, False) for name, t in zip(names, trees)]
    ranks = run_world(_runs_then_drain, 4, jobs, str(tmp_path / "w4"), timeout_s=300)
    out = ranks[0][0]
    dp, sync, stale = (_losses(out[name][0]) for name in names)
    assert stale[-1] < stale[0] - 0.3, stale  # it learns: measured 5.48 -> 4.20
    # the mean of 4 replicas' AdamW updates is not AdamW on the mean gradient: waiting at once
    # ends at 4.17 against DP's 4.06 (+2.8%); one step in flight adds little to that: 4.20
    # (+3.5% on DP, +0.7% on waiting at once)
    assert stale[-1] < 1.06 * dp[-1], (stale, dp)
    assert abs(stale[-1] - sync[-1]) < 0.02 * sync[-1], (stale, sync)
    sent = {name: sum(r["comm_bytes"].get("all_reduce", 0) for r in out[name][0]) for name in names}
    # one model-sized all-reduce per step each (the gradient, or the change), plus the same
    # control and loss all-reduces: equal to the byte, 4,163,280 bytes per rank each
    assert sent["hpsgd1"] == sent["hpsgd0"] == sent["dp"], sent
    # end_period: one model on every replica, bitwise (G is built from all-reduced values
    # only), where just before each held G plus its own change; 5 syncs merged
    assert [r[1:] for r in ranks] == [(False, True, 5)] * 4, [r[1:] for r in ranks]


@pytest.mark.parametrize("lowcomm,why", [
    ({"algorithm": "hpsgd", "overlap_steps": 2},
     "lowcomm.overlap_steps=2 with lowcomm.algorithm='hpsgd': HPSGD keeps at most one step's"),
    ({"algorithm": "hpsgd", "inner_steps": 4},
     "lowcomm.inner_steps is not read by lowcomm.algorithm='hpsgd'"),
    ({"algorithm": "local_sgd", "overlap_steps": 0},
     "lowcomm.overlap_steps is not read by lowcomm.algorithm='local_sgd'"),
])
def test_config_refuses_what_hpsgd_does_not_run(tmp_path, corpus, lowcomm, why):
    with pytest.raises(ConfigError, match="lowcomm") as err:
        config_from_dict(tiny_tree(tmp_path, corpus, lowcomm=lowcomm))
    assert why in str(err.value), str(err.value)


def test_config_accepts_hpsgd(tmp_path, corpus):
    for overlap in (0, 1):
        cfg = config_from_dict(tiny_tree(tmp_path, corpus, lowcomm=hpsgd(overlap),
                                         checkpoint={"every": 3}, parallel={"nproc": 4}))
        assert (cfg.lowcomm.algorithm, cfg.lowcomm.overlap_steps) == ("hpsgd", overlap)
    default = config_from_dict(tiny_tree(tmp_path, corpus, lowcomm={"algorithm": "hpsgd"}))
    assert default.lowcomm.overlap_steps == 1  # the paper's setting
