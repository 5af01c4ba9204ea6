"""The planner's cost model against hand-computed values (docs/planner.md's formulas)."""

import dataclasses

import pytest

from loomtrain.parallel.pipeline.schedules import bubble_theory
from loomtrain.planner import comm_cost as C
from loomtrain.planner.cost import estimate, model_flops_per_step, step_costs
from loomtrain.planner.plan import Plan, StageCosts, StepCosts
from loomtrain.planner.presets import PRESETS, preset
from loomtrain.planner.specs import BUILTIN, ClusterSpec
from loomtrain.planner.step_time import step_time

H100 = BUILTIN["h100-80g"]


def test_gpt3_175b_has_175b_parameters_within_one_percent():
    assert abs(PRESETS["gpt3-175b"].params - 175e9) / 175e9 < 0.01
    assert abs(PRESETS["gpt-1t"].params - 1.008e12) / 1.008e12 < 0.001  # Narayanan et al. Table 1


def test_default_preset_counts_what_loomtrain_builds():
    from loomtrain.models import GPT
    m = preset("default")
    model = GPT(m.vocab_size, m.seq_len, m.d_model, m.n_layers, m.n_heads, m.mlp_ratio)
    assert m.params == sum(p.numel() for p in model.parameters())  # tied head counted once
    with pytest.raises(ValueError, match="gpt3-175b"):
        preset("gpt-5")


def test_model_flops_by_hand():
    m = preset("default")  # h 256, L 4, s 128, V 256, r 4
    per_token = 4 * (2 * 12 * 256 ** 2 + 4 * 128 * 256) + 2 * 256 * 256
    assert model_flops_per_step(m, 32) == 3 * 32 * 128 * per_token


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_memory_per_stage(stage):
    """Mixed precision keeps 2 + 2 + 12 bytes per parameter (ZeRO, sec. 3.1); stage 1 shards
    the 12, stage 2 also the gradients' 2, stage 3 also the weights' 2, over dp."""
    m, n = preset("gpt3-1.3b"), 8
    e = estimate(m, ClusterSpec(H100, n, 8), Plan(dp=n, zero_stage=stage, micro_batch=1))
    P = m.params
    expect = {0: (2, 2, 12), 1: (2, 2, 12 / n), 2: (2, 2 / n, 12 / n), 3: (2 / n, 2 / n, 12 / n)}
    got = (e.memory["weights"], e.memory["gradients"], e.memory["optimizer"])
    assert got == tuple(int(P * x) for x in expect[stage])
    assert e.memory["gathered"] == (0 if stage < 3 else 2 * 2 * m.embedding_params)  # largest unit
    offloaded = estimate(m, ClusterSpec(H100, n, 8), Plan(dp=n, zero_stage=max(stage, 1),
                                                          offload_optimizer=True))
    assert offloaded.memory["optimizer"] == 0


def test_data_parallel_wire_bytes_and_time_are_the_ring_formulas():
    m, n = preset("gpt3-125m"), 4
    cluster = ClusterSpec(H100, n, 8)
    e = estimate(m, cluster, Plan(dp=n, micro_batch=2))
    grads = m.params * 2  # bf16
    assert e.comm_bytes["dp"] == int(2 * (n - 1) / n * grads)
    d = H100
    assert C.all_reduce_s(cluster, grads, n, False) == pytest.approx(
        2 * (n - 1) * d.intra_node_latency_s + 2 * (n - 1) / n * grads / d.intra_node_bytes_per_s)
    costs = step_costs(m, cluster, Plan(dp=n, micro_batch=2))
    assert costs.stages[0].grad_sync_s == pytest.approx(C.all_reduce_s(cluster, grads, n, False))
    z3 = estimate(m, cluster, Plan(dp=n, zero_stage=3, micro_batch=1, microbatches=2))
    assert z3.comm_bytes["dp"] == int(2 * (3 * (n - 1) / n * grads))  # per microbatch: rs + 2 ag


def test_groups_cross_nodes_where_the_mesh_puts_them():
    c = ClusterSpec(H100, 64, 8)
    sizes = {"pp": 2, "dp": 4, "cp": 1, "tp": 8}
    assert not C.spans_nodes(c, sizes, "tp")  # tp innermost: 8 consecutive ranks, one node
    assert C.spans_nodes(c, sizes, "dp") and C.spans_nodes(c, sizes, "pp")
    assert not C.spans_nodes(c, {"pp": 1, "dp": 4, "cp": 1, "tp": 2}, "dp")  # 4 x 2 = 8 ranks


