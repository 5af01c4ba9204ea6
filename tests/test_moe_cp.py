"""The mixture of experts under context parallelism (issue 29; docs/moe.md, "Context
parallelism"): the balance loss taken over whole rows that cp (or data.balance's pool) splits,
its statistics all-reduced with autograd, counted once per row; the experts' gradients
reduced over dp x cp, and over edp x cp with expert parallelism. The oracle: ring attention,
Ulysses (recomputed), data.balance's pool, ep 2 x cp 2 with the data-parallel engine and with
ZeRO-3 reproduce the single-process losses, expert loads and balance loss (fp32), and the dry
run predicts their collectives."""

from __future__ import annotations

from conftest import refused, tiny_tree
from harness import run_world

from loomtrain.mesh import expert_replicas
from loomtrain.train.metrics import read_metrics
from test_moe import MODEL, STEPS, _check_dry_run, _check_same_run, _metered

# world 2: cp 2 (ring; Ulysses with every block recomputed: its all-reduces rerun), and
# data.balance's pool of the 2 dp ranks' rows; world 4: dp 2 (ep 2) x cp 2
TWO = [{"cp": 2}, {"cp": 2, "cp_method": "ulysses", "recompute": "full"}, "balance"]
FOUR = [{"cp": 2, "ep": 2}, {"cp": 2, "ep": 2, "zero_stage": 3}]
# the pool's ring exchanges follow the documents it deals: the dry run does not predict them
DEALT = ("dpcp", "send")


def test_expert_replicas_join_each_edp_group_with_its_cp_peers():
    sizes = {"pp": 1, "dp": 4, "cp": 2, "tp": 1}  # rank = 2 dp + cp
    assert expert_replicas(sizes, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert expert_replicas(sizes, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # the cp groups
    assert expert_replicas(sizes, 1) == [list(range(8))]  # dp x cp


def test_context_and_expert_parallel_moe_reproduces_the_single_process_run(tmp_path, doc_corpus):
    """Packed documents throughout (data.balance deals them), so one reference serves all."""
    def trees(world, layouts):
        return [tiny_tree(tmp_path, doc_corpus, model=MODEL, train={"steps": STEPS},
                          data={"packing": True, "balance": parallel == "balance"},
                          parallel={"nproc": world, **(parallel if parallel != "balance" else {})})
                for parallel in layouts]
    run_world(_metered, 1, trees(1, [{}]), str(tmp_path / "one"), timeout_s=200)
    want = read_metrics(tmp_path / "one" / "run0")
    metered2 = run_world(_metered, 2, trees(2, TWO), str(tmp_path / "two"), True, timeout_s=300)
    metered4 = run_world(_metered, 4, trees(4, FOUR), str(tmp_path / "four"), True,
                         timeout_s=300)
    for layouts, ranks in ((TWO, metered2), (FOUR, metered4)):
        for i, tree in enumerate(trees(len(ranks), layouts)):
            _check_dry_run(tree, [{k: v for k, v in r[i].items() if k != DEALT} for r in ranks])
    assert DEALT in metered2[0][TWO.index("balance")]  # the pool split documents
    runs = [(p, tmp_path / "two" / f"run{i}") for i, p in enumerate(TWO)] + \
        [(p, tmp_path / "four" / f"run{i}") for i, p in enumerate(FOUR)]
    for parallel, run in runs:
        got = read_metrics(run)
        # the same sums in other orders (ring merges, rows summed over ranks): fp32 rounding
        _check_same_run(got, want, parallel)
    assert want[-1]["loss"] < want[0]["loss"] - 0.2  # it learns


def test_expert_parallelism_with_the_balance_pool_is_refused(capsys):
    says = refused(capsys, ["train", "--dry-run", "--set", "model.name=llama", "--set",
                            "model.n_experts=4", "--set", "parallel.ep=2", "--set",
                            "data.packing=true", "--set", "data.balance=true", "--nproc", "2"])
    assert "the all-to-alls carry other bytes than the dry run counts" in says
