"""The analytic cost model of one training step of a GPT or a llama (the shapes of presets.py
and llama_shape.py) under a Plan: FLOPs, memory traffic, launches and collectives per layer,
the schedule's step time, memory per device (docs/planner.md states every formula with its
source; the names below follow it). step_costs() gives the same per-stage numbers to the
event simulator (simulate.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from functools import lru_cache

from loomtrain.models.config import padded_vocab
from loomtrain.planner import comm_cost as C
from loomtrain.planner.plan import Estimate, Plan, StageCosts, StepCosts
from loomtrain.planner.presets import ModelShape
from loomtrain.planner.specs import ClusterSpec

COMPUTE_BYTES = {"bf16": 2, "fp32": 4}
FP32 = 4
# bytes each precision keeps per parameter (Rajbhandari et al. 2020, ZeRO, sec. 3.1: mixed
# precision Adam keeps 2 + 2 + 12): weights, gradients, optimizer (fp32 master + Adam m, v)
WEIGHT_BYTES = {"bf16": 2, "fp32": 4}
GRAD_BYTES = {"bf16": 2, "fp32": 4}
OPTIMIZER_BYTES = {"bf16": 12, "fp32": 8}
# bytes the optimizer step moves per parameter, as torch's foreach AdamW runs it (one pass
# per op over the parameter list, torch/optim/adamw.py): decay p (r+w 8), lerp m to g (12),
# v *= beta2 (8), v += g*g (12), a new sqrt(v) (8), its bias scaling and + eps (8 + 8),
# p += m / it (16): 80 in fp32; the gradient norm reads g and clipping scales it (4 + 8),
# zero_grad(set_to_none=False) writes it (4): 96. Mixed precision also reads the bf16
# gradient and writes the bf16 weights (+4). Measured here (2026-12-05): 11.8 ms for the
# default model's 3.3M parameters at 27 GB/s, 97 bytes per parameter.
OPTIMIZER_TRAFFIC = {"fp32": 96, "bf16": 100}
# memory-bound traffic per token in one forward: the shape's `traffic_h` (norms, adds,
# attention's inputs and output, the MLP's activation, ...), and the head's log-softmax over V
# (read and write, fp32, 2V) and its backward (2V). Backward moves twice the forward's.
# Operator launches per forward: the shape's `ops`; backward launches twice as many.
OPTIMIZER_OPS = 24  # foreach AdamW, norm, clip, zero_grad over the whole parameter list
HOST_ADAM_PARAMS_PER_S = 1e9  # offload: CPU Adam, an assumption (docs/planner.md)
BLOCKS = ("block", "moe")  # the kinds of a transformer block: dense, a mixture of experts


@lru_cache(maxsize=256)
def _kinds(model: ModelShape) -> tuple[str, ...]:
    return ("embed", *("moe" if model.is_moe(i) else "block" for i in range(model.n_layers)), "head")


def layer_kinds(model: ModelShape) -> list[str]:
    """[embed, a kind per block ("block", or "moe" for a mixture of experts), head]."""
    return list(_kinds(model))


def forward_flops(model: ModelShape, kind: str, tokens: float) -> float:
    """Matmul FLOPs of one layer's forward over `tokens` tokens (Narayanan et al. 2021, eq. 3
    without the 3x for backward): a block 2 FLOPs per matmul weight per token (the GPT's
    (4 + 2r)h^2; the llama's q, k, v, o and SwiGLU matrices, `block_matmul_params`; a MoE
    block's router and the k experts and shared experts a token runs, `moe_matmul_params`)
    plus attention's QK^T and AV, 4 s h per token (counted over the full causal square, as
    Megatron counts it, and over every query head: grouped-query attention shares k and v,
    not the products); the head 2 h V; the embedding none (a gather)."""
    h = model.d_model
    if kind in BLOCKS:
        weights = model.moe_matmul_params if kind == "moe" else model.block_matmul_params
        return tokens * (2 * weights + 4 * model.seq_len * h)
    return tokens * 2 * h * model.vocab_size if kind == "head" else 0.0


def rank_flops(model: ModelShape, kind: str, tokens: float, tp: int, sp: bool) -> float:
    """One tp rank's share of `forward_flops`: 1/tp, but a MoE block's feed-forward, whole on
    every tp rank (parallel/tensor_llama.py), runs over the rank's own tokens: all of them, or
    1/tp of them under sequence parallelism."""
    flops = forward_flops(model, kind, tokens) / tp
    if kind == "moe" and not sp:
        flops += 2 * tokens * model.moe_feed_forward_matmul_params * (1 - 1 / tp)
    return flops


def model_flops_per_step(model: ModelShape, global_batch: int) -> float:
    """Forward + backward (3x forward) of the whole model on global_batch sequences, without
    recompute: the numerator of MFU (Chowdhery et al. 2022, appendix B)."""
    tokens = global_batch * model.seq_len
    kinds = Counter(_kinds(model))
    return 3 * sum(n * forward_flops(model, kind, tokens) for kind, n in kinds.items())


def split_experts(model: ModelShape, kind: str, ep: int) -> int:
    """The routed experts' weights of a layer when ep > 1 splits them (parallel/expert/: they
    are replicated over edp, not dp, and shard there under ZeRO); 0 at ep = 1, where they are
    the block's weights like any other."""
    return model.expert_params if kind == "moe" and ep > 1 else 0


