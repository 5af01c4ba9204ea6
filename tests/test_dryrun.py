"""The dry run's estimates: pure formulas against torch's own numbers and against hand-computed
ZeRO and pipeline cases, and real runs (DataParallel, ZeRO, tp and pp, world 2 and 4) whose
metered bytes the predicted collectives must match exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness import run_world
from loomtrain.cli import main
from loomtrain.comm.meter import wire_bytes
from loomtrain.errors import ConfigError
from loomtrain.models import GPT, MLP, build_model, token_loss_sum
from loomtrain.models.config import ModelConfig
from loomtrain.optim import build_optimizer
from loomtrain.parallel.data import build_buckets
from loomtrain.parallel.zero import estimate as zero_estimate
from loomtrain.parallel.zero import make_plan
from loomtrain.parallel.zero.layout import zero_memory
from loomtrain.train import dryrun
from loomtrain.train.config import config_from_dict, config_to_toml
from loomtrain.train.dryrun_text import dry_run
from loomtrain.train.metrics import read_metrics


def saved_storage_bytes(params, forward):
    """(bytes of the distinct storages autograd saves while `forward()` runs, parameters
    excluded, and what it returns), measured with saved_tensors_hooks. Storages stay alive
    until backward, so a data pointer is never reused in between."""
    excluded = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        storage = x.untyped_storage()
        if storage.data_ptr() not in excluded:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = forward()
    return sum(seen.values()), out


def saved_activation_bytes(model: torch.nn.Module, vocab_size: int, b: int, t: int,
                           loss_sum=token_loss_sum) -> int:
    """What one forward of `model` and the loss saves (saved_storage_bytes); backward then
    runs to show the graph is complete."""
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab_size, (b, t), generator=g)
    targets = torch.randint(0, vocab_size, (b, t), generator=g)
    saved, loss = saved_storage_bytes(model.parameters(), lambda: loss_sum(model(idx), targets))
    loss.backward()
    return saved


# The formulas name every tensor autograd saves; on torch 2.13 CPU they match to the byte.
# 1% leaves room for kernel-specific extras on other builds (an RNG state, a padded
# log-sum-exp) while still failing on any missing d-wide tensor, d/(2d+V+L(8d+2rd)) of the
# total: 2.2% or more for these shapes.
TOLERANCE = 0.01


# bf16: the model in bfloat16, as the ZeRO engine runs it (its parameters are views of a bf16
# buffer); the loss casts the logits to fp32.
DTYPES = [(torch.float32, 4), (torch.bfloat16, 2)]


@pytest.mark.parametrize("dtype,c", DTYPES)
@pytest.mark.parametrize("b,t,d,layers,heads,ratio,vocab", [
    (2, 16, 32, 2, 2, 4, 256),
    (3, 24, 48, 3, 4, 2, 300),
    (1, 8, 16, 1, 1, 1, 64),
])
def test_gpt_activation_estimate_matches_measurement(b, t, d, layers, heads, ratio, vocab, dtype, c):
    torch.manual_seed(0)
    model = GPT(vocab, t, d, layers, heads, ratio, dropout=0.0).to(dtype)
    measured = saved_activation_bytes(model, vocab, b, t)
    estimate = dryrun.gpt_activation_bytes(b, t, d, layers, heads, ratio, vocab, c)
    assert abs(estimate - measured) <= TOLERANCE * measured, (estimate, measured)


@pytest.mark.parametrize("dtype,c", DTYPES)
@pytest.mark.parametrize("b,t,d,layers,ratio,vocab", [(2, 16, 32, 2, 4, 256), (3, 10, 24, 3, 2, 100)])
def test_mlp_activation_estimate_matches_measurement(b, t, d, layers, ratio, vocab, dtype, c):
    torch.manual_seed(0)
    model = MLP(vocab, d, layers, ratio).to(dtype)
    measured = saved_activation_bytes(model, vocab, b, t)
    estimate = dryrun.mlp_activation_bytes(b, t, d, layers, ratio, vocab, c)
    assert abs(estimate - measured) <= TOLERANCE * measured, (estimate, measured)


# The llama's variants: grouped-query attention (2 query heads per kv head) or multi-head,
# untied or tied head, qk-norm (which also makes o_proj's input a copy), q/k/v biases, a
# sliding window (its mask is saved). d 32, 2 layers: a missing d-wide tensor is 2% of the
# total or more (c d over c (6d + 4f) + 4 (4d + 2 + h) + ... per token and layer).
LLAMA = {"name": "llama", "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 16,
         "vocab_size": 64, "ffn_hidden": 40}
LLAMA_VARIANTS = [{"n_kv_heads": 2}, {"n_kv_heads": 4, "tie_embeddings": True},
                  {"n_kv_heads": 2, "qk_norm": True, "qkv_bias": True, "tie_embeddings": True},
                  {"n_kv_heads": 1, "qkv_bias": True, "sliding_window": 5},
                  {"n_kv_heads": 2, "head_dim": 12, "qk_norm": True},  # Qwen3's wider heads
                  # mixtures of experts (activations.py `moe_feed_forward_bytes`): Mixtral's
                  # shape; DeepSeek's sigmoid router without renormalization, with Qwen's gated
                  # shared expert; one MoE block of two, top-1
                  {"n_kv_heads": 2, "n_experts": 4},
                  {"n_kv_heads": 2, "n_experts": 4, "router": "sigmoid", "router_norm_topk": False,
                   "n_shared_experts": 1, "shared_expert_gate": True, "moe_hidden": 24},
                  {"n_kv_heads": 2, "n_experts": 3, "experts_per_token": 1, "moe_every": 2}]


@pytest.mark.parametrize("dtype,c", DTYPES)
@pytest.mark.parametrize("keys", LLAMA_VARIANTS)
def test_llama_activation_estimate_matches_measurement(keys, dtype, c):
    m = ModelConfig(**LLAMA, **keys)
    torch.manual_seed(0)
    model = build_model(m).to(dtype)
    measured = saved_activation_bytes(model, m.vocab_size, 3, m.seq_len)
    estimate = dryrun.activation_bytes(m, 3, c)
    assert abs(estimate - measured) <= TOLERANCE * measured, (estimate, measured)


def test_activation_bytes_dispatches_on_model_name(tiny):
    cfg = tiny()
    m = cfg.model
    assert dryrun.activation_bytes(m, 3) == dryrun.gpt_activation_bytes(
        3, m.seq_len, m.d_model, m.n_layers, m.n_heads, m.mlp_ratio, m.vocab_size)
    m = tiny(model={"name": "mlp"}).model
    assert dryrun.activation_bytes(m, 3) == dryrun.mlp_activation_bytes(
        3, m.seq_len, m.d_model, m.n_layers, m.mlp_ratio, m.vocab_size)


@pytest.mark.parametrize("optimizer,momentum", [("adamw", 0.9), ("sgd", 0.9), ("sgd", 0.0)])
def test_optimizer_states_match_torch(tiny, optimizer, momentum):
    cfg = tiny(train={"optimizer": optimizer, "beta1": momentum})
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg.train)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    params = sum(p.numel() for p in model.parameters())
    # per-parameter-sized state only: AdamW's `step` scalars are left out on purpose
    state = sum(v.numel() for s in opt.state.values() for k, v in s.items() if k != "step")
    assert state == dryrun.optimizer_states(optimizer, momentum) * params


def test_memory_per_rank_is_the_sum_of_its_parts():
    est = dryrun.memory_per_rank(1000, 2, activations=5000)
    assert (est.parameter_bytes, est.gradient_bytes, est.optimizer_bytes) == (4000, 4000, 8000)
    assert est.total_bytes == 4000 + 4000 + 8000 + 5000


def test_gradient_all_reduces_follow_the_ring_formula():
    assert dryrun.gradient_all_reduces([400, 40], dp=1) == []
    two = dryrun.gradient_all_reduces([400, 40], dp=2)
    assert [c.wire_bytes for c in two] == [400, 40]  # 2(N-1)/N = 1 for N = 2
    four = dryrun.gradient_all_reduces([400, 40], dp=4)
    assert [c.wire_bytes for c in four] == [600, 60]
    assert all(c.axis == "dp" and c.ranks == 4 and c.every_steps == 1 for c in four)


def test_trainer_collectives():
    assert dryrun.trainer_collectives(world=1, dp=1, log_every=10, eval_every=50) == []
    control, logged, val = dryrun.trainer_collectives(world=4, dp=4, log_every=10, eval_every=50)
    assert (control.axis, control.payload_bytes, control.wire_bytes, control.every_steps) == \
        ("world", 16, wire_bytes("ring_all_reduce", 16, 4), 1)
    assert (logged.payload_bytes, logged.every_steps) == (8, 10)
    assert (val.payload_bytes, val.every_steps) == (16, 50)
    assert zero_estimate.wire_bytes_per_step([control, logged]) == 24 + 12 / 10


def test_estimate_uses_the_real_model_and_buckets(tiny):
    cfg = tiny(parallel={"nproc": 4, "bucket_mb": 0.01})
    est = dryrun.estimate(cfg)
    assert not dist.is_initialized()  # the fake group is torn down
    model = build_model(cfg.model)
    params = list(dict.fromkeys(model.parameters()))
    assert est.parameters == sum(p.numel() for p in params)
    # the engine fills buckets in reverse registration order (parallel/data.py)
    buckets = build_buckets(params[::-1], int(0.01 * 2**20))
    assert est.bucket_bytes == [b.buffer.numel() * 4 for b in buckets]
    assert len(est.engine) == len(buckets) > 1 and est.zero is None
    # rank 0 is the root of gloo's binomial broadcast tree: log2(4) = 2 children
    assert est.broadcast_wire_bytes == 2 * est.parameters * 4
    assert est.memory.parameter_bytes == est.parameters * 4


def test_dry_run_text_names_mesh_memory_and_collectives(tiny):
    text = dry_run(tiny(parallel={"nproc": 4, "ranks_per_node": 2}))
    assert "mesh pp=1 dp=4 cp=1 tp=1 (world 4, 2 node(s) of 2 ranks)" in text
    assert "node-local [0, 1], cross-node [0, 2]" in text
    for word in ("parameters", "gradients", "optimizer state", "activations", "total",
                 "all_reduce over dp (4 ranks)", "control (tokens, stop flag)"):
        assert word in text, word



def test_dry_run_text_of_ulysses_and_auto_under_data_parallel(tiny):
    # the grouped lines name every algorithm (the all-to-all once raised KeyError); "auto"
    # runs the kernel its plan chooses for these heads: two heads over cp 2, Ulysses
    for method in ("ulysses", "auto"):
        text = dry_run(tiny(parallel={"nproc": 4, "cp": 2, "cp_method": method}))
        assert "all_to_all over cp (2 ranks)" in text and "((N-1)/N x S each)" in text, method


# --- ZeRO: the engine's collectives and memory, by hand ----------------------------------------


class FakeMesh:
    """What make_plan reads from a mesh: rank 0 of dp = local x cross ranks."""

    device = torch.device("cpu")

    def __init__(self, local: int, cross: int = 1):
        self.sizes = {"dp": local * cross, "dp.local": local, "dp.cross": cross, "self": 1}

    def size(self, axis: str) -> int:
        return self.sizes[axis]

    def local_rank(self, axis: str) -> int:
        return 0


def plan(stage, local=4, cross=1, **kw):
    return make_plan(FakeMesh(local, cross), stage, **kw)


UNITS, ROOT_LEN = [("a", 100), ("b", 300)], 40  # padded lengths, small: gloo's native ops


def totals(collectives) -> dict[tuple[str, str], tuple[int, int, int]]:
    """(op, axis) -> (calls, payload bytes, wire bytes) of one step."""
    out = {}
    for c in collectives:
        calls, payload, wire = out.get((c.op, c.axis), (0, 0, 0))
        out[(c.op, c.axis)] = (calls + c.calls, payload + c.calls * c.payload_bytes,
                               wire + c.calls * c.wire_bytes)
    return out


def native_rs(n, s):  # gloo's reduce_scatter is a full all-reduce (comm/collectives.py)
    return 2 * (n - 1) * s // n


def gather(n, s):
    return (n - 1) * s // n


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype,c", DTYPES)
def test_flat_zero_collectives(stage, dtype, c):
    a, sizes = 3, [100, 300, 40]  # micro-batches; every unit with the root
    got = totals(zero_estimate.zero_collectives(plan(stage, compute_dtype=dtype), UNITS, ROOT_LEN, a))
    reductions = 1 if stage == 1 else a  # stage 1 reduces on the last micro-batch only
    expected = {("reduce_scatter", "dp"): (3 * reductions, reductions * 4 * sum(sizes),
                                           reductions * sum(native_rs(4, 4 * p) for p in sizes)),
                ("all_reduce", "dp"): (1, 4, 6)}  # clip_grad_norm_'s fp32 over dp
    if stage < 3:  # every rank keeps every unit: gathered once after the step
        expected[("all_gather", "dp")] = (3, c * sum(sizes), sum(gather(4, c * p) for p in sizes))
    else:  # the root once per micro-batch, every other unit for forward and for backward
        expected[("all_gather", "dp")] = (
            a + 2 * a * 2, a * c * 40 + 2 * a * c * 400,
            a * gather(4, c * 40) + 2 * a * (gather(4, c * 100) + gather(4, c * 300)))
    assert got == expected


def test_stage0_bf16_all_reduces_each_unit_once():
    got = zero_estimate.zero_collectives(plan(0, compute_dtype=torch.bfloat16), UNITS, ROOT_LEN, 3)
    assert totals(got) == {("all_reduce", "dp"): (3, 4 * 440, sum(2 * 3 * 4 * p // 4 for p in (100, 300, 40)))}
    assert [c.unit for c in got] == ["b", "a", "root"]  # the engine's launch order


@pytest.mark.parametrize("stage", [2, 3])
def test_hierarchical_zero_collectives(stage):
    a, sizes = 2, [100, 300, 40]
    node = totals(zero_estimate.zero_collectives(plan(stage, 2, 2, hierarchical=True), UNITS, ROOT_LEN, a))
    shard_rs = (3 * a, a * 4 * sum(sizes), a * sum(native_rs(2, 4 * p) for p in sizes))
    shard = [4 * p // 2 for p in sizes]  # fp32 gradient shards, what crosses the nodes
    assert node[("reduce_scatter", "dp.local")] == shard_rs
    assert node[("all_reduce", "dp.cross")] == (3 * a, a * sum(shard), a * sum(2 * s // 2 for s in shard))
    assert node[("all_reduce", "dp.local")] == (1, 4, 4)  # the norm over the node's ranges
    assert ("all_gather", "dp.cross") not in node and ("reduce_scatter", "dp.cross") not in node
    over_dp = totals(zero_estimate.zero_collectives(
        plan(stage, 2, 2, hierarchical=True, optimizer_shard="dp"), UNITS, ROOT_LEN, a))
    assert over_dp[("reduce_scatter", "dp.cross")] == (3 * a, a * sum(shard), a * sum(native_rs(2, s) for s in shard))
    assert over_dp[("all_gather", "dp.cross")] == (3, sum(shard), sum(gather(2, s) for s in shard))
    assert over_dp[("all_reduce", "dp")] == (1, 4, 6)  # the optimizer ranges tile all of dp
    assert over_dp[("reduce_scatter", "dp.local")] == shard_rs
    gathers = over_dp[("all_gather", "dp.local")]  # gathers never leave the node
    assert gathers[0] == (3 if stage == 2 else a + 2 * a * 2)


def test_large_units_reduce_scatter_as_rings():
    big = 64 << 10  # 256 KiB of fp32: comm.collectives.RING_MIN_BYTES
    got = zero_estimate.zero_collectives(plan(2), [("a", big), ("b", big - 4)], 0, 1)
    rs = {c.unit: (c.algorithm, c.wire_bytes) for c in got if c.op == "reduce_scatter"}
    assert rs == {"a": ("ring_reduce_scatter", 3 * big), "b": ("ring_all_reduce", 6 * (big - 4))}


def test_no_collectives_on_one_rank():
    assert zero_estimate.zero_collectives(plan(3, local=1), UNITS, ROOT_LEN, 2) == []


def test_stage3_evaluation_gathers_every_unit_once():
    got = zero_estimate.zero_eval_gathers(plan(3), UNITS, ROOT_LEN, eval_microbatches=2, eval_every=50)
    assert totals(got) == {("all_gather", "dp"): (6, 2 * 4 * 440, 2 * sum(gather(4, 4 * p) for p in (40, 100, 300)))}
    assert all(c.every_steps == 50 for c in got)
    assert zero_estimate.zero_eval_gathers(plan(2), UNITS, ROOT_LEN, 2, 50) == []


def test_gathered_bytes_take_the_largest_prefetch_window():
    units = [("a", 10), ("b", 30), ("c", 20)]
    assert zero_estimate.gathered_bytes(plan(3, local=2), units, 4, prefetch=1) == 4 * (4 + 30 + 20)
    assert zero_estimate.gathered_bytes(plan(3, local=2), units, 4, prefetch=0) == 4 * (4 + 30)
    assert zero_estimate.gathered_bytes(plan(3, local=2), units, 4, prefetch=9) == 4 * (4 + 60)
    bf16 = plan(3, local=2, compute_dtype=torch.bfloat16)
    assert zero_estimate.gathered_bytes(bf16, units, 4, prefetch=1) == 2 * (4 + 50)
    assert zero_estimate.gathered_bytes(plan(2, local=2), units, 4, 1) == 0  # stages 1-2 keep every unit
    assert zero_estimate.gathered_bytes(plan(3, local=1), units, 4, 1) == 0  # one shard rank: nothing gathered


@pytest.mark.parametrize("dtype,c", DTYPES)
def test_stage3_inside_a_pipeline_by_reshard(dtype, c):
    """zero_reshard inside a pipeline: gradients reduced once per step either way; "step"
    gathers each unit once, "micro_batch" for every forward, rerun and backward, the root per
    forward and per backward of each of the rank's stages; only "step" holds every unit."""
    a, sizes, p = 3, [100, 300], plan(3, compute_dtype=dtype)
    step = totals(zero_estimate.zero_collectives(p, UNITS, ROOT_LEN, a, "step"))
    micro = totals(zero_estimate.zero_collectives(p, UNITS, ROOT_LEN, a, "micro_batch",
                                                  reruns=a, stages=2))
    rs = ("reduce_scatter", "dp")
    assert step[rs] == micro[rs] == (3, 4 * (40 + 400), sum(native_rs(4, 4 * n) for n in [40, *sizes]))
    assert step[("all_gather", "dp")] == (3, c * 440, sum(gather(4, c * n) for n in [40, *sizes]))
    root_calls, unit_calls = 2 * (a + a), 2 * a + a
    assert micro[("all_gather", "dp")] == (
        root_calls + 2 * unit_calls, c * (root_calls * 40 + unit_calls * 400),
        root_calls * gather(4, c * 40) + unit_calls * sum(gather(4, c * n) for n in sizes))
    units = [("a", 10), ("b", 30), ("c", 20)]
    assert zero_estimate.gathered_bytes(p, units, 4, 1, "step") == c * (4 + 60)
    # the prefetch window stays inside a stage: [a] and [b, c], not a + b
    assert zero_estimate.gathered_bytes(p, units, 4, 1, "micro_batch", [["a"], ["b", "c"]]) == c * (4 + 50)
    assert zero_estimate.gathered_bytes(p, units, 4, 1, "micro_batch", [["a", "b"], ["c"]]) == c * (4 + 40)


