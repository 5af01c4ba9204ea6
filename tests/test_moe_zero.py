"""Expert parallelism with hierarchical ZeRO, recomputation, activation offload and gradient
compression (issue 29; parallel/expert/, parallel/zero/, parallel/data.py): the layout's rule
(every ep group inside a node), the experts' hierarchical shards in the dry run of a world of
8, and one world-4 spawn of "two nodes" against the single-process run (fp32, 1e-4, the same
tokens per expert), the dry run against the meter."""

from __future__ import annotations

from conftest import refused, tiny_tree
from harness import run_world

from loomtrain.cli import main
from loomtrain.train import dryrun
from loomtrain.train.config import config_from_dict
from loomtrain.train.metrics import read_metrics
from test_moe import A2A, MODEL, STEPS, _check_dry_run, _metered, _rel_loss
from test_weave import _predicted

NODES = {"ranks_per_node": 2}  # world 4 as two nodes of two: ep groups [0 1] [2 3]
# hierarchical ZeRO-3, the optimizer state split across the nodes too, with recomputation
HIERARCHICAL = {"ep": 2, "zero_stage": 3, "hierarchical": True, "optimizer_shard": "dp",
                **NODES, "recompute": "full"}
TOPK_ALL = {"method": "topk", "ratio": 1.0}  # every value sent with its index: exact
TOPK = {"method": "topk", "ratio": 0.1, "error_every": 4}  # error feedback on


def test_hierarchical_zero_keeps_every_ep_group_inside_a_node(capsys):
    argv = ["train", "--dry-run", "--nproc", "4", "--set", "model.name=llama", "--set",
            "model.n_experts=4", "--set", "parallel.zero_stage=3", "--set",
            "parallel.hierarchical=true", "--set", "parallel.ranks_per_node=2"]
    assert "ep groups of 4 dp ranks span nodes of parallel.ranks_per_node=2 ranks; choose " \
        "parallel.ep among [1, 2]" in refused(capsys, argv + ["--set", "parallel.ep=4"])
    assert main(argv + ["--set", "parallel.ep=2"]) == 0
    assert main(argv[:-2] + ["--set", "parallel.ep=4"]) == 0  # flat ZeRO: any ep


def _collectives(tmp_path, corpus, **parallel) -> tuple[dict, int]:
    """The dry run's collectives of a step per (axis, op), as (ranks, payload, calls), and
    the bytes of one MoE block's experts on one ep rank."""
    cfg = config_from_dict(tiny_tree(tmp_path, corpus, model=MODEL,
                                     train={"global_batch": 16}, parallel=parallel))
    out: dict = {}
    for c in dryrun.estimate(cfg).collectives:
        if c.every_steps == 1:
            out.setdefault((c.axis, c.op), []).append((c.ranks, c.payload_bytes, c.calls))
    m = cfg.model
    return out, 4 * 3 * m.d_model * m.expert_width * m.n_experts // parallel.get("ep", 1)


def test_the_experts_shard_inside_the_node_and_reduce_across_nodes(tmp_path, corpus):
    """World 8 as two nodes of 4, dp 8, ep 2: the all-to-alls stay in the node, each expert's
    replicas (edp, 4: two on each node) shard over the 2 on the node and reduce the shard
    across the nodes, as the other parameters do over dp (4 on the node, 2 nodes)."""
    got, experts = _collectives(tmp_path, corpus, nproc=8, ep=2, zero_stage=3,
                                hierarchical=True, ranks_per_node=4)
    assert got["edp.local", "reduce_scatter"] == [(2, experts, 1)] * 2  # payload: the unit
    assert got["edp.cross", "all_reduce"] == [(2, experts // 2, 1)] * 2  # its shard
    assert got["edp.local", "all_gather"] == [(2, experts, 2)] * 2  # forward, backward
    assert {r for r, _, _ in got["dp.local", "reduce_scatter"]} == {4}
    assert {r for r, _, _ in got["dp.cross", "all_reduce"]} == {2}
    assert {r for r, _, _ in got[A2A]} == {2} and ("edp", "all_reduce") not in got


def test_recomputation_reruns_the_all_to_alls(tmp_path, corpus):
    """A recomputed block exchanges its counts, dispatch and combine again in its backward."""
    plain = _collectives(tmp_path, corpus, nproc=4, ep=2)[0][A2A]
    again = _collectives(tmp_path, corpus, nproc=4, ep=2, recompute="full")[0][A2A]
    assert [calls for _, _, calls in plain] == [2 * 2, 2 * 4 * 2]  # 2 blocks, 2 micro-batches
    assert [calls for _, _, calls in again] == [2 * 2 * 2, 2 * 6 * 2]


def test_hierarchical_zero_recompute_offload_and_compression_reproduce_one_process(
        tmp_path, corpus):
    """World 4, ep 2 (edp 2): as two nodes of two, hierarchical ZeRO-3 with recomputation;
    half the blocks' activations offloaded, with top-k keeping every value (exact): both
    reproduce one process. Top-k 10% with error feedback learns. Top-k compresses each
    expert bucket over edp, the others over dp."""
    def tree(world, parallel, compression=None, micro_batch=2):
        return tiny_tree(tmp_path, corpus, model=MODEL,
                         train={"steps": STEPS, "micro_batch": micro_batch},
                         parallel={"nproc": world, **parallel}, compression=compression or {})
    # the global batch of 8 rows in one micro-batch: the same sums as test_moe's four of 2
    # (its losses to 1e-6), at half the time
    run_world(_metered, 1, [tree(1, {}, micro_batch=8)], str(tmp_path / "one"), timeout_s=200)
    want = read_metrics(tmp_path / "one" / "run0")
    four = [tree(4, HIERARCHICAL), tree(4, {"ep": 2, "offload_activations": 0.5}, TOPK_ALL),
            tree(4, {"ep": 2}, TOPK)]
    ranks = run_world(_metered, 4, four, str(tmp_path / "four"), True, timeout_s=400)
    _check_dry_run(four[0], [r[0] for r in ranks])
    for i in (0, 1):
        got = read_metrics(tmp_path / "four" / f"run{i}")
        assert _rel_loss(got, want) < 1e-4, (four[i]["parallel"], _rel_loss(got, want))
        assert [r["moe_tokens_per_expert"] for r in got] == \
            [r["moe_tokens_per_expert"] for r in want], four[i]["parallel"]
        aux = max(abs(a["moe_aux_loss"] - b["moe_aux_loss"]) for a, b in zip(got, want))
        assert aux < 1e-5, (four[i]["parallel"], aux)
    for i in (1, 2):  # the dry run reports dense buckets: only the all-to-alls are its to
        # check; top-k's sparse all-reduce gathers each expert bucket over edp (no all-reduce)
        exchanges = _predicted(config_from_dict(four[i]))[A2A][0]
        assert all(r[i][A2A][0] == exchanges for r in ranks), i
        assert ("edp", "all_gather") in ranks[0][i] and ("edp", "all_reduce") not in ranks[0][i]
    got = read_metrics(tmp_path / "four" / "run2")
    assert got[-1]["loss"] < want[0]["loss"] - 0.4, got[-1]["loss"]  # one process: 0.8
    assert all(r["compression_ratio"] > 3 and 0 < r["compression_local_error"] < 1
               for r in got)
    measured = [r for r in got if "compression_error" in r]
    assert [r["step"] for r in measured] == [4, 8, 12]
    assert all(0 < r["compression_error"] < 1 for r in measured)
