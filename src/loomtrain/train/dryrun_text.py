"""The text `loom train --dry-run` prints, from the numbers of `dryrun.estimate(cfg)`.

Plain data parallel and the sharded engine are printed apart: for the latter each memory row
gives its formula and the collectives are grouped by what they do (so are tp's and pp's). With
pp > 1 a pipeline section names every pp rank's stages and the schedule's stash and bubble.
docs/dry-run.md shows them.
"""

from __future__ import annotations

from loomtrain.estimate import Collective, MemoryEstimate, wire_bytes_per_step
from loomtrain.parallel.pipeline.estimate import PipelineEstimate
from loomtrain.parallel.zero.estimate import ZeroLayout, compute_bytes
from loomtrain.train.dryrun import DryRun, estimate, optimizer_states
from loomtrain.train.metrics import _fmt_bytes as fmt_bytes


def dry_run(cfg) -> str:
    """The text `loom train --dry-run` prints."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    est = estimate(cfg)
    lines = [
        f"dry run of {cfg.run.name!r}: nothing is trained",
        f"data:  {est.data}",
        f"model: {m.name}, {est.model_parameters:,} parameters (d_model {m.d_model}, {m.n_layers} "
        f"layers, seq_len {m.seq_len}, vocab {m.vocab_size})",
        _setup_line(cfg),
        f"batch: global {t.global_batch} = dp {p.dp_size} x micro {t.micro_batch} x "
        f"{'pipelined micro-batches' if p.pp > 1 else 'accumulation'} {cfg.accumulation_steps}",
        *([] if est.zero is None else _zero_lines(est.zero, cfg)),
        "",
        est.layout,
        *([] if est.pipeline is None else ["", *_pipeline_lines(est.pipeline, cfg)]),
        "",
        *(_memory_lines(est, cfg) if est.zero is None else _zero_memory_lines(est, cfg)),
        *_busiest_lines(est),
        "",
        *(_collective_lines(est, cfg) if est.bucket_bytes and est.engine == est.reductions
          else _grouped_collective_lines(est, cfg)),
    ]
    return "\n".join(lines)


def _setup_line(cfg) -> str:
    """Rank 0's set-up peak: the most model bytes it holds at once while the model is built
    (train/materialize.py)."""
    from loomtrain.train.materialize import setup_peak

    s = setup_peak(cfg)
    if cfg.train.init_from is not None:
        return (f"set-up: train.init_from loads the whole model ({fmt_bytes(s.model_bytes)}) on "
                "every rank before the split")
    return (f"set-up: rank 0 holds at most {fmt_bytes(s.peak_bytes)} while building (its pieces "
            f"{fmt_bytes(s.rank_bytes)}, then one full tensor at a time, the largest "
            f"{fmt_bytes(s.largest_bytes)}; the whole model {fmt_bytes(s.model_bytes)})")


# the closed forms of schedules.bubble_theory: p = pp, m = micro-batches, V = virtual stages
BUBBLE = {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)", "interleaved": "(p-1)/(V m+p-1)",
          "zb-h1": "(p-1)(F+I-W)/((p-1)(F+I-W) + m(F+I+W))"}


def _pipeline_lines(pipe: PipelineEstimate, cfg) -> list[str]:
    p, s, split = cfg.parallel, pipe.schedule, pipe.split
    cut = f"split at layers {list(p.split_points)}" if p.split_points else "balanced by parameters"
    out = [f"pipeline: schedule {s.name}, {s.microbatches} micro-batch(es) per step, {s.stages} "
           f"stages (pp {s.pp} x {s.virtual_stages} virtual), {cut}"]
    if split.balance_by_time:
        out.append('  (pipeline_balance="time" times every layer on the real ranks; the dry run '
                   "cannot, so it cut by parameters: the run may cut elsewhere)")
    for r in range(s.pp):
        stages = "; ".join(f"stage {k} = {_layer_names(split.stage_layers[k])}"
                           for k in range(r, s.stages, s.pp))
        out.append(f"  pp rank {r}: {stages}: {split.rank_parameters[r]:,} parameters; peak stash "
                   f"{pipe.sim.peak_stash[r]} micro-batch(es), activations {fmt_bytes(pipe.peaks[r])}")
    summed = ("each holder sends its contribution to the others after every update"
              if s.name == "async" else "its gradient is summed over pp")
    for name, _, ranks in split.shared:
        out.append(f"  tied: {name} is held by pp ranks {ranks}; {summed}")
    if s.name == "async":
        return out + ["  bubble: none in the steady state (no flush: the micro-batches stream "
                      "across steps; docs/pipeline.md)"]
    if s.name not in BUBBLE:  # planned: docs/dry-run.md, "The memory-budgeted schedule"
        return out + _planned_lines(s)
    copies = ", offload and reload 0.5" if p.offload_activations else ""
    out.append(f"  bubble: {BUBBLE[s.name]} = {pipe.bubble_theory:.1%} in theory; simulated "
               f"{pipe.sim.bubble:.1%} (unit times F 1, B 2 = I 1 + W 1{copies}; free communication)")
    out.append(f"  recompute {p.recompute!r}; offload_activations {p.offload_activations:g} of each "
               "rank's stashed micro-batches")
    return out


def _planned_lines(s) -> list[str]:
    """What the optimal schedule's plan chose for each rank's (micro-batch, stage) pairs."""
    out = [f"  planned with unit times (F 1, I 1, W 1, each copy 0.5) and the formulas' bytes; "
           f"the run plans with measured ones, and may choose otherwise"]
    for r, actions in enumerate(s.actions):
        offloaded = sum(a.kind == "OFFLOAD" for a in actions)
        recomputed = sum(stage % s.pp == r for _, stage in s.recompute)
        out.append(f"  pp rank {r}: of {s.microbatches} micro-batches, {offloaded} offloaded, "
                   f"{recomputed} recomputed, the others kept")
    return out


def _layer_names(names: list[str]) -> str:
    """"embed, blocks.0-2" for embed, blocks.0, blocks.1, blocks.2."""
    out, blocks = [], []
    for name in [*names, ""]:
        if name.startswith("blocks."):
            blocks.append(name.removeprefix("blocks."))
            continue
        if blocks:
            out.append(f"blocks.{blocks[0]}" + (f"-{blocks[-1]}" if len(blocks) > 1 else ""))
            blocks = []
        if name:
            out.append(name)
    return ", ".join(out)


def _busiest_lines(run: DryRun) -> list[str]:
    """The pp rank whose activations peak highest, when it is not rank 0's."""
    if run.pipeline is None or max(run.pipeline.peaks) <= run.pipeline.peaks[0]:
        return []
    peaks = run.pipeline.peaks
    r = peaks.index(max(peaks))
    return [f"  busiest: pp rank {r} peaks at {fmt_bytes(peaks[r])} of activations "
            f"({fmt_bytes(peaks[r] - peaks[0])} more than rank 0; its stages above)"]


