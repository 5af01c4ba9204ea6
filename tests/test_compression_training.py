"""Gradient compression in training (parallel/data.py, lowcomm/diloco.py, the trainer, the
checkpoint): the config's rules, the oracle (top-k keeping everything at world 2 is DP bit for
bit, on gradients and on DiLoCo's pseudo-gradients), top-k 1% learning on fewer bytes with
its figures logged, and a resume that restores the error-feedback residuals bitwise.

One spawn at world 2 runs every training case."""

from __future__ import annotations

import re

import pytest

from conftest import tiny_tree
from harness import run_world
from loomtrain.errors import ConfigError
from loomtrain.train.config import config_from_dict
from test_lowcomm import _losses, _runs


@pytest.mark.parametrize("sections, says", [
    ({"compression": {"method": "powersgd", "ratio": 0.1}}, "compression.ratio is not read"),
    ({"compression": {"method": "topk", "rank": 8}}, "compression.rank is not read"),
    ({"compression": {"error_feedback": False}}, 'compression.method="none"'),
    ({"compression": {"method": "topk", "applies_to": "pseudo_gradients"}},
     'lowcomm.algorithm="diloco"'),
    ({"compression": {"method": "sign"}, "lowcomm": {"algorithm": "local_sgd"}},
     "reduces no gradients"),
    ({"compression": {"method": "int8"}, "parallel": {"nproc": 2, "zero_stage": 2}},
     "ZeRO stage 0"),
    ({"compression": {"method": "zip"}}, "method"),
])
def test_config_refuses_what_compression_does_not_do(tmp_path, corpus, sections, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        config_from_dict(tiny_tree(tmp_path, corpus, **sections))


def test_config_accepts_each_method(tmp_path, corpus):
    for method in ("topk", "randomk", "powersgd", "int8", "sign"):
        cfg = config_from_dict(tiny_tree(tmp_path, corpus, compression={"method": method},
                                         comm={"sparse_allreduce": "balanced"}))
        assert cfg.compression.method == method and cfg.comm.sparse_allreduce == "balanced"
    cfg = config_from_dict(tiny_tree(tmp_path, corpus, lowcomm={"algorithm": "diloco"},
                                     compression={"method": "powersgd",
                                                  "applies_to": "pseudo_gradients"}))
    assert cfg.compression.applies_to == "pseudo_gradients"


def test_world2_oracle_learning_metrics_and_resume(tmp_path, corpus):
    def tree(compression=None, **sections):
        return tiny_tree(tmp_path, corpus, parallel={"nproc": 2}, compression=compression or {},
                         **sections)

    everything = {"method": "topk", "ratio": 1.0}  # sends every value, with its index
    diloco = {"algorithm": "diloco", "inner_steps": 2}
    topk = {"method": "topk", "ratio": 0.01, "error_every": 5}
    # top-k 5% with error feedback, 8 steps, checkpoints every 4: the residual must come back
    stopping = dict(compression={"method": "topk", "ratio": 0.05}, train={"steps": 8},
                    checkpoint={"every": 4})
    jobs = [("dp", tree(), None, False),
            ("topk_all", tree(everything), None, False),
            ("topk_all_balanced", tree(everything, comm={"sparse_allreduce": "balanced"}), None,
             False),
            ("topk_1pct", tree(topk), None, False),
            ("diloco", tree(lowcomm=diloco), None, False),
            ("diloco_topk_all", tree({**everything, "applies_to": "pseudo_gradients"},
                                     lowcomm=diloco), None, False),
            ("ref", tree(**stopping), None, False),
            ("stopped", tree(**stopping), 6, False),  # stops after step 6, with a checkpoint
            ("stopped", tree(**stopping), None, True)]
    out = run_world(_runs, 2, jobs, str(tmp_path / "w2"), timeout_s=300)[0]

    # the oracle: at world 2 a sum of two values is the same float in any order, so top-k
    # keeping every value (an all-gather of every (index, value) pair, or Zen's partitions)
    # reproduces the dense all-reduce, and DP's losses, bit for bit
    dp = _losses(out["dp"][0])
    assert dp[-1] < dp[0] - 0.3
    assert _losses(out["topk_all"][0]) == dp  # == on floats
    assert _losses(out["topk_all_balanced"][0]) == dp
    assert _losses(out["diloco_topk_all"][0]) == _losses(out["diloco"][0])

    # top-k 1% with error feedback learns, on far fewer gradient bytes, and logs its figures
    records = out["topk_1pct"][0]
    losses = _losses(records)
    assert losses[-1] < losses[0] - 0.2, losses
    sent = {name: sum(sum(v for k, v in r["comm_bytes"].items() if k in ("all_gather", "all_to_all",
                                                                           "all_reduce"))
                      for r in out[name][0]) for name in ("dp", "topk_1pct")}
    assert sent["topk_1pct"] < sent["dp"] / 5, sent
    assert all(r["compression_ratio"] > 5 and 0 < r["compression_local_error"] < 1
               for r in records)
    measured = [r for r in records if "compression_error" in r]
    assert [r["step"] for r in measured] == [5, 10, 15, 20]
    assert all(0 < r["compression_error"] < 1.5 for r in measured)
    assert all(r["comm_bytes"].get("all_reduce_diagnostic", 0) > 0 for r in measured)
    # the diagnostic is listed, not counted in the total
    for r in measured:
        assert r["comm_bytes"]["total"] == sum(v for k, v in r["comm_bytes"].items()
                                               if k not in ("total", "all_reduce_diagnostic"))
    assert all("compression_ratio" not in r for r in out["dp"][0])

    # resume: the error-feedback residual of every rank comes back, so steps 7-8 are bitwise
    # the unstopped run's (without it they would differ: the residual carries 95% of each
    # gradient)
    reference = _losses(out["ref"][0])
    records, saved = out["stopped"]
    assert saved == ["step_00000006", "step_00000008"]
    assert _losses(records) == reference


def _resume_under_other_settings(rank, world, pairs, root):
    """For each (first, second): train `first` to its end, then resume its folder under
    `second`; the CheckpointError's message per pair (None where it resumed)."""
    from pathlib import Path

    from loomtrain import comm
    from loomtrain.errors import CheckpointError
    from loomtrain.train import checkpoint, trainer
    from loomtrain.train.launch import init_distributed
    from loomtrain.train.run import train_loop

    out = []
    for i, (first, second) in enumerate(pairs):
        run_dir = Path(root) / f"run{i}"
        cfg = config_from_dict(first)
        train_loop(cfg, run_dir, None, init_distributed(cfg), trainer.StopFlag())
        cfg = config_from_dict(second)
        mesh = init_distributed(cfg)
        comm.barrier(mesh)  # rank 0 has published the last checkpoint
        try:
            train_loop(cfg, run_dir, checkpoint.list_checkpoints(run_dir)[-1], mesh,
                       trainer.StopFlag())
        except CheckpointError as err:
            out.append(str(err))
        else:
            out.append(None)
    return out


def test_compression_state_that_does_not_fit_the_run_is_refused(tmp_path, corpus):
    """Top-k's residuals under other buckets, and PowerSGD's warm-start Q at another rank: a
    CheckpointError (exit 2 from the CLI) while the checkpoint loads, before any step (PowerSGD's
    used to fail inside the first step's backward, with a traceback, after the resume had
    rewritten config.toml)."""
    def tree(bucket_mb, steps, compression):
        return tiny_tree(tmp_path, corpus, parallel={"nproc": 2, "bucket_mb": bucket_mb},
                         compression=compression, train={"steps": steps})
    topk = {"method": "topk", "ratio": 0.05}
    pairs = [(tree(0.01, 2, topk), tree(0.05, 4, topk)),
             (tree(0.01, 2, {"method": "powersgd", "rank": 2}),
              tree(0.01, 4, {"method": "powersgd", "rank": 3}))]
    ranks = run_world(_resume_under_other_settings, 2, pairs, str(tmp_path), timeout_s=120)
    for topk_said, powersgd_said in ranks:
        assert topk_said and "does not fit this run's" in topk_said \
            and "parallel.bucket_mb" in topk_said, topk_said
        assert powersgd_said and "PowerSGD warm-start Q of gradient bucket" in powersgd_said \
            and "compression.rank=3 needs" in powersgd_said, powersgd_said


def _starts_during_backward(rank, world):
    """A GPT in the DP engine with small buckets and a compressor that records when each
    bucket's exchange starts; the embedding's gradient (the backward's last) records when it is
    ready. Returns (start times, embedding ready time, buckets)."""
    import time

    import torch

    from loomtrain.comm.compress import build_compressor
    from loomtrain.mesh import build_mesh
    from loomtrain.models.gpt import GPT
    from loomtrain.parallel.data import DataParallel

    class Recording:
        def __init__(self, inner):
            self.inner, self.starts = inner, []

        def start(self, *args):
            self.starts.append(time.perf_counter())
            return self.inner.start(*args)

    torch.manual_seed(0)
    gpt = GPT(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=2)
    ready = []
    gpt.tok_emb.weight.register_post_accumulate_grad_hook(lambda p: ready.append(time.perf_counter()))
    compressor = Recording(build_compressor("topk", 0.1, 4, True, 0))
    model = DataParallel(gpt, build_mesh({"dp": world}), bucket_mb=0.02, last_bucket_mb=0.0,
                         compressor=compressor)
    x = torch.randint(0, 64, (2, 16))
    model(x).square().mean().backward()
    return compressor.starts, ready[0], len(model.buckets)


def test_bucket_exchanges_start_during_backward():
    """The overlap: every bucket but the embedding's is compressed and its exchange started
    before the backward reaches the embedding (the last gradient)."""
    for starts, embedding_ready, buckets in run_world(_starts_during_backward, 2, timeout_s=120):
        assert buckets >= 3 and len(starts) == buckets
        assert sum(t < embedding_ready for t in starts) >= buckets - 1, (starts, embedding_ready)