def test_reshard_auto_rule_and_its_refusals(tiny, monkeypatch):
    from loomtrain.parallel.zero import reshard

    assert reshard.choose_reshard(100, 100) == "step" and reshard.choose_reshard(101, 100) == "micro_batch"
    layout = {"nproc": 4, "pp": 2, "zero_stage": 3}
    assert dryrun.estimate(tiny(parallel=layout)).zero.reshard == "step"  # MiBs fit here
    monkeypatch.setattr(reshard, "capacity_bytes", lambda device, local_ranks: 1)
    assert 'zero_reshard "micro_batch" (auto: rank 0\'s step with every unit held needs' in \
        dry_run(tiny(parallel=layout))
    # W after the backward: auto keeps the units; "micro_batch" is refused there
    assert dryrun.estimate(tiny(parallel=layout | {"schedule": "zb-h1"})).zero.reshard == "step"
    for bad in ({"schedule": "zb-h1", "zero_reshard": "micro_batch"},
                {"pp": 1, "zero_reshard": "step"}, {"zero_stage": 2, "zero_reshard": "micro_batch"}):
        with pytest.raises(ConfigError, match="parallel.zero_reshard"):
            tiny(parallel=layout | bad)


def test_gradients_in_flight_follow_the_reduction_queue():
    units, root = [("a", 10), ("b", 20)], 4  # launch order: b, a, root
    # stage 2 fp32, L = 2: new = prev = 4p + 4p/2 (source and shard), the root's buffer 4R
    # until it launches: launches b: 120 + 16, a: 60 + 120 + 16, root: 24 + 60
    assert zero_estimate.in_flight_bytes(plan(2, local=2), units, root) == 196
    # stage 3 bf16, hierarchical (C = 2): new = 2p + 4p + 2p, prev = 4p + 2p, older = 2p,
    # root 2R: b: 160 + 8, a: 80 + 120 + 8, root: 32 + 60 + 40
    bf16 = plan(3, 2, 2, hierarchical=True, compute_dtype=torch.bfloat16)
    assert zero_estimate.in_flight_bytes(bf16, units, root) == 208
    # stages 0-1: reduced in place in the fp32 accumulator; bf16 adds a 2p buffer (+ the root's)
    assert zero_estimate.in_flight_bytes(plan(1), units, root) == 0
    assert zero_estimate.in_flight_bytes(plan(0, compute_dtype=torch.bfloat16), units, root) == 40 + 8


