"""A plan -> a config `loom train` runs (issue 12: "the plan is applied"): `plan_config`,
`runnable` (would `loom train` run it), `write_config`, and `resolve_auto` for
`parallel.plan = "auto"`. The mapping, field by field: docs/planner.md, "A plan as a config".
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path

import tomli_w

from loomtrain.errors import UserError
from loomtrain.planner.plan import Plan
from loomtrain.planner.presets import ModelShape, from_model_config

# the [parallel] keys a plan decides; a base config's values for them are replaced (or dropped)
PLANNED_PARALLEL = ("plan", "nproc", "dp", "tp", "pp", "cp", "ep", "zero_stage", "hierarchical",
                    "schedule", "virtual_stages", "microbatches", "recompute", "offload_optimizer",
                    "offload_activations", "sequence_parallel", "split_points")
# the first line of every file write_config writes: only such a file may be overwritten
MARKER = "# written by loom plan"


def _recompute(plan: Plan) -> str:
    """The one parallel.recompute that means the plan's per-block choice (ValueError if none)."""
    flags = plan.recompute_layers
    if flags is None or not flags:
        return plan.recompute
    if all(flags):
        return plan.recompute if plan.recompute != "none" else "full"
    if not any(flags):
        return "none"
    raise ValueError("per-layer recompute (recompute_layers "
                     f"{''.join('1' if f else '0' for f in flags)}) is not expressible: loom train's "
                     "parallel.recompute applies to every block of every stage")


def _split_points(plan: Plan, shape: ModelShape) -> list[int]:
    """plan.split (layers per stage) -> parallel.split_points (the first layer of stages 1..)."""
    if plan.split is None:
        return []
    layers, stages = shape.n_layers + 2, plan.pp * plan.virtual_stages
    if len(plan.split) != stages or sum(plan.split) != layers or min(plan.split) < 1:
        raise ValueError(f"the plan's split {list(plan.split)} is not {stages} stages of at least one "
                         f"layer summing to the model's {layers} layers (embed, blocks, head)")
    points, first = [], 0
    for size in plan.split[:-1]:
        first += size
        points.append(first)
    return points