def rank_params(model: ModelShape, kind: str, tp: int = 1, ep: int = 1) -> float:
    """The parameters one rank holds of a layer of this kind: one tp rank's (`tp_params`; a
    MoE block's feed-forward whole on every tp rank), the routed experts' E / ep."""
    return model.tp_params(kind, tp) - split_experts(model, kind, ep) * (1 - 1 / ep)


def even_split(model: ModelShape, stages: int, tp: int = 1, ep: int = 1) -> tuple[int, ...]:
    """Layers per stage as loomtrain balances them by default (pipeline_balance="params": the
    linear partition minimizing the largest stage's parameters, those a rank holds once tp
    and ep have split the model; split.py's balance)."""
    from loomtrain.parallel.pipeline.split import balance
    bounds = balance([float(rank_params(model, k, tp, ep)) for k in layer_kinds(model)], stages)
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


class _Layer:
    """One layer's per-microbatch costs under a plan (times in s, bytes per device)."""
    __slots__ = ("kind", "forward_s", "input_s", "weight_s", "recompute_s", "fwd_comm_s", "bwd_comm_s",
                 "stash_bytes", "checkpoint_bytes", "params", "expert_params", "tp_wire", "ep_wire")


def padded(model: ModelShape, tp: int) -> ModelShape:
    """`model` as each of `tp` ranks holds and computes it: its vocabulary padded to a
    multiple of tp (models/config.py `padded_vocab`); the useful FLOPs of MFU keep
    the real one."""
    vocab = padded_vocab(model.vocab_size, tp)
    return model if vocab == model.vocab_size else replace(model, vocab_size=vocab)


def _layer(model: ModelShape, cluster: ClusterSpec, plan: Plan, kind: str, recompute: str) -> _Layer:
    model = padded(model, plan.tp)
    d, c = cluster.device, COMPUTE_BYTES[plan.precision]
    tp, cp, b, h = plan.tp, plan.cp, plan.micro_batch, model.d_model
    s_local = model.seq_len // cp
    tokens = b * s_local
    rate = d.achieved_flops(plan.precision, plan.devices)
    bandwidth = d.mem_bandwidth_bytes_per_s * d.share(plan.devices)
    flops = rank_flops(model, kind, tokens, tp, plan.sequence_parallel)
    attn_s = 0.0
    ops = model.ops[kind]
    if kind in BLOCKS:  # the attention core at its own rate, the GEMMs at the matmul rate
        attn_flops = tokens * 4 * model.seq_len * h / tp
        attn_s = attn_flops / (rate * d.attention_efficiency)
        flops -= attn_flops
        split, whole = model.traffic_h["split"], model.traffic_h["replicated"]
        if kind == "moe":  # its feed-forward whole on every tp rank, as the norms
            split = model.traffic_h["moe_split"]
            whole += model.traffic_h["moe"] + model.traffic_h["moe_ep"] * (plan.ep > 1)
            ops += model.ops["moe_ep"] * (plan.ep > 1)
        elems = tokens * h * (split / tp + whole / (tp if plan.sequence_parallel else 1))
        traffic = elems * c
    elif kind == "embed":
        traffic = tokens * model.traffic_h["embed"] * h * c
    else:
        traffic = tokens * (model.traffic_h["head"] * h * c + 2 * FP32 * model.vocab_size / tp)
    overhead = ops * d.overhead_s(plan.devices)
    L = _Layer()
    L.kind = kind
    L.forward_s = flops / rate + attn_s + traffic / bandwidth + overhead
    # backward: the input-gradient and weight-gradient matmuls each cost the forward's FLOPs;
    # the memory-bound backward (2x the forward's traffic) and attention's (2x its forward:
    # no weights) go with the input gradient
    L.input_s = flops / rate + 2 * attn_s + 2 * traffic / bandwidth + overhead
    L.weight_s = flops / rate + overhead
    L.recompute_s = 0.0
    act = b * s_local * h * c  # one activation tensor (b, s/cp, h)
    L.stash_bytes = model.stash_bytes(kind, b, s_local, c, tp, plan.sequence_parallel)
    if kind in BLOCKS:
        if recompute == "full":  # keep the block's input only; replay its forward
            L.recompute_s = L.forward_s
            L.stash_bytes = act // (tp if plan.sequence_parallel else 1)
        elif recompute == "selective":  # drop what the attention core saves; replay it
            L.recompute_s = attn_s + tokens * 4 * h * c / tp / bandwidth
            L.stash_bytes -= model.core_bytes(b, s_local, c, tp)
    L.checkpoint_bytes = act
    L.fwd_comm_s, L.bwd_comm_s, L.tp_wire = _tp_comm(model, cluster, plan, kind, act)
    ep_fwd, ep_bwd, L.ep_wire = _ep_comm(model, cluster, plan, kind, act)
    L.fwd_comm_s += ep_fwd
    L.bwd_comm_s += ep_bwd
    if cp > 1 and kind in BLOCKS:
        _add_cp_comm(L, model, cluster, plan, attn_s)
    L.forward_s += L.fwd_comm_s
    L.input_s += L.bwd_comm_s
    L.expert_params = split_experts(model, kind, plan.ep) / plan.ep
    L.params = rank_params(model, kind, tp, plan.ep) - L.expert_params
    return L


