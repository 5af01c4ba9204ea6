"""The planner's search and the stage-split MILP: the MILP against brute force, the branch and
bound against exhaustive evaluation, fix/space/accept, the explanation, and the 10-second
budget on GPT-3 175B over 1024 GPUs (issue 12)."""

import random
from dataclasses import replace

import pytest

from loomtrain.planner.cost import estimate
from loomtrain.planner.plan import Plan
from loomtrain.planner.presets import preset
from loomtrain.planner.search import PARTS, search, why_faster
from loomtrain.planner.search_space import Space
from loomtrain.planner.specs import BUILTIN, ClusterSpec, DeviceSpec
from loomtrain.planner.split_milp import (brute_force_split, inflight, min_bottleneck, refine_split,
                                          solve_split)

H100, A100_40 = BUILTIN["h100-80g"], BUILTIN["a100-40g"]


def _random_case(seed: int):
    """6-9 layers [embed, blocks, head], 2-3 stages, a 1F1B in-flight count, and a budget
    drawn from "needs most layers recomputed" to "fits without"."""
    rng = random.Random(seed)
    n, stages = rng.randint(6, 9), rng.randint(2, 3)
    t = [rng.uniform(0.5, 2.0) for _ in range(n)]
    r = [0.0] + [x * rng.uniform(0.2, 0.5) for x in t[1:-1]] + [0.0]
    p = [rng.uniform(1, 3) for _ in range(n)]
    a = [rng.uniform(1, 4) for _ in range(n)]
    c = [a[0]] + [x * 0.2 for x in a[1:-1]] + [a[-1]]
    keep = [stages - s for s in range(stages)]
    budget = rng.uniform(0.5, 1.2) * sum(x + 2 * y for x, y in zip(p, a)) / stages
    return t, r, p, a, c, budget, stages, keep


def test_milp_matches_brute_force_on_random_small_cases():
    recomputed = infeasible = 0
    for seed in range(14):
        case = _random_case(seed)
        milp, brute = solve_split(*case), brute_force_split(*case)
        assert (milp is None) == (brute is None), seed
        if brute is None:
            infeasible += 1
            continue
        split, flags, bottleneck = milp
        # HiGHS stops within mip_rel_gap = 1e-6 of the optimum
        assert bottleneck == pytest.approx(brute[2], rel=1e-5), seed
        assert sum(split) == len(case[0]) and len(split) == case[6] and min(split) >= 1
        recomputed += any(flags)
        t, r, p, a, c, budget, _, keep = case
        start = 0
        for s, size in enumerate(split):  # the MILP's answer fits, as it claims
            rng = range(start, start + size)
            assert sum(p[i] + keep[s] * (c[i] if flags[i] else a[i]) for i in rng) <= budget * (1 + 1e-9)
            start += size
    assert recomputed >= 3 and infeasible >= 1  # the cases exercise both sides of the budget


def test_min_bottleneck_is_the_unconstrained_optimum():
    for seed in range(5):
        t, r, p, a, c, _, stages, keep = _random_case(seed)
        free = brute_force_split(t, r, p, a, c, float("inf"), stages, keep)[2]
        assert min_bottleneck(t, stages) == pytest.approx(free, rel=1e-9)
        assert min_bottleneck(t, stages) <= free


def test_milp_infeasible_budget_returns_none():
    t, r, p, a, c, _, stages, keep = _random_case(0)
    assert solve_split(t, r, p, a, c, min(p) / 2, stages, keep) is None
    assert brute_force_split(t, r, p, a, c, min(p) / 2, stages, keep) is None


def test_inflight_follows_the_schedules():
    assert inflight("1f1b", 4, 8) == [4, 3, 2, 1]
    assert inflight("1f1b", 4, 2) == [2, 2, 2, 1]
    assert inflight("gpipe", 3, 8) == [8, 8, 8]
    assert inflight("zb-h1", 2, 8, offload_activations=0.5) == [2, 1.5]


