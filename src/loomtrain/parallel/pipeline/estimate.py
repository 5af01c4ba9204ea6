"""What the pipeline keeps and sends per rank, for `loom train --dry-run` (`estimate_pipeline`):
the stages cut on a meta-device model, the activations saved per layer and stage, each rank's
peak over the simulated schedule, and the sends and pp all-reduces of one step. Formulas and
notation: docs/dry-run.md, "Pipeline parallelism".
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from loomtrain.activations import (FP32_BYTES, gpt_layer_bytes, llama_core_bytes,
                                   llama_layer_bytes, mlp_layer_bytes, moe_extra_bytes)
from loomtrain.comm.meter import wire_bytes
from loomtrain.estimate import Collective, DryRunPlan
from loomtrain.parallel.pipeline import schedules as S


def _kind(layer: str) -> str:
    return "block" if layer.startswith("blocks.") else layer


def layer_activation_bytes(m, layer: str, micro_batch: int, c: int, tp: int = 1,
                           sequence_parallel: bool = False) -> int:
    """Layer `layer` ("embed", "blocks.i", "head") of the model `m` (a ModelConfig; its
    seq_len the tokens of a row one rank runs), on one of `tp` ranks; a llama's MoE block
    with its mixture of experts (activations.py `moe_extra_bytes`)."""
    block = int(layer.split(".")[1]) if _kind(layer) == "block" else -1
    experts = moe_extra_bytes(m, block, micro_batch, c, tp, sequence_parallel) if block >= 0 else 0
    if tp > 1:
        from loomtrain.parallel.tensor_estimate import tensor_layer_bytes

        return tensor_layer_bytes(m, _kind(layer), micro_batch, tp, sequence_parallel, c) + experts
    if m.name == "llama":
        return llama_layer_bytes(_kind(layer), micro_batch, m.seq_len, m, c) + experts
    if m.name == "gpt":
        return gpt_layer_bytes(_kind(layer), micro_batch, m.seq_len, m.d_model, m.n_heads,
                               m.mlp_ratio, m.vocab_size, c)
    assert m.name == "mlp", m.name
    return mlp_layer_bytes(_kind(layer), micro_batch, m.seq_len, m.d_model, m.mlp_ratio,
                           m.vocab_size, c)


def _deferred_widths(m, layer: str, tp: int = 1) -> tuple[int, int]:
    """(Linear inputs, Linear output gradients) per token that zero-bubble's W needs, kept
    from I (runtime.py `DeferredWeightGrads`): a GPT block's ln1 output, attention output,
    ln2 output (d each) and GELU output (rd), and the gradients of qkv (3d), proj (d), fc (rd)
    and the MLP's proj (d); a llama block's ln1 output (q, k and v share it), attention
    output (heads x head_dim: d but where head_dim widens the heads) and ln2 output (gate and
    up share it), d each, and SwiGLU product (f), and the gradients of q (heads x head_dim)
    and o (d), k and v (kv_heads x head_dim each), gate and up (f each)
    and down (d); an MLP-model block's LayerNorm and GELU outputs and the gradients of fc and
    proj; the head's ln_f output (d) and the logits' gradient (V). Under tensor parallelism
    nothing is deferred but the MLP model's head: `defer_linear_weights` patches plain
    nn.Linear layers only, and the tensor-parallel ones keep their own backward."""
    d, r, kind = m.d_model, m.mlp_ratio, _kind(layer)
    if kind == "embed" or (tp > 1 and not (m.name == "mlp" and kind == "head")):
        return 0, 0
    if kind == "head":
        return d, m.vocab_size
    if m.name == "llama":
        f, q, kv = m.ffn_width, m.n_heads * m.head_width, m.kv_heads * m.head_width
        return 2 * d + q + f, 2 * d + q + 2 * kv + 2 * f
    return ((3 + r) * d, (5 + r) * d) if m.name == "gpt" else ((1 + r) * d, (1 + r) * d)


def core_bytes(m, micro_batch: int, c: int, tp: int = 1) -> int:
    """What selective recomputation frees of one block on one of `tp` ranks: the GPT's fp32
    log-sum-exp (with the fused attention kernel), the llama's `llama_core_bytes`."""
    if m.name == "llama":
        return llama_core_bytes(micro_batch, m.seq_len, m, c, tp)
    return FP32_BYTES * micro_batch * m.seq_len * m.n_heads // tp