def _add_cp_comm(L: _Layer, model: ModelShape, cluster: ClusterSpec, plan: Plan,
                 attn_s: float) -> None:
    """A block's cp collectives per microbatch, added to `L`: the ring's cp - 1 hops of this
    rank's k and v (`kv_width`) forward, twice as many backward (the k, v and their
    gradients), hidden behind the attention core where the device runs them apart; a MoE
    block's per-row balance statistics (b 2E fp32, models/moe.py `balance_loss`) all-reduced
    over cp in its forward, blocking."""
    tp, cp = plan.tp, plan.cp
    sizes = {"tp": tp, "cp": cp, "dp": plan.dp, "pp": plan.pp}
    crosses = C.spans_nodes(cluster, sizes, "cp")
    kv = plan.micro_batch * model.seq_len // cp * model.kv_width(tp) * COMPUTE_BYTES[plan.precision]
    hop = C.send_s(cluster, kv, crosses) + C.inline_s(cluster, cp, plan.devices, shift=True)
    ring_f, ring_b = (cp - 1) * hop, 2 * (cp - 1) * hop
    hide = cluster.device.cores is None or plan.devices < cluster.device.cores
    L.fwd_comm_s += max(0.0, ring_f - attn_s) if hide else ring_f
    L.bwd_comm_s += max(0.0, ring_b - 2 * attn_s) if hide else ring_b
    L.tp_wire += 3 * (cp - 1) * kv
    if L.kind == "moe":
        stats = FP32 * plan.micro_batch * 2 * model.n_experts
        L.fwd_comm_s += (C.all_reduce_s(cluster, stats, cp, crosses)
                         + C.inline_s(cluster, cp, plan.devices))
        L.tp_wire += C.all_reduce_wire(stats, cp)


def _ep_comm(model: ModelShape, cluster: ClusterSpec, plan: Plan, kind: str,
             act: float) -> tuple[float, float, float]:
    """(forward s, backward s, wire bytes) of a MoE block's all-to-alls over ep per
    microbatch, as parallel/expert/ runs them (the dry run's `exchange_collectives`): the
    counts (8 E bytes) and the k copies of the rank's tokens (`act` bytes, b s/cp d c, / tp
    under sequence parallelism, where each tp rank routes its piece of the sequence:
    dispatch, then combine) forward; the copies' gradients, combine's and dispatch's,
    backward. Each is an all-to-all (comm_cost.all_to_all_s) of balanced routing, blocking
    (the experts wait for their rows), and pays the sync penalty."""
    if kind != "moe" or plan.ep == 1:
        return 0.0, 0.0, 0.0
    ep = plan.ep
    sizes = {"tp": plan.tp, "cp": plan.cp, "ep": ep, "dp": plan.dp, "pp": plan.pp}
    crosses = C.spans_nodes(cluster, sizes, "ep")
    penalty = C.inline_s(cluster, ep, plan.devices)
    counts = 8 * model.n_experts
    rows = act * model.experts_per_token / (plan.tp if plan.sequence_parallel else 1)

    def call(nbytes):
        return C.all_to_all_s(cluster, nbytes, ep, crosses) + penalty

    wire = C.gather_wire(counts, ep) + 4 * C.gather_wire(rows, ep)
    return call(counts) + 2 * call(rows), 2 * call(rows), wire


