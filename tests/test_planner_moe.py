"""The planner and a mixture of experts (issue 29, point 5): the shape counts what loomtrain
builds and the FLOPs of k experts a token, not E; the cost model's memory, activations and
all-to-all bytes equal the dry run's at ep 1, 2 and 4, and under tp (with and without
sequence parallelism, the feed-forward whole on every tp rank), pp, cp and ep x tp, their tp
and cp bytes too; the search considers ep and splits the experts where only that fits; a
dense model never gets ep; and `loom plan` writes an ep config that `loom train` runs, the
dry run matching its meter."""

from __future__ import annotations

import random
import tomllib
from collections import Counter
from dataclasses import asdict, replace

import pytest
import tomli_w
from conftest import tiny_tree
from harness import run_world

from loomtrain.cli import main
from loomtrain.models import build_model
from loomtrain.models.config import ModelConfig
from loomtrain.planner import comm_cost as C
from loomtrain.planner.apply import plan_config, runnable
from loomtrain.planner.cost import (estimate, forward_flops, layer_kinds, model_flops_per_step,
                                    rank_flops)
from loomtrain.planner.plan import Plan
from loomtrain.planner.presets import from_model_config, preset
from loomtrain.planner.search import search
from loomtrain.planner.search_space import Space, check_fix
from loomtrain.planner.specs import BUILTIN, ClusterSpec
from loomtrain.train import dryrun
from loomtrain.train.config import config_from_dict
from loomtrain.train.metrics import read_metrics
from test_moe import MODEL, _check_dry_run
from test_planner_apply import _loom_train_takes
from test_weave import _metered

H100 = BUILTIN["h100-80g"]
MOE = {"name": "llama", "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
       "n_experts": 8, "experts_per_token": 2, "n_shared_experts": 1, "seq_len": 32,
       "vocab_size": 256}
# one block whose experts (16 of width 256) outweigh the rest; test_moe's options on (the
# sigmoid router with its bias, a shared expert, the balance loss)
HEAVY = {**MODEL, "n_layers": 1, "n_experts": 16, "moe_hidden": 256, "seq_len": 32}


def test_the_shape_counts_what_loomtrain_builds_and_k_experts_a_token():
    """Parameters as built, dense and MoE blocks mixed (moe_every 2, Qwen's shared gate, a
    sigmoid router); the model FLOPs count the router and the k experts a token runs: more
    experts add only the router's d x E."""
    m = ModelConfig(**{**MOE, "n_layers": 3, "moe_every": 2, "moe_hidden": 48,
                       "shared_expert_gate": True, "router": "sigmoid"})
    model, shape = build_model(m), from_model_config(m, "t")
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert layer_kinds(shape) == ["embed", "block", "moe", "block", "head"]
    assert shape.moe_block_params == sum(p.numel() for p in model.blocks[1].parameters())
    assert shape.block_params == sum(p.numel() for p in model.blocks[0].parameters())
    written = config_from_dict({"model": shape.model_keys()}).model  # a planned config's
    assert from_model_config(written, "t") == shape
    d, s, k, h = 64, 32, 2, 48
    attention = 2 * d * d + 2 * d * 32  # q, o; k, v of 2 kv heads of 16
    moe = attention + d * 8 + 3 * d * h * (k + 1) + d  # router, k experts + shared, gate
    dense = attention + 3 * d * m.ffn_width
    per_token = 2 * (2 * dense + moe) + 3 * 4 * s * d + 2 * d * 256
    assert model_flops_per_step(shape, 4) == 3 * 4 * s * per_token
    more = replace(shape, n_experts=16)
    assert model_flops_per_step(more, 4) - model_flops_per_step(shape, 4) == 3 * 4 * s * 2 * d * 8


def _dry_run(ep: int, zero_stage: int):
    cfg = config_from_dict({"model": MOE, "train": {"global_batch": 8, "micro_batch": 1},
                            "parallel": {"nproc": 4, "ep": ep, "zero_stage": zero_stage}})
    return cfg, dryrun.estimate(cfg)


