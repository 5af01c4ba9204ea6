"""`loom train --dry-run`: resolve the config, build the mesh and the data-parallel engine on a
fake backend in this one process, estimate memory per rank and the collectives of one
optimizer step, and train nothing (the single-process dry run of torchtitan's fake backend).

The estimates are pure functions of numbers (tested without processes); `dry_run(cfg)` feeds
them with what the real code builds: the mesh (`build_mesh` over torch's fake process group,
which accepts every collective and moves nothing), the model on the meta device (shapes
without storage) and the gradient buckets of `apply_data_parallel`. Everything is fp32, the
dtype the trainer trains in. Formulas and their sources: docs/dry-run.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from loomtrain.comm.meter import wire_bytes
from loomtrain.errors import ConfigError
from loomtrain.train.metrics import _fmt_bytes as fmt_bytes

FP32_BYTES = 4
INDEX_BYTES = 8  # token ids, targets and positions are int64


def gpt_activation_bytes(micro_batch: int, seq_len: int, d_model: int, n_layers: int,
                         n_heads: int, mlp_ratio: int, vocab_size: int) -> int:
    """Bytes autograd saves for backward in one forward of models/gpt.py plus the loss (dropout 0).

    Per token and layer (fp32): ln1 output d, qkv 3d (q, k, v are views of it), attention
    output d (the proj input is a view of it: the fused SDPA kernel writes it as b,t,h,dh),
    residual after attention d, ln2 output d, fc output rd, GELU output rd, block output d,
    so 8d + 2rd; plus mean and rstd of both LayerNorms (4) and the attention log-sum-exp (h).
    Once per token: the embedding sum (block 0 input) d, ln_f output d, ln_f stats 2 and the
    log-softmax output V that cross-entropy keeps. Ids and targets are int64 per token,
    positions int64 per position, and cross-entropy keeps one fp32 total weight.
    The flash/efficient attention kernels save no t x t matrix; this counts every tensor
    measured by tests/test_dryrun.py on torch 2.13 CPU, to the byte.
    """
    b, t, d, r = micro_batch, seq_len, d_model, mlp_ratio
    per_layer = 8 * d + 2 * r * d + 4 + n_heads
    per_token = 2 * d + 2 + vocab_size + n_layers * per_layer
    return FP32_BYTES * (b * t * per_token + 1) + INDEX_BYTES * (2 * b * t + t)


def mlp_activation_bytes(micro_batch: int, seq_len: int, d_model: int, n_layers: int,
                         mlp_ratio: int, vocab_size: int) -> int:
    """Bytes saved for backward by models/mlp.py plus the loss.

    Per token and layer: LayerNorm output d and stats 2, fc output rd, GELU output rd, block
    output d. Once per token: the embedding output d, ln_f output d and stats 2, the
    log-softmax output V; int64 ids and targets; one fp32 total weight.
    """
    b, t, d, r = micro_batch, seq_len, d_model, mlp_ratio
    per_token = 2 * d + 2 + vocab_size + n_layers * (2 * d + 2 * r * d + 2)
    return FP32_BYTES * (b * t * per_token + 1) + INDEX_BYTES * 2 * b * t


def activation_bytes(model_cfg, micro_batch: int) -> int:
    """One micro-batch's saved activations: accumulation runs micro-batches one after another,
    and each backward frees its graph, so only one is alive at a time."""
    m = model_cfg
    if m.name == "gpt":
        return gpt_activation_bytes(micro_batch, m.seq_len, m.d_model, m.n_layers, m.n_heads,
                                    m.mlp_ratio, m.vocab_size)
    if m.name == "mlp":
        return mlp_activation_bytes(micro_batch, m.seq_len, m.d_model, m.n_layers,
                                    m.mlp_ratio, m.vocab_size)
    raise AssertionError(f"no activation formula for model {m.name!r}")


def optimizer_states(optimizer: str, momentum: float) -> int:
    """fp32 state tensors per parameter: AdamW keeps exp_avg and exp_avg_sq; SGD keeps a
    momentum buffer only when momentum (train.beta1) is non-zero, as torch.optim.SGD does.
    AdamW's per-tensor `step` scalars are left out (4 bytes per parameter tensor)."""
    if optimizer == "adamw":
        return 2
    if optimizer == "sgd":
        return 1 if momentum > 0 else 0
    raise AssertionError(f"no state count for optimizer {optimizer!r}")