def _tp_comm(model: ModelShape, cluster: ClusterSpec, plan: Plan, kind: str,
             act: float) -> tuple[float, float, float]:
    """(forward s, backward s, wire bytes) of one layer's tp collectives per microbatch, the
    calls the shape's `tp_calls` names (Megatron's f and g; Shoeybi et al. 2019, sec. 3;
    sequence parallel, Korthikanti et al. 2022, turns each all-reduce into an all-gather and
    a reduce-scatter: twice the calls, the same bytes). Each call also pays the sync penalty
    (comm_cost)."""
    tp = plan.tp
    if tp == 1:
        return 0.0, 0.0, 0.0
    sizes = {"tp": tp, "cp": plan.cp, "dp": plan.dp, "pp": plan.pp}
    crosses = C.spans_nodes(cluster, sizes, "tp")
    penalty = C.inline_s(cluster, tp, plan.devices)
    tokens_bytes = plan.micro_batch * model.seq_len // plan.cp * FP32  # one fp32 per token
    counts = FP32 * plan.micro_batch * 2 * model.n_experts  # a MoE block's per-row counts

    def ar(nbytes):
        return C.all_reduce_s(cluster, nbytes, tp, crosses) + penalty, C.all_reduce_wire(nbytes, tp)

    def half(nbytes):  # an all-gather or a reduce-scatter
        return C.gather_s(cluster, nbytes, tp, crosses) + penalty, C.gather_wire(nbytes, tp)

    functions = {"ar": ar, "half": half}
    payloads = {"act": act, "tokens": tokens_bytes, "counts": counts}  # else weight elements
    out = [0.0, 0.0, 0.0]
    for i, side in enumerate(model.tp_calls(kind, tp, plan.sequence_parallel, plan.ep)):
        for op, payload, count in side:
            nbytes = payloads.get(payload) or payload * WEIGHT_BYTES[plan.precision]
            t, wire = functions[op](nbytes)
            out[i] += count * t
            out[2] += count * wire
    return out[0], out[1], out[2]


def _layers(model: ModelShape, cluster: ClusterSpec, plan: Plan) -> list[_Layer]:
    """Every layer's costs, in order; blocks share one object per recompute mode (identical)."""
    cache = {}

    def get(kind, mode):
        if (kind, mode) not in cache:
            cache[kind, mode] = _layer(model, cluster, plan, kind, mode)
        return cache[kind, mode]

    flags = plan.recompute_layers or (None,) * model.n_layers
    blocks = [get(kind, plan.recompute if f is None else ("full" if f else "none"))
              for kind, f in zip(_kinds(model)[1:-1], flags)]
    return [get("embed", "none"), *blocks, get("head", "none")]


def stage_layers(model: ModelShape, plan: Plan) -> list[range]:
    """The layer indices of each of the pp * virtual_stages stages (plan.split, or even)."""
    stages = plan.pp * plan.virtual_stages
    split = plan.split or _even_split(padded(model, plan.tp), stages, plan.tp, plan.ep)
    bounds = [0]
    for n in split:
        bounds.append(bounds[-1] + n)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _groups(layers: list[_Layer], rng: range, uniform: bool) -> list[tuple[_Layer, int]]:
    """A stage's layers as (layer, count) runs: O(1) when every block shares one object
    (no per-layer recompute flags), so the search's estimates stay cheap at 96 layers."""
    if not uniform:
        return [(layers[i], 1) for i in rng]
    last = len(layers) - 1
    blocks = len(rng) - (rng.start == 0) - (rng.stop == last + 1)
    out = [(layers[0], 1)] if rng.start == 0 else []
    if blocks:
        out.append((layers[1], blocks))
    return out + ([(layers[last], 1)] if rng.stop == last + 1 else [])


def _offloaded(groups, fraction: float) -> list[_Layer]:
    """pp = 1: the blocks parallel/offload.py offloads, the first round(f L)."""
    blocks = [x for x, n in groups if x.kind in BLOCKS for _ in range(n)]
    return blocks[:round(fraction * len(blocks))]