def _activation_why(run: DryRun, cfg, dtype: str = "") -> str:
    t, m, pipe, cp = cfg.train, cfg.model, run.pipeline, cfg.parallel.cp
    mine = f" (seq_len / cp {cp})" if cp > 1 else ""
    tokens = f"{t.micro_batch} x {m.seq_len // cp} tokens{mine}{dtype}{_dropout(m)}"
    recompute = "" if cfg.parallel.recompute == "none" else f", recompute {cfg.parallel.recompute!r}"
    if pipe is None:
        offload = run.offload  # the first blocks' saved tensors in host memory
        if offload is not None:
            recompute += f", the first {offload} of {m.n_layers} blocks offloaded"
        return f"saved for backward, one micro-batch of {tokens}{recompute}"
    return (f"rank 0's peak over the {pipe.schedule.name} step: {pipe.sim.peak_stash[0]} "
            f"micro-batch(es) of {tokens} stashed{recompute} (docs/dry-run.md)")


def _memory_lines(run: DryRun, cfg) -> list[str]:
    t, est = cfg.train, run.memory
    states = optimizer_states(t.optimizer, t.beta1)
    mine = " (pp rank 0's stages)" if run.pipeline is not None else ""
    backprop = [
        ("gradients", est.gradient_bytes, "one fp32 gradient per parameter "
         + ("(bucket buffers)" if run.bucket_bytes else "(.grad)")),
        ("optimizer state", est.optimizer_bytes,
         f"{t.optimizer}: {states} fp32 state(s) per parameter"),
    ]
    rows = [
        ("parameters", est.parameter_bytes, f"{run.parameters:,} x 4 B (fp32){mine}"),
        # a forward-only (zeroth-order) run holds no gradient; its state is a row of its own
        *(backprop if est.gradient_bytes else []),
        ("activations", est.activation_bytes, _activation_why(run, cfg)),
        *_rows(est),
        ("total", est.total_bytes, "(ZeRO stage 0: nothing is sharded)" if run.bucket_bytes
         else "(nothing is sharded)"),
    ]
    return ["memory per rank (estimate):"] + [
        f"  {name:<16} {fmt_bytes(n):>10}  {why}" for name, n, why in rows]


def _rows(est: MemoryEstimate) -> list[tuple[str, int, str]]:
    """The rows components add (an outer optimizer's state)."""
    return [(r.name, r.nbytes, r.why) for r in est.rows]