def test_zero_memory_per_rank_adds_the_step_and_splits_host_memory():
    units, root = [("a", 400), ("b", 800)], 80  # P = 1280, a multiple of 4
    p = plan(3, compute_dtype=torch.bfloat16)
    est = zero_estimate.zero_memory_per_rank(p, units, root, states=2, activations=1000, prefetch=1)
    persistent = zero_memory([400, 800, 80], 3, 4, 4, 2, 2, separate_master=True)
    assert (est.parameter_bytes, est.gradient_bytes, est.optimizer_bytes) == \
        (persistent.parameter_bytes, persistent.gradient_bytes, persistent.optimizer_bytes)
    assert est.gathered_bytes == zero_estimate.gathered_bytes(p, units, root, 1) > 0
    assert est.in_flight_bytes == zero_estimate.in_flight_bytes(p, units, root) > 0
    assert est.total_bytes == persistent.total_bytes + 1000 + est.gathered_bytes + est.in_flight_bytes
    assert est.host_bytes == 0 and est.device_bytes == est.total_bytes
    # offload, stage 1: the fp32 accumulator stays on the device, the reduced range (4P/S),
    # master weights and optimizer state go to the host
    off = zero_estimate.zero_memory_per_rank(plan(1, offload=True), units, root, 2, 1000, 1)
    assert off.gradient_bytes == 4 * 1280 + 4 * 1280 // 4
    assert off.optimizer_bytes == (2 + 1) * 4 * 1280 // 4
    assert off.host_bytes == off.optimizer_bytes + 4 * 1280 // 4
    assert off.device_bytes == 4 * 1280 + 4 * 1280 + 1000  # parameters, accumulator, activations