def _offloaded_blocks_kept(groups, fraction: float) -> float:
    """pp = 1, a fraction offloaded: the stash less the offloaded blocks', but at least the
    embedding's and two blocks' (the backward runs one while the one ahead reloads:
    recompute.py `recomputed_activation_bytes`, the dry run's formula)."""
    off = _offloaded(groups, fraction)
    embed = sum(x.stash_bytes * n for x, n in groups if x.kind == "embed")
    return max(_total(groups, "stash_bytes") - sum(x.stash_bytes for x in off),
               embed + 2 * max((x.stash_bytes for x in off), default=0))


def _offloaded_blocks_exposed_s(groups, fraction: float, link_bytes_per_s: float) -> float:
    """pp = 1: the copy time each way that compute does not hide. A block's copy out runs
    beside the next block's forward, its copy back beside the backward of the block after
    it (longer than a forward): what exceeds a block's forward shows."""
    return sum(max(0.0, x.stash_bytes / link_bytes_per_s - x.forward_s)
               for x in _offloaded(groups, fraction))


def _total(groups, field: str) -> float:
    return sum(getattr(x, field) * n for x, n in groups)


def _stage_params(model: ModelShape, plan: Plan, groups) -> float:
    """Parameters (per tp rank) of one stage's layers, a tied embedding and head counted once
    when the stage holds both (pp = 1); across stages each of the first and last keeps a copy
    (split.py's pp_copies)."""
    params = _total(groups, "params")
    if model.tied_head and groups[0][0].kind == "embed" and groups[-1][0].kind == "head":
        params -= padded_vocab(model.vocab_size, plan.tp) * model.d_model / plan.tp
    return params


@lru_cache(maxsize=4096)
def _even_split(model: ModelShape, stages: int, tp: int, ep: int) -> tuple[int, ...]:
    return even_split(model, stages, tp, ep)


def _replicas(plan: Plan, experts: bool = False) -> int:
    """The ranks holding a copy of a parameter: dp x cp (cp ranks hold whole replicas); for
    the experts ep splits, dp x cp / ep (the "edp" ranks holding the same experts)."""
    return plan.dp * plan.cp // (plan.ep if experts else 1)