def _dropout(m) -> str:
    return (f"; not counted: the dropout masks and unfused attention scores of "
            f"model.dropout={m.dropout}") if m.dropout else ""


def _collective_lines(run: DryRun, cfg) -> list[str]:
    p, grads = cfg.parallel, run.engine
    out = ["collectives per optimizer step (wire bytes: what one rank sends, ring formula):"]
    if grads:
        payload = sum(c.payload_bytes for c in grads)
        wire = sum(c.wire_bytes for c in grads)
        out.append(
            f"  gradients: {len(grads)} all_reduce over dp ({p.dp_size} ranks), one per bucket of "
            f"<= {p.bucket_mb:g} MiB (largest {fmt_bytes(max(run.bucket_bytes))}): payload "
            f"{fmt_bytes(payload)}, wire {fmt_bytes(wire)} = 2(N-1)/N x payload")
    else:
        out.append("  gradients: none (dp = 1)")
    out += _trainer_lines(run.collectives[len(grads):])
    return out + _total_lines(run)


def _trainer_lines(collectives: list[Collective]) -> list[str]:
    out = []
    for c in collectives:
        when = "every step" if c.every_steps == 1 else f"every {c.every_steps} steps"
        out.append(f"  {c.purpose}: all_reduce over {c.axis} ({c.ranks} ranks), {when}: "
                   f"payload {c.payload_bytes} B, wire {c.wire_bytes} B")
    return out


def _total_lines(run: DryRun) -> list[str]:
    calls = sum(c.calls for c in run.collectives if c.every_steps == 1)
    out = [f"  total: {calls} collective(s) every step, "
           f"{fmt_bytes(wire_bytes_per_step(run.collectives))} sent per step on average"]
    if run.broadcast_wire_bytes:
        out.append(f"  once at start: parameters broadcast from dp rank 0, rank 0 sends "
                   f"{fmt_bytes(run.broadcast_wire_bytes)}")
    return out


def _zero_lines(z: ZeroLayout, cfg) -> list[str]:
    p, plan = cfg.parallel, z.plan
    what = {0: "nothing sharded, gradients all-reduced", 1: "optimizer state sharded",
            2: "optimizer state and gradients sharded",
            3: "optimizer state, gradients and parameters sharded"}[p.zero_stage]
    if p.zero_stage == 0:
        where = f"over {plan.replica_axis} ({plan.replica_ranks} ranks)"
    elif plan.replica_ranks > 1:
        where = (f"over {plan.shard_axis} ({plan.shard_ranks} ranks), replicated over "
                 f"{plan.replica_axis} ({plan.replica_ranks}); optimizer state over "
                 f"{plan.optimizer_ranks} ranks")
    else:
        where = f"over {plan.shard_axis} ({plan.shard_ranks} ranks)"
    extras = [f"{cfg.train.precision} compute" + (", fp32 master weights" if compute_bytes(plan) != 4 else "")]
    if p.zero_stage == 3:
        extras.append(f"prefetch {p.prefetch}")
    if plan.offload:
        extras.append("optimizer offloaded to the host")
    blocks = len(z.units)
    held = [] if z.reshard is None or p.zero_stage < 2 else [
        f"       inside the pipeline: gradients held and reduced once per step; "
        + (f'zero_reshard "{z.reshard}" ({z.reshard_why})' if p.zero_stage == 3 else
           "stage 2 gathers no parameter during the step")]
    return [f"zero:  stage {p.zero_stage}, {what} {where}; {', '.join(extras)}",
            f"       {blocks} unit(s){' + root' if z.root else ''}, each padded to a multiple of "
            f"{plan.shard_ranks * plan.replica_ranks}: "
            f"{sum(n for _, n in z.units) + z.root:,} elements (P)", *held]


def _gathered_why(cfg, reshard: str | None, c: int, nbytes: int) -> str:
    """Which units stage 3 holds gathered at once: inside a pipeline with zero_reshard "step"
    all of them, else the root and a prefetch window (inside one stage, in a pipeline)."""
    if cfg.parallel.schedule == "async":
        return "none: each forward gathers the units into its stash (stashed weights)"
    if not nbytes:
        return "none (stage 3 only)"
    if reshard == "step":
        return f"through the step (zero_reshard \"step\"): the root and every unit, {c} B each"
    within = " of one stage" if reshard else ""
    return (f"during a step: the root + {1 + cfg.parallel.prefetch} unit(s){within} "
            f"(1 + prefetch), {c} B each")