def test_refine_split_drops_recompute_where_memory_allows():
    """GPT-3 13B on 8 A100-40G, tp 2 pp 4: full recompute everywhere fits, none does not; the
    MILP recomputes only what the early (more microbatches in flight) stages need."""
    shape, cluster = preset("gpt3-13b"), ClusterSpec(A100_40, 8, 8)
    plan = Plan(tp=2, pp=4, micro_batch=2, microbatches=32, recompute="full")
    assert not estimate(shape, cluster, replace(plan, recompute="none")).fits
    refined = refine_split(shape, cluster, plan)
    assert refined is not None and len(refined.split) == 4 and sum(refined.split) == shape.n_layers + 2
    flags = refined.recompute_layers
    assert len(flags) == shape.n_layers and 0 < sum(flags) < shape.n_layers
    before, after = estimate(shape, cluster, plan), estimate(shape, cluster, refined)
    assert after.fits and after.step_time_s < 0.9 * before.step_time_s
    assert refine_split(shape, cluster, replace(plan, pp=1, tp=8)) is None  # no pipeline to split


def _exhaustive(shape, cluster, batch, fix=None):
    """Every plan of the space search_space.py defines, each estimated."""
    space, out = Space(shape, cluster, batch, fix or {}), []
    for dp, tp, pp, cp in space.meshes():
        for b, m in space.micro_batches(dp):
            for key in space.compute_keys(tp, pp):
                for v in space.sync_variants(dp, tp, cp):
                    plan = Plan(dp=dp, tp=tp, pp=pp, cp=cp, micro_batch=b, microbatches=m, **key, **v)
                    e = estimate(shape, cluster, plan)
                    tries = [e] if e.fits else [estimate(shape, cluster, replace(plan, **o))
                                                for o in space.offload_variants(plan)]
                    out += [x for x in tries if x.fits]
    return sorted(out, key=lambda e: e.step_time_s)


def _cpu(cores: int) -> DeviceSpec:
    """A cpu-here as calibrate.py would write it (made-up figures): processes share `cores`."""
    return DeviceSpec("cpu-here", peak_bf16_flops=1e11, peak_fp32_flops=1e11, mem_bytes=8 * 10 ** 8,
                      mem_bandwidth_bytes_per_s=2e10, intra_node_bytes_per_s=5e9, intra_node_latency_s=5e-5,
                      inter_node_bytes_per_s=5e9, inter_node_latency_s=5e-5, host_link_bytes_per_s=2e10,
                      cores=cores, flops_by_procs=((1, 5e10), (2, 2.5e10), (4, 1.25e10)))


@pytest.mark.parametrize("name, device, devices, batch", [
    ("gpt3-6.7b", A100_40, 4, 16),  # 107 GB of weights and Adam state on 4 x 40 GB: memory binds
    ("default", _cpu(2), 4, 32),  # more processes than cores: nothing overlaps, two precisions
])
def test_pruning_keeps_the_exhaustive_top_plans(name, device, devices, batch):
    """Branch and bound evaluates a small share of the plans and finds the same top 5."""
    shape, cluster = preset(name), ClusterSpec(device, devices, devices)
    every = _exhaustive(shape, cluster, batch)
    result = search(shape, cluster, batch, top=5, refine=False)
    assert result.evaluated < len(every) / 5
    got = [e.step_time_s for e in result.ranked]
    assert got == pytest.approx([e.step_time_s for e in every[:5]], rel=1e-12)
    assert result.ranked[0].plan in {e.plan for e in every if e.step_time_s == every[0].step_time_s}


def test_ranked_sorted_and_all_fit_and_fix_respected():
    shape, cluster = preset("gpt3-1.3b"), ClusterSpec(H100, 16, 8)
    result = search(shape, cluster, 64, top=6)
    times = [e.step_time_s for e in result.ranked]
    assert len(times) == 6 and times == sorted(times)
    assert all(e.fits and e.plan.devices == 16 for e in result.ranked)
    assert result.notes == {i: None for i in range(6)}
    fixed = search(shape, cluster, 64, top=4, fix={"pp": 2, "schedule": "gpipe", "zero_stage": 1})
    assert fixed.ranked and all(e.plan.pp == 2 and e.plan.schedule == "gpipe" and e.plan.zero_stage == 1
                                for e in fixed.ranked)
    assert fixed.ranked[0].step_time_s >= times[0]