# --- ZeRO on the fake backend ------------------------------------------------------------------


def test_zero_estimate_lays_out_the_real_units(tiny):
    # d_model 34: a block has 14,314 parameters, padded to 14,316 (a multiple of dp = 4)
    cfg = tiny(model={"d_model": 34}, parallel={"nproc": 4, "zero_stage": 3})
    est = dryrun.estimate(cfg)
    assert not dist.is_initialized()
    model = build_model(cfg.model)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
    assert block % 4 and est.zero.units == [("blocks.0", block + 4 - block % 4),
                                            ("blocks.1", block + 4 - block % 4)]
    assert est.zero.root == -(-root // 4) * 4  # embeddings, ln_f; the tied head counted once
    assert (est.zero.plan.stage, est.zero.plan.shard_ranks) == (3, 4)
    # shard() broadcasts the same state as DataParallel: gloo's tree from rank 0, 2 children
    assert est.broadcast_wire_bytes == 2 * est.parameters * 4
    padded = sum(n for _, n in est.zero.units) + est.zero.root
    assert est.memory.parameter_bytes == padded  # 4P / L with L = 4
    assert est.bucket_bytes == []


def test_zero_estimate_refuses_unit_patterns_that_match_nothing(tiny):
    cfg = tiny(parallel={"nproc": 2, "zero_stage": 2, "shard_units": ["layers.*"]})
    with pytest.raises(ConfigError, match=r"parallel.shard_units=\['layers.\*'\]: no module"):
        dryrun.estimate(cfg)
    assert not dist.is_initialized()


def test_zero_dry_run_text(tiny):
    text = dry_run(tiny(parallel={"nproc": 4, "ranks_per_node": 2, "zero_stage": 3,
                                         "hierarchical": True, "optimizer_shard": "dp",
                                         "offload_optimizer": True},
                               train={"precision": "bf16"}))
    for words in ("zero:  stage 3", "over dp.local (2 ranks), replicated over dp.cross (2)",
                  "optimizer state over 4 ranks", "L = 2 shard ranks, S = 4 optimizer ranks",
                  "gathered units", "grads in flight", "[host]", "device ", "reduce_scatter over dp.local",
                  "reduce_scatter over dp.cross", "all_gather over dp.cross", "all_reduce over dp (4 ranks)",
                  "validation gathers", "control (tokens, stop flag)", "(bf16)"):
        assert words in text, words


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cli_dry_run_of_every_zero_stage(tiny, tmp_path, capsys, stage):
    path = tmp_path / "tiny.toml"
    path.write_text(config_to_toml(tiny()))
    assert main(["train", "--dry-run", str(path), "--nproc", "2", "--set", f"parallel.zero_stage={stage}"]) == 0
    out = capsys.readouterr().out
    assert f"zero:  stage {stage}" in out and "reduce_scatter over dp (2 ranks)" in out


def _train(rank, world, cfgs, run_dirs):
    """Train each config in turn on this one world (a process group per config would cost a
    spawn each); `run()` would tear the group down, so its two halves are called directly."""
    from loomtrain.train.launch import init_distributed
    from loomtrain.train.run import train_loop
    from loomtrain.train.trainer import StopFlag

    out = []
    for cfg, run_dir in zip(cfgs, run_dirs):
        train_loop(cfg, Path(run_dir), None, init_distributed(cfg), StopFlag())
        out.append(read_metrics(run_dir) if rank == 0 else None)
    return out


def _per_op(collectives, validation: bool) -> dict[str, int]:
    """Predicted wire bytes by op of one record, as the meter's records hold them. With
    log_every = eval_every = 1 a record holds its step's collectives, logged loss included;
    the validation after it (all-reduce, and stage 3's gathers) lands in the next record."""
    out: dict[str, int] = {}
    for c in collectives:
        if c.every_steps == 1 and (validation or not c.purpose.startswith("validation")):
            out[c.op] = out.get(c.op, 0) + c.wire_bytes * c.calls
    return dict(sorted(out.items())) | {"total": sum(out.values())}


# d_model 80: a block's fp32 gradient (311 KB) is reduce-scattered as a ring, the root's
# (93 KB) and a hierarchical shard (156 KB) by gloo's native op: both meter formulas are hit.
WIDE = {"d_model": 80, "n_heads": 2}
LLAMA_RUN = {"name": "llama", "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 40}
CASES = {
    2: [("stage 0 fp32 (DataParallel)", {}),
        ("stage 0 bf16", {"train": {"precision": "bf16"}}),
        ("stage 1", {"model": WIDE, "parallel": {"zero_stage": 1}}),
        ("stage 2", {"model": WIDE, "parallel": {"zero_stage": 2}}),
        ("stage 3 bf16, prefetch 2", {"model": WIDE, "parallel": {"zero_stage": 3, "prefetch": 2},
                                      "train": {"precision": "bf16"}}),
        ("tp 2", {"parallel": {"tp": 2}, "train": {"global_batch": 4}}),
        ("tp 2, sequence parallel, bf16", {"parallel": {"tp": 2, "sequence_parallel": True},
                                           "train": {"global_batch": 4, "precision": "bf16"}}),
        ("MLP model, tp 2", {"model": {"name": "mlp"}, "parallel": {"tp": 2},
                             "train": {"global_batch": 4}}),
        # the llama: tp with its kv heads replicated (their weight and bias gradients summed
        # over tp) and q/k-norm; with sequence parallelism (the embedding reduce-scatters);
        # ZeRO-3 over its blocks
        ("llama, tp 2, kv heads replicated, qk_norm, qkv_bias, heads 12 wide",
         {"model": LLAMA_RUN | {"n_kv_heads": 1, "qk_norm": True, "qkv_bias": True,
                                "head_dim": 12},
          "parallel": {"tp": 2}, "train": {"global_batch": 4}}),
        ("llama, tp 2, sequence parallel, bf16",
         {"model": LLAMA_RUN, "parallel": {"tp": 2, "sequence_parallel": True},
          "train": {"global_batch": 4, "precision": "bf16"}}),
        ("llama, stage 3 bf16", {"model": LLAMA_RUN, "parallel": {"zero_stage": 3},
                                 "train": {"precision": "bf16"}}),
        # recomputation outside a pipeline: torch's checkpoint reruns each block's forward
        # but its last tp collective; the cp kernels: Ulysses with the llama's kv heads split
        # over cp, recomputed (its exchanges twice), and LASP's state gathers
        ("tp 2, full recomputation", {"parallel": {"tp": 2, "recompute": "full"},
                                      "train": {"global_batch": 4}}),
        ("llama, cp 2 Ulysses, full recomputation",
         {"model": LLAMA_RUN, "parallel": {"cp": 2, "cp_method": "ulysses", "recompute": "full"},
          "train": {"global_batch": 4}}),
        ("linear attention, cp 2 LASP", {"model": {"attention": "linear"}, "parallel": {"cp": 2},
                                         "train": {"global_batch": 4}})],
    # d_model 34: blocks padded to a multiple of 4 (as in test_zero_estimate_lays_out_the_real_units)
    4: [("hierarchical stage 2, optimizer per node",
         {"model": {"d_model": 34}, "parallel": {"zero_stage": 2, "hierarchical": True}}),
        ("hierarchical stage 3, optimizer over dp, offloaded",
         {"model": {"d_model": 34}, "parallel": {"zero_stage": 3, "hierarchical": True,
                                                 "optimizer_shard": "dp", "offload_optimizer": True}}),
        ("tp 2 x dp 2, sequence parallel, stage 3",
         {"parallel": {"tp": 2, "sequence_parallel": True, "zero_stage": 3},
          "train": {"global_batch": 8}}),
        ("tp 2 x dp 2, data parallel", {"parallel": {"tp": 2}, "train": {"global_batch": 8}}),
        # automatic sequence parallelism rewrites the tp model's trace: one head per tp rank,
        # so its plan chooses the ring
        ("tp 2 x cp 2, cp_method auto, sequence parallel",
         {"parallel": {"tp": 2, "cp": 2, "cp_method": "auto", "sequence_parallel": True},
          "train": {"global_batch": 4}}),
        # 4 layers in 4 stages: rank 0 holds stages 0 and 2, sends both ways
        ("pp 2 x dp 2, interleaved, ZeRO-1",
         {"parallel": {"pp": 2, "schedule": "interleaved", "virtual_stages": 2, "zero_stage": 1},
          "train": {"micro_batch": 4}}),
        # ZeRO-3 units freed after every forward and backward: each gathered per forward,
        # rerun and backward, the root per forward and per backward of each stage
        ("pp 2 x dp 2, interleaved, ZeRO-3 reshard micro_batch, full recomputation",
         {"parallel": {"pp": 2, "schedule": "interleaved", "virtual_stages": 2, "zero_stage": 3,
                       "zero_reshard": "micro_batch", "recompute": "full"},
          "train": {"micro_batch": 4}})],
}


@pytest.mark.parametrize("world", [2, 4])
def test_predicted_collectives_match_the_meter(tiny, tmp_path, world):
    # accumulation 2 everywhere, so "last micro-batch" and "every micro-batch" differ; 3
    # validation batches: dp ranks get 2 and 1 (world 2), or 1 and 0 (world 4)
    base = {"run": {"eval_every": 1, "eval_batches": 3},
            "train": {"steps": 2, "global_batch": 4 * world},
            "parallel": {"nproc": world, "bucket_mb": 0.01,
                         "ranks_per_node": 2 if world == 4 else None}}
    cfgs, dirs = [], []
    for i, (_, sections) in enumerate(CASES[world]):
        tree = {k: base.get(k, {}) | sections.get(k, {}) for k in set(base) | set(sections)}
        cfgs.append(tiny(**tree))
        dirs.append(str(tmp_path / f"run{i}"))
    results = run_world(_train, world, cfgs, dirs, timeout_s=180)[0]
    for (label, _), cfg, records in zip(CASES[world], cfgs, results):
        assert cfg.accumulation_steps == 2
        est = dryrun.estimate(cfg)
        expected = [_per_op(est.collectives, validation=False), _per_op(est.collectives, validation=True)]
        assert [r["comm_bytes"] for r in records] == expected, label
        assert (cfg.parallel.tp > 1) == any(c.axis == "tp" for c in est.collectives), label
        assert (cfg.parallel.cp > 1) == any(c.axis == "cp" for c in est.collectives), label
    stage1 = dryrun.estimate(cfgs[2]) if world == 2 else None
    if stage1 is not None:  # the ring and the native reduce-scatter were both predicted
        assert {c.algorithm for c in stage1.engine if c.op == "reduce_scatter"} == \
            {"ring_reduce_scatter", "ring_all_reduce"}


@pytest.mark.parametrize("model,sp", [({}, False), ({}, True), (LLAMA_RUN | {"qk_norm": True}, True),
                                      ({"name": "mlp"}, False)])
def test_tp_collectives_of_pipeline_stages_add_up_to_the_model(tiny, model, sp):
    """Every layer's tp collectives are counted on the rank that runs it: the stages of a
    pipeline cut anywhere add up to the whole model, call for call and byte for byte (the
    gradient norm, once per rank, aside)."""
    from loomtrain.parallel.tensor_estimate import tensor_collectives

    m = tiny(model={"n_layers": 3, **model}, parallel={"nproc": 2, "tp": 2,
                                                        "sequence_parallel": sp}).model
    layers = ["embed", *(f"blocks.{i}" for i in range(3)), "head"]

    def totals(part):
        out = {}
        for c in tensor_collectives(m, 2, 2, sp, 3, 4, eval_forwards=2, layers=part):
            if not c.purpose.startswith("gradient norm"):
                out[c.op, c.every_steps] = [a + b for a, b in
                                            zip(out.get((c.op, c.every_steps), (0, 0)),
                                                (c.calls, c.calls * c.wire_bytes))]
        return out

    whole = totals(None)
    assert whole == totals(layers) and whole
    for cut in range(1, len(layers)):
        first, second = totals(layers[:cut]), totals(layers[cut:])
        assert {k: [a + b for a, b in zip(first.get(k, (0, 0)), second.get(k, (0, 0)))]
                for k in whole} == whole, cut


# --- tensor parallel: activations per rank ---------------------------------------------------


def _tp_saved_bytes(rank, world, cases):
    from loomtrain.mesh import build_mesh
    from loomtrain.parallel import apply_tensor_parallel

    mesh = build_mesh({"tp": world})
    out = []
    for cfg in cases:
        torch.manual_seed(0)
        model, loss_sum = apply_tensor_parallel(build_model(cfg.model), mesh, cfg)
        out.append(saved_activation_bytes(model, cfg.model.vocab_size, cfg.train.micro_batch,
                                          cfg.model.seq_len, loss_sum))
    return out


def test_tensor_parallel_activation_formula_matches_saved_tensors(tiny):
    from loomtrain.parallel.tensor_estimate import tensor_activation_bytes

    cases = [tiny(model={"d_model": 48, "n_heads": 4, "n_layers": 2}, parallel={"nproc": 2, "tp": 2},
                  train={"micro_batch": 3, "global_batch": 6}),
             tiny(model={"d_model": 48, "n_heads": 4, "n_layers": 2},
                  parallel={"nproc": 2, "tp": 2, "sequence_parallel": True},
                  train={"micro_batch": 3, "global_batch": 6}),
             tiny(model={"name": "mlp", "d_model": 48}, parallel={"nproc": 2, "tp": 2})]
    # the llama: kv heads split (2 kv heads) or replicated (1), multi-head (4), each switch
    llama = {"name": "llama", "d_model": 32, "n_heads": 4, "ffn_hidden": 40}
    cases += [tiny(model={**llama, **keys}, parallel={"nproc": 2, "tp": 2, "sequence_parallel": sp})
              for keys, sp in [({"n_kv_heads": 2}, False),
                               ({"n_kv_heads": 1, "qk_norm": True, "qkv_bias": True,
                                 "tie_embeddings": True, "sliding_window": 5}, False),
                               ({"n_kv_heads": 1, "qk_norm": True, "tie_embeddings": True}, True),
                               ({"n_kv_heads": 4}, True)]]
    measured = run_world(_tp_saved_bytes, 2, cases, timeout_s=120)[0]
    for cfg, got in zip(cases, measured):
        p = cfg.parallel
        want = tensor_activation_bytes(cfg.model, cfg.train.micro_batch, p.tp, p.sequence_parallel)
        assert abs(got - want) <= TOLERANCE * want, (cfg.model, p.sequence_parallel, got, want)
    assert measured[1] < measured[0]  # sequence parallel keeps less


# --- pipeline: stages, stash peaks, point-to-point sends -----------------------------------


# the pipeline tests' models: the GPT's and the MLP's MLP 2x wide; the llama with grouped-query
# attention and a sliding window, or multi-head with qk-norm (what selective recompute frees
# differs: activations.py llama_core_bytes)
STAGE_MODELS = {"gpt": {"mlp_ratio": 2}, "mlp": {"mlp_ratio": 2},
                "llama": {"n_kv_heads": 2, "ffn_hidden": 64, "sliding_window": 7},
                "llama-qk": {"name": "llama", "qk_norm": True, "ffn_hidden": 64, "head_dim": 12}}


def _stage_model(tiny, name: str, n_layers: int):
    return tiny(model={"name": name, "n_layers": n_layers, "d_model": 48, "n_heads": 4,
                       **STAGE_MODELS[name]})


@pytest.mark.parametrize("name,bounds,recompute", [
    ("gpt", [0, 1, 3, 5], "none"), ("gpt", [0, 2, 4, 5], "none"), ("mlp", [0, 2, 3, 5], "none"),
    ("gpt", [0, 1, 3, 5], "selective"), ("gpt", [0, 2, 4, 5], "selective"),
    ("llama", [0, 1, 3, 5], "none"), ("llama", [0, 2, 4, 5], "selective"),
    ("llama-qk", [0, 1, 3, 5], "selective")])
def test_stage_activations_match_saved_tensors(tiny, name, bounds, recompute):
    from loomtrain.parallel.pipeline import PipelineModule, layers_of
    from loomtrain.parallel.pipeline.estimate import stage_memory

    cfg = _stage_model(tiny, name, 3)
    m, b = cfg.model, 3
    torch.manual_seed(0)
    model = build_model(m)
    for module in model.modules():
        if hasattr(module, "recompute_core"):
            module.recompute_core = recompute == "selective"
    layers = layers_of(model)
    stages = PipelineModule(model, layers, bounds, list(range(len(bounds) - 1)))
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, m.vocab_size, (b, m.seq_len), generator=g) for _ in range(2))
    last = len(bounds) - 2
    for s in range(last + 1):
        run = (lambda s=s, x=x: token_loss_sum(stages(x, s), y)) if s == last else (lambda s=s, x=x: stages(x, s))
        saved, out = saved_storage_bytes(model.parameters(), run)
        names = [layer.name for layer in layers[bounds[s]:bounds[s + 1]]]
        mem = stage_memory(m, names, b, 4, recompute, s == 0, s == last)
        received = 0 if s == 0 else x.numel() * 4  # saved by the stage's first LayerNorm
        assert abs(mem.stashed + received - saved) <= TOLERANCE * saved, (s, names, mem, saved)
        assert mem.held == received + (0 if s == last else out.numel() * 4)
        x = out.detach().requires_grad_(True)