def _in_flight_why(cfg, held: bool) -> str:
    """The gradient buffers alive at once: a backward's, a held step's, or an async update's."""
    if cfg.parallel.schedule == "async":
        return ("at an update: the stash's gradient (cP) and two units' fp32 buffers being "
                "reduced (docs/dry-run.md)")
    return ("during backward: buffers being filled and reduced"
            + (", and every unit's unreduced fp32 gradient held through the step (4P)"
               if held else "") + " (docs/dry-run.md)")


def _zero_memory_lines(run: DryRun, cfg) -> list[str]:
    t, plan, est = cfg.train, run.zero.plan, run.memory
    c, stage = compute_bytes(plan), cfg.parallel.zero_stage
    n_shard, n_opt = plan.shard_ranks, plan.optimizer_ranks
    dtype = "fp32" if c == 4 else "bf16"
    pipelined = cfg.parallel.pp > 1
    host = " [host]" if plan.offload else ""
    states = optimizer_states(t.optimizer, t.beta1)
    master = int(c != 4 or plan.offload)  # fp32 master weights of their own
    rows = [
        ("parameters", est.parameter_bytes,
         f"{c}P / L, my shard ({dtype})" if stage == 3 else f"{c}P, every unit ({dtype})"),
        ("gradients", est.gradient_bytes,
         "4P / S, my reduced fp32 range" + host if stage >= 2 else
         "4P, the fp32 accumulator" + (" + 4P / S, the reduced range [host]" if plan.offload else "")),
        ("optimizer state", est.optimizer_bytes,
         f"{t.optimizer}: 4 x {states + master}P / S: {states} state(s)"
         + (" + fp32 master weights" if master else "") + f" of my range{host}"),
        ("activations", est.activation_bytes, _activation_why(run, cfg, f" ({dtype})")),
        ("gathered units", est.gathered_bytes,
         _gathered_why(cfg, run.zero.reshard, c, est.gathered_bytes)),
        ("grads in flight", est.in_flight_bytes, _in_flight_why(cfg, pipelined and stage >= 2)
         if est.in_flight_bytes else "none: .grad are views of the fp32 accumulator"),
        *_rows(est),
        ("total", est.total_bytes,
         f"device {fmt_bytes(est.device_bytes)}, host {fmt_bytes(est.host_bytes)}" if plan.offload
         else f"(ZeRO stage {stage})"),
    ]
    head = (f"memory per rank (estimate; P = {sum(n for _, n in run.zero.units) + run.zero.root:,} "
            f"padded elements, L = {n_shard} shard ranks, S = {n_opt} optimizer ranks):")
    return [head] + [f"  {name:<16} {fmt_bytes(n):>10}  {why}".rstrip() for name, n, why in rows]


_HOW = {"ring_all_reduce": "2(N-1)/N x S", "ring_reduce_scatter": "ring, (N-1)/N x S",
        "ring_all_gather": "(N-1)/N x S", "all_to_all": "(N-1)/N x S",
        "send": "S, point to point", "tree_broadcast": "S per tree child"}


def _how(op: str, algorithm: str) -> str:
    if op == "reduce_scatter" and algorithm == "ring_all_reduce":
        return "gloo native (below 256 KiB), 2(N-1)/N x S"
    return _HOW[algorithm]


def _grouped_collective_lines(run: DryRun, cfg) -> list[str]:
    """The engine's collectives (ZeRO's, data parallel's and tensor parallel's) grouped by what
    they do, then the trainer's own."""
    a = cfg.accumulation_steps
    out = [f"collectives per optimizer step (wire bytes: what one rank sends; S = payload of "
           f"one call; A = {a} micro-batch(es)):"]
    own = [c for c in run.collectives[len(run.engine):] if c.op == "all_reduce"]
    evals = run.collectives[len(run.engine) + len(own):]
    groups: dict[tuple, list[Collective]] = {}
    for c in run.engine + evals:
        groups.setdefault((c.purpose, c.op, c.axis, c.ranks, c.every_steps), []).append(c)
    for (purpose, op, axis, ranks, every), cs in groups.items():
        calls = {}
        for c in cs:
            calls[_how(op, c.algorithm)] = calls.get(_how(op, c.algorithm), 0) + c.calls
        how = ("; ".join(f"{n} x {h}" for h, n in calls.items()) if len(calls) > 1
               else next(iter(calls)) + " each")
        when = "" if every == 1 else f", every {every} steps"
        out.append(f"  {purpose}: {sum(calls.values())} {op} over {axis} ({ranks} ranks){when}: "
                   f"payload {fmt_bytes(sum(c.payload_bytes * c.calls for c in cs))}, wire "
                   f"{fmt_bytes(sum(c.wire_bytes * c.calls for c in cs))} ({how})")
    if not any(c.axis.startswith("dp") for c in run.engine):
        out.append("  gradients over dp: none (dp = 1)")
    return out + _trainer_lines(own) + _total_lines(run)
