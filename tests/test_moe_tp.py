"""The mixture of experts under tensor parallelism (issue 29; parallel/tensor_llama.py): the
attention split over tp, the feed-forward whole on every tp rank (expert tensor-parallel size
1), without and with sequence parallelism, and expert parallelism over the dp ranks of each tp
coordinate (ep x tp). Each layout reproduces the single-process losses (fp32, 1e-4), expert
loads and balance loss, and the dry run predicts its collectives and activations; an ep x tp
checkpoint resumes on one process."""

from __future__ import annotations

from conftest import tiny_tree
from harness import run_world
from test_dryrun import TOLERANCE, saved_activation_bytes
from test_moe import MODEL, STEPS, _check_dry_run, _check_same_run, _metered, _rel_loss

from loomtrain.parallel.tensor_estimate import tensor_activation_bytes
from loomtrain.train.checkpoint import step_dir
from loomtrain.train.config import config_from_dict
from loomtrain.train.metrics import read_metrics

SAVED = 6
# world 4, tp 2 x dp 2: sequence parallelism with the experts whole (recomputed: its balance
# counts' all-reduce runs again); dp 2 as ep 2 in each tp coordinate, without and with sequence
# parallelism, the last under ZeRO-3 with the experts in units of their own (gathered inside
# the MoE's forward, after it starts), saving at step SAVED
LAYOUTS = [{"tp": 2, "sequence_parallel": True, "recompute": "full"}, {"tp": 2, "ep": 2},
           {"tp": 2, "ep": 2, "sequence_parallel": True, "zero_stage": 3,
            "shard_units": ["blocks.*.attn", "blocks.*.mlp.experts"]}]
# the activations of tp-split mixtures of experts: MODEL's, and Qwen's gated shared expert over
# a dense and a MoE block with the softmax router, each with and without sequence parallelism
SHAPES = [MODEL, {**MODEL, "router": "softmax", "shared_expert_gate": True, "moe_every": 2,
                  "moe_hidden": 24, "ffn_hidden": 40}]


def _trained_and_measured(rank, world, trees, root, resumes, shapes) -> tuple:
    """`_metered` (every rank's), then what one forward of each of `shapes` (config trees, tp
    2) saves for backward on this rank (test_dryrun.py `saved_activation_bytes`)."""
    import torch

    from loomtrain.mesh import build_mesh
    from loomtrain.models import build_model
    from loomtrain.parallel import apply_tensor_parallel

    steps = _metered(rank, world, trees, root, True, resumes)
    mesh, saved = build_mesh({"dp": world // 2, "tp": 2}), []
    for tree in shapes:
        cfg = config_from_dict(tree)
        torch.manual_seed(0)
        model, loss_sum = apply_tensor_parallel(build_model(cfg.model), mesh, cfg)
        saved.append(saved_activation_bytes(model, cfg.model.vocab_size, cfg.train.micro_batch,
                                            cfg.model.seq_len, loss_sum))
    return steps, saved


def test_tensor_and_expert_parallelism_reproduce_the_single_process_run(tmp_path, corpus):
    def trees(world, layouts, saves=()):
        return [tiny_tree(tmp_path, corpus, model=MODEL, train={"steps": STEPS},
                          parallel={"nproc": world, **parallel},
                          checkpoint={"every": SAVED if parallel in saves else 0})
                for parallel in layouts]
    four = trees(4, LAYOUTS, saves=LAYOUTS[-1:])
    shapes = [tiny_tree(tmp_path, corpus, model=shape, parallel={"nproc": 4, "tp": 2,
                                                                 "sequence_parallel": sp})
              for shape in SHAPES for sp in (False, True)]
    ranks = run_world(_trained_and_measured, 4, four, str(tmp_path / "four"), [], shapes,
                      timeout_s=300)
    saved = step_dir(tmp_path / "four" / f"run{len(four) - 1}", SAVED)
    # one process: the reference, then the ep x tp checkpoint resumed
    run_world(_metered, 1, trees(1, [{}, {}]), str(tmp_path / "one"), False, [None, str(saved)],
              timeout_s=200)
    want = read_metrics(tmp_path / "one" / "run0")
    assert want[-1]["loss"] < want[0]["loss"] - 0.2  # it learns
    for i, (tree, parallel) in enumerate(zip(four, LAYOUTS)):
        _check_dry_run(tree, [steps[i] for steps, _ in ranks])
        got = read_metrics(tmp_path / "four" / f"run{i}")
        _check_same_run(got, want, parallel)
    resumed = read_metrics(tmp_path / "one" / "run1")
    assert [r["step"] for r in resumed] == list(range(SAVED + 1, STEPS + 1))
    assert _rel_loss(resumed, want) < 1e-4, _rel_loss(resumed, want)
    for tree, got in zip(shapes, ranks[0][1]):
        cfg = config_from_dict(tree)
        p = cfg.parallel
        estimate = tensor_activation_bytes(cfg.model, cfg.train.micro_batch, p.tp,
                                           p.sequence_parallel)
        assert abs(estimate - got) <= TOLERANCE * got, (tree["model"], p.sequence_parallel,
                                                        estimate, got)