@pytest.mark.parametrize("name", ["gpt", "mlp", "llama"])
def test_zero_bubble_keeps_the_linear_inputs_and_output_gradients(tiny, name):
    from loomtrain.parallel.pipeline import PipelineModule, layers_of
    from loomtrain.parallel.pipeline.estimate import stage_memory
    from loomtrain.parallel.pipeline.runtime import DeferredWeightGrads, defer_linear_weights

    cfg = _stage_model(tiny, name, 2)
    m, b = cfg.model, 3
    torch.manual_seed(0)
    model = build_model(m)
    layers = layers_of(model)
    stages = PipelineModule(model, layers, [0, 1, 4], [0, 1])  # blocks and head on stage 1
    store = DeferredWeightGrads()
    defer_linear_weights(stages, store)
    x = torch.randn(b, m.seq_len, m.d_model, requires_grad=True)
    y = torch.randint(0, m.vocab_size, (b, m.seq_len))
    with store.deferring("I"):
        token_loss_sum(stages(x, 1), y).backward()
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for _, _, x_in, dy in store.pending["I"] for t in (x_in, dy)}
    mem = stage_memory(m, [layer.name for layer in layers[1:]], b, 4, "none", False, True)
    assert sum(kept.values()) == mem.weight_inputs + mem.output_grads


