"""loomtrain's ZeRO stages 0-3 against torch FSDP2 and DeepSpeed ZeRO 1-3, measured in the same run.

    pip install -e ".[peers]"   # DeepSpeed: without it the benchmark says so and exits 2
    python benchmarks/zero.py [--rounds 8] [--steps 2] [--world4-rounds 4]
                              [--timeline-out FILE] [--small]   # ~12 min on 2 cores
    python benchmarks/zero.py --no-peer ...   # without DeepSpeed: loomtrain and FSDP2 only

What is the same for every engine: a GPT of 50.5M parameters from the trainer's
`build_model` (d_model 512, 16 layers, 8 heads, seq_len 128, byte vocabulary, tied head; a tiny
one with --small), the stdlib corpus through `WindowSampler` cut per rank by `rank_samples`
(the same batches at every step), gloo on 127.0.0.1 with one thread per rank, AdamW from
`build_optimizer`, the lr schedule, clipping at 1.0 and the trainer's own `train_step` with
its per-step token-count all-reduce, all in fp32.

Engines. World 2: stage 0 (`DataParallel`, replicated), stages 1, 2, 3 (`shard`, prefetch 1),
torch FSDP2 (`fully_shard` on every block, then on the root, over a 1-D cpu DeviceMesh) and
DeepSpeed ZeRO stages 1, 2, 3 (`deepspeed.initialize` on the CPU accelerator, over the
world's gloo group, its ZeRO defaults otherwise; `deepspeed_config`). World 4 as two "nodes"
of 2 ranks (`ranks_per_node=2`): stage 3 flat and stage 3 hierarchical. FSDP2 and DeepSpeed
average gradients and loomtrain sums them, so their loss is divided by global tokens / world
(exact at world 2), as benchmarks/ddp.py does for DDP. DeepSpeed steps through its own
`backward` (told not to divide by the accumulation steps: the global token count already
spans them) and `step` (the reduction, clipping and update at the last micro-batch), with the
same torch AdamW (`build_optimizer`) handed to it: the same update as every other engine's,
so that the comparison is of the engines, not of two Adam kernels.

How (the scheme of benchmarks/ddp.py): each engine trains in its own world of spawned
processes, one engine per process, so peak resident memory can be told apart; the worlds of
one world size live together and take turns, the idle ones blocked on a queue, in an order
reversed every round, so a drift of the machine's load falls on all alike. Each world runs
`warmup` untimed steps (AdamW allocates its state on the first), then one timed round of
`steps` steps per turn; round i of every engine covers the same steps and batches. After the
rounds, the stage-3 world records steps on its timeline with prefetch 1, 0, 0, 1 and keeps, for
each prefetch, the faster of its two (the one less disturbed by whatever else the machine runs).

Per engine: tokens/s (median over rounds), peak RSS per rank and its growth over the RSS just
before the model was built (the training state: parameters, gradients, optimizer, engine
buffers, activations), the bytes a rank writes to its sockets per step (growth of `wchar` in
/proc/self/io, as benchmarks/collectives.py measures; the same figure for every engine), and
for loomtrain the payload and wire bytes per step its CommMeter counts (the peers' collectives
bypass it, so they have none). For every loomtrain
stage the growth is set against `formula_mem_bytes`. Memory, measured so that RSS follows the
live tensors: every rank pins glibc's mmap threshold (`pin_mmap_threshold`), and the peak is
restarted after set-up, so the set-up's peak (`setup_mem_growth_bytes`: the whole model built,
then wrapped) and the steps' (`step_mem_growth_bytes`) are reported apart; `mem_growth_bytes`
is the larger, the process's.

The last line on stdout is one JSON object (see `summarize`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from worlds import (
    World,
    closing_worlds,
    free_port,
    import_peer,
    peak_rss_bytes,
    pin_mmap_threshold,
    reset_peak_rss,
    rss_bytes,
    serve_commands,
)

from loomtrain import comm
from loomtrain.data import WindowSampler, load_corpus, rank_samples
from loomtrain.mesh import build_mesh
from loomtrain.models import IGNORE_INDEX, build_model, token_loss_sum
from loomtrain.optim import build_optimizer, lr_at, set_lr
from loomtrain.parallel.data import DataParallel
from loomtrain.parallel.zero import ROOT, assign_parameters, find_units, shard
from loomtrain.parallel.zero.layout import unit_layout, zero_memory
from loomtrain.report import busy_s
from loomtrain.timeline import Timeline, hidden_s
from loomtrain.train.config import config_from_dict
from loomtrain.train.dryrun import activation_bytes
from loomtrain.train.trainer import train_step

MODEL = {"d_model": 512, "n_layers": 16, "n_heads": 8, "seq_len": 128, "vocab_size": 256}
SMALL_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32, "vocab_size": 256}
ADAMW_STATES = 2  # exp_avg, exp_avg_sq


@dataclass(frozen=True)
class Engine:
    name: str
    world: int
    stage: int | None  # None: torch FSDP2
    hierarchical: bool = False
    ranks_per_node: int | None = None
    deepspeed: bool = False  # DeepSpeed's ZeRO `stage` instead of loomtrain's

    @property
    def loomtrain(self) -> bool:
        return self.stage is not None and not self.deepspeed


DEEPSPEED_STAGES = (1, 2, 3)
# each DeepSpeed stage next to loomtrain's, and stage 3 next to FSDP2, in every round's order
WORLD2 = (Engine("stage0", 2, 0),
          Engine("stage1", 2, 1), Engine("deepspeed_stage1", 2, 1, deepspeed=True),
          Engine("stage2", 2, 2), Engine("deepspeed_stage2", 2, 2, deepspeed=True),
          Engine("deepspeed_stage3", 2, 3, deepspeed=True), Engine("stage3", 2, 3),
          Engine("fsdp2", 2, None))
WORLD4 = (Engine("stage3_flat", 4, 3, ranks_per_node=2),
          Engine("stage3_hierarchical", 4, 3, hierarchical=True, ranks_per_node=2))


# --- the memory formula (pure) -----------------------------------------------------------------


def formula_mem_bytes(stage: int, padded: list[int], root_padded: int, largest_group: int,
                      shard_ranks: int, replica_ranks: int, prefetch: int,
                      activations: int, accumulation: int = 1) -> dict[str, int]:
    """Peak bytes of one rank's training state in fp32 with AdamW: persistent + max(backward, step).

    `padded`: every block unit's flat length, `root_padded` the root unit's (stage 0: the
    parameter count as the only unit, root 0). L = `shard_ranks`, C = `replica_ranks`
    (hierarchical: the nodes; the optimizer state is split over the node, S = L).
    `largest_group`: elements of the larger optimizer parameter group (AdamW's decay group).
    U = 4 x the largest block's padded length, in bytes.

    persistent  `zero_memory`: parameters, gradients, AdamW state kept between steps.
    backward    the peak is at the start of backward, when every saved activation of the
                micro-batch is alive (`activation_bytes`), plus what the engine holds while
                block k-1 computes its backward, just after block k launched its reduction
                (engine.py, communication.py):
                stage 0  nothing: the buckets are the persistent gradients, reduced in place.
                stage 1  block k's reduce-scatter runs in place in the fp32 accumulator; the
                         ring (comm/ring.py) holds min(2, L-1) receive chunks of U/L.
                stage 2  block k-1's gradient buffer U (touched as its gradients arrive);
                         block k's buffer under reduction U (freed when the op completes) and
                         the ring's spare chunks, min(2, L-2) x U/L (its last step receives
                         into the output). With one micro-batch per step the reduce-scatter
                         writes into the zeroed gradient shard and, with C > 1, the replica
                         all-reduce runs in place there; with more, the later micro-batches
                         add a shard output U/L, and with C > 1 block k+1's, still in its
                         replica all-reduce, U/L.
                stage 3  as stage 2, plus the root unit (gathered from the start of forward
                         to the end of backward) and the gathered blocks: the one computing and
                         `prefetch` ahead, (1 + prefetch) U.
                All are counted as alive at once: the ring buffers of block k may already be
                freed when block k-1's activations peak, so this is an upper bound by <= 2U/L.
    step        AdamW's foreach update allocates one temporary (sqrt of exp_avg_sq) per
                parameter group, of the group's length on this rank: 4 x largest_group / S.
                Stage 0's buckets and stage 1-2's in-place publishing add nothing.
    Activation gradients in backward (a few block-sized tensors) and the allocator's own
    overhead are not counted.
    """
    ranks = 1 if stage == 0 else shard_ranks
    persistent = zero_memory(padded + [root_padded], stage, ranks, ranks, ADAMW_STATES).total_bytes
    unit = 4 * max(padded)
    ring_chunks = {1: max(0, min(2, ranks - 1)), 2: max(0, min(2, ranks - 2))}  # ring.py spares
    grad_transient = {0: 0, 1: ring_chunks[1] * unit // ranks,
                      2: 2 * unit + (ring_chunks[2] + (1 + (replica_ranks > 1)) * (accumulation > 1))
                      * unit // ranks}
    backward = grad_transient[min(stage, 2)]
    if stage == 3:
        backward += 4 * root_padded + (1 + prefetch) * unit
    step = 4 * -(-largest_group // ranks)
    transient = max(activations + backward, step)
    return {"formula_mem_bytes": persistent + transient, "persistent_bytes": persistent,
            "activation_bytes": activations, "backward_engine_bytes": backward,
            "optimizer_step_bytes": step}


def model_numbers(model_cfg, multiple: int) -> dict:
    """The unit lengths `shard` lays out and the optimizer group sizes, from a model built on
    the meta device (shapes only) with the engine's own pure layout functions."""
    with torch.device("meta"):
        model = build_model(model_cfg)
    params = list(dict.fromkeys(model.parameters()))
    padded, root = [], 0
    for name, named in assign_parameters(model, find_units(model)).items():
        length = unit_layout(name, [(n, tuple(p.shape)) for n, p in named], multiple).padded
        if name == ROOT:
            root = length
        else:
            padded.append(length)
    return {"parameters": sum(p.numel() for p in params), "padded": padded, "root_padded": root,
            "largest_group": max(sum(p.numel() for p in params if p.dim() >= 2),
                                 sum(p.numel() for p in params if p.dim() < 2))}


