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


def test_activation_offload_without_a_pipeline_keeps_two_blocks_at_least():
    """pp = 1 (parallel/offload.py): the first round(f L) blocks' stash leaves the device, but
    the backward holds the embedding's and two blocks' (the dry run's formula)."""
    m = preset("gpt3-1.3b")
    cluster = ClusterSpec(H100, 8, 8)
    kept = {f: estimate(m, cluster, Plan(dp=8, micro_batch=1, offload_activations=f)).memory[
        "activations"] for f in (0.0, 0.5, 1.0)}
    block = (kept[0.0] - kept[0.5]) / round(0.5 * m.n_layers)
    assert block > 0 and kept[1.0] < kept[0.5] < kept[0.0]
    assert kept[1.0] == pytest.approx(max(kept[0.0] - m.n_layers * block, 2 * block), rel=0.01)


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


def _cpu_here(**fields) -> "DeviceSpec":
    """A cpu-here as calibrate.py writes it (made-up figures): 2 cores shared by the
    processes, measured all-reduce times, a sync penalty, a slow attention core."""
    from loomtrain.planner.specs import DeviceSpec
    base = dict(name="cpu-here", peak_bf16_flops=4e11, peak_fp32_flops=1e11, mem_bytes=8 * 10 ** 9,
                mem_bandwidth_bytes_per_s=2e10, intra_node_bytes_per_s=2e9, intra_node_latency_s=1e-4,
                inter_node_bytes_per_s=2e9, inter_node_latency_s=1e-4, host_link_bytes_per_s=2e10,
                matmul_efficiency=1.0, op_overhead_s=1e-5, cores=2,
                flops_by_procs=((1, 1e11), (2, 5e10), (4, 2.4e10)),
                collective_fit=((2, 2e-4, 1e9), (4, 3e-4, 1e9)),
                collective_table=((2, 4, 3e-4), (2, 1 << 20, 2e-3), (2, 16 << 20, 20e-3),
                                  (4, 4, 9e-4), (4, 1 << 20, 3e-3), (4, 16 << 20, 30e-3)),
                sync_penalty=((2, 2, 8e-4), (4, 2, 1e-3), (4, 4, 2e-3)), attention_efficiency=0.5)
    return DeviceSpec(**{**base, **fields})


def test_cpu_here_interpolates_the_measured_all_reduce_and_sends_on_the_send_link():
    cluster = ClusterSpec(_cpu_here(), 2, 2)
    assert C.all_reduce_s(cluster, 1 << 20, 2, False) == pytest.approx(2e-3)  # a measured point
    half = 4 + ((1 << 20) - 4) / 2
    assert C.all_reduce_s(cluster, half, 2, False) == pytest.approx((3e-4 + 2e-3) / 2)
    assert C.all_reduce_s(cluster, 32 << 20, 2, False) == pytest.approx(20e-3 + 16 * 18e-3 / 15)  # last slope
    assert C.all_reduce_s(cluster, 1 << 20, 3, False) == pytest.approx(3e-3)  # nearest n: 4
    assert C.gather_s(cluster, 1 << 20, 2, False) == pytest.approx(1e-3)  # half the ring
    # a send is the send/recv fit's, not the all-reduce's
    assert C.send_s(cluster, 2e9, False) == pytest.approx(1e-4 + 1.0)
    assert C.inline_s(cluster, 2, 2) == 8e-4 and C.inline_s(cluster, 2, 4) == 1e-3
    assert C.inline_s(cluster, 4, 4) == 2e-3 and C.inline_s(cluster, 1, 2) == 0.0
    assert C.inline_s(ClusterSpec(H100, 8, 8), 8, 8) == 0.0  # GPUs: not modelled


def test_cpu_here_shares_the_cores_and_the_memory():
    d = _cpu_here()
    assert d.share(1) == 1 and d.share(2) == 0.5 and d.share(4) == pytest.approx(0.24)
    assert d.overhead_s(2) == 1e-5 and d.overhead_s(4) == 2e-5  # 2 processes per core
    assert d.achieved_flops("bf16", 2) == pytest.approx(4 * d.achieved_flops("fp32", 2))
    assert ClusterSpec(d, 4, 4).mem_per_device == 2 * 10 ** 9
    assert ClusterSpec(H100, 8, 8).mem_per_device == H100.mem_bytes  # a device of its own
    m, plan = preset("default"), Plan(precision="fp32", micro_batch=8, microbatches=1)
    d = _cpu_here(op_overhead_s=0.0)  # one process per core: the launches do not slow down
    one = estimate(m, ClusterSpec(d, 1, 1), plan)
    two = estimate(m, ClusterSpec(d, 2, 2), dataclasses.replace(plan, dp=2))
    # each of 2 processes computes at half speed: the same microbatch takes twice as long,
    # its memory-bound part and optimizer step included
    assert two.time["compute"] == pytest.approx(2 * one.time["compute"], rel=1e-6)
    controls = 2 * C.all_reduce_s(ClusterSpec(d, 2, 2), 16, 2, False)
    assert two.time["optimizer"] - controls == pytest.approx(2 * one.time["optimizer"], rel=1e-6)


