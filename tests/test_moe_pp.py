"""The mixture of experts under pipeline parallelism (issue 29): a MoE block on the meta device
gives its shape (the stages' split), a stage's blocks keep their rows among the whole model's,
and the synchronous schedules, with expert parallelism and ZeRO inside each stage, reproduce
the single-process losses and expert loads (fp32, 1e-4; bf16 within 2%), a pipeline's
checkpoint resumes under another cut and ep, and the dry run predicts their collectives."""

from __future__ import annotations

from importlib import import_module
from types import SimpleNamespace

import torch
from conftest import refused, tiny_tree
from harness import run_world
from test_moe import MODEL, STEPS, _cfg, _check_dry_run, _metered, _rel_loss

from loomtrain.models import build_model
from loomtrain.models.moe import MoE
from loomtrain.parallel.expert.balance import moe_layers, moe_rows
from loomtrain.parallel.pipeline import split
from loomtrain.train.checkpoint import step_dir
from loomtrain.train.metrics import read_metrics

# blocks 1 and 3 are MoE, 0 and 2 dense: with embed and head, 6 layers to cut into stages
DEEP = {"n_layers": 4, "moe_every": 2}


def test_a_moe_block_on_the_meta_device_gives_its_shape():
    moe = MoE(_cfg()).to("meta")
    out = moe(torch.empty(2, 5, 32, device="meta"))
    assert out.shape == (2, 5, 32) and out.is_meta


def test_a_stage_holds_its_blocks_rows_among_the_whole_models(monkeypatch):
    """Cut after block 2 (embed, blocks 0-2 | block 3, head), on the meta device, as the run
    cuts (no real forward for the shapes): stage 0 holds the first of the two MoE blocks,
    stage 1 the second; each is the row of its block, not its stage's."""
    def no_real_forward(*_):
        raise AssertionError("the stage shapes need a real forward")
    # the module, which the package's function `split` hides
    monkeypatch.setattr(import_module("loomtrain.parallel.pipeline.split"), "_real_shapes",
                        no_real_forward)
    cfg = _cfg(**DEEP)
    rows = []
    for rank in (0, 1):
        mesh = SimpleNamespace(size=lambda axis: 2, local_rank=lambda axis, r=rank: r,
                               device=torch.device("cpu"))
        with torch.device("meta"):
            model = build_model(cfg)
        module, shapes, _ = split(model, mesh, 2, torch.zeros(1, 16, dtype=torch.long), [4])
        assert shapes[0] == (torch.Size([1, 16, 32]), torch.float32)
        assert len(moe_layers(module)) == 1
        rows.append(moe_rows(module, cfg))
    assert rows == [[0], [1]]


# world 2: pp 2 under each synchronous schedule (the optimal one profiles its stages at build:
# backwards the step's counts must not include); stage 0 of the zero-bubble one holds dense
# blocks only (it fills no row of the step's expert table); 1F1B in bf16, within 2% of fp32
BF16 = {"precision": "bf16"}
PP2 = [({"pp": 2, "schedule": "interleaved", "virtual_stages": 2, "recompute": "full"}, {}),
       ({"pp": 2, "schedule": "zb-h1", "split_points": [2], "offload_activations": 0.5}, {}),
       ({"pp": 2, "schedule": "optimal"}, {}),
       ({"pp": 2, "schedule": "1f1b"}, BF16)]
# world 4: dp 2 in each stage: ep 2 x pp 2, and with ZeRO-3 (the experts' units sharded
# over edp: each rank alone at ep = dp) and zero-bubble; then ep 2 x pp 2 again, resumed from
# the zero-bubble run's checkpoint (another cut: the routers' biases move between stages)
PP4 = [({"pp": 2, "ep": 2, "schedule": "1f1b"}, {}),
       ({"pp": 2, "ep": 2, "zero_stage": 3, "schedule": "zb-h1"}, {})]
SAVED, SAVER = 6, 1


def _check(got: list, want: list, layout) -> None:
    """A run's records against the single-process ones of the same steps."""
    if layout[1] == BF16:
        assert _rel_loss(got, want) < 0.02, (layout, _rel_loss(got, want))
        return
    assert _rel_loss(got, want) < 1e-4, (layout, _rel_loss(got, want))
    by_step = {r["step"]: r for r in want}
    for r in got:
        ref = by_step[r["step"]]
        assert r["moe_tokens_per_expert"] == ref["moe_tokens_per_expert"], (layout, r["step"])
        assert abs(r["moe_aux_loss"] - ref["moe_aux_loss"]) < 1e-5, (layout, r["step"])


def test_pipeline_and_expert_parallelism_reproduce_the_single_process_run(tmp_path, corpus):
    def trees(world, layouts, every=0):
        return [tiny_tree(tmp_path, corpus, model={**MODEL, **DEEP},
                          train={"steps": STEPS, **train}, parallel={"nproc": world, **parallel},
                          checkpoint={"every": every}) for parallel, train in layouts]
    run_world(_metered, 1, trees(1, [({}, {})]), str(tmp_path / "one"), timeout_s=200)
    want = read_metrics(tmp_path / "one" / "run0")
    assert len(want[0]["moe_tokens_per_expert"]) == 2  # both MoE blocks, in block order
    saved = str(step_dir(tmp_path / "2" / f"run{SAVER}", SAVED))
    for world, layouts, resumes in ((2, PP2, []), (4, PP4 + PP4[:1], [None, None, saved])):
        every = SAVED if world == 2 else 0
        ranks = run_world(_metered, world, trees(world, layouts, every),
                          str(tmp_path / str(world)), True, resumes, timeout_s=400)
        for i, tree in enumerate(trees(world, layouts, every)):
            # the dry run is rank 0's: its stage's ranks (pp outermost in the mesh)
            _check_dry_run(tree, [r[i] for r in ranks[:world // 2]])
            got = read_metrics(tmp_path / str(world) / f"run{i}")
            _check(got, want, layouts[i])
    resumed = read_metrics(tmp_path / "4" / f"run{len(PP4)}")
    assert [r["step"] for r in resumed] == list(range(SAVED + 1, STEPS + 1))


def test_the_asynchronous_pipeline_is_refused_with_its_reason(capsys):
    argv = ["train", "--dry-run", "--nproc", "2", "--set", "model.name=llama", "--set",
            "model.n_experts=4", "--set", "parallel.pp=2", "--set", "parallel.schedule=async"]
    assert "a later step than its forward" in refused(capsys, argv)