@dataclass(frozen=True)
class StageMemory:
    """Bytes one micro-batch of a stage (a pair) occupies on its rank, by how long they live
    (activation_peak says when each is added and freed)."""

    stashed: int  # saved for backward by the forward; offloadable
    received: int  # the stage's input (stages after the first)
    output: int  # the stage's output (stages before the last), until its backward
    recomputed: int  # recompute="full": saved by the backward's rerun of the forward
    weight_inputs: int  # zero-bubble: the Linear inputs the deferred W uses, from I to W
    output_grads: int  # zero-bubble: the Linear output gradients, from I to W

    @property
    def held(self) -> int:
        return self.received + self.output


def stage_memory(m, layers: list[str], micro_batch: int, c: int, recompute: str,
                 first: bool, last: bool, tp: int = 1,
                 sequence_parallel: bool = False) -> StageMemory:
    """A pair of the stage made of `layers`. A stage after the first receives its input
    (b t d, which its first LayerNorm saves: counted once, as received); a stage before the
    last keeps its output until the backward that the received gradient starts. recompute
    "full" saves only the input in forward and everything again when the backward reruns it;
    "selective" checkpoints each block's attention core, whose saved tensors are q, k, v (kept
    anyway as the checkpoint's inputs), its output (kept anyway as proj's input, a view of it)
    and the fp32 log-sum-exp (h per token): only the last is freed (with the fused attention
    kernel; the unfused one's t x t scores, with dropout, are not counted); the llama's frees
    more (activations.py `llama_core_bytes`). The llama's first RMSNorm saves the received
    input itself only in fp32, which is all a pipeline runs (bf16 is refused with it). On one
    of `tp` ranks the layers are tensor_estimate's; under sequence parallelism a boundary
    holds 1/tp of the tokens."""
    saved = sum(layer_activation_bytes(m, x, micro_batch, c, tp, sequence_parallel)
                for x in layers)
    boundary = c * micro_batch * m.seq_len * m.d_model // (tp if sequence_parallel else 1)
    received, output = (0 if first else boundary), (0 if last else boundary)
    tokens, widths = c * micro_batch * m.seq_len, [_deferred_widths(m, x, tp) for x in layers]
    inputs, grads = tokens * sum(w for w, _ in widths), tokens * sum(g for _, g in widths)
    if recompute == "full":
        return StageMemory(0, received, output, saved - received, inputs, grads)
    core = 0
    if recompute == "selective":
        core = sum(_kind(x) == "block" for x in layers) * core_bytes(m, micro_batch, c, tp)
    return StageMemory(saved - received - core, received, output, 0, inputs, grads)


def activation_peak(spans, memory: list[StageMemory], recomputed=frozenset(),
                    rerun_memory: list[StageMemory] | None = None) -> int:
    """A rank's peak activation bytes over its simulated timeline (`SimResult.spans[rank]`,
    schedules.live_peak), as runtime.py holds them. A pair adds stashed, received and output
    at its forward's end and recomputed at its backward's start; B's end frees it all. Under
    zero-bubble, I's end frees the autograd graph and the output, and W keeps the Linear
    inputs and output gradients until its end. An offloaded pair's activations live in the
    stash instead, off the device from OFFLOAD's end to RELOAD's start, and the stash keeps
    them (and the input) until the pair's release (B's or W's end). The pairs in `recomputed`
    (a planned schedule's choice) count as `rerun_memory` says (recompute="full")."""
    spans = list(spans)
    offloaded = {(a.microbatch, a.stage) for a, _, _ in spans if a.kind == S.OFFLOAD}

    def change(a: S.Action) -> tuple[int, int]:
        pair = (a.microbatch, a.stage)
        s = (rerun_memory if pair in recomputed else memory)[a.stage]
        stash = pair in offloaded
        whole = s.stashed + s.held + s.recomputed
        if a.kind == S.I:
            kept = s.output if stash else whole - s.weight_inputs
            return s.recomputed, s.output_grads - kept
        if a.kind == S.W:
            kept = whole - s.output if stash else s.weight_inputs
            return 0, -kept - s.output_grads
        return {S.F: (0, s.stashed + s.held), S.B: (s.recomputed, -whole),
                S.OFFLOAD: (0, -s.stashed), S.RELOAD: (s.stashed, 0)}.get(a.kind, (0, 0))
    return S.live_peak(spans, change)


