"""Resharding: a checkpoint written at one ZeRO stage and rank count resumes at any other and
continues the single-process loss curve."""

from __future__ import annotations

from pathlib import Path

from conftest import tiny_tree
from harness import run_world
from loomtrain.train import trainer
from loomtrain.train.checkpoint import read_metadata, step_dir
from loomtrain.train.config import config_from_dict
from loomtrain.train.launch import init_distributed
from loomtrain.train.metrics import read_metrics
from loomtrain.train.run import train_loop


def _jobs(rank, world, jobs):
    """Run (config tree, run folder, checkpoint to resume or None) jobs in turn in this world;
    rank 0 returns each run's {step: loss}."""
    out = []
    for tree, run_dir, resume in jobs:
        cfg = config_from_dict(tree)
        train_loop(cfg, Path(run_dir), Path(resume) if resume else None, init_distributed(cfg),
                   trainer.StopFlag())
        out.append({r["step"]: r["loss"] for r in read_metrics(run_dir)} if rank == 0 else None)
    return out


def test_reshard_on_load_across_stages_and_rank_counts(tmp_path, corpus):
    def tree(world, **parallel):
        return tiny_tree(tmp_path, corpus, train={"steps": 8}, checkpoint={"every": 4},
                         parallel={"nproc": world, **parallel})

    def run(world, *jobs):
        return run_world(_jobs, world, [(t, str(tmp_path / d), r) for t, d, r in jobs],
                         timeout_s=240)[0]

    reference = run(1, (tree(1), "ref", None))[0]
    stage0 = run(2, (tree(2), "stage0_w2", None))[0]
    hier = {"zero_stage": 3, "hierarchical": True, "ranks_per_node": 2}
    stage3, from_stage0 = run(
        4, (tree(4, **hier), "stage3_w4", None),
        (tree(4, **hier, optimizer_shard="dp"), "from_stage0", step_dir(tmp_path / "stage0_w2", 4)))
    saved = step_dir(tmp_path / "stage3_w4", 4)
    # the sharded checkpoint holds the unsharded names and shapes (boxes of every rank's range)
    shapes = {k: tuple(v.size) for k, v in read_metadata(saved).state_dict_metadata.items()
              if k.startswith("model.")}
    assert shapes["model.blocks.0.attn.qkv.weight"] == (96, 32)
    assert shapes["model.head.weight"] == shapes["model.tok_emb.weight"] == (256, 32)
    (to_stage1,) = run(2, (tree(2, zero_stage=1), "to_stage1", saved))
    (to_one,) = run(1, (tree(1), "to_one", saved))
    for curve in (stage0, stage3):
        assert sorted(curve) == list(range(1, 9))
    for curve in (from_stage0, to_stage1, to_one):
        assert sorted(curve) == [5, 6, 7, 8]  # resumed after step 4
    # another layout sums in another order: fp32 round-off only, as in the oracle tests
    for curve in (stage0, stage3, from_stage0, to_stage1, to_one):
        for step, loss in curve.items():
            assert abs(loss - reference[step]) / reference[step] < 1e-4, (step, loss, reference[step])