def test_activation_peak_weighs_the_simulated_stash():
    from loomtrain.parallel.pipeline import schedules
    from loomtrain.parallel.pipeline.estimate import StageMemory, activation_peak

    def mem(stashed=0, received=0, output=0, recomputed=0, inputs=0, grads=0):
        return StageMemory(stashed, received, output, recomputed, inputs, grads)

    # one byte per pair, kept to W by zero-bubble's Linear inputs: the simulator's own count
    for name, pp, m, v, offload in [("gpipe", 2, 3, 1, 0), ("1f1b", 4, 6, 1, 0.5),
                                    ("zb-h1", 3, 5, 1, 0), ("zb-h1", 2, 4, 1, 1),
                                    ("interleaved", 2, 4, 2, 0)]:
        schedule = schedules.build(name, pp, m, v)
        sim = schedules.simulate(schedules.with_offload(schedule, offload) if offload else schedule)
        unit = [mem(stashed=1, inputs=1)] * (pp * v)
        assert [activation_peak(spans, unit) for spans in sim.spans] == list(sim.peak_stash), name
    sim = schedules.simulate(schedules.build("gpipe", 2, 3))
    # GPipe keeps 3 micro-batches: 3 x (10 + 1) stashed; recomputed: 3 held + one rerun's 10
    assert activation_peak(sim.spans[0], [mem(stashed=10, output=1)] * 2) == 33
    assert activation_peak(sim.spans[0], [mem(output=1, recomputed=10)] * 2) == 13
    # ZB-H1: I frees the graph (stashed 10) but for the Linear inputs W needs (3), and adds
    # the output gradients (5). Rank 0: F0 F1 I0 W0 I1 W1, both forwards' 10 at once; rank 1:
    # F0 I0 F1 I1 W0 W1, F1's 10 beside micro-batch 0's deferred 3 + 5
    sim = schedules.simulate(schedules.build("zb-h1", 2, 2))
    zb = [mem(stashed=10, inputs=3, grads=5)] * 2
    assert [activation_peak(spans, zb) for spans in sim.spans] == [10 + 10, 3 + 5 + 10]
    # interleaved stages of one rank weigh differently: stage 0 (1 B) and stage 2 (100 B)
    sim = schedules.simulate(schedules.build("interleaved", 2, 2, 2))
    memory = [mem(stashed=1), mem(), mem(stashed=100), mem()]
    assert activation_peak(sim.spans[0], memory) == 2 * 1 + 2 * 100  # all 4 forwards first