def engine_formula(engine: Engine, model_cfg, train: dict, prefetch: int) -> dict:
    micro_batch = train["micro_batch"]
    shard_ranks = engine.ranks_per_node if engine.hierarchical else engine.world
    replica_ranks = engine.world // shard_ranks
    if engine.stage == 0:
        n = model_numbers(model_cfg, 1)
        padded, root = [n["parameters"]], 0
    else:
        n = model_numbers(model_cfg, engine.world)
        padded, root = n["padded"], n["root_padded"]
    return formula_mem_bytes(engine.stage, padded, root, n["largest_group"], shard_ranks,
                             replica_ranks, prefetch, activation_bytes(model_cfg, micro_batch),
                             train["global_batch"] // (engine.world * micro_batch))


# --- one rank ----------------------------------------------------------------------------------


class TorchFSDP2(nn.Module):
    """An FSDP2-sharded model plus the two methods `train_step` asks of an engine."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Reduce-scatter every micro-batch into the sharded gradient, as loomtrain's stages 2
        and 3 do (FSDP2's `set_requires_gradient_sync(False)` would keep full gradients)."""
        yield

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        # torchtitan's clipping for DTensor gradients: the norm of the shards' norms
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        norm = nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if max_norm > 0:
            nn.utils.clip_grads_with_norm_(list(self.module.parameters()), max_norm, norm,
                                           foreach=True)
        return norm


def import_deepspeed():
    """DeepSpeed on its CPU accelerator (this benchmark runs on CPU and gloo), its log quiet
    below warnings; where it is not installed, `import_peer` exits."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    deepspeed = import_peer("deepspeed", "benchmarks/zero.py")
    deepspeed.utils.logger.setLevel(logging.WARNING)
    # torch's notes on the collectives DeepSpeed calls, once per call site and rank
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    return deepspeed


def deepspeed_config(stage: int, cfg) -> dict:
    """DeepSpeed's configuration for ZeRO `stage` and the run's batch and clipping, fp32;
    everything else (buckets, overlap, stage 3's prefetch and persistence) its defaults."""
    return {"train_micro_batch_size_per_gpu": cfg.train.micro_batch,
            "gradient_accumulation_steps": cfg.accumulation_steps,
            "gradient_clipping": cfg.train.grad_clip,
            "zero_optimization": {"stage": stage},
            "fp16": {"enabled": False}, "bf16": {"enabled": False},
            "steps_per_print": 2**31 - 1}  # no progress lines


def deepspeed_step(engine, batches, global_tokens: float) -> torch.Tensor:
    """One step through DeepSpeed's engine: `backward` and `step` per micro-batch (the step
    reduces, clips and updates at the last one). The loss is already divided by the token
    count over every micro-batch, so `backward` must not divide by their number again.
    Returns this rank's loss sum."""
    loss_sum = torch.zeros((), dtype=torch.float64)
    for x, y in batches:
        loss = token_loss_sum(engine(x), y)
        engine.backward(loss / global_tokens, scale_wrt_gas=False)
        engine.step()
        loss_sum += loss.detach()
    return loss_sum


def wrap(engine: Engine, model: nn.Module, mesh, cfg):
    """(model, optimizer, factor on the global token count): loomtrain's engines are built as
    the trainer builds them (gradients summed over dp, `gradient_reduce="sum"`), FSDP2 and
    DeepSpeed average them, so their loss is divided by tokens / world instead. DeepSpeed
    gets the same torch AdamW and uses the world's process group (initialized already)."""
    if engine.deepspeed:
        # what a launcher would set (DeepSpeed asserts it): one machine, so the local rank
        os.environ["LOCAL_RANK"] = str(dist.get_rank())
        optimizer = build_optimizer(model, cfg.train)
        with contextlib.redirect_stdout(sys.stderr):  # its op builds print; stdout is the JSON's
            ds_engine, optimizer, _, _ = import_deepspeed().initialize(
                model=model, optimizer=optimizer, config=deepspeed_config(engine.stage, cfg),
                dist_init_required=False)
        return ds_engine, optimizer, 1.0 / engine.world
    if engine.stage is None:
        device_mesh = init_device_mesh("cpu", (engine.world,), mesh_dim_names=("dp",))
        for block in model.blocks:
            fully_shard(block, mesh=device_mesh)
        fully_shard(model, mesh=device_mesh)
        return TorchFSDP2(model), build_optimizer(model, cfg.train), 1.0 / engine.world
    optimizer = build_optimizer(model, cfg.train)
    if engine.stage == 0:
        return DataParallel(model, mesh, "dp", cfg.parallel.bucket_mb, gradient_reduce="sum"), \
            optimizer, 1.0
    model, optimizer = shard(model, optimizer, mesh, engine.stage,
                             hierarchical=engine.hierarchical, prefetch=cfg.parallel.prefetch,
                             gradient_reduce="sum")
    return model, optimizer, 1.0


def wchar_bytes() -> int:
    """Bytes this process (all its threads) handed to write()/writev(): gloo's TCP sends."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


class Trainer:
    """One rank of one engine's world: the trainer's step, from step 0 on."""

    def __init__(self, engine: Engine, cfg):
        self.engine, self.cfg, self.step = engine, cfg, 0
        self.mesh = build_mesh({"dp": engine.world}, ranks_per_node=engine.ranks_per_node)
        corpus = load_corpus(cfg.data.source, cfg.data.val_fraction, cfg.model.vocab_size)
        self.sampler = WindowSampler(corpus.train, cfg.model.seq_len, cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        if engine.deepspeed:
            import_deepspeed()  # before the baseline: the library is not training state
        self.rss_before_model = rss_bytes()
        self.model, self.optimizer, self.token_factor = wrap(engine, build_model(cfg.model),
                                                             self.mesh, cfg)
        # the set-up's peak (the model built whole, then wrapped) apart from the steps' peak
        self.setup_peak = peak_rss_bytes()
        self.peak_reset = reset_peak_rss()

    def train(self, steps: int) -> float:
        """Run `steps` (at least 1) steps; returns the global loss of the last one and keeps
        its gradient norm before clipping (`grad_norm`: the normalization's check)."""
        t, mesh, world = self.cfg.train, self.mesh, self.engine.world
        for _ in range(steps):
            batches = [self.sampler.batch(rank_samples(self.step, t.global_batch,
                                                       mesh.local_rank("dp"), world,
                                                       t.micro_batch, micro))
                       for micro in range(self.cfg.accumulation_steps)]
            count = torch.tensor([sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)],
                                 dtype=torch.float64)
            comm.all_reduce(count, mesh, "dp")  # the trainer's per-step control all-reduce
            global_tokens = float(count)
            set_lr(self.optimizer, lr_at(self.step, t))
            if self.engine.deepspeed:
                loss_sum = deepspeed_step(self.model, batches, global_tokens * self.token_factor)
                self.grad_norm = float(self.model.get_global_grad_norm())
            else:
                loss_sum, grad_norm, _ = train_step(self.model, self.optimizer, batches,
                                                    global_tokens * self.token_factor, t.grad_clip)
                self.grad_norm = float(grad_norm)
            stepped = math.isfinite(self.grad_norm)
            assert stepped, f"{self.engine.name}: non-finite gradient at step {self.step}"
            self.step += 1
        comm.all_reduce(loss_sum, mesh, "dp")
        return float(loss_sum) / global_tokens

    def _slowest(self, seconds: float) -> float:
        elapsed = torch.tensor([seconds], dtype=torch.float64)
        comm.all_reduce(elapsed, self.mesh, "dp", op="max")
        return float(elapsed)

    def _wire_by_axis(self) -> dict[str, int]:
        meter = self.mesh.meter
        return {axis: meter.total("wire_bytes", axis=axis) for axis, _ in list(meter.counts)}

    def timed_round(self, steps: int) -> dict:
        meter = self.mesh.meter
        comm.barrier(self.mesh)
        wchar0, by_axis0 = wchar_bytes(), self._wire_by_axis()
        payload0, wire0 = meter.total("payload_bytes"), meter.total("wire_bytes")
        t0, cpu0 = time.perf_counter(), time.process_time()
        loss = self.train(steps)  # its loss all-reduce is the closing barrier
        cpu_s = time.process_time() - cpu0  # all threads of this rank, gloo's included
        wall_s = time.perf_counter() - t0
        socket_bytes = wchar_bytes() - wchar0
        elapsed = self._slowest(wall_s)
        tokens = steps * self.cfg.train.global_batch * self.cfg.model.seq_len
        return {"tokens_per_s": tokens / elapsed, "step_s": elapsed / steps,
                "cpu_s_per_step": cpu_s / steps, "last_step_loss": loss,
                "socket_bytes_per_step": socket_bytes / steps,
                "payload_bytes_per_step": (meter.total("payload_bytes") - payload0) / steps,
                "wire_bytes_per_step": (meter.total("wire_bytes") - wire0) / steps,
                "wire_bytes_by_axis_per_step": {axis: (wire - by_axis0.get(axis, 0)) / steps
                                                for axis, wire in self._wire_by_axis().items()},
                "step_peak_mem_bytes": peak_rss_bytes(), "setup_peak_mem_bytes": self.setup_peak,
                "rss_before_model_bytes": self.rss_before_model, "peak_reset": self.peak_reset}

    def timeline_step(self, prefetch: int) -> dict:
        """One step recorded on the engine's timeline with `prefetch` blocks gathered ahead."""
        self.model.prefetch, self.model.timeline = prefetch, Timeline()
        comm.barrier(self.mesh)
        t0 = time.perf_counter()
        self.train(1)
        step_s = self._slowest(time.perf_counter() - t0)
        spans, self.model.timeline = self.model.timeline.sorted_spans(), None
        self.model.prefetch = self.cfg.parallel.prefetch
        return {"step": self.step, "step_s": step_s, "spans": spans}  # step counted from 1


def _rank_main(rank: int, engine: Engine, port: int, cfg_dict: dict, warmup: int,
               mmap_threshold_kib: int, commands: list, results) -> None:
    """A spawned rank: set up, report the first step's loss and gradient norm after
    warm-up, then run one
    command at a time: ("round", steps), ("timeline", prefetch), or None to stop."""
    pin_mmap_threshold(mmap_threshold_kib)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 2 cores, 2 ranks: the same for every engine
    dist.init_process_group("gloo", rank=rank, world_size=engine.world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        trainer = Trainer(engine, config_from_dict(cfg_dict))
        first = {"first_step_loss": trainer.train(1), "first_step_grad_norm": trainer.grad_norm}
        if warmup > 1:
            trainer.train(warmup - 1)
        results.put((rank, first))
        serve_commands(rank, commands, results,
                       {"round": trainer.timed_round, "timeline": trainer.timeline_step})
        comm.barrier(trainer.mesh)  # before destroy: avoids an intermittent abort (DESIGN.md)
    finally:
        dist.destroy_process_group()


# --- the worlds, from the parent ---------------------------------------------------------------


def start_world(engine: Engine, cfg_dict: dict, args) -> World:
    """One engine's world of spawned ranks, idle (blocked on a queue) between commands."""
    return World(engine.name, engine.world, _rank_main,
                 (engine, free_port(), cfg_dict, args.warmup, args.mmap_threshold_kib),
                 args.timeout_s)


def round_figures(world: World, steps: int) -> dict:
    """Rank 0's figures; memory and bytes the max over ranks. Peak: of the whole process
    (set-up or steps); growth: over the RSS just before the model was built."""
    by_rank = world.command(("round", steps))
    got, out = by_rank.values(), dict(by_rank[0])
    out["cpu_s_per_step"] = statistics.mean(r["cpu_s_per_step"] for r in got)
    for r in got:
        r["peak_mem_bytes"] = max(r["setup_peak_mem_bytes"], r["step_peak_mem_bytes"])
    for key in ("peak_mem_bytes", "socket_bytes_per_step", "wire_bytes_per_step",
                "payload_bytes_per_step"):
        out[key] = max(r[key] for r in got)
    for key in ("", "setup_", "step_"):
        out[f"{key}mem_growth_bytes"] = max(
            r[f"{key}peak_mem_bytes"] - r["rss_before_model_bytes"] for r in got)
    out["peak_reset"] = all(r["peak_reset"] for r in got)
    return out


def run_worlds(engines, cfg_dict: dict, args, rounds: int, start: float, timeline: bool):
    """Start one world per engine (set-up and warm-up run side by side: nothing is timed
    there), then `rounds` rounds in turns; returns (rounds per engine, the first step's loss
    and gradient norm per engine, the stage-3 timelines)."""
    with closing_worlds({}) as worlds:  # a failed or hung world must not outlive the run
        for engine in engines:
            worlds[engine.name] = start_world(engine, cfg_dict, args)
        first = {name: w.collect()[0] for name, w in worlds.items()}
        names = [e.name for e in engines]
        done: dict[str, list[dict]] = {name: [] for name in names}
        for i in range(rounds):
            for name in names if i % 2 == 0 else names[::-1]:
                r = round_figures(worlds[name], args.steps)
                done[name].append(r)
                print(f"world {engines[0].world} round {i + 1}/{rounds} {name:>19}: "
                      f"{r['tokens_per_s']:7.1f} tok/s, step {r['step_s']:5.2f} s, growth "
                      f"{r['mem_growth_bytes'] / 2**20:6.1f} MiB "
                      f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
        timelines = {}
        for prefetch in (1, 0, 0, 1) if timeline else ():  # each twice, in ABBA order
            record = worlds["stage3"].command(("timeline", prefetch))[0]
            if prefetch not in timelines or record["step_s"] < timelines[prefetch]["step_s"]:
                timelines[prefetch] = record  # the less disturbed by the machine's other load
    return done, first, timelines


# --- the summary -------------------------------------------------------------------------------


def timeline_figures(record: dict) -> dict:
    """Seconds of gather and reduce running at all (`busy_s`) and overlapped with the blocks'
    compute (`hidden_s`: the compute lane without its "wait gather" spans, as loom report
    reads it), and seconds compute waited for a gather."""
    spans = record["spans"]
    return {"step_s": record["step_s"],
            "gather_busy_s": busy_s(spans, "gather"), "gather_overlap_s": hidden_s(spans, "gather"),
            "reduce_busy_s": busy_s(spans, "reduce"), "reduce_overlap_s": hidden_s(spans, "reduce"),
            "gather_wait_s": sum(s["end_s"] - s["start_s"] for s in spans
                                 if s["lane"] == "compute" and s["name"].startswith("wait"))}


def engine_figures(rounds: list[dict], formula: dict | None) -> dict:
    """Medians of the rounds, the last round's memory and bytes; loomtrain's engines (with a
    `formula`) also their CommMeter's bytes, which a peer's collectives bypass."""
    last = rounds[-1]  # peak RSS only grows: the last round's is the process's peak
    out = {k: statistics.median(r[k] for r in rounds)
           for k in ("tokens_per_s", "step_s", "cpu_s_per_step")}
    metered = ("wire_bytes_per_step", "payload_bytes_per_step", "wire_bytes_by_axis_per_step")
    out.update({k: last[k] for k in ("peak_mem_bytes", "mem_growth_bytes", "step_mem_growth_bytes",
                                     "setup_mem_growth_bytes", "socket_bytes_per_step",
                                     "last_step_loss") + (metered if formula else ())})
    if formula is not None:
        out.update(formula)
        for key in ("", "step_"):
            out[f"{key}mem_growth_over_formula"] = (last[f"{key}mem_growth_bytes"]
                                                    / formula["formula_mem_bytes"])
    out["per_round_tokens_per_s"] = [round(r["tokens_per_s"], 1) for r in rounds]
    return out


def paired_ratios(rounds: dict, ours: str, theirs: str) -> list[float]:
    """ours / theirs tokens/s of every round (the two ran next to each other in it)."""
    return [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rounds[ours], rounds[theirs])]


def deepspeed_figures(fig: dict, rounds: dict) -> dict:
    """Per DeepSpeed stage k: its tokens/s and peak memory per rank, loomtrain's stage k over
    it (tokens/s: the median of the paired rounds' ratios; peak memory and its growth over
    the pre-model RSS), and its figures in full under "deepspeed"."""
    out = {"deepspeed": {}}
    for k in DEEPSPEED_STAGES:
        ours, theirs = fig[f"stage{k}"], fig[f"deepspeed_stage{k}"]
        out[f"deepspeed_stage{k}_tokens_per_s"] = theirs["tokens_per_s"]
        out[f"deepspeed_stage{k}_peak_mem_bytes"] = theirs["peak_mem_bytes"]
        out[f"stage{k}_over_deepspeed_stage{k}_tokens_per_s"] = statistics.median(
            paired_ratios(rounds, f"stage{k}", f"deepspeed_stage{k}"))
        out[f"stage{k}_over_deepspeed_stage{k}_peak_mem"] = \
            ours["peak_mem_bytes"] / theirs["peak_mem_bytes"]
        out[f"stage{k}_over_deepspeed_stage{k}_mem_growth"] = \
            ours["mem_growth_bytes"] / theirs["mem_growth_bytes"]
        out["deepspeed"][str(k)] = theirs
    return out


def max_rel_diff(values: list[float], ref: float) -> float:
    return max(abs(v - ref) / abs(ref) for v in values)


def world2_engines(peer: bool) -> tuple[Engine, ...]:
    """The world-2 engines; without the peer (`--no-peer`) DeepSpeed's are left out."""
    return tuple(e for e in WORLD2 if peer or not e.deepspeed)


def summarize(w2: tuple, w4: tuple | None, cfg2: dict, cfg4: dict, args) -> dict:
    rounds, first, timelines = w2
    world2 = world2_engines(not args.no_peer)
    model_cfg = config_from_dict(cfg2).model
    prefetch = cfg2["parallel"]["prefetch"]

    def formula(engine, cfg):
        return engine_formula(engine, model_cfg, cfg["train"], prefetch)

    fig = {e.name: engine_figures(rounds[e.name], formula(e, cfg2) if e.loomtrain else None)
           for e in world2}
    for e in world2:
        fig[e.name].update(first[e.name])
    s3, f2 = fig["stage3"], fig["fsdp2"]
    # stage 3 and FSDP2 are neighbours in every round's order: their pair sees the same load
    pairs = paired_ratios(rounds, "stage3", "fsdp2")
    out = {"benchmark": "zero", "world": 2, "steps": args.steps, "warmup_steps": args.warmup,
           "rounds": args.rounds, "world4_rounds": args.world4_rounds if w4 else 0,
           "stage3_tokens_per_s": s3["tokens_per_s"], "fsdp2_tokens_per_s": f2["tokens_per_s"],
           "stage3_over_fsdp2_tokens_per_s": statistics.median(pairs),
           "stage3_peak_mem_bytes": s3["peak_mem_bytes"],
           "fsdp2_peak_mem_bytes": f2["peak_mem_bytes"],
           "stage3_mem_growth_bytes": s3["mem_growth_bytes"],
           "fsdp2_mem_growth_bytes": f2["mem_growth_bytes"],
           "stages": {name[-1]: fig[name] for name in ("stage0", "stage1", "stage2", "stage3")},
           "fsdp2": f2}
    if not args.no_peer:
        out.update(deepspeed_figures(fig, rounds))
    losses = {name: (fig[name]["first_step_loss"], fig[name]["last_step_loss"]) for name in fig}
    grad_norms = {name: fig[name]["first_step_grad_norm"] for name in fig}
    if w4 is not None:
        rounds4, first4, _ = w4
        model4 = config_from_dict(cfg4).model
        hier = {e.name: engine_figures(rounds4[e.name], engine_formula(
            e, model4, cfg4["train"], prefetch)) for e in WORLD4}
        for e in WORLD4:
            hier[e.name].update(first4[e.name])
            losses[e.name] = (first4[e.name]["first_step_loss"], hier[e.name]["last_step_loss"])
            grad_norms[e.name] = first4[e.name]["first_step_grad_norm"]
        pairs4 = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in
                  zip(rounds4["stage3_hierarchical"], rounds4["stage3_flat"])]
        out["hierarchical"] = {"world": 4, "ranks_per_node": 2,
                               "hierarchical_over_flat_tokens_per_s": statistics.median(pairs4),
                               "flat": hier["stage3_flat"],
                               "hierarchical": hier["stage3_hierarchical"]}
    if timelines:
        out["timeline"] = {f"prefetch_{p}": timeline_figures(r) for p, r in timelines.items()}
    out["losses"] = {name: {"first": a, "last": b} for name, (a, b) in losses.items()}
    out["first_step_grad_norms"] = grad_norms
    ref_first, ref_last = losses["stage0"]
    out["first_step_loss_max_rel_diff"] = max_rel_diff([a for a, _ in losses.values()], ref_first)
    # world 2 only: the world-4 engines run fewer rounds, so their last step is another one
    out["last_step_loss_max_rel_diff"] = max_rel_diff(
        [fig[e.name]["last_step_loss"] for e in world2], ref_last)
    # the gradient norm before clipping: a wrong loss normalization changes it by its factor,
    # where the losses hardly move (AdamW's update and the clipping undo a gradient's scale)
    out["first_step_grad_norm_max_rel_diff"] = max_rel_diff(list(grad_norms.values()),
                                                            grad_norms["stage0"])
    if not args.no_peer:
        deepspeed = [f"deepspeed_stage{k}" for k in DEEPSPEED_STAGES]
        out["deepspeed_max_rel_diff"] = {
            "first_step_loss": max_rel_diff([losses[n][0] for n in deepspeed], ref_first),
            "last_step_loss": max_rel_diff([losses[n][1] for n in deepspeed], ref_last),
            "first_step_grad_norm": max_rel_diff([grad_norms[n] for n in deepspeed],
                                                 grad_norms["stage0"])}
    growth = {k: v["mem_growth_over_formula"] for k, v in out["stages"].items()}
    out["targets"] = {"stage3_tokens_per_s_ge_fsdp2": out["stage3_over_fsdp2_tokens_per_s"] >= 1.0,
                      "stage3_peak_mem_le_fsdp2": s3["peak_mem_bytes"] <= f2["peak_mem_bytes"],
                      # the same without the process's own baseline (torch, imports), which
                      # differs between processes by a MiB or so
                      "stage3_mem_growth_le_fsdp2":
                          s3["mem_growth_bytes"] <= f2["mem_growth_bytes"],
                      "mem_within_10pct_of_formula": {k: abs(v - 1) <= 0.10
                                                      for k, v in growth.items()}}
    for k in DEEPSPEED_STAGES if not args.no_peer else ():
        out["targets"][f"stage{k}_tokens_per_s_ge_deepspeed"] = \
            out[f"stage{k}_over_deepspeed_stage{k}_tokens_per_s"] >= 1.0
        out["targets"][f"stage{k}_peak_mem_le_deepspeed"] = \
            out[f"stage{k}_over_deepspeed_stage{k}_peak_mem"] <= 1.0
    t, m = cfg2["train"], cfg2["model"]
    out["config"] = {
        "model": m, "parameters": model_numbers(model_cfg, 1)["parameters"], "small": args.small,
        "data": "stdlib", "global_batch": t["global_batch"], "micro_batch": t["micro_batch"],
        "world4_micro_batch": cfg4["train"]["micro_batch"],
        "accumulation_steps": t["global_batch"] // (2 * t["micro_batch"]),
        "tokens_per_step": t["global_batch"] * m["seq_len"], "optimizer": "adamw",
        "grad_clip": t["grad_clip"], "prefetch": prefetch,
        "bucket_mb": cfg2["parallel"]["bucket_mb"],
        "threads_per_rank": 1, "backend": "gloo", "dtype": "fp32",
        "deepspeed": None if args.no_peer else {
            "version": import_deepspeed().__version__, "accelerator": "cpu",
            "optimizer": "torch AdamW (build_optimizer) given to deepspeed.initialize",
            "config": {k: deepspeed_config(k, config_from_dict(cfg2)) for k in DEEPSPEED_STAGES}},
        "mmap_threshold_kib": args.mmap_threshold_kib or "glibc default (dynamic)",
        "peak_reset_after_setup": all(r["peak_reset"] for rs in rounds.values() for r in rs),
        "torch": torch.__version__}
    return out


def build_cfg_dict(args, world: int) -> dict:
    """The trainer's config for `world` ranks (validated); world 4 halves the micro-batch so
    the global batch, and so every step's data, stays the same."""
    micro = args.micro_batch if world == 2 else max(1, args.micro_batch // 2)
    return config_from_dict({
        "model": SMALL_MODEL if args.small else MODEL,
        "train": {"global_batch": args.global_batch, "micro_batch": micro},
        "parallel": {"nproc": world, "bucket_mb": args.bucket_mb, "prefetch": 1},
    }).model_dump()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds per world-2 engine")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps at the start of each world (the first: the loss check)")
    parser.add_argument("--world4-rounds", type=int, default=4,
                        help="timed rounds per world-4 engine (0: skip world 4)")
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2, help="at world 2; half at world 4")
    parser.add_argument("--bucket-mb", type=float, default=4.0, help="stage 0's buckets")
    parser.add_argument("--timeline-out", type=Path, default=None,
                        help="write the stage-3 timelines' spans here (JSON)")
    parser.add_argument("--small", action="store_true", help="a tiny GPT (for the smoke test)")
    parser.add_argument("--no-peer", action="store_true",
                        help="leave DeepSpeed out (loomtrain's stages and FSDP2 only): for a "
                             "machine without the peers extra")
    parser.add_argument("--mmap-threshold-kib", type=int, default=128,
                        help="glibc mmap threshold in every rank (0: glibc's dynamic default); "
                             "see pin_mmap_threshold")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="fail if a world gives no result for this long")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 1 or args.world4_rounds < 0:
        parser.error("--rounds, --steps and --warmup must be at least 1 (the first step is the "
                     "loss check, and it is never timed), --world4-rounds at least 0")
    if not args.no_peer:
        import_deepspeed()  # without it: one line on stderr and exit 2
    cfg2, cfg4 = build_cfg_dict(args, 2), build_cfg_dict(args, 4)
    start = time.perf_counter()
    w2 = run_worlds(world2_engines(not args.no_peer), cfg2, args, args.rounds, start, timeline=True)
    w4 = run_worlds(WORLD4, cfg4, args, args.world4_rounds, start, timeline=False) \
        if args.world4_rounds else None
    out = summarize(w2, w4, cfg2, cfg4, args)
    out["wall_s"] = time.perf_counter() - start
    if args.timeline_out is not None:  # each entry as Timeline.write writes one (report.py)
        args.timeline_out.write_text(json.dumps(
            {f"prefetch_{p}": {"rank": 0, "prefetch": p, **r} for p, r in w2[2].items()}, indent=1))
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