@pytest.mark.parametrize("fix, match", [
    ({"dp": 4, "tp": 2, "pp": 1, "cp": 1}, "makes 8 devices"),
    ({"schedule": "pipedream"}, "schedule"),
    ({"virtual_stages": 2, "schedule": "1f1b"}, "interleaved"),
    ({"microbatches": 5}, "divide the global batch"),
    ({"dp": 16, "micro_batch": 1, "microbatches": 2}, "product"),
    ({"colour": 1}, "not a plan field"),
])
def test_bad_fix_raises_value_error(fix, match):
    with pytest.raises(ValueError, match=match):
        search(preset("gpt3-1.3b"), ClusterSpec(H100, 16, 8), 64, fix=fix)


def test_fix_tp_must_divide_the_heads():
    with pytest.raises(ValueError, match="16 heads"):
        search(preset("gpt3-1.3b"), ClusterSpec(H100, 24, 8), 48, fix={"tp": 3})


def test_bad_space_and_top():
    shape, cluster = preset("gpt3-125m"), ClusterSpec(H100, 8, 8)
    with pytest.raises(ValueError, match="space"):
        search(shape, cluster, 64, space="everything")
    with pytest.raises(ValueError, match="top"):
        search(shape, cluster, 64, top=0)


def test_loom_space_keeps_only_accepted_plans_and_all_space_notes_them():
    shape, cluster = preset("gpt3-1.3b"), ClusterSpec(H100, 16, 8)
    refused = search(shape, cluster, 64, top=5).ranked[0].plan.dp

    def accept(plan):
        return f"dp={refused} is refused here" if plan.dp == refused else None

    free = search(shape, cluster, 64, top=5, accept=accept)
    assert free.ranked[0].plan.dp == refused and free.notes[0] == f"dp={refused} is refused here"
    assert all((free.notes[i] is None) == (e.plan.dp != refused) for i, e in enumerate(free.ranked))
    loom = search(shape, cluster, 64, top=5, space="loom", accept=accept)
    assert len(loom.ranked) == 5 and all(e.plan.dp != refused for e in loom.ranked)
    assert all(v is None for v in loom.notes.values())
    assert loom.ranked[0].step_time_s >= free.ranked[0].step_time_s


def test_why_first_beats_second_names_the_largest_difference():
    shape, cluster = preset("gpt3-13b"), ClusterSpec(H100, 64, 8)
    base = Plan(dp=4, tp=8, pp=2, micro_batch=1, microbatches=64, zero_stage=1, sequence_parallel=True)
    a, b = estimate(shape, cluster, base), estimate(shape, cluster, replace(base, dp=1, pp=8,
                                                                            microbatches=256))
    assert a.step_time_s < b.step_time_s
    text = why_faster(a, b)
    diff = {k: b.time[k] - a.time[k] for k in a.time}
    top = max(diff, key=diff.get)
    assert f"it spends {diff[top]:.3g} s less on {PARTS[top]}" in text
    assert "pp 2 vs 8" in text and "dp 4 vs 1" in text


def test_cpu_here_searches_fp32_and_bf16():
    """Both precisions are in the space: the search takes the one this CPU runs faster."""
    for bf16_flops, best in ((1e11, "bf16"), (0.7e11, "fp32")):  # bf16 at fp32's speed: less traffic
        cluster = ClusterSpec(replace(_cpu(2), peak_bf16_flops=bf16_flops), 2, 2)
        assert search(preset("default"), cluster, 32, top=3).ranked[0].plan.precision == best
    cluster = ClusterSpec(_cpu(2), 2, 2)
    only = search(preset("default"), cluster, 32, top=5, fix={"precision": "fp32"})
    assert all(e.plan.precision == "fp32" for e in only.ranked)


def test_gpt3_175b_on_1024_h100_within_ten_seconds():
    shape, cluster = preset("gpt3-175b"), ClusterSpec(H100, 1024, 8)
    result = search(shape, cluster, 1536, top=10)
    assert result.search_s < 10.0  # issue 12's budget; about 3 s measured on this 2-core machine
    best = result.ranked[0]
    assert best.fits and best.plan.tp <= 8 and 0.2 < best.mfu < 0.7
    assert len(result.ranked) == 10 and result.pruned > 10 * result.evaluated
