"""`loom plan`: resolve the model, the cluster and the batch from the command line, search,
print the ranked plans (or --json), simulate the best (--timeline) and write it as a config
(--write-config). Every bad argument is a ConfigError (exit 2) naming it."""

from __future__ import annotations

import json
from pathlib import Path

from loomtrain.errors import ConfigError
from loomtrain.planner.plan import Estimate, Plan
from loomtrain.planner.presets import PRESETS, ModelShape, from_model_config, preset
from loomtrain.planner.specs import GB, ClusterSpec, load_device

# global batch (sequences of 2048) the GPT-3 paper trained each size with (Brown et al. 2020,
# Table 2.1: 0.5M, 1M, 2M, 3.2M tokens); Megatron's 1T run used 3072 (Narayanan et al. Table 1)
DEFAULT_BATCH = {"gpt3-125m": 256, "gpt3-350m": 256, "gpt3-760m": 256, "gpt3-1.3b": 512,
                 "gpt3-2.7b": 512, "gpt3-6.7b": 1024, "gpt3-13b": 1024, "gpt3-175b": 1536,
                 "gpt-1t": 3072, "default": 32}
PLAN_FIELDS = {k for k in Plan.__dataclass_fields__ if k not in ("split", "recompute_layers")}


def parse_fix(text: str | None) -> dict:
    """`dp=8,tp=8,pp=16,schedule=interleaved` -> typed Plan fields."""
    if not text:
        return {}
    fixed = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in PLAN_FIELDS:
            raise ConfigError(f"--fix {text!r}: {item!r} is not KEY=VALUE with KEY one of "
                              f"{', '.join(sorted(PLAN_FIELDS))}")
        kind = type(getattr(Plan(), key))
        try:
            fixed[key] = (value.strip().lower() in ("1", "true", "yes")) if kind is bool \
                else kind(value.strip())
        except ValueError:
            raise ConfigError(f"--fix {key}={value!r}: expected a {kind.__name__}") from None
    return fixed


def resolve_model(name: str, seq: int | None) -> tuple[ModelShape, dict | None, int | None]:
    """(shape, the config's TOML tables or None, the config's global batch or None)."""
    if name in PRESETS:
        shape = preset(name)
        base, batch = None, None
    elif Path(name).suffix == ".toml":
        import tomllib

        from loomtrain.train.config import load_config
        cfg = load_config(name)  # a bad file is refused here with its own message
        try:
            shape = from_model_config(cfg.model, Path(name).stem)
        except ValueError as err:
            raise ConfigError(f"--model {name!r}: {err}") from None
        base, batch = tomllib.loads(Path(name).read_text()), cfg.train.global_batch
    else:
        raise ConfigError(f"--model {name!r}: choose a preset ({', '.join(PRESETS)}) or give a "
                          "loomtrain config file (.toml)")
    if seq is not None:
        from dataclasses import replace
        shape = replace(shape, seq_len=seq)
    return shape, base, batch


def resolve_cluster(args) -> ClusterSpec:
    try:
        device = load_device(args.gpu)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus}: give the number of devices, >= 1")
    per_node = args.gpus_per_node or (args.gpus if device.cores is not None else min(8, args.gpus))
    if per_node < 1 or args.gpus % per_node and args.gpus > per_node:
        raise ConfigError(f"--gpus-per-node {per_node} must divide --gpus {args.gpus}")
    inter = args.inter_node_gbps * GB / 8 if args.inter_node_gbps else None
    return ClusterSpec(device, args.gpus, min(per_node, args.gpus), inter)


def plan_row(e: Estimate) -> dict:
    """One plan of --json: its settings and figures."""
    return {"settings": e.plan.settings(), "step_time_s": e.step_time_s,
            "tokens_per_s": e.tokens_per_s, "tflops_per_device": e.tflops_per_device,
            "mfu": e.mfu, "mem_per_device_bytes": e.mem_per_device_bytes,
            "comm_bytes_per_step": e.comm_bytes_per_step, "time_s": e.time,
            "memory_bytes": e.memory, "comm_bytes": e.comm_bytes}


