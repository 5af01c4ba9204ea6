"""The mixture of experts across two model-splitting axes at once (issue 29): tensor with
pipeline parallelism (under sequence parallelism), context with tensor parallelism (under
ZeRO-3) and context with pipeline parallelism each reproduce the single-process losses and
expert loads (fp32, 1e-4), and the dry run predicts rank 0's collectives."""

from __future__ import annotations

from conftest import tiny_tree
from harness import run_world
from test_moe import MODEL, STEPS, _check_dry_run, _check_same_run, _metered

from loomtrain.train.metrics import read_metrics

DEEP = {"n_layers": 4, "moe_every": 2}  # blocks 2 and 4 MoE: each pipeline stage holds one
LAYOUTS = [{"pp": 2, "tp": 2, "sequence_parallel": True},
           {"cp": 2, "tp": 2, "zero_stage": 3},
           {"cp": 2, "pp": 2}]


def test_two_splitting_axes_at_once_reproduce_the_single_process_run(tmp_path, corpus):
    def trees(world, layouts):
        return [tiny_tree(tmp_path, corpus, model={**MODEL, **DEEP}, train={"steps": STEPS},
                          parallel={"nproc": world, **parallel}) for parallel in layouts]
    run_world(_metered, 1, trees(1, [{}]), str(tmp_path / "one"), timeout_s=200)
    want = read_metrics(tmp_path / "one" / "run0")
    ranks = run_world(_metered, 4, trees(4, LAYOUTS), str(tmp_path / "four"), True,
                      timeout_s=400)
    for i, tree in enumerate(trees(4, LAYOUTS)):
        _check_dry_run(tree, [ranks[0][i]])
        got = read_metrics(tmp_path / "four" / f"run{i}")
        _check_same_run(got, want, LAYOUTS[i])