def _uniform(pp, m, schedule, v=1, f=1.0, i=1.0, w=1.0, send=0.0, sync=0.0, opt=0.0):
    stage = StageCosts(forward_s=f, backward_input_s=i, backward_weight_s=w, recompute_s=0.0,
                       forward_comm_s=0.0, backward_comm_s=0.0, send_s=send, grad_sync_s=sync,
                       param_gather_s=0.0, offload_s=0.0, activation_bytes=0)
    return StepCosts((stage,) * (pp * v), pp, m, schedule, v, opt, True)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4), (8, 32)])
def test_bubble_fraction_matches_the_papers(schedule, v, pp, m):
    t = step_time(_uniform(pp, m, schedule, v))
    busy = t["compute"]
    assert busy == m * v * 3.0
    assert t["bubble"] / (t["bubble"] + busy) == pytest.approx(bubble_theory(schedule, pp, m, v))


def test_pipeline_fill_pays_the_sends_and_a_slow_stage_sets_the_pace():
    t = step_time(_uniform(4, 8, "1f1b", send=0.25))
    assert t["compute"] + t["bubble"] == pytest.approx((8 + 3) * 3.0 + 2 * 3 * 0.25)
    slow = _uniform(4, 8, "1f1b")
    stages = list(slow.stages)
    stages[2] = dataclasses.replace(stages[2], forward_s=2.0)
    t = step_time(dataclasses.replace(slow, stages=tuple(stages)))
    assert t["compute"] + t["bubble"] == pytest.approx(7 * 4.0 + 3 * 3.0 + 4.0)


def test_gradient_sync_hides_behind_the_last_backward_only_when_it_can():
    hidden = step_time(_uniform(1, 4, "1f1b", sync=1.5))  # the last backward is 2.0
    assert hidden["grad_sync"] == 0.0
    exposed = step_time(_uniform(1, 4, "1f1b", sync=3.5))
    assert exposed["grad_sync"] == pytest.approx(1.5)
    blocking = dataclasses.replace(_uniform(1, 4, "1f1b", sync=1.5), grad_sync_overlaps=False)
    assert step_time(blocking)["grad_sync"] == pytest.approx(1.5)


def test_one_f_one_b_holds_p_microbatches_gpipe_all_of_them():
    m, c = preset("gpt3-1.3b"), ClusterSpec(H100, 4, 8)
    one = estimate(m, c, Plan(pp=4, microbatches=16, micro_batch=1, schedule="1f1b"))
    gpipe = estimate(m, c, Plan(pp=4, microbatches=16, micro_batch=1, schedule="gpipe"))
    stashes = [s.activation_bytes for s in step_costs(m, c, Plan(pp=4, microbatches=16, micro_batch=1)).stages]
    assert gpipe.memory["activations"] == 16 * max(stashes)
    assert one.memory["activations"] == max(min(16, 4 - r) * s for r, s in enumerate(stashes))
    full = estimate(m, c, Plan(pp=4, microbatches=16, micro_batch=1, recompute="full"))
    # blocks keep their inputs only; the last stage still keeps the fp32 log-softmax (V wide)
    assert full.memory["activations"] < one.memory["activations"] / 5
    assert full.time["compute"] > one.time["compute"]  # paid with a replayed forward


def test_tensor_parallel_splits_compute_and_pays_collectives():
    m = preset("gpt3-6.7b")
    one = estimate(m, ClusterSpec(H100, 1, 8), Plan(micro_batch=1))
    two = estimate(m, ClusterSpec(H100, 2, 8), Plan(tp=2, micro_batch=1))
    assert two.time["compute"] < 0.6 * one.time["compute"]
    assert two.time["tp_cp_comm"] > 0 and one.time["tp_cp_comm"] == 0
    assert two.memory["weights"] == pytest.approx(one.memory["weights"] / 2, rel=0.01)
    for e in (one, two):
        assert 0 < e.mfu < 1
        assert e.tokens_per_s == pytest.approx(m.seq_len / e.step_time_s)