def test_attention_runs_at_its_own_rate_in_the_input_gradient():
    m, plan = preset("default"), Plan(precision="fp32", micro_batch=8, microbatches=1)
    slow = step_costs(m, ClusterSpec(_cpu_here(attention_efficiency=0.25), 1, 1), plan)
    fast = step_costs(m, ClusterSpec(_cpu_here(attention_efficiency=0.5), 1, 1), plan)
    attn = 8 * 128 * 4 * 128 * 256 * m.n_layers / 1e11  # forward FLOPs at the matmul rate
    (s,), (f,) = slow.stages, fast.stages
    assert s.forward_s - f.forward_s == pytest.approx(attn * (4 - 2))
    assert s.backward_input_s - f.backward_input_s == pytest.approx(2 * attn * (4 - 2))
    assert s.backward_weight_s == f.backward_weight_s  # attention has no weights


def test_tensor_parallel_collectives_counted_as_tensor_py_runs_them():
    """Per microbatch, tp=2: blocks 2 activation all-reduces each way; the embedding 1
    forward; the head 1 backward and the cross-entropy's 3 small ones forward. Sequence
    parallel: twice the calls at half the time each, plus 6 small ones a block and 2 in the
    head backward. Every call pays the sync penalty."""
    d = _cpu_here(collective_table=None, collective_fit=((2, 1e-4, 1e9),))
    cluster, m = ClusterSpec(d, 2, 2), preset("default")
    act = 8 * 128 * 256 * 4
    ar = lambda nbytes: 2 * 1e-4 + nbytes / 1e9 + 8e-4  # noqa: E731
    half = lambda nbytes: 1e-4 + nbytes / 2 / 1e9 + 8e-4  # noqa: E731
    plan = Plan(tp=2, precision="fp32", micro_batch=8, microbatches=1)
    (st,) = step_costs(m, cluster, plan).stages
    fwd = m.n_layers * 2 * ar(act) + ar(act) + 3 * ar(8 * 128 * 4)
    bwd = m.n_layers * 2 * ar(act) + ar(act)
    assert st.forward_comm_s == pytest.approx(fwd) and st.backward_comm_s == pytest.approx(bwd)
    (sp,) = step_costs(m, cluster, dataclasses.replace(plan, sequence_parallel=True)).stages
    norm = 256 * 4
    fwd = m.n_layers * 4 * half(act) + ar(act) + 3 * ar(8 * 128 * 4) + half(act)
    bwd = m.n_layers * (4 * half(act) + 6 * ar(norm)) + half(act) + half(act) + 2 * ar(norm)
    assert sp.forward_comm_s == pytest.approx(fwd) and sp.backward_comm_s == pytest.approx(bwd)
    assert sp.backward_comm_s > st.backward_comm_s  # the calls, not the bytes, cost here


def test_optimizer_step_counts_foreach_adamw_passes():
    m, d = preset("default"), _cpu_here()
    plan = Plan(precision="fp32", micro_batch=8, microbatches=1)
    e = estimate(m, ClusterSpec(d, 1, 1), plan)
    assert e.time["optimizer"] == pytest.approx(96 * m.params / 2e10 + 24 * 1e-5, rel=1e-6)


# --- the llama family (planner/llama_shape.py) ------------------------------------------------


