"""The configurations `loom plan` searches (docs/planner.md, "Search"): which values each Plan
field takes on a cluster, how `--fix` narrows them, and the checks that refuse a fix no valid
plan can satisfy. Pure enumeration; search.py ranks what this yields.

A plan is grouped as search.py bounds it: a mesh (dp, tp, pp, cp), then a micro-batch size
and expert parallelism's ep (a split of dp, for a mixture of experts), then a "compute key"
(everything that changes the per-stage compute: recompute, sequence parallel, schedule and
virtual stages, precision), then the "sync variants" (ZeRO stage, hierarchical, offload),
which change only communication, the optimizer step and memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from loomtrain.planner.plan import RECOMPUTE, SCHEDULES, Plan
from loomtrain.planner.presets import ModelShape
from loomtrain.planner.specs import CPU_HERE, ClusterSpec

PRECISIONS = ("bf16", "fp32")
OFFLOAD_ACTIVATIONS = (0.0, 0.5, 1.0)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


@dataclass(frozen=True)
class Space:
    """The search space on one cluster: `fix` (Plan field -> value) narrows every field."""
    shape: ModelShape
    cluster: ClusterSpec
    batch: int
    fix: dict

    def values(self, key: str, default) -> list:
        return [self.fix[key]] if key in self.fix else list(default)

    def meshes(self):
        """(dp, tp, pp, cp) with dp tp pp cp = devices; tp divides the heads and stays in a
        node; cp divides the sequence; pp <= layers + 2 (embed and head count as layers)."""
        n, shape = self.cluster.gpus, self.shape
        tps = self.values("tp", [t for t in _divisors(n) if shape.n_heads % t == 0
                                 and t <= self.cluster.gpus_per_node])
        for tp in tps:
            for cp in self.values("cp", [c for c in _divisors(n // tp) if shape.seq_len % c == 0]):
                pps = [p for p in _divisors(n // (tp * cp)) if p <= shape.n_layers + 2]
                for pp in self.values("pp", pps):
                    dp = n // (tp * cp * pp)
                    if dp * tp * cp * pp == n and ("dp" not in self.fix or self.fix["dp"] == dp):
                        yield dp, tp, pp, cp

    def expert_splits(self, dp: int) -> list[int]:
        """ep: the divisors of dp that divide the experts of a mixture of experts (each ep
        rank holds n_experts / ep of every MoE block's); 1 for a dense model."""
        n = self.shape.n_experts
        splits = [e for e in _divisors(dp) if n % e == 0] if n else [1]
        return [e for e in self.values("ep", splits) if dp % e == 0]

    def micro_batches(self, dp: int) -> list[tuple[int, int]]:
        """(micro_batch, microbatches) with dp x microbatches x micro_batch = the global batch;
        micro_batch a power of two unless fixed."""
        per_replica, out = self.batch // dp, []
        if self.batch % dp:
            return out
        if "microbatches" in self.fix:
            m = self.fix["microbatches"]
            bs = [per_replica // m] if per_replica % m == 0 else []
            bs = [b for b in bs if b >= 1 and self.fix.get("micro_batch", b) == b]
        else:
            bs = self.values("micro_batch", _powers_of_two(per_replica))
        return [(b, per_replica // b) for b in bs if per_replica % b == 0]

    def compute_keys(self, tp: int, pp: int) -> list[dict]:
        """Recompute x sequence parallel (tp > 1) x schedule and virtual stages (pp > 1:
        gpipe, 1f1b, interleaved with v = 2..4 where pp v <= layers + 2, zb-h1) x precision
        (bf16 on GPUs; also fp32 on cpu-here, where loomtrain trains fp32)."""
        precisions = PRECISIONS if self.cluster.device.name == CPU_HERE else ("bf16",)
        stages = self.shape.n_layers + 2
        schedules = [(self.fix.get("schedule", "1f1b"), 1)] if self.fix.get("virtual_stages", 1) == 1 else []
        if pp > 1:
            vs = self.values("virtual_stages", range(2, 5))
            schedules = [(s, 1) for s in self.values("schedule", SCHEDULES) if s != "interleaved"]
            if "interleaved" in self.values("schedule", SCHEDULES):
                schedules += [("interleaved", v) for v in vs if v > 1 and pp * v <= stages]
            if self.fix.get("virtual_stages", 1) > 1:
                schedules = [(s, v) for s, v in schedules if s == "interleaved"]
        out = []
        if self.fix.get("sequence_parallel") and tp == 1:
            return out  # Megatron's sequence parallelism splits over tp
        for recompute in self.values("recompute", RECOMPUTE):
            for sp in self.values("sequence_parallel", (False, True) if tp > 1 else (False,)):
                for schedule, v in schedules:
                    for precision in self.values("precision", precisions):
                        out.append(dict(recompute=recompute, sequence_parallel=sp,
                                        schedule=schedule, virtual_stages=v, precision=precision,
                                        diloco_h=self.fix.get("diloco_h", 1)))
        return out

    def sync_variants(self, dp: int, tp: int, cp: int) -> list[dict]:
        """ZeRO stage 0-3, hierarchical when ZeRO shards over a group that crosses nodes."""
        crosses = tp * dp * cp > self.cluster.gpus_per_node
        out = []
        offload = self.fix.get("offload_optimizer", False)
        for z in self.values("zero_stage", range(1, 4) if offload else range(4)):
            for hier in self.values("hierarchical", (False, True) if z >= 1 and crosses else (False,)):
                out.append(dict(zero_stage=z, hierarchical=hier, offload_optimizer=offload,
                                offload_activations=self.fix.get("offload_activations", 0.0)))
        return out

    def offload_variants(self, plan: Plan) -> list[dict]:
        """Offload, tried only for a plan that does not fit without it: the optimizer state
        to the host (ZeRO >= 1, as ZeRO-Offload) and a share of the stashed activations (of
        the micro-batches in flight with a pipeline, of the blocks without one)."""
        if "offload_optimizer" in self.fix or "offload_activations" in self.fix:
            return []  # fixed: the sync variants already carry them
        opts = (False, True) if plan.zero_stage >= 1 else (False,)
        return [dict(offload_optimizer=o, offload_activations=a) for o in opts
                for a in OFFLOAD_ACTIVATIONS if o or a]


def check_fix(shape: ModelShape, cluster: ClusterSpec, batch: int, fix: dict) -> None:
    """ValueError naming the field when `fix` cannot describe a valid plan on this cluster."""
    fields = set(Plan.__dataclass_fields__) - {"split", "recompute_layers"}
    for key in fix:
        if key not in fields:
            raise ValueError(f"fix {key}: not a plan field; choose from {', '.join(sorted(fields))}")
    mesh = {k: fix[k] for k in ("dp", "tp", "pp", "cp") if k in fix}
    product = 1
    for k, v in mesh.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"fix {k}={v!r}: a mesh size is a positive integer")
        product *= v
    shown = " x ".join(f"{k}={v}" for k, v in mesh.items())
    if len(mesh) == 4 and product != cluster.gpus:
        raise ValueError(f"fix {shown} makes {product} devices; the cluster has {cluster.gpus} "
                         "(dp x tp x pp x cp must equal --gpus)")
    if cluster.gpus % product:
        raise ValueError(f"fix {shown} makes {product} devices, which does not divide the "
                         f"cluster's {cluster.gpus}")
    rules = [
        ("tp", lambda v: shape.n_heads % v == 0, f"tp must divide the {shape.n_heads} heads"),
        ("cp", lambda v: shape.seq_len % v == 0, f"cp must divide seq_len {shape.seq_len}"),
        ("pp", lambda v: v <= shape.n_layers + 2,
         f"pp can be at most {shape.n_layers + 2} (the blocks plus embed and head)"),
        ("ep", lambda v: v == 1 or (v > 1 and shape.n_experts and shape.n_experts % v == 0),
         f"ep splits the experts of a mixture of experts and must divide them ({shape.name} has "
         f"{shape.n_experts})"),
        ("zero_stage", lambda v: v in (0, 1, 2, 3), "zero_stage is 0, 1, 2 or 3"),
        ("schedule", lambda v: v in SCHEDULES, f"schedule is one of {', '.join(SCHEDULES)}"),
        ("recompute", lambda v: v in RECOMPUTE, f"recompute is one of {', '.join(RECOMPUTE)}"),
        ("precision", lambda v: v in PRECISIONS, f"precision is one of {', '.join(PRECISIONS)}"),
        ("micro_batch", lambda v: v >= 1 and batch % v == 0,
         f"micro_batch must be >= 1 and divide the global batch {batch}"),
        ("microbatches", lambda v: v >= 1 and batch % v == 0,
         f"microbatches must be >= 1 and divide the global batch {batch}"),
        ("virtual_stages", lambda v: v >= 1, "virtual_stages is >= 1"),
        ("offload_activations", lambda v: 0.0 <= v <= 1.0, "offload_activations is a fraction in [0, 1]"),
        ("diloco_h", lambda v: v >= 1, "diloco_h is >= 1"),
    ]
    for key, ok, why in rules:
        if key in fix and not ok(fix[key]):
            raise ValueError(f"fix {key}={fix[key]!r}: {why}")
    if "ep" in fix and fix["ep"] > 1 and fix.get("dp", fix["ep"]) % fix["ep"]:
        raise ValueError(f"fix ep={fix['ep']} must divide dp={fix['dp']} (expert parallelism "
                         "splits the experts over ranks of dp)")
    if fix.get("virtual_stages", 1) > 1 and fix.get("schedule", "interleaved") != "interleaved":
        raise ValueError(f"fix virtual_stages={fix['virtual_stages']} needs schedule=interleaved, "
                         f"not {fix['schedule']!r}")
    if fix.get("hierarchical") and fix.get("zero_stage", 1) == 0:
        raise ValueError("fix hierarchical=true needs zero_stage >= 1 (it shards ZeRO state in the node)")
    if fix.get("offload_optimizer") and fix.get("zero_stage", 1) == 0:
        raise ValueError("fix offload_optimizer=true needs zero_stage >= 1 (ZeRO-Offload's "
                         "partitioned state)")
    if "dp" in fix and "micro_batch" in fix and "microbatches" in fix \
            and fix["dp"] * fix["micro_batch"] * fix["microbatches"] != batch:
        raise ValueError(f"fix dp={fix['dp']} micro_batch={fix['micro_batch']} microbatches="
                         f"{fix['microbatches']}: their product must be the global batch {batch}")