def _send(purpose: str, pp: int, payload: int, calls: int, every: int = 1) -> Collective:
    return Collective(purpose, "send", "pp", pp, payload, wire_bytes("send", payload, pp),
                      every, calls, "send")


def _pp_all_reduce(purpose: str, pp: int, payload: int) -> Collective:
    return Collective(purpose, "all_reduce", "pp", pp, payload,
                      wire_bytes("ring_all_reduce", payload, pp))


def pipeline_collectives(schedule: S.Schedule, rank: int, boundary_bytes: list[int],
                         shared: list[tuple[str, int]]) -> list[Collective]:
    """Rank `rank`'s pp-axis communication in one step (runtime.py): each SEND_F of its
    actions sends stage s's output (boundary_bytes[s]), each SEND_B the gradient of stage s's
    input (boundary_bytes[s-1]), wire = payload; then, after the last backward, every pp rank
    all-reduces the gradient of each parameter several pp ranks hold ((name, fp32 bytes);
    ranks without a copy add zeros), and the gradient norm's 4-byte all-reduce over pp."""
    calls: dict[tuple[str, int], int] = {}
    for a in schedule.actions[rank]:
        if a.kind in (S.SEND_F, S.SEND_B):
            calls[a.kind, a.stage] = calls.get((a.kind, a.stage), 0) + 1
    out = []
    for (kind, s), n in calls.items():
        if kind == S.SEND_F:
            out.append(_send(f"activations, stage {s} -> {s + 1}", schedule.pp, boundary_bytes[s], n))
        else:
            out.append(_send(f"input gradients, stage {s} -> {s - 1}", schedule.pp,
                             boundary_bytes[s - 1], n))
    out += [_pp_all_reduce(f"tied {name} gradient, summed over pp", schedule.pp, nbytes)
            for name, nbytes in shared]
    return out + [_pp_all_reduce("gradient norm over pp", schedule.pp, FP32_BYTES)]


def eval_sends(schedule: S.Schedule, rank: int, boundary_bytes: list[int], forwards: int,
               eval_every: int) -> list[Collective]:
    """`forward_only`: each evaluation forward sends the output of each of the rank's stages
    but the last, blocking (the evaluation micro-batch has micro_batch rows too)."""
    return [_send(f"validation forward, stage {s} -> {s + 1}", schedule.pp, boundary_bytes[s],
                  forwards, eval_every)
            for s in range(rank, schedule.stages - 1, schedule.pp)]


# --- the split, on the meta device ----------------------------------------------------------


@dataclass(frozen=True)
class PipelineSplit:
    stage_layers: list[list[str]]  # the layers of every stage
    boundary_bytes: list[int]  # stage s's output for one micro-batch
    rank_parameters: list[int]  # parameters each pp rank holds (a tied one on each holder)
    shared: list[tuple[str, int, list[int]]]  # (name, fp32 bytes, the pp ranks holding it)
    balance_by_time: bool  # pipeline_balance="time" was asked for; parameters were used


def split_on_meta(model, mesh, cfg):
    """(this rank's PipelineModule, PipelineSplit) of a meta-device `model`, as the trainer's
    `split_model` cuts it (a micro-batch of seq_len / cp tokens per row; boundaries in bf16
    with train.precision="bf16", as apply_pipeline casts them); with
    pipeline_balance="time" by parameters instead (a meta model cannot be timed)."""
    from loomtrain.parallel.pipeline import _sample, layers_of, shared_parameters, split

    p = cfg.parallel
    by_time = p.pipeline_balance == "time" and not p.split_points
    sample = _sample(cfg, mesh)
    bf16 = cfg.train.precision == "bf16"
    whole = copy.deepcopy(model)  # split drops the other ranks' modules from `model`
    module, shapes, _ = split(model, mesh, p.pp * p.virtual_stages, sample,
                              list(p.split_points) or "params")
    bounds, layers = module.bounds, layers_of(whole)
    modules, params = dict(whole.named_modules()), dict(whole.named_parameters())
    per_rank: list[dict[int, int]] = [{} for _ in range(p.pp)]
    for s in range(len(bounds) - 1):
        for layer in layers[bounds[s]:bounds[s + 1]]:
            for path in layer.owns:
                per_rank[s % p.pp].update((id(q), q.numel()) for q in modules[path].parameters())
    shared = [(name, FP32_BYTES * params[name].numel(), ranks)
              for name, ranks in shared_parameters(whole, layers, bounds, p.pp).items()]
    return module, PipelineSplit(
        [[x.name for x in layers[bounds[s]:bounds[s + 1]]] for s in range(len(bounds) - 1)],
        [shape.numel() * (2 if bf16 and dtype.is_floating_point else dtype.itemsize)
         for shape, dtype in shapes],
        [sum(h.values()) for h in per_rank], shared, by_time)