def test_llama_shapes_count_what_loomtrain_builds():
    """Every llama preset's shape has the parameters tests/test_llama.py holds the built
    models to; a config's shape with every switch (tied head, q/k/v biases, qk-norm) counts
    what models/llama.py builds from it."""
    from loomtrain.models import build_model
    from loomtrain.models.config import ModelConfig
    from loomtrain.planner.presets import from_model_config
    from test_llama import PRESET_PARAMETERS

    for name, parameters in PRESET_PARAMETERS.items():
        assert PRESETS[name].params == parameters, name
    m = ModelConfig(name="llama", d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=96,
                    tie_embeddings=True, qkv_bias=True, qk_norm=True, seq_len=32)
    model, shape = build_model(m), from_model_config(m, "t")
    assert shape.params == sum(p.numel() for p in model.parameters())  # the tied head once
    assert shape.block_params == sum(p.numel() for p in model.blocks[0].parameters())
    wide = m.model_copy(update={"head_dim": 24})  # Qwen3's heads, wider than d_model / n_heads
    model, shape = build_model(wide), from_model_config(wide, "t")
    assert shape.block_params == sum(p.numel() for p in model.blocks[0].parameters())
    assert shape.model_keys()["head_dim"] == 24
    assert (shape.seq_len, shape.kv_heads, shape.ffn_width, shape.preset) == (32, 2, 96, None)
    assert (PRESETS["llama3-8b"].seq_len, PRESETS["llama3-8b"].preset) == (8192, "llama3-8b")


def test_llama_flops_by_hand():
    m = preset("llama3-8b")  # d 4096, 32 layers, 8 kv heads of 128, SwiGLU 14336, V 128256
    matmul = 2 * 4096 ** 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # q, o; k, v; gate, up, down
    per_token = 32 * (2 * matmul + 4 * 8192 * 4096) + 2 * 4096 * 128256
    assert model_flops_per_step(m, 4) == 3 * 4 * 8192 * per_token


@pytest.mark.parametrize("tp,sp,recompute", [(1, False, "none"), (2, False, "selective"),
                                             (2, True, "none"), (1, False, "selective")])
def test_llama_stash_is_the_dry_runs_formula(tp, sp, recompute):
    """One microbatch in flight (pp 1): the activations are activations.py's, held to the
    tensors autograd saves by tests/test_dryrun.py, less what selective recompute frees."""
    from loomtrain.activations import llama_activation_bytes, llama_core_bytes

    m = preset("mistral-7b")  # grouped-query attention and a sliding window
    e = estimate(m, ClusterSpec(H100, tp, 8),
                 Plan(tp=tp, sequence_parallel=sp, recompute=recompute, micro_batch=1))
    freed = m.n_layers * llama_core_bytes(1, m.seq_len, m, 2, tp) if recompute == "selective" else 0
    assert e.memory["activations"] == llama_activation_bytes(m, 1, 2, tp, sp) - freed


def test_llama_tensor_parallel_collectives_counted_as_tensor_llama_runs_them():
    """tp=2 over a llama with one kv head (replicated), q/k-norm and q/k/v biases: the GPT's
    activation collectives (test above), and backward per block the sums of the replicated
    k_proj and v_proj weights and biases and of q_norm's and k_norm's weights; sequence
    parallel reduce-scatters the embedding and sums ln1's, ln2's and ln_f's weights."""
    from loomtrain.planner.llama_shape import LlamaShape

    d = _cpu_here(collective_table=None, collective_fit=((2, 1e-4, 1e9),))
    cluster = ClusterSpec(d, 2, 2)
    m = LlamaShape("t", 2, 64, 4, 32, 256, kv_heads=1, ffn_width=128, qkv_bias=True, qk_norm=True)
    act, tokens = 8 * 32 * 64 * 4, 8 * 32 * 4
    ar = lambda nbytes: 2 * 1e-4 + nbytes / 1e9 + 8e-4  # noqa: E731
    half = lambda nbytes: 1e-4 + nbytes / 2 / 1e9 + 8e-4  # noqa: E731
    weights = 2 * ar(16 * 4) + 2 * ar(16 * 64 * 4) + 2 * ar(16 * 4)  # q/k-norm, k/v w and b
    plan = Plan(tp=2, precision="fp32", micro_batch=8, microbatches=1)
    (st,) = step_costs(m, cluster, plan).stages
    assert st.forward_comm_s == pytest.approx(2 * 2 * ar(act) + ar(act) + 3 * ar(tokens))
    assert st.backward_comm_s == pytest.approx(2 * (2 * ar(act) + weights) + ar(act))
    (sp,) = step_costs(m, cluster, dataclasses.replace(plan, sequence_parallel=True)).stages
    assert sp.forward_comm_s == pytest.approx(2 * 4 * half(act) + 2 * half(act) + 3 * ar(tokens))
    norms = 2 * 2 * ar(64 * 4) + ar(64 * 4)
    assert sp.backward_comm_s == pytest.approx(2 * (4 * half(act) + weights) + 2 * half(act) + norms)