@dataclass(frozen=True)
class MemoryEstimate:
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return (self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes
                + self.activation_bytes)


def memory_per_rank(parameters: int, states_per_parameter: int, activations: int) -> MemoryEstimate:
    """ZeRO stage 0: every rank holds all parameters, a gradient for each (the engine's bucket
    buffers) and all optimizer state, in fp32."""
    p = parameters * FP32_BYTES
    return MemoryEstimate(p, p, states_per_parameter * p, activations)


@dataclass(frozen=True)
class Collective:
    purpose: str
    op: str
    axis: str
    ranks: int  # group size
    payload_bytes: int
    wire_bytes: int  # what one rank sends (comm/meter.py)
    every_steps: int = 1


def _all_reduce(purpose: str, axis: str, ranks: int, payload: int, every: int = 1) -> Collective:
    return Collective(purpose, "all_reduce", axis, ranks, payload,
                      wire_bytes("ring_all_reduce", payload, ranks), every)


def gradient_all_reduces(bucket_payload_bytes: list[int], dp: int) -> list[Collective]:
    """One ring all-reduce over dp per gradient bucket, on the last micro-batch only (the
    others run under no_sync). On one dp rank the comm layer sends and counts nothing."""
    if dp == 1:
        return []
    n = len(bucket_payload_bytes)
    return [_all_reduce(f"gradient bucket {i + 1}/{n}", "dp", dp, size)
            for i, size in enumerate(bucket_payload_bytes)]


def trainer_collectives(world: int, dp: int, log_every: int, eval_every: int) -> list[Collective]:
    """The trainer's own: the control all-reduce (2 float64: token count, stop flag) over the
    world every step, the loss (1 float64) over dp on logged steps, the validation (loss sum,
    token count: 2 float64) over dp on evaluation steps. train/trainer.py; the last step is
    also logged and evaluated."""
    out = []
    if world > 1:
        out.append(_all_reduce("control (tokens, stop flag)", "world", world, 16))
    if dp > 1:
        out.append(_all_reduce("logged loss", "dp", dp, 8, log_every))
        out.append(_all_reduce("validation loss", "dp", dp, 16, eval_every))
    return out


def wire_bytes_per_step(collectives: list[Collective]) -> float:
    """Average wire bytes one rank sends per optimizer step."""
    return sum(c.wire_bytes / c.every_steps for c in collectives)


def _check_data(cfg) -> str:
    """The corpus the run would read, and whether it holds one window for train and val."""
    from loomtrain.data import load_corpus, require_windows

    corpus = load_corpus(cfg.data.source, cfg.data.val_fraction, cfg.model.vocab_size)
    require_windows(corpus, cfg.model.seq_len, cfg.data.source)
    return corpus.description