@dataclass(frozen=True)
class PipelineEstimate:
    split: PipelineSplit
    schedule: S.Schedule
    sim: S.SimResult  # unit times (schedules.DEFAULT_TIMES)
    memory: list[StageMemory]  # per stage
    peaks: list[int]  # activation bytes per pp rank
    bubble_theory: float
    collectives: list[Collective]  # rank 0's, every step
    eval_sends: list[Collective]  # rank 0's, every evaluation


def stage_memories(stage_layers: list[list[str]], cfg, c: int, m,
                   recompute: str) -> list[StageMemory]:
    """Every stage's StageMemory under `recompute`."""
    p, last = cfg.parallel, len(stage_layers) - 1
    return [stage_memory(m, names, cfg.train.micro_batch, c, recompute, s == 0, s == last, p.tp,
                         p.sequence_parallel)
            for s, names in enumerate(stage_layers)]


def simulated_peaks(stage_layers: list[list[str]], schedule: S.Schedule, cfg, c: int,
                    m) -> tuple[list[StageMemory], S.SimResult, list[int]]:
    """(every stage's StageMemory, the simulated schedule, each pp rank's activation peak): the
    dry run's, and what ZeRO's zero_reshard="auto" weighs at build (zero/reshard.py). A planned
    schedule (optimal) is simulated with the unit times it was planned with, its recomputed
    backwards longer by a forward."""
    memory = stage_memories(stage_layers, cfg, c, m, cfg.parallel.recompute)
    if schedule.name in S.SCHEDULES:
        sim = S.simulate(schedule)
    else:
        from loomtrain.parallel.pipeline.optimal_costs import action_times

        sim = S.simulate(schedule, action_times(unit_costs(memory), schedule.recompute))
    rerun = stage_memories(stage_layers, cfg, c, m, "full")
    return memory, sim, [activation_peak(spans, memory, schedule.recompute, rerun)
                         for spans in sim.spans]


def pipeline_estimate(split: PipelineSplit, schedule: S.Schedule, cfg, c: int,
                      eval_forwards: int, m=None) -> PipelineEstimate:
    """`m`: the [model] keys as a rank runs them (DryRunPlan.local_model; None: cfg.model)."""
    m = m or cfg.model
    if schedule.name == "async":  # a steady-state step of the stream
        from loomtrain.parallel.pipeline.async_estimate import stream_peaks

        memory = stage_memories(split.stage_layers, cfg, c, m, cfg.parallel.recompute)
        return PipelineEstimate(split, schedule, S.simulate(schedule), memory,
                                stream_peaks(memory, schedule.pp), 0.0,
                                stream_collectives(schedule, 0, split.boundary_bytes, split.shared),
                                eval_sends(schedule, 0, split.boundary_bytes, eval_forwards,
                                           cfg.run.eval_every))
    memory, sim, peaks = simulated_peaks(split.stage_layers, schedule, cfg, c, m)
    if schedule.name in S.SCHEDULES:
        theory = S.bubble_theory(schedule.name, schedule.pp, schedule.microbatches,
                                 schedule.virtual_stages)
    else:
        theory = sim.bubble
    shared = [(name, nbytes) for name, nbytes, _ in split.shared]
    return PipelineEstimate(split, schedule, sim, memory, peaks, theory,
                            pipeline_collectives(schedule, 0, split.boundary_bytes, shared),
                            eval_sends(schedule, 0, split.boundary_bytes, eval_forwards,
                                       cfg.run.eval_every))


