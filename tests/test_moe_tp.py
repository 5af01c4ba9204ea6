"""The mixture of experts under tensor parallelism (issue 29; parallel/tensor_llama.py): the
attention split over tp, the feed-forward whole on every tp rank (expert tensor-parallel size
1), without and with sequence parallelism, and expert parallelism over the dp ranks of each tp
coordinate (ep x tp). Each layout reproduces the single-process losses (fp32, 1e-4), expert
loads and balance loss, and the dry run predicts its collectives; an ep x tp checkpoint resumes
on one process."""

from __future__ import annotations

from conftest import tiny_tree
from harness import run_world
from test_moe import MODEL, STEPS, _check_dry_run, _metered, _rel_loss

from loomtrain.train.checkpoint import step_dir
from loomtrain.train.metrics import read_metrics

SAVED = 6
TP2 = [{"tp": 2}, {"tp": 2, "sequence_parallel": True}]  # world 2
# world 4: dp 2 as ep 2 in each of the two tp coordinates; the last saves at step SAVED
EP_TP = [{"tp": 2, "ep": 2}, {"tp": 2, "ep": 2, "sequence_parallel": True, "zero_stage": 3}]


def test_tensor_and_expert_parallelism_reproduce_the_single_process_run(tmp_path, corpus):
    def trees(world, layouts, saves=False):
        return [tiny_tree(tmp_path, corpus, model=MODEL, train={"steps": STEPS},
                          parallel={"nproc": world, **parallel},
                          checkpoint={"every": SAVED if saves else 0}) for parallel in layouts]
    run_world(_metered, 1, trees(1, [{}]), str(tmp_path / "one"), timeout_s=200)
    want = read_metrics(tmp_path / "one" / "run0")
    two = trees(2, TP2)
    metered2 = run_world(_metered, 2, two, str(tmp_path / "two"), True, timeout_s=300)
    four = trees(4, EP_TP[:1]) + trees(4, EP_TP[1:], saves=True)
    metered4 = run_world(_metered, 4, four, str(tmp_path / "four"), True, timeout_s=300)
    saved = step_dir(tmp_path / "four" / f"run{len(four) - 1}", SAVED)
    run_world(_metered, 1, trees(1, [{}]), str(tmp_path / "resumed"), False, [str(saved)],
              timeout_s=200)
    for trees_, ranks in ((two, metered2), (four, metered4)):
        for i, tree in enumerate(trees_):
            _check_dry_run(tree, [r[i] for r in ranks])
    runs = [(p, tmp_path / "two" / f"run{i}") for i, p in enumerate(TP2)] + \
        [(p, tmp_path / "four" / f"run{i}") for i, p in enumerate(EP_TP)]
    for parallel, run in runs:
        got = read_metrics(run)
        rel = _rel_loss(got, want)
        print(parallel, rel)
        assert rel < 1e-4, (parallel, rel)
        assert [r["moe_tokens_per_expert"] for r in got] == \
            [r["moe_tokens_per_expert"] for r in want], parallel
        aux = max(abs(a["moe_aux_loss"] - b["moe_aux_loss"]) for a, b in zip(got, want))
        assert aux < 1e-5, (parallel, aux)
    got = read_metrics(tmp_path / "resumed" / "run0")
    assert [r["step"] for r in got] == list(range(SAVED + 1, STEPS + 1))
    assert _rel_loss(got, want) < 1e-4, _rel_loss(got, want)
