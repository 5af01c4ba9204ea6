"""Checkpoints across layouts (issue 28): a run saved under pp, cp, tp, ZeRO and bf16, in
rich combinations, resumes under another layout at world 4 and on one process, continuing
the uninterrupted loss curve (relative 1e-4); `loom export` of each checkpoint gives the
full tensors a single process loads from it. Three spawned worlds: the saving runs (world 4),
their resumes in other layouts (world 4), and on one process the references and a resume of
each. Checkpoints written before 2026-12-06 (param groups by parameter name) load, in this
process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from conftest import tiny_tree
from harness import run_world
from loomtrain.cli import main
from loomtrain.errors import CheckpointError
from loomtrain.models import build_model
from loomtrain.optim import build_optimizer
from loomtrain.parallel.placement import Boxes
from loomtrain.parallel.state import PLAIN
from loomtrain.train import checkpoint, trainer
from loomtrain.train.config import config_from_dict
from loomtrain.train.launch import init_distributed
from loomtrain.train.metrics import read_metrics
from loomtrain.train.run import train_loop

LLAMA = {"name": "llama", "n_layers": 4, "d_model": 32, "n_heads": 4, "n_kv_heads": 2}
GPT = {"name": "gpt"}
BF16 = {"precision": "bf16"}
# name -> (model, train, the saving layout at world 4, the layout it resumes in at world 4)
CASES = {
    "llama_pp2_tp2": (LLAMA, {}, {"pp": 2, "tp": 2, "schedule": "1f1b"}, {"zero_stage": 3}),
    "zero3_pp2_dp2": (GPT, {}, {"pp": 2, "zero_stage": 3, "schedule": "interleaved",
                                "virtual_stages": 2},
                      {"pp": 2, "tp": 2, "zero_stage": 1, "schedule": "1f1b"}),
    "tp2_cp2_zero2": (GPT, {}, {"tp": 2, "cp": 2, "zero_stage": 2}, {"pp": 4, "schedule": "1f1b"}),
    "bf16_zero1_pp2": (GPT, BF16, {"pp": 2, "zero_stage": 1, "schedule": "zb-h1"},
                       {"pp": 2, "tp": 2, "schedule": "zb-h1"}),
    "tp2_sp_zero3_dp2": (GPT, {}, {"tp": 2, "sequence_parallel": True, "zero_stage": 3},
                         {"pp": 2, "cp": 2, "schedule": "1f1b"}),
    "hier_zero3_dp4": (GPT, {}, {"zero_stage": 3, "hierarchical": True, "ranks_per_node": 2},
                       {"tp": 2}),
}
STEPS, SAVED = 12, 6


def _tree(tmp_path, corpus, world: int, model: dict, train: dict, parallel: dict) -> dict:
    return tiny_tree(tmp_path, corpus, model=model, train={"steps": STEPS, **train},
                     parallel={"nproc": world, **parallel}, checkpoint={"every": SAVED})


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


def _full(value) -> torch.Tensor:
    """A state entry as the full tensor (a ZeRO layout's are boxes of it)."""
    if not isinstance(value, Boxes):
        return value.detach().clone()
    full = torch.empty(value.shape, dtype=value.boxes[0][2].dtype)
    for offsets, sizes, view in value.boxes:
        full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = view
    return full


def _resume_capturing(rank, world, jobs, out):
    """`_jobs` on one process, each resume also writing the model it loaded, as full tensors,
    to `out`/<run folder name>.pt."""
    real = trainer.restore

    def restore(built, path, extra=None):
        meta = real(built, path, extra)
        state = checkpoint.training_state(built.model, built.optimizer, layout=built.layout or PLAIN)
        torch.save({k: _full(v) for k, v in state["model"].items()},
                   Path(out) / f"{Path(path).parents[1].name}.pt")
        return meta

    trainer.restore = restore
    return _jobs(rank, world, jobs)


def _rel(curve: dict, reference: dict) -> float:
    assert sorted(curve) == list(range(SAVED + 1, STEPS + 1)), sorted(curve)
    return max(abs(curve[s] - reference[s]) / reference[s] for s in curve)


def test_every_layout_resumes_in_another_and_on_one_process_and_exports(tmp_path, corpus):
    saved = {n: str(tmp_path / "save" / n) for n in CASES}
    curves = run_world(_jobs, 4, [(_tree(tmp_path, corpus, 4, m, t, p), saved[n], None)
                                  for n, (m, t, p, _) in CASES.items()], timeout_s=400)[0]
    saving = dict(zip(CASES, curves))
    at = {n: str(checkpoint.step_dir(Path(saved[n]), SAVED)) for n in CASES}
    resumed4 = run_world(_jobs, 4, [(_tree(tmp_path, corpus, 4, m, t, r), str(tmp_path / "w4" / n), at[n])
                                    for n, (m, t, _, r) in CASES.items()], timeout_s=400)[0]
    captured = tmp_path / "captured"
    captured.mkdir()
    references = [(_tree(tmp_path, corpus, 1, m, {}, {}), str(tmp_path / "ref" / m["name"]), None)
                  for m in (GPT, LLAMA)]
    one = run_world(_resume_capturing, 1,
                    references + [(_tree(tmp_path, corpus, 1, m, t, {}), str(tmp_path / "w1" / n), at[n])
                                  for n, (m, t, _, _) in CASES.items()],
                    str(captured), timeout_s=300)[0]
    reference = {"gpt": one[0], "llama": one[1]}
    for name, curve4, curve1 in zip(CASES, resumed4, one[2:]):
        model, train = CASES[name][:2]
        # bf16 follows its own uninterrupted curve; fp32 the single-process one
        ref = saving[name] if train else reference[model["name"]]
        for world, curve in ((4, curve4), (1, curve1)):
            assert _rel(curve, ref) < 1e-4, (name, world, _rel(curve, ref))
    for name in CASES:  # the export of each layout's checkpoint: what one process loads
        run_dir = tmp_path / "export" / name
        shutil.copytree(at[name], checkpoint.step_dir(run_dir, SAVED))
        model, train = CASES[name][:2]
        trainer.write_config(run_dir, config_from_dict(_tree(tmp_path, corpus, 1, model, train, {})))
        assert main(["export", str(run_dir), "--out", str(run_dir / "model.safetensors")]) == 0
        exported = load_file(str(run_dir / "model.safetensors"))
        loaded = torch.load(captured / f"{name}.pt")
        with torch.device("meta"):
            names = set(build_model(config_from_dict(_tree(tmp_path, corpus, 1, model, train, {})).model)
                        .state_dict())
        assert set(exported) == names, (name, set(exported) ^ names)
        for key in loaded:
            assert exported[key].dtype == torch.float32, (name, key)  # bf16's fp32 masters
            assert torch.equal(exported[key], loaded[key]), (name, key)


def _saved_groups(tiny, tmp_path, groups, unsaved: str = "") -> tuple[Path, object]:
    """A one-process checkpoint whose param groups are `groups(hyperparameters by group index,
    each group's parameter names)`, without the optimizer state under name `unsaved`; and its
    config."""
    cfg = tiny()
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.train)
    checkpoint.init_optimizer_state(optimizer)
    state = checkpoint.training_state(model, optimizer)
    names = [[n for n, p in model.named_parameters() if any(p is q for q in g["params"])]
             for g in optimizer.param_groups]
    hyper = [{**g, "lr": 0.25 + i} for i, g in enumerate(state["optim"]["param_groups"])]
    state["optim"]["param_groups"] = groups(hyper, names)
    state["optim"]["state"].pop(unsaved, None)
    state["rng.rank0.cpu"] = torch.get_rng_state()
    path = tmp_path / "step"
    dcp.save(state, checkpoint_id=path, no_dist=True)
    (path / "loom.json").write_text(json.dumps({"step": 1, "world": 1}))
    return path, cfg