def test_pipeline_estimate_cuts_the_model_as_the_trainer(tiny):
    cfg = tiny(model={"n_layers": 6}, parallel={"nproc": 4, "pp": 2, "schedule": "zb-h1",
                                                "pipeline_balance": "time"})
    est = dryrun.estimate(cfg)
    assert not dist.is_initialized()
    pipe = est.pipeline
    assert pipe.split.balance_by_time  # a meta model cannot be timed: cut by parameters
    model = build_model(cfg.model)
    tied = model.tok_emb.weight.numel()
    assert sum(pipe.split.rank_parameters) - tied == est.model_parameters
    assert est.parameters == pipe.split.rank_parameters[0]
    assert pipe.split.stage_layers[0][0] == "embed" and pipe.split.stage_layers[-1][-1] == "head"
    assert [(n, r) for n, _, r in pipe.split.shared] == [("tok_emb.weight", [0, 1])]
    assert est.memory.activation_bytes == pipe.peaks[0] > 0
    b, t, d = cfg.train.micro_batch, cfg.model.seq_len, cfg.model.d_model
    sends = [c for c in est.collectives if c.op == "send" and c.every_steps == 1]
    assert [(c.calls, c.payload_bytes, c.wire_bytes) for c in sends] == [(2, b * t * d * 4, b * t * d * 4)]
    assert pipe.bubble_theory == pytest.approx(1 / 7)  # zb-h1, p 2, m 2, F = I = W: 1 / (1 + 2 x 3)
    text = dry_run(cfg)
    for words in ("pipeline: schedule zb-h1, 2 micro-batch(es) per step", 'pipeline_balance="time"',
                  "pp rank 0: stage 0 = embed, blocks.", "pp rank 1: stage 1 = blocks.",
                  "tied: tok_emb.weight is held by pp ranks [0, 1]", "bubble: (p-1)(F+I-W)",
                  "peak stash 2 micro-batch(es)", "activations, stage 0 -> 1: 2 send over pp",
                  "gradient norm over pp", "logged loss: all_reduce over pp"):
        assert words in text, words


def test_interleaved_dry_run_names_every_stage_of_every_rank(tiny):
    text = dry_run(tiny(model={"n_layers": 6}, parallel={
        "nproc": 4, "pp": 4, "schedule": "interleaved", "virtual_stages": 2}, train={"global_batch": 8}))
    assert "8 stages (pp 4 x 2 virtual)" in text
    assert "pp rank 0: stage 0 = embed; stage 4 = blocks.3:" in text
    assert "pp rank 3: stage 3 = blocks.2; stage 7 = head:" in text
    assert "input gradients, stage 4 -> 3" in text and "busiest: pp rank 1" in text


def test_async_dry_run_counts_the_stream_per_update(tiny):
    """schedule="async" (async_estimate.py): rank 0 stashes pp weight versions and pp
    micro-batches of activations whatever M is, and the dp engine reduces after each of its
    M updates (the counts match the meter: tests/test_weave.py, world 4)."""
    def est(zero_stage, global_batch=16):
        return dryrun.estimate(tiny(train={"global_batch": global_batch}, parallel={
            "nproc": 4, "pp": 2, "schedule": "async", "zero_stage": zero_stage}))

    whole, sharded, few = est(0), est(3), est(3, global_batch=4)  # M = 4, 4, 1
    stash = {r.name: r.nbytes for r in whole.memory.rows}["stashed weights"]
    assert stash == 2 * 4 * whole.parameters  # pp = 2 fp32 copies of pp rank 0's stage
    elements = sum(n for _, n in sharded.zero.units) + sharded.zero.root
    assert {r.name: r.nbytes for r in sharded.memory.rows}["stashed weights"] == 2 * 4 * elements
    assert sharded.memory.gathered_bytes == 0  # stage 3 gathers into the stashes only
    assert few.pipeline.peaks == sharded.pipeline.peaks  # the stream carries pp - r across steps
    calls: dict = {}
    for c in sharded.reductions:
        calls[c.op, c.axis] = calls.get((c.op, c.axis), 0) + c.calls
    units = len(sharded.zero.units) + 1  # and the root
    assert calls[("reduce_scatter", "dp")] == calls[("all_gather", "dp")] == 4 * units
    assert calls[("all_reduce", "dp")] == 4 * 2  # each update's norms: the untied, the tied one
    assert all(c.calls == 4 for c in whole.reductions)  # each bucket, every update