def _build_on_fake_backend(cfg):
    """(mesh description, parameter count, gradient bucket sizes, start-up broadcast bytes) of
    rank 0, from the real mesh and engine over a fake world of parallel.nproc ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from loomtrain.mesh import build_mesh
    from loomtrain.models import build_model
    from loomtrain.parallel.data import apply_data_parallel

    assert not dist.is_initialized(), "the dry run builds its own (fake) process group"
    p = cfg.parallel
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p.nproc)
    try:
        try:
            # the layout does not depend on the device; cpu needs no GPU here
            mesh = build_mesh({"pp": p.pp, "dp": p.dp_size, "cp": p.cp, "tp": p.tp},
                              ranks_per_node=p.ranks_per_node, device="cpu")
        except ValueError as err:
            raise ConfigError(f"parallel.ranks_per_node={p.ranks_per_node}: {err}") from None
        with torch.device("meta"):
            model = build_model(cfg.model)
        engine = apply_data_parallel(model, mesh, p)
        parameters = sum(x.numel() for x in dict.fromkeys(model.parameters()))
        buckets = [b.buffer.numel() * b.buffer.element_size() for b in engine.buckets]
        layout = mesh.describe()
        if mesh.nodes > 1:
            local, cross = (_ranks(mesh.group_ranks(f"dp.{s}")) for s in ("local", "cross"))
            layout += f"\n  rank 0's dp sub-groups: node-local {local}, cross-node {cross}"
        return layout, parameters, buckets, mesh.meter.total("wire_bytes", op="broadcast")
    finally:
        dist.destroy_process_group()


def _ranks(ranks: list[int]) -> str:
    if len(ranks) <= 8:
        return str(ranks)
    return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


@dataclass(frozen=True)
class DryRun:
    data: str
    layout: str
    parameters: int
    bucket_bytes: list[int]
    broadcast_wire_bytes: int
    memory: MemoryEstimate
    gradients: list[Collective]
    collectives: list[Collective]  # gradients, then the trainer's own


def estimate(cfg) -> DryRun:
    """Everything `loom train --dry-run` reports, as numbers."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    # the estimates below model full replication; the config refuses the rest today
    assert p.zero_stage == 0 and p.tp == p.pp == p.cp == 1, "dry-run estimates need updating"
    data = _check_data(cfg)
    layout, parameters, buckets, broadcast_wire = _build_on_fake_backend(cfg)
    memory = memory_per_rank(parameters, optimizer_states(t.optimizer, t.beta1),
                             activation_bytes(m, t.micro_batch))
    grads = gradient_all_reduces(buckets, p.dp_size)
    own = trainer_collectives(p.nproc, p.dp_size, cfg.run.log_every, cfg.run.eval_every)
    return DryRun(data, layout, parameters, buckets, broadcast_wire, memory, grads, grads + own)


def dry_run(cfg) -> str:
    """The text `loom train --dry-run` prints."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    est = estimate(cfg)
    lines = [
        f"dry run of {cfg.run.name!r}: nothing is trained",
        f"data:  {est.data}",
        f"model: {m.name}, {est.parameters:,} parameters (d_model {m.d_model}, {m.n_layers} "
        f"layers, seq_len {m.seq_len}, vocab {m.vocab_size})",
        f"batch: global {t.global_batch} = dp {p.dp_size} x micro {t.micro_batch} x "
        f"accumulation {cfg.accumulation_steps}",
        "",
        est.layout,
        "",
        *_memory_lines(est, cfg),
        "",
        *_collective_lines(est, cfg),
    ]
    return "\n".join(lines)


def _memory_lines(run: DryRun, cfg) -> list[str]:
    t, m, est = cfg.train, cfg.model, run.memory
    states = optimizer_states(t.optimizer, t.beta1)
    dropout = (f"; not counted: the dropout masks and unfused attention scores of "
               f"model.dropout={m.dropout}") if m.dropout else ""
    rows = [
        ("parameters", est.parameter_bytes, f"{run.parameters:,} x 4 B (fp32)"),
        ("gradients", est.gradient_bytes, "one fp32 gradient per parameter (bucket buffers)"),
        ("optimizer state", est.optimizer_bytes,
         f"{t.optimizer}: {states} fp32 state(s) per parameter"),
        ("activations", est.activation_bytes,
         f"saved for backward, one micro-batch of {t.micro_batch} x {m.seq_len} tokens{dropout}"),
        ("total", est.total_bytes, "(ZeRO stage 0: nothing is sharded)"),
    ]
    return ["memory per rank (estimate):"] + [
        f"  {name:<16} {fmt_bytes(n):>10}  {why}" for name, n, why in rows]


def _collective_lines(run: DryRun, cfg) -> list[str]:
    p, grads = cfg.parallel, run.gradients
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
    for c in run.collectives[len(grads):]:
        when = "every step" if c.every_steps == 1 else f"every {c.every_steps} steps"
        out.append(f"  {c.purpose}: all_reduce over {c.axis} ({c.ranks} ranks), {when}: "
                   f"payload {c.payload_bytes} B, wire {c.wire_bytes} B")
    calls = sum(1 for c in run.collectives if c.every_steps == 1)
    out.append(f"  total: {calls} collective(s) every step, "
               f"{fmt_bytes(wire_bytes_per_step(run.collectives))} sent per step on average")
    if run.broadcast_wire_bytes:
        out.append(f"  once at start: parameters broadcast from dp rank 0, rank 0 sends "
                   f"{fmt_bytes(run.broadcast_wire_bytes)}")
    return out