def _shard_groups(cluster: ClusterSpec, plan: Plan, experts: bool = False) -> tuple[int, int, bool]:
    """(ranks sharding ZeRO state, ranks outside them, does the dp x cp group cross nodes) of
    the parameters (`experts`: of the experts ep splits, over edp, whose ranks span the dp
    group's extent). Gradients are reduced over the replicas (`_replicas`); hierarchical ZeRO
    shards inside the node and reduces across (AsyncHZP, ZeRO++ hpZ)."""
    n = _replicas(plan, experts)
    crosses = plan.tp * plan.dp * plan.cp > cluster.gpus_per_node
    if not plan.hierarchical:
        return n, 1, crosses
    inside = max(1, min(n, cluster.gpus_per_node // (plan.tp * (plan.ep if experts else 1))))
    return inside, n // inside, crosses


def _state_bytes(plan: Plan, inside: int) -> tuple[float, float, float]:
    """Bytes per parameter of (weights, gradients, optimizer state) one rank keeps when ZeRO
    shards over `inside` ranks (Rajbhandari et al. 2020, sec. 3.1): stage 1 the optimizer
    state, 2 also the gradients, 3 also the weights; offloaded, no optimizer state."""
    z, prec = plan.zero_stage, plan.precision
    return (WEIGHT_BYTES[prec] / (inside if z == 3 else 1),
            GRAD_BYTES[prec] / (inside if z >= 2 else 1),
            0 if plan.offload_optimizer else OPTIMIZER_BYTES[prec] / (inside if z >= 1 else 1))


def _sync_parts(model: ModelShape, cluster: ClusterSpec, plan: Plan,
                groups: list) -> tuple[tuple, tuple]:
    """`_sync_costs` of the stages `groups` (each a list of (layer, count)): of their
    parameters over the replicas, and of the experts ep splits over edp (zeros at ep = 1),
    each in units of their own (a MoE block's experts are a ZeRO unit apart, parallel/zero)."""
    dense = _sync_costs(cluster, plan, sum(_stage_params(model, plan, g) for g in groups),
                        sum(_units(g) for g in groups))
    experts = sum(_total(g, "expert_params") for g in groups)
    if not experts:
        return dense, (0.0, 0.0, 0.0)
    units = sum(n for g in groups for x, n in g if x.expert_params)
    return dense, _sync_costs(cluster, plan, experts, units, experts=True)


def _sync_costs(cluster: ClusterSpec, plan: Plan, params: float, units: int = 1,
                experts: bool = False) -> tuple[float, float, float]:
    """For one stage's `params` (per tp rank) in `units` layers: (gradient sync per step s,
    ZeRO-3 gathers per microbatch s, wire bytes per step). Stage 0: one all-reduce; 1:
    reduce-scatter and the updated weights' all-gather (the same bytes, Rajbhandari et al.
    sec. 5); 2: the reduce-scatter on every microbatch; 3: also the weights' all-gather before
    each forward and backward, one call per layer (parallel/zero: a unit per block, one for
    the rest), each paying the sync penalty (comm_cost.inline_s). Hierarchical: reduce-scatter
    and gather inside the node, all-reduce of the node's shard across nodes. DiLoCo (H > 1):
    an fp32 all-reduce every H steps, amortized. `experts`: the experts ep splits, over edp."""
    g = params * GRAD_BYTES[plan.precision]
    w = params * WEIGHT_BYTES[plan.precision]
    inside, outside, crosses = _shard_groups(cluster, plan, experts)
    n, m, z = _replicas(plan, experts), plan.microbatches, plan.zero_stage
    if plan.diloco_h > 1:
        t = C.all_reduce_s(cluster, params * FP32, n, crosses) / plan.diloco_h
        return t, 0.0, C.all_reduce_wire(params * FP32, n) / plan.diloco_h
    if z == 0:
        return C.all_reduce_s(cluster, g, n, crosses), 0.0, C.all_reduce_wire(g, n)
    in_crosses = crosses and not plan.hierarchical
    rs = C.gather_s(cluster, g, inside, in_crosses) + C.all_reduce_s(cluster, g / inside, outside, True)
    rs_wire = C.gather_wire(g, inside) + C.all_reduce_wire(g / inside, outside)
    ag, ag_wire = C.gather_s(cluster, w, inside, in_crosses), C.gather_wire(w, inside)
    if z == 1:
        return rs + ag, 0.0, rs_wire + ag_wire
    if z == 2:
        return m * rs + ag, 0.0, m * rs_wire + ag_wire
    penalty = units * C.inline_s(cluster, inside, plan.devices)
    return m * (rs + penalty), 2 * (ag + penalty), m * (rs_wire + 2 * ag_wire)


def _memory(model: ModelShape, cluster: ClusterSpec, plan: Plan, groups) -> dict[str, int]:
    """Bytes on the most loaded pp rank: the stash of its microbatches in flight under the
    schedule, and the output of each (but the last stage's) until its backward (the pipeline
    runtime keeps it to start the backward from the received gradient), weights, gradients
    and optimizer state as ZeRO shards them over `inside` ranks, ZeRO-3's gathered units,
    DiLoCo's outer state; the experts ep splits, E / ep per MoE block, as ZeRO shards them
    over the `inside` ranks of edp."""
    p, v, m = plan.pp, plan.virtual_stages, plan.microbatches
    per_param = _state_bytes(plan, _shard_groups(cluster, plan)[0])
    per_expert = _state_bytes(plan, _shard_groups(cluster, plan, experts=True)[0])
    z, prec = plan.zero_stage, plan.precision
    stage_params = [_stage_params(model, plan, g) for g in groups]
    stage_experts = [_total(g, "expert_params") for g in groups]
    stage_stash = [_total(g, "stash_bytes") for g in groups]
    stage_output = _stage_outputs(model, plan)
    worst: dict[str, int] = {}
    for rank in range(p):
        mine = range(rank, p * v, p)
        params = sum(stage_params[s] for s in mine)
        experts = sum(stage_experts[s] for s in mine)
        stash = max(stage_stash[s] for s in mine)
        output = max(stage_output[s] for s in mine)
        if plan.schedule == "gpipe" or p == 1:
            in_flight = m if p > 1 else 1
        elif plan.schedule == "interleaved":  # Megatron's warmup on rank 0: (p-1)2 + (v-1)p + 1
            in_flight = min(m * v, 2 * (p - 1 - rank) + (v - 1) * p + 1)
        else:  # 1f1b, zb-h1: rank r holds p - r microbatches (Narayanan et al. 2021, sec. 2.2)
            in_flight = min(m, p - rank)
        if p == 1 and plan.offload_activations:
            kept = _offloaded_blocks_kept(groups[0], plan.offload_activations)
        else:
            kept = (stash * (1 - plan.offload_activations) + output) * in_flight
            if plan.offload_activations:
                kept += stash  # the microbatch being computed stays on the device
        weights, grads, optimizer = (params * a + experts * b for a, b in zip(per_param, per_expert))
        if plan.diloco_h > 1:  # DiLoCo's outer state: the global weights and Nesterov momentum
            optimizer += 2 * (params + experts) * FP32
        gathered = 0
        if z == 3:  # the unit computing and the one prefetched, gathered whole (a MoE
            # block's experts with it, unless edp is one rank: then they are whole already)
            gathered = 2 * max(x.params + x.expert_params * (per_expert[0] < per_param[0])
                               for s in mine for x, _ in groups[s]) * WEIGHT_BYTES[prec]
        parts = {"weights": weights, "gradients": grads, "optimizer": optimizer,
                 "activations": kept, "gathered": gathered}
        parts = {k: int(x) for k, x in parts.items()}
        if sum(parts.values()) > sum(worst.values()):
            worst = parts
    return worst


def _stage_outputs(model: ModelShape, plan: Plan) -> list[float]:
    """The bytes of one microbatch's output each stage keeps until its backward: a boundary
    activation (b s/cp d c, / tp under sequence parallelism) but on the last stage."""
    stages, c = plan.pp * plan.virtual_stages, COMPUTE_BYTES[plan.precision]
    act = plan.micro_batch * model.seq_len // plan.cp * model.d_model * c
    boundary = act / (plan.tp if plan.sequence_parallel else 1)
    return [boundary * (s < stages - 1) for s in range(stages)]


def step_costs(model: ModelShape, cluster: ClusterSpec, plan: Plan) -> StepCosts:
    return _step_costs(model, cluster, plan, _stage_groups(model, cluster, plan))


def _stage_groups(model: ModelShape, cluster: ClusterSpec, plan: Plan):
    layers = _layers(model, cluster, plan)
    uniform = plan.recompute_layers is None and len(set(_kinds(model)[1:-1])) == 1
    return [_groups(layers, rng, uniform) for rng in stage_layers(model, plan)]


def _step_costs(model, cluster, plan, groups) -> StepCosts:
    d = cluster.device
    c = COMPUTE_BYTES[plan.precision]
    sizes = {"tp": plan.tp, "cp": plan.cp, "dp": plan.dp, "pp": plan.pp}
    act = plan.micro_batch * model.seq_len // plan.cp * model.d_model * c
    send = C.send_s(cluster, act / (plan.tp if plan.sequence_parallel else 1),
                    C.spans_nodes(cluster, sizes, "pp")) if plan.pp > 1 else 0.0
    out, memo = [], {}
    for g, output in zip(groups, _stage_outputs(model, plan)):
        key = (_stage_params(model, plan, g), _units(g), _total(g, "expert_params"))
        if key not in memo:
            dense, experts = _sync_parts(model, cluster, plan, [g])
            memo[key] = (dense[0] + experts[0], dense[1] + experts[1])
        sync_s, gather_s = memo[key]
        offload = 0.0
        stash = _total(g, "stash_bytes")
        if plan.offload_activations and plan.pp == 1:
            offload = _offloaded_blocks_exposed_s(g, plan.offload_activations, d.host_link_bytes_per_s)
        elif plan.offload_activations:
            offload = plan.offload_activations * stash / d.host_link_bytes_per_s
        out.append(StageCosts(
            forward_s=_total(g, "forward_s"), backward_input_s=_total(g, "input_s"),
            backward_weight_s=_total(g, "weight_s"), recompute_s=_total(g, "recompute_s"),
            forward_comm_s=_total(g, "fwd_comm_s"), backward_comm_s=_total(g, "bwd_comm_s"),
            send_s=send, grad_sync_s=sync_s, param_gather_s=gather_s, offload_s=offload,
            activation_bytes=int(stash + output)))
    sharded = plan.zero_stage >= 1
    inside = _shard_groups(cluster, plan)[0] if sharded else 1
    inside_experts = _shard_groups(cluster, plan, experts=True)[0] if sharded else 1
    stage_shards = [_stage_params(model, plan, g) / inside
                    + _total(g, "expert_params") / inside_experts for g in groups]
    shard = max(sum(stage_shards[r::plan.pp]) for r in range(plan.pp))
    if plan.offload_optimizer:  # gradients down, weights up over the host link; CPU Adam
        optimizer_s = (2 * c * shard / d.host_link_bytes_per_s + shard / HOST_ADAM_PARAMS_PER_S)
    else:
        optimizer_s = (OPTIMIZER_TRAFFIC[plan.precision] * shard
                       / (d.mem_bandwidth_bytes_per_s * d.share(plan.devices))
                       + OPTIMIZER_OPS * d.overhead_s(plan.devices))
    # the trainer's per-step control all-reduce and the gradient norm's (a few bytes each)
    optimizer_s += 2 * C.all_reduce_s(cluster, 16, plan.devices, plan.devices > cluster.gpus_per_node)
    overlaps = d.cores is None or plan.devices < d.cores
    return StepCosts(tuple(out), plan.pp, plan.microbatches, plan.schedule if plan.pp > 1 else "1f1b",
                     plan.virtual_stages, optimizer_s, overlaps, bubble_scale(cluster, plan))


def _units(groups) -> int:
    """ZeRO-3 gathers of a stage: one unit per block, one for everything else it holds (the
    experts ep splits are units apart: `_sync_parts`)."""
    blocks = sum(n for x, n in groups if x.kind in BLOCKS)
    return blocks + (blocks < sum(n for _, n in groups))


def bubble_scale(cluster: ClusterSpec, plan: Plan) -> float:
    """The pipeline bubble's time per unit of its idle work. With a device per process it is
    1. On cpu-here with more processes than cores, the processes time-share the cores, and
    the ones waiting in the bubble (about half of them on average through fill and drain)
    lend theirs to the rest, which run at the speed of that many processes, up to the speed
    their own threads allow (cores // processes, at least 1: as fast as `cores` processes)."""
    d, procs = cluster.device, plan.devices
    if plan.pp == 1 or not d.cores or procs <= d.cores:
        return 1.0
    running = max(-(-procs // 2), d.cores)
    return d.share(procs) / d.share(running)


def estimate(model: ModelShape, cluster: ClusterSpec, plan: Plan) -> Estimate:
    """The predicted step time, throughput, MFU, memory and communication of `plan`."""
    from loomtrain.planner.step_time import step_time
    groups = _stage_groups(model, cluster, plan)
    costs = _step_costs(model, cluster, plan, groups)
    times = step_time(costs)
    memory = _memory(model, cluster, plan, groups)
    step_s = sum(times.values())
    batch = plan.dp * plan.microbatches * plan.micro_batch
    flops = model_flops_per_step(model, batch)
    mine = [x for s, g in enumerate(groups) if s % plan.pp == 0 for x in g]
    dense, experts = _sync_parts(model, cluster, plan, groups[::plan.pp])  # pp rank 0's
    act = plan.micro_batch * model.seq_len // plan.cp * model.d_model * COMPUTE_BYTES[plan.precision]
    comm = {"dp": int(dense[2]), "edp": int(experts[2]),
            "tp_cp": int(plan.microbatches * _total(mine, "tp_wire")),
            "ep": int(plan.microbatches * _total(mine, "ep_wire")),
            "pp": int(2 * plan.microbatches * plan.virtual_stages * act) if plan.pp > 1 else 0}
    mem = sum(memory.values())
    return Estimate(plan=plan, step_time_s=step_s, tokens_per_s=batch * model.seq_len / step_s,
                    tflops_per_device=flops / step_s / plan.devices / 1e12,
                    mfu=flops / step_s / plan.devices / cluster.device.peak_flops(plan.precision),
                    mem_per_device_bytes=mem, comm_bytes_per_step=sum(comm.values()),
                    fits=mem <= cluster.mem_per_device, memory=memory, time=times,
                    comm_bytes=comm)


def layer_costs(model: ModelShape, cluster: ClusterSpec, plan: Plan):
    """Per layer (embed, blocks, head) of one microbatch, for split_milp.py: forward+backward
    time t, the extra time r if recomputed (full), static bytes p (weights, gradients and
    optimizer state as the plan's ZeRO stage keeps them), the stash a kept, the checkpoint c
    kept instead when recomputed; and the device's memory budget. Embed and head are never
    recomputed (r = 0, c = a)."""
    plain = {k: _layer(model, cluster, plan, k, "none") for k in set(_kinds(model))}
    full = {k: _layer(model, cluster, plan, k, "full") for k in BLOCKS if k in plain}
    per_param = sum(_state_bytes(plan, _shard_groups(cluster, plan)[0]))
    per_expert = sum(_state_bytes(plan, _shard_groups(cluster, plan, experts=True)[0]))
    t, r, p, a, c = [], [], [], [], []
    for kind in _kinds(model):
        x = plain[kind]
        t.append(x.forward_s + x.input_s + x.weight_s)
        r.append(full[kind].recompute_s if kind in full else 0.0)
        p.append(x.params * per_param + x.expert_params * per_expert)
        a.append(x.stash_bytes)
        c.append(full[kind].stash_bytes if kind in full else x.stash_bytes)
    return t, r, p, a, c, cluster.mem_per_device