def _tp_calls(est) -> dict:
    return {c.purpose: c.calls for c in est.collectives if c.axis == "tp" and c.every_steps == 1}


def _one_pair_mb(est, stage: int) -> float:
    """MiB one micro-batch of `stage` saves, as the optimal schedule's profile counts it."""
    memory = est.pipeline.memory[stage]
    return (memory.stashed + memory.received) / 2**20


def test_dry_run_plans_the_optimal_schedule_as_the_runtime(tiny):
    """schedule="optimal": the runtime's plan (`plan_for_config`) under the dry run's unit
    costs (pipeline/estimate.py `unit_costs`). Below two micro-batches of stage 0, rank 0
    cannot keep them all: its peak falls under 1F1B's, and each micro-batch it recomputes
    reruns its stage's tp forward collectives (the embedding's and two per block)."""
    def run(**keys):  # 2 micro-batches: a small MILP
        return tiny(model={"n_layers": 6}, train={"global_batch": 4},
                    parallel={"nproc": 4, "pp": 2, "tp": 2, **keys})
    plain = dryrun.estimate(run(schedule="1f1b"))
    cfg = run(schedule="optimal", activation_budget_mb=1.8 * _one_pair_mb(plain, 0))
    est = dryrun.estimate(cfg)
    s = est.pipeline.schedule
    recomputed = {m for m, stage in s.recompute if stage == 0}
    assert s.name == "optimal" and recomputed and est.pipeline.peaks[0] < plain.pipeline.peaks[0]
    forward = {"embedding lookup (vocabulary-parallel)": 1,
               "attention and MLP outputs (row-parallel proj)": 2 * 3}  # blocks 0-2
    assert _tp_calls(est) == {k: n + len(recomputed) * forward.get(k, 0)
                              for k, n in _tp_calls(plain).items()}
    assert f"pp rank 0: of 2 micro-batches, 0 offloaded, {len(recomputed)} recomputed" in dry_run(cfg)


def test_pipeline_collectives_match_the_meter(tiny, tmp_path):
    """A real pp=2 run on 2 ranks: rank 0's metered bytes per op, record by record, are the
    dry run's (4 micro-batches, 3 evaluation forwards after every step); the optimal schedule
    under a budget of 1.5 micro-batches of the larger stage (whatever it keeps, offloads or
    recomputes: without tp or cp its collectives are the same)."""
    def pp2(**keys):
        return tiny(model={"n_layers": 6}, parallel={"nproc": 2, "pp": 2, **keys})
    plain = dryrun.estimate(pp2(schedule="1f1b"))
    budget = 1.5 * max(_one_pair_mb(plain, s) for s in (0, 1))
    cases = [({}, {"pp": 2, "schedule": "1f1b"}),
             ({}, {"pp": 2, "schedule": "interleaved", "virtual_stages": 2}),
             (LLAMA_RUN | {"tie_embeddings": True}, {"pp": 2, "schedule": "1f1b"}),
             ({}, {"pp": 2, "schedule": "optimal", "activation_budget_mb": budget})]
    cfgs = [tiny(model={"n_layers": 6, **model}, run={"eval_every": 1, "eval_batches": 3},
                 train={"steps": 2}, parallel={"nproc": 2, **case}) for model, case in cases]
    dirs = [str(tmp_path / f"run{i}") for i in range(len(cfgs))]
    results = run_world(_train, 2, cfgs, dirs, timeout_s=180)[0]
    for case, cfg, records in zip(cases, cfgs, results):
        est = dryrun.estimate(cfg)
        expected = [_per_op(est.collectives, validation=False), _per_op(est.collectives, validation=True)]
        assert [r["comm_bytes"] for r in records] == expected, case
        assert expected[0]["send"] > 0
    tied = [c.purpose for c in dryrun.estimate(cfgs[2]).collectives if c.purpose.startswith("tied")]
    assert tied == ["tied tok_emb.weight gradient, summed over pp"]  # the llama's tied head


# --- the llama's published shapes, on the meta device --------------------------------------


@pytest.mark.parametrize("preset,parameters,layout", [
    ("llama3-8b", 8_030_261_248, {"tp": 8, "sequence_parallel": True}),
    ("llama3-70b", 70_553_706_496, {"pp": 8, "recompute": "selective", "schedule": "zb-h1"}),
    ("llama3-70b", 70_553_706_496, {"zero_stage": 3})])
def test_llama_presets_dry_run_without_building_the_model(tmp_path, capsys, preset, parameters,
                                                          layout):
    """8B and 70B (32 and 282 GB of fp32 weights, more than this machine's memory): the dry
    run builds them on the meta device. The data is a token file with ids up to Llama 3's
    vocabulary; the activations are the formula's, split as the layout splits them."""
    import numpy as np

    tokens = tmp_path / "tokens.u32"
    np.random.default_rng(0).integers(0, 128256, 30_000, dtype=np.uint32).tofile(tokens)
    keys = {"model": {"preset": preset, "seq_len": 1024},
            "data": {"source": str(tokens), "val_fraction": 0.1},
            "train": {"micro_batch": 1, "global_batch": 8,
                      "precision": "bf16" if "zero_stage" in layout else "fp32"},
            "parallel": {"nproc": 8, **layout}}
    cfg = config_from_dict(keys)
    est = dryrun.estimate(cfg)
    assert est.model_parameters == parameters
    m, c = cfg.model, 2 if "zero_stage" in layout else 4
    if "tp" in layout:
        assert est.memory.activation_bytes == dryrun.llama_activation_bytes(m, 1, c, 8, True)
    elif "pp" in layout:  # stage 0: the embedding and blocks, their attention cores freed
        from loomtrain.activations import llama_core_bytes, llama_layer_bytes

        blocks = len(est.pipeline.split.stage_layers[0]) - 1
        block = llama_layer_bytes("block", 1, 1024, m, c) - llama_core_bytes(1, 1024, m, c)
        assert est.pipeline.memory[0].stashed == llama_layer_bytes("embed", 1, 1024, m, c) + blocks * block
        assert est.memory.activation_bytes == est.pipeline.peaks[0]
    else:
        assert est.memory.activation_bytes == dryrun.activation_bytes(m, 1, c)
    path = tmp_path / "llama.toml"
    path.write_text(config_to_toml(cfg))
    assert main(["train", "--dry-run", str(path)]) == 0
    assert f"model: llama, {parameters:,} parameters" in capsys.readouterr().out