ONE = SimpleNamespace(rank=0, world=1, device=torch.device("cpu"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("form", ["by_name", "with_params"])
def test_param_groups_written_before_2026_12_06_load(tiny, tmp_path, form):
    """A pipeline wrote them keyed by parameter name; the other layouts as torch's list with
    each group's parameter names. Both give each group its own hyperparameters back."""
    def groups(hyper, names):
        if form == "by_name":
            return {n: g for g, group in zip(hyper, names) for n in group}
        return [{**g, "params": group} for g, group in zip(hyper, names)]

    path, cfg = _saved_groups(tiny, tmp_path, groups)
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.train)
    checkpoint.load(path, model, optimizer, ONE)
    assert [g["lr"] for g in optimizer.param_groups] == [0.25, 1.25]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [cfg.train.weight_decay, 0.0]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_tied_head_without_its_own_optimizer_state_is_refused(tiny, tmp_path):
    """Before 2026-12-06 a tied parameter's optimizer state was saved under its first name
    only (tok_emb.weight): a pipeline's last stage, which holds the head alone, is told why."""
    path, cfg = _saved_groups(tiny, tmp_path, lambda hyper, names: hyper, unsaved="head.weight")
    last_stage = torch.nn.ModuleDict({"head": torch.nn.Linear(cfg.model.d_model, 256, bias=False)})
    with pytest.raises(CheckpointError, match="no optimizer state for head.weight: it was written "
                                              "before 2026-12-06"):
        checkpoint.load(path, last_stage, build_optimizer(last_stage, cfg.train), ONE)
