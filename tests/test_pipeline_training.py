"""Pipeline parallelism in the trainer (`parallel.pp`): every synchronous schedule reproduces
the single-process loss curve (alone, with recomputation and offload; composed with the other
axes: tests/test_weave.py), offload and recomputation lower the measured activation peak, and a
recorded step writes its timeline (checkpoints: tests/test_checkpoint_layouts.py)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_tree
from harness import run_world
from loomtrain.models import build_model
from loomtrain.optim import build_optimizer
from loomtrain.train.apply import parallelize
from loomtrain.parallel.pipeline import runtime_of
from loomtrain.train.config import config_from_dict
from loomtrain.train.launch import init_distributed
from loomtrain.train.metrics import read_metrics
from test_zero import _train_many

MODEL = {"n_layers": 6}  # 8 layers (embed, 6 blocks, head): enough for pp=4 x 2 virtual stages
PP_ORACLE = {  # world -> configurations checked against the single-process run
    2: [{"pp": 2, "schedule": "gpipe", "offload_activations": 1.0},
        {"pp": 2, "schedule": "1f1b", "recompute": "full"},
        {"pp": 2, "schedule": "zb-h1", "offload_activations": 0.5, "recompute": "selective"},
        {"pp": 2, "schedule": "interleaved", "virtual_stages": 2, "pipeline_balance": "time"},
        # a budget of 0.7 MiB holds one micro-batch of each stage (0.38 and 0.46 MiB), so
        # the plan recomputes the others
        {"pp": 2, "schedule": "optimal", "activation_budget_mb": 0.7}],
    4: [{"pp": 4, "schedule": "gpipe"}, {"pp": 4, "schedule": "1f1b"},
        {"pp": 4, "schedule": "zb-h1"}, {"pp": 4, "schedule": "interleaved", "virtual_stages": 2}],
}  # pp with dp, ZeRO, tp and cp: tests/test_weave.py


def _runs(tmp_path, corpus, world, parallels, name, **sections):
    trees = [tiny_tree(tmp_path, corpus, model=MODEL, parallel={"nproc": world, **p}, **sections)
             for p in parallels]
    run_world(_train_many, world, trees, str(tmp_path / name), timeout_s=280)
    return [read_metrics(tmp_path / name / f"run{i}") for i in range(len(trees))]


def test_oracle_every_schedule_alone(tmp_path, corpus):
    reference = _runs(tmp_path, corpus, 1, [{}], "ref")[0]
    assert len(reference) == 20 and reference[-1]["loss"] < reference[0]["loss"] - 0.3
    for world, configs in PP_ORACLE.items():
        for cfg, records in zip(configs, _runs(tmp_path, corpus, world, configs, f"w{world}")):
            # the same sums in another order (the micro-batches' gradients accumulate stage by
            # stage, zero-bubble's deferred weight matmuls, ZeRO's shard-wise norms): ~1e-7
            for key in ("loss", "grad_norm"):
                rel = max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(records, reference))
                assert rel < 1e-4, (world, cfg, key, rel)


def _peaks(rank, world, tree, variants):
    """This rank's peak of live activation bytes over one training step, per variant."""
    out = {}
    for name, parallel in variants.items():
        cfg = config_from_dict({**tree, "parallel": {**tree["parallel"], **parallel}})
        mesh = init_distributed(cfg)
        torch.manual_seed(0)
        model, optimizer, loss_fn = parallelize(build_model(cfg.model), mesh, cfg,
                                                lambda m: build_optimizer(m, cfg.train))
        batches = [(torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32)))
                   for _ in range(cfg.accumulation_steps)]
        runtime = runtime_of(model)
        runtime.measure_activations = True
        runtime.stash.synchronous = True  # copies done when the schedule says: load-proof
        runtime.train_step(model, batches, 8 * 32.0, loss_fn)
        out[name] = runtime.stash.peak_bytes
        runtime.stash.close()
    return out


def test_offload_and_recompute_lower_the_measured_activation_peak(tmp_path, corpus):
    tree = tiny_tree(tmp_path, corpus, model=MODEL, parallel={"nproc": 2, "pp": 2, "schedule": "gpipe"})
    variants = {"none": {}, "offload": {"offload_activations": 1.0},
                "half": {"offload_activations": 0.5}, "full": {"recompute": "full"},
                "selective": {"recompute": "selective"},
                "optimal": {"schedule": "optimal", "activation_budget_mb": 0.7}}
    for peaks in run_world(_peaks, 2, tree, variants, timeout_s=120):
        # GPipe stashes all 4 micro-batches. With the copies waited for (the stash's
        # `synchronous`: on a loaded machine a copy thread can lag a whole forward, which
        # says nothing about the schedule), offloading every one leaves two on the device
        # at most (the one computing, and the one reloaded a compute ahead of its backward)
        assert peaks["offload"] <= 0.5 * peaks["none"] + 1, peaks
        assert peaks["offload"] < peaks["half"] < peaks["none"], peaks
        # recomputation keeps each stage input, and one micro-batch's activations while
        # its backward runs; selective drops only the attention core's
        assert peaks["full"] < 0.5 * peaks["none"], peaks
        assert peaks["selective"] < peaks["none"], peaks
        # the memory-budgeted plan keeps the measured peak within its budget
        assert peaks["none"] > 0.7 * 2**20 >= peaks["optimal"], peaks


def test_recorded_step_writes_the_timeline_and_logs_the_bubble(tmp_path, corpus):
    config = [{"pp": 2, "schedule": "1f1b"}]
    records = _runs(tmp_path, corpus, 2, config, "tl", run={"timeline_step": 3},
                    train={"steps": 4})[0]
    assert [("bubble" in r) for r in records] == [False, False, True, False]
    doc = json.loads((tmp_path / "tl" / "run0" / "pipeline_timeline.json").read_text())
    assert doc["schedule"] == "1f1b" and doc["pp"] == 2 and doc["microbatches"] == 4
    assert doc["bubble_theory"] == pytest.approx(1 / 5)
    assert 0 < doc["bubble_measured"] == records[2]["bubble"] < 1
    for rank in doc["ranks"]:
        computed = sorted(s["name"] for s in rank["spans"] if s["kind"] in ("F", "B"))
        r = rank["rank"]
        assert computed == sorted(f"{k}{m}.{r}" for k in "FB" for m in range(4))