def stream_collectives(schedule: S.Schedule, rank: int, boundary_bytes: list[int],
                       shared: list[tuple[str, int, list[int]]]) -> list[Collective]:
    """Rank `rank`'s pp-axis communication in a steady-state step: the sends of its M
    forwards and backwards (`pipeline_collectives`), each tied parameter it holds sent to every
    other holder after each of its M updates (fp32), and one all-reduce over pp of the step's
    gradient statistics (3 float64)."""
    m, pp = schedule.microbatches, schedule.pp
    sends = [c for c in pipeline_collectives(schedule, rank, boundary_bytes, []) if c.op == "send"]
    tied = [_send(f"tied {name} gradient, to pp rank {h}, every update", pp, nbytes,
                  m) for name, nbytes, ranks in shared if rank in ranks
            for h in ranks if h != rank]
    return sends + tied + [_pp_all_reduce("gradient statistics over pp", pp, 3 * 8)]


def estimate_pipeline(plan: DryRunPlan) -> None:
    """The pipeline's part of the dry run (the `Pipeline` component's hook): the schedule the
    runtime would run (the asynchronous one: a steady-state step, async_estimate.py), this
    rank's stages of the meta model, the activation peak of its stages over the simulated schedule, its sends and
    pp all-reduces."""
    from loomtrain.errors import ConfigError
    from loomtrain.parallel.pipeline import build_schedule

    cfg = plan.cfg
    plan.model, split = split_on_meta(plan.model, plan.mesh, cfg)
    try:
        if cfg.parallel.schedule == "optimal":
            memory = stage_memories(split.stage_layers, cfg, plan.compute_bytes,
                                    plan.local_model, "none")
            schedule = planned_schedule(cfg, unit_costs(memory))
        elif cfg.parallel.schedule == "async":
            from loomtrain.parallel.pipeline.async_estimate import async_schedule, stream_states

            schedule = async_schedule(cfg.parallel.pp, cfg.accumulation_steps)
            plan.optimizer_states = stream_states(cfg, plan.optimizer_states)
        else:
            schedule = build_schedule(cfg)
    except ValueError as err:
        raise ConfigError(f"parallel.schedule={cfg.parallel.schedule!r}: {err}") from None
    pipe = pipeline_estimate(split, schedule, cfg, plan.compute_bytes, plan.eval_forwards,
                             plan.local_model)
    plan.layers = [x for s in range(0, schedule.stages, schedule.pp)
                   for x in split.stage_layers[s]]
    plan.activation_bytes = pipe.peaks[0]
    plan.collectives += pipe.collectives
    plan.eval_collectives += pipe.eval_sends
    plan.parts["pipeline"] = pipe


def unit_costs(memory: list[StageMemory]):
    """schedule="optimal"'s StageCosts as the dry run knows them: the simulator's unit times
    (schedules.DEFAULT_TIMES: F 1, B 2 = I 1 + W 1, each copy 0.5) for the ones the runtime
    measures (profile.py), and each stage's bytes by the formulas: what its forward saves
    (its received input among them, as the profile's stash counts) and the input that stays
    when it is recomputed."""
    from loomtrain.parallel.pipeline.optimal_costs import StageCosts

    t = S.DEFAULT_TIMES
    return [StageCosts(f=t[S.F], b=t[S.B], i=t[S.I], w=t[S.W], offload=t[S.OFFLOAD],
                       reload=t[S.RELOAD], activation_bytes=s.stashed + s.received,
                       input_bytes=s.received) for s in memory]


def planned_schedule(cfg, costs) -> S.Schedule:
    """The schedule the runtime plans (pipeline/__init__.py `_optimal_pipeline`), by the same
    functions (`optimal_budget`, `check_budget`, `plan_for_config`), from `costs`.
    ValueError: no schedule fits the budget."""
    from loomtrain.parallel.pipeline import optimal_budget
    from loomtrain.parallel.pipeline.optimal import check_budget, plan_for_config

    p, microbatches = cfg.parallel, cfg.accumulation_steps
    budget = optimal_budget(p, microbatches, costs)
    check_budget(p.pp, microbatches, costs, budget)
    return plan_for_config(p.pp, microbatches, costs, budget)