def _assert_the_dry_runs(e, dry) -> None:
    """The estimate's weights, gradients, optimizer state and activations per rank are the
    dry run's, and so are its all-to-all bytes over ep and its experts' gradient sync over
    edp (edp x cp, "edpcp", under context parallelism)."""
    mem = dry.memory
    assert (e.memory["weights"], e.memory["gradients"], e.memory["optimizer"],
            e.memory["activations"]) == (mem.parameter_bytes, mem.gradient_bytes,
                                         mem.optimizer_bytes, mem.activation_bytes)
    wire = Counter()
    for c in dry.engine:
        wire[c.axis, c.op] += c.wire_bytes * c.calls
    assert e.comm_bytes["ep"] == wire["ep", "all_to_all"]
    assert e.comm_bytes["edp"] == sum(v for (axis, _), v in wire.items()
                                      if axis in ("edp", "edpcp"))


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_memory_and_all_to_all_bytes_equal_the_dry_runs(ep):
    """fp32 on 4 ranks: the weights, gradients and optimizer state per rank (the experts
    E / ep, sharded over edp by ZeRO) and the activations equal the dry run's; the
    all-to-alls over ep and the experts' gradient sync over edp send the dry run's bytes."""
    cluster = ClusterSpec(H100, 4, 4)
    for zero_stage in (0, 3):
        cfg, dry = _dry_run(ep, zero_stage)
        e = estimate(from_model_config(cfg.model), cluster,
                     Plan(dp=4, ep=ep, zero_stage=zero_stage, micro_batch=1, microbatches=2,
                          precision="fp32"))
        _assert_the_dry_runs(e, dry)
        assert (e.comm_bytes["ep"] > 0) == (ep > 1)
    assert e.comm_bytes["ep"] == (0 if ep == 1 else 2 * 2 * (ep - 1) / ep * (
        8 * 8 + 4 * 32 * 2 * 64 * 4))  # 2 micro-batches x 2 blocks: counts and 4 row exchanges