def describe(plan: Plan) -> str:
    s = plan.settings()
    mesh = ("dp", "tp", "pp", "cp", "ep")
    text = " ".join(f"{k}={s[k]}" for k in mesh if s.get(k, 1) > 1) or "single"
    text += f" zero{plan.zero_stage}" + " hier" * plan.hierarchical
    text += f" mb{plan.micro_batch}x{plan.microbatches}"
    if plan.pp > 1:
        text += f" {plan.schedule}" + (f"/v{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    if plan.recompute != "none" or plan.recompute_layers:
        text += f" rc:{plan.recompute if not plan.recompute_layers else 'per-layer'}"
    if plan.split:
        text += " split:" + "-".join(map(str, plan.split))
    text += " sp" * plan.sequence_parallel + " offopt" * plan.offload_optimizer
    if plan.offload_activations:
        text += f" offact{plan.offload_activations:g}"
    return text + (f" diloco{plan.diloco_h}" if plan.diloco_h > 1 else "") + f" {plan.precision}"


def table(ranked: list[Estimate], notes: dict) -> str:
    head = f"{'#':>2}  {'plan':<52} {'step s':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} " \
           f"{'mem GB':>7} {'comm GB':>8}"
    lines = [head, "-" * len(head)]
    for i, e in enumerate(ranked, 1):
        lines.append(f"{i:>2}  {describe(e.plan):<52} {e.step_time_s:>9.4g} {e.tokens_per_s:>10.4g} "
                     f"{e.tflops_per_device:>8.3g} {e.mfu:>6.1%} {e.mem_per_device_bytes / 1e9:>7.3g} "
                     f"{e.comm_bytes_per_step / 1e9:>8.3g}")
        if notes.get(i - 1):
            lines.append(f"    not run by `loom train` yet: {notes[i - 1]}")
    return "\n".join(lines)


def cmd_plan(args) -> int:
    from loomtrain.planner.apply import runnable, write_config
    from loomtrain.planner.search import search

    shape, base, config_batch = resolve_model(args.model, args.seq)
    cluster = resolve_cluster(args)
    batch = args.global_batch or config_batch or DEFAULT_BATCH.get(shape.name, 32 * args.gpus)
    fix = parse_fix(args.fix)
    space = args.space or ("loom" if args.write_config else "all")

    def accept(plan: Plan) -> str | None:
        return runnable(plan, shape, batch, base)

    try:
        result = search(shape, cluster, batch, top=args.top, space=space, fix=fix, accept=accept)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    ranked = result.ranked
    if not ranked:
        raise ConfigError(f"no plan of {shape.name} ({shape.params / 1e9:.3g}B parameters) fits "
                          f"{args.gpus} x {cluster.device.name} ({cluster.mem_per_device / 1e9:.3g} GB "
                          f"each) at global batch {batch}{' with --fix ' + args.fix if fix else ''}: "
                          "add devices, lower --global-batch, or choose a larger device")
    notes = getattr(result, "notes", {}) or {}
    if args.json:
        doc = {"model": shape.__dict__, "params": shape.params, "devices": args.gpus,
               "device": cluster.device.name, "gpus_per_node": cluster.gpus_per_node,
               "global_batch": batch, "space": space, "search_s": result.search_s,
               "plans": [{**plan_row(e), "runnable": notes.get(i) is None}
                         for i, e in enumerate(ranked)]}
        print(json.dumps(doc))
    else:
        print(f"{shape.name}: {shape.params / 1e9:.4g}B parameters, seq {shape.seq_len}, global batch "
              f"{batch}; {args.gpus} x {cluster.device.name}, {cluster.gpus_per_node} per node; "
              f"searched in {result.search_s:.2f} s")
        print(table(ranked, notes))
        if len(ranked) > 1:
            print(f"\nwhy #1 beats #2: {result.why_first_beats_second(ranked[0], ranked[1])}")
    if args.timeline:
        from loomtrain.planner.cost import step_costs
        from loomtrain.planner.simulate import draw_timeline, simulate_step
        sim = simulate_step(step_costs(shape, cluster, ranked[0].plan))
        draw_timeline(sim, args.timeline, f"{shape.name}: {describe(ranked[0].plan)}")
        print(f"timeline of #1 (simulated step {sim.step_time_s:.4g} s): {args.timeline}")
    if args.write_config:
        best = ranked[0]
        why = accept(best.plan)
        if why is not None:
            raise ConfigError(f"--write-config: the best plan is not one `loom train` runs: {why}")
        header = (f"written by loom plan: {describe(best.plan)}; predicted step {best.step_time_s:.4g} s, "
                  f"{best.tokens_per_s:.4g} tokens/s, {best.mem_per_device_bytes / 1e9:.3g} GB per device "
                  f"on {args.gpus} x {cluster.device.name}")
        try:
            write_config(args.write_config, best.plan, shape, batch, base, header=header)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        print(f"wrote {args.write_config}")
    return 0