def plan_config(plan: Plan, shape: ModelShape, batch: int, base: dict | None = None) -> dict:
    """The TOML tree of a `loom train` config running `plan` on `shape` at global batch `batch`
    (sequences per step). `base`: a config's tables, kept except for the keys the plan decides
    (None: loomtrain's defaults). The [model] section is the shape's (`model_keys`). ValueError
    when the plan cannot be written as a config at all (its batch, split or per-layer
    recompute)."""
    if plan.dp * plan.microbatches * plan.micro_batch != batch:
        raise ValueError(f"the plan's dp*microbatches*micro_batch = {plan.dp}*{plan.microbatches}*"
                         f"{plan.micro_batch} = {plan.dp * plan.microbatches * plan.micro_batch} is "
                         f"not the global batch {batch}")
    tree = copy.deepcopy(base) if base else {}
    tree.setdefault("model", {}).update(shape.model_keys())
    par = {k: v for k, v in tree.get("parallel", {}).items() if k not in PLANNED_PARALLEL}
    par.update(nproc=plan.devices, dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp,
               zero_stage=plan.zero_stage, hierarchical=plan.hierarchical,
               offload_optimizer=plan.offload_optimizer, sequence_parallel=plan.sequence_parallel)
    if plan.ep > 1:  # written only for a mixture of experts' plan, which needs it
        par["ep"] = plan.ep
    recompute = _recompute(plan)
    if plan.pp > 1:  # the config refuses pipeline keys without a pipeline, even at their defaults
        par.update(schedule=plan.schedule, virtual_stages=plan.virtual_stages,
                   microbatches=plan.microbatches, recompute=recompute,
                   offload_activations=plan.offload_activations,
                   split_points=_split_points(plan, shape))
    else:  # written only when the plan asks for them, so that the config names the refusal
        par.update({k: v for k, v in (("recompute", recompute), ("offload_activations",
                    plan.offload_activations)) if v not in ("none", 0.0)})
    tree["parallel"] = par
    tree.setdefault("train", {}).update(global_batch=batch, micro_batch=plan.micro_batch,
                                        precision=plan.precision)
    if plan.diloco_h > 1:
        tree.setdefault("lowcomm", {}).update(algorithm="diloco", inner_steps=plan.diloco_h)
        ckpt = tree.setdefault("checkpoint", {})
        every = ckpt.get("every", 100)  # CheckpointConfig's default; a multiple of inner_steps
        ckpt["every"] = -(-every // plan.diloco_h) * plan.diloco_h
    return tree


def _node_layout(tree: dict) -> str | None:
    """The mesh's refusal at start-up (mesh.build_mesh): with parallel.ranks_per_node below
    nproc, every axis group must spread evenly over the nodes."""
    par = tree["parallel"]
    per_node = par.get("ranks_per_node")
    if per_node is None or per_node >= par["nproc"]:
        return None
    from loomtrain.mesh import axis_groups, split_by_node  # imports torch: only when needed

    sizes = {a: par[a] for a in ("pp", "dp", "cp", "tp")}
    for axis in sizes:
        try:
            split_by_node(axis_groups(sizes, axis), per_node)
        except ValueError as err:
            return f"parallel.ranks_per_node={per_node}: {err}"
    return None


@lru_cache(maxsize=64)
def _units_refusal(shape: ModelShape, units: tuple[str, ...]) -> str | None:
    """parallel.shard_units that match no module (parallel.check_units, run before spawning)."""
    from loomtrain.parallel import check_units
    from loomtrain.train.config import config_from_dict

    try:
        check_units(config_from_dict({"model": shape.model_keys(), "parallel": {
            "nproc": 1, "zero_stage": 1, "shard_units": list(units)}}))
    except UserError as err:
        return str(err)
    return None


@lru_cache(maxsize=65536)
def _refusal(plan: Plan, shape: ModelShape, batch: int, base_json: str) -> str | None:
    from loomtrain.train.config import config_from_dict

    try:
        tree = plan_config(plan, shape, batch, json.loads(base_json))
        cfg = config_from_dict(tree)
    except (ValueError, UserError) as err:
        return " ".join(str(err).removeprefix("invalid configuration: ").split())
    if cfg.parallel.shard_units:
        return _units_refusal(shape, tuple(cfg.parallel.shard_units))
    return _node_layout(tree)


def runnable(plan: Plan, shape: ModelShape, batch: int, base: dict | None = None) -> str | None:
    """None if `loom train` runs `plan` as `plan_config` writes it, else why not, in one line.

    Checks what `loom train` checks before it trains: the config's validation (train/config.py:
    every combination it refuses), the shard_units patterns (parallel.check_units) and the
    mesh's node layout (mesh.build_mesh with ranks_per_node). Not checked: the data source
    (train/task.py check_task_data reads the corpus; it does not depend on the plan) and
    schedule="optimal"'s measured activation budget (the planner never plans that schedule).
    Cached on (plan, shape, batch, base): the search asks for many plans."""
    return _refusal(plan, shape, batch, json.dumps(base or {}, sort_keys=True))


def write_config(path, plan: Plan, shape: ModelShape, batch: int, base: dict | None = None,
                 header: str | None = None) -> Path:
    """Write `plan_config`'s tree as TOML to `path`, first line `# written by loom plan...`
    (then `header`'s lines as comments). ValueError if the plan is not runnable, or if `path`
    exists and is not such a file: a user's own config is never overwritten. The text goes to
    a temporary file beside `path` that is then renamed over it, so a failure leaves no
    half-written config."""
    path = Path(path)
    why = runnable(plan, shape, batch, base)
    if why is not None:
        raise ValueError(f"not writing {str(path)!r}: `loom train` would refuse the plan: {why}")
    if path.exists() and (not path.is_file() or not path.read_text(errors="replace").startswith(MARKER)):
        raise ValueError(f"not writing {str(path)!r}: it exists and was not written by loom plan "
                         "(its first line is not the plan's comment); give a new file name")
    lines = (header or "").splitlines()
    if not lines or not lines[0].startswith(MARKER[2:]):
        lines.insert(0, MARKER[2:])
    text = "".join(f"# {line}\n" for line in lines) + tomli_w.dumps(plan_config(plan, shape, batch, base))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def resolve_auto(cfg, choose):
    """For `parallel.plan = "auto"`: the config with the plan `choose(shape, nproc, batch,
    base)` returns (the best plan for the config's model on its nproc ranks at its global
    batch; the caller searches) in place of the config's own parallel and batch settings. The
    result has `plan = "none"`, so its written config.toml (and a --resume) runs that plan
    again without planning. A config without plan = "auto" is returned as it is. ConfigError
    if no plan is found or `loom train` refuses the chosen one."""
    from loomtrain.errors import ConfigError
    from loomtrain.train.config import config_from_dict

    if cfg.parallel.plan != "auto":
        return cfg
    try:
        shape = from_model_config(cfg.model)
    except ValueError as err:
        raise ConfigError(f'parallel.plan="auto": {err}') from None
    base = cfg.model_dump(exclude_none=True)
    nproc, batch = cfg.parallel.nproc, cfg.train.global_batch
    try:
        plan = choose(shape, nproc, batch, base)
    except ValueError as err:  # no spec for this device, a search refused
        raise ConfigError(str(err)) from None
    if plan is None:
        raise ConfigError(f'parallel.plan="auto": no plan of this model runs on parallel.nproc='
                          f"{nproc} ranks at train.global_batch={batch}")
    why = runnable(plan, shape, batch, base)
    if plan.devices != nproc:
        why = f"it uses {plan.devices} ranks, not parallel.nproc={nproc}"
    if why is not None:
        raise ConfigError(f'parallel.plan="auto": the chosen plan does not run: {why}')
    return config_from_dict(plan_config(plan, shape, batch, base))


def device_kind(run_device: str) -> str:
    """The planner's device kind for run.device on this machine: a built-in GPU kind from the
    CUDA device's name (and memory, for the A100s), else "cpu-here" (`loom bench calibrate`)."""
    import torch

    from loomtrain.planner.specs import CPU_HERE

    if run_device == "cpu" or (run_device == "auto" and not torch.cuda.is_available()):
        return CPU_HERE
    name = torch.cuda.get_device_name(0)
    large = torch.cuda.get_device_properties(0).total_memory > 50e9
    for family, kind in (("H200", "h200-141g"), ("H100", "h100-80g"),
                         ("A100", "a100-80g" if large else "a100-40g")):
        if family in name:
            return kind
    raise ValueError(f'parallel.plan="auto": the planner has no spec for the GPU {name!r}; '
                     "plan with `loom plan --gpu SPEC.toml --write-config FILE` instead")


def this_machine(kind: str):
    """The device spec of `device_kind`'s `kind`. cpu-here not yet calibrated: a quick
    calibration on first use (`calibrate.cpu_here`), said in one line on stderr and cached for
    later runs; by the one process that plans, `loom train`'s launcher (its ranks get the
    planned config). Under torchrun every rank plans alone, before any process group exists:
    ranks that measured apart could choose apart, so there the calibration must exist
    already (ValueError)."""
    import sys

    from loomtrain.planner.calibrate import cpu_here
    from loomtrain.planner.specs import CPU_HERE, calibration_path, load_device
    from loomtrain.train.stop import in_torchrun

    if kind != CPU_HERE:
        return load_device(kind)
    path = calibration_path()
    if in_torchrun() and not path.is_file():
        raise ValueError(f'parallel.plan="auto" under torchrun plans on every rank from this '
                         f"machine's calibration, and {path} does not exist: run `loom bench "
                         "calibrate` on each node first (the ranks of one job must read the "
                         "same figures), or plan once with `loom plan --write-config FILE`")

    def say(where):
        print(f'loom: parallel.plan="auto": no calibration of this machine yet; measuring a '
              f"quick one (`loom bench calibrate --quick`, 15-25 s), saved to {where}",
              file=sys.stderr, flush=True)
    return cpu_here(before=say)


def choose_here(shape: ModelShape, nproc: int, batch: int, base: dict) -> Plan | None:
    """`resolve_auto`'s `choose` for `loom train`: the best plan by the cost model of `shape`
    on `nproc` devices of this machine's kind (`device_kind`), ranks_per_node of them per node
    (base's parallel.ranks_per_node; unset: one node), among the plans `loom train` runs. Every
    rank plans alone, before the process group exists: the search is deterministic, so ranks
    agree as long as they read the same spec (the built-in GPU kinds; cpu-here is each
    machine's own calibration, which machines of one job must share). `loom train --dry-run`
    models every plan the search can return."""
    from loomtrain.planner.search import search
    from loomtrain.planner.specs import ClusterSpec

    device = this_machine(device_kind(base.get("run", {}).get("device", "auto")))
    per_node = base.get("parallel", {}).get("ranks_per_node") or nproc
    # the numerics stay the user's: train.precision is kept, not searched (bf16 changes them)
    precision = base.get("train", {}).get("precision", "fp32")
    result = search(shape, ClusterSpec(device, nproc, min(per_node, nproc)), batch, top=1,
                    space="loom", fix={"precision": precision},
                    accept=lambda plan: runnable(plan, shape, batch, base))
    return result.ranked[0].plan if result.ranked else None