def test_tp_keeps_the_mixture_whole_on_every_rank():
    """Under tp a MoE block's attention is split and its feed-forward (router, experts, shared
    experts) is whole on every tp rank: its weights not divided by tp, its FLOPs over all the
    rank's tokens without sequence parallelism and over 1/tp of them with it; its tp
    collectives are the attention half's, plus under sequence parallelism the counts forward
    and the feed-forward's weight gradients backward (this rank's E / ep experts)."""
    shape, T = from_model_config(ModelConfig(**MOE)), 64
    d, h, E = 64, shape.expert_width, 8
    attention, norms = 2 * d * d + 2 * d * 32, 2 * d
    feed_forward = d * E + 3 * E * d * h + 3 * d * h
    assert shape.tp_params("moe", 2) == attention / 2 + norms + feed_forward
    assert shape.tp_params("moe", 1) == shape.moe_block_params
    per_token = 2 * (d * E + 3 * d * h * 3)  # router, k = 2 experts and the shared one
    attention_flops = T * (2 * attention + 4 * 32 * d)
    assert rank_flops(shape, "moe", T, 2, False) == attention_flops / 2 + T * per_token
    assert rank_flops(shape, "moe", T, 2, True) == forward_flops(shape, "moe", T) / 2
    assert shape.tp_calls("moe", 2, False) == ([("ar", "act", 1)], [("ar", "act", 1)])
    forward, backward = shape.tp_calls("moe", 2, True, ep=2)
    assert forward == [("half", "act", 2), ("ar", "counts", 1)]
    assert backward == [("half", "act", 2), ("ar", d, 2), ("ar", E * d, 1),
                        ("ar", E // 2 * d * h, 3), ("ar", h * d, 3)]


# world 4: the Plan fields of the layouts the planner must cost as loomtrain builds them
LAYOUTS = {
    "tp 2": {"dp": 2, "tp": 2},
    "tp 2, sequence parallel": {"dp": 2, "tp": 2, "sequence_parallel": True},
    "pp 2": {"dp": 2, "pp": 2},
    "cp 2": {"dp": 2, "cp": 2},
    "ep 2 x tp 2": {"dp": 2, "tp": 2, "ep": 2},
    "ep 2 x tp 2, sequence parallel": {"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True},
    "pp 2 x tp 2, sequence parallel": {"pp": 2, "tp": 2, "sequence_parallel": True},
}


def _tp_cp_wire(dry) -> float:
    """The dry run's tp and cp bytes of a step as the planner counts them: each call's
    payload at the ring's wire (2 (n-1)/n of an all-reduce, (n-1)/n of an all-gather or
    reduce-scatter: gloo's reduce-scatter, which the meter counts as an all-reduce, is costed
    as NCCL's), a send's payload; without the evaluation's and the once-a-step all-reduces
    of the gradient norm and the expert table, which the planner leaves out."""
    wire = 0.0
    for c in dry.engine:
        if c.axis not in ("tp", "cp") or c.purpose.startswith(
                ("validation", "gradient norm", "expert loads")):
            continue
        ring = {"all_reduce": C.all_reduce_wire, "send": lambda nbytes, n: nbytes}.get(
            c.op, C.gather_wire)
        wire += c.calls * ring(c.payload_bytes, c.ranks)
    return wire


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tp_pp_cp_layouts_cost_what_the_dry_run_counts(layout):
    """fp32 on 4 ranks, ZeRO 0 and 3: the weights, gradients, optimizer state and
    activations per rank equal the dry run's (pp: rank 0's, which holds two microbatches of
    stage 0 under 1F1B and is the most loaded), the all-to-alls over ep (T / tp tokens under
    sequence parallelism) and the experts' sync over edp send its bytes, and so do tp's
    collectives (a MoE block's attention half, its feed-forward's weight gradients under
    sequence parallelism) and cp's (the ring, the balance statistics per row)."""
    shape, cluster = from_model_config(ModelConfig(**MOE)), ClusterSpec(H100, 4, 4)
    for zero_stage in (0, 3):
        fields = LAYOUTS[layout]
        plan = Plan(microbatches=8 // fields.get("dp", 1), zero_stage=zero_stage,
                    precision="fp32", **fields)
        dry = dryrun.estimate(config_from_dict(plan_config(plan, shape, 8)))
        e = estimate(shape, cluster, plan)
        _assert_the_dry_runs(e, dry)
        assert e.comm_bytes["tp_cp"] == _tp_cp_wire(dry)
    assert (e.comm_bytes["ep"] > 0) == (plan.ep > 1)
    assert (e.comm_bytes["tp_cp"] > 0) == (plan.tp * plan.cp > 1)


def _plans(shape, cluster, batch: int, fix: dict):
    """Every plan of the space, ep and offload variants included."""
    space = Space(shape, cluster, batch, fix)
    for dp, tp, pp, cp in space.meshes():
        for b, m in space.micro_batches(dp):
            for ep in space.expert_splits(dp):
                for key in space.compute_keys(tp, pp):
                    for v in space.sync_variants(dp, tp, cp):
                        plan = Plan(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch=b,
                                    microbatches=m, **key, **v)
                        yield plan
                        yield from (replace(plan, **o) for o in space.offload_variants(plan))


def _runnable_estimates(shape, cluster, batch: int, fix: dict) -> list:
    """Every plan of the space `loom train` runs, estimated."""
    return [estimate(shape, cluster, plan) for plan in _plans(shape, cluster, batch, fix)
            if runnable(plan, shape, batch) is None]


def test_the_loom_space_of_a_mixture_is_what_loom_train_takes():
    """`runnable` (the components' refusals, asked of the config's validation) says None
    exactly for the plans of a mixture of experts `loom train` takes, on a sample of its
    whole space on 4 devices (tp, pp and cp included) and on named plans: ep with tp and
    sequence parallelism, with pp, with cp (taken), cp with sequence parallelism and
    hierarchical ZeRO x cp x ep (refused); and with data.balance ep is refused: the search's
    space "loom" keeps to layouts the trainer accepts."""
    shape, batch = from_model_config(ModelConfig(**MOE), "moe"), 8
    plans = list(_plans(shape, ClusterSpec(H100, 4, 4), batch, {}))
    pure = [p for p in plans if p.dp == 4 and p.recompute == "none" and not p.offload_activations]
    sample = [x for group, n in ((plans, 8), ([p for p in plans if p.ep > 1], 4), (pure, 4))
              for x in random.Random(0).sample(group, n)]  # dp x ep with ZeRO: mostly taken
    named = [Plan(dp=2, tp=2, ep=2, sequence_parallel=True, microbatches=4),
             Plan(dp=2, pp=2, ep=2, microbatches=4), Plan(dp=2, cp=2, ep=2, microbatches=4),
             Plan(tp=2, cp=2, sequence_parallel=True, microbatches=8),
             Plan(dp=2, cp=2, ep=2, zero_stage=1, hierarchical=True, microbatches=4)]
    verdicts = [(plan, runnable(plan, shape, batch) is None, _loom_train_takes(plan, shape, batch))
                for plan in sample + named]
    for plan, listed, takes in verdicts:
        assert listed == takes, (plan, runnable(plan, shape, batch))
    assert {listed for _, listed, _ in verdicts} == {True, False}
    assert any(plan.ep > 1 and listed for plan, listed, _ in verdicts)
    assert [listed for _, listed, _ in verdicts[-len(named):]] == [True] * 3 + [False] * 2
    balance = {"data": {"balance": True, "packing": True}}
    assert runnable(named[2], shape, batch, balance).startswith("parallel.ep=2 with data.balance")
    assert runnable(replace(named[2], ep=1), shape, batch, balance) is None


def _split_only(every: list) -> int:
    """A device memory that holds a plan of `every` only when ep splits the experts: half-way
    between the lightest plan with ep > 1 and the lightest with ep = 1."""
    least = {ep: min(e.mem_per_device_bytes for e in every if (e.plan.ep > 1) == ep)
             for ep in (False, True)}
    # at ep = 1 every rank holds (or ZeRO-3 gathers) the block's 16 experts whole, which
    # outweighs the activations ep keeps (it refuses recomputation and activation offload)
    assert least[True] < least[False], least
    return (least[True] + least[False]) // 2


def test_the_search_splits_the_experts_where_only_that_fits():
    """World 4 (dp 4): without memory pressure the search ranks plans of every ep; on a
    device that holds only split experts, the best plans `loom train` runs have ep > 1 and
    are the exhaustive enumeration's (the bounds stay exact with ep), and pinning ep = 1
    leaves no plan."""
    shape, roomy = from_model_config(ModelConfig(**HEAVY), "heavy"), ClusterSpec(H100, 4, 4)
    ranked = search(shape, roomy, 8, top=40, fix={"dp": 4}).ranked
    assert {e.plan.ep for e in ranked} == {1, 2, 4}
    every = _runnable_estimates(shape, roomy, 8, {"dp": 4})
    mem = _split_only(every)
    fitting = sorted(e.step_time_s for e in every if e.mem_per_device_bytes <= mem)
    cluster = ClusterSpec(replace(H100, mem_bytes=mem), 4, 4)

    def accept(plan):
        return runnable(plan, shape, 8)
    best = search(shape, cluster, 8, top=3, space="loom", fix={"dp": 4}, accept=accept).ranked
    assert all(e.fits and e.plan.ep > 1 for e in best)
    assert [e.step_time_s for e in best] == pytest.approx(fitting[:3], rel=1e-12)
    assert not search(shape, cluster, 8, top=3, space="loom", fix={"dp": 4, "ep": 1},
                      accept=accept).ranked


def test_a_dense_model_never_gets_ep():
    shape, cluster = preset("llama-debug"), ClusterSpec(H100, 4, 4)
    assert Space(shape, cluster, 8, {}).expert_splits(4) == [1]
    assert all(e.plan.ep == 1 for e in search(shape, cluster, 8, top=20).ranked)
    with pytest.raises(ValueError, match="fix ep=2: ep splits the experts"):
        check_fix(shape, cluster, 8, {"ep": 2})
    moe = from_model_config(ModelConfig(**MOE))
    with pytest.raises(ValueError, match="must divide them"):
        check_fix(moe, cluster, 8, {"ep": 3})
    with pytest.raises(ValueError, match="must divide dp=2"):
        check_fix(moe, cluster, 8, {"ep": 4, "dp": 2})


def test_loom_plan_writes_an_ep_config_that_trains(tmp_path, corpus):
    """`loom plan --write-config` at world 2 on a device that holds only split experts: the
    written config has parallel.ep = 2, `loom train` runs it (the dry run matching the meter
    on every rank) and it learns."""
    tree = tiny_tree(tmp_path, corpus, model=HEAVY, train={"steps": 4})
    shape = from_model_config(ModelConfig(**tree["model"]), "moe")
    fix = {"dp": 2, "precision": "fp32"}
    spec = {k: v for k, v in asdict(H100).items() if v is not None and k != "source"}
    device, config, out = (tmp_path / name for name in ("device.toml", "moe.toml", "planned.toml"))
    every = _runnable_estimates(shape, ClusterSpec(H100, 2, 2), 8, fix)
    device.write_text(tomli_w.dumps({**spec, "mem_bytes": _split_only(every)}))
    config.write_text(tomli_w.dumps(tree))
    assert main(["plan", "--model", str(config), "--gpus", "2", "--gpu", str(device),
                 "--fix", "dp=2,precision=fp32", "--write-config", str(out)]) == 0
    planned = tomllib.loads(out.read_text())
    assert planned["parallel"]["ep"] == 2 and planned["parallel"]["nproc"] == 2
    ranks = run_world(_metered, 2, [planned], str(tmp_path / "run"), True, timeout_s=200)
    _check_dry_run(planned, [r[0] for r in ranks])
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "run0")]
    assert len(losses) == 4 and losses[-1] < losses[0]
