"""loomtrain's DataParallel against torch's DistributedDataParallel, measured in the same run.

    .venv/bin/python benchmarks/ddp.py [--rounds 30] [--steps 2] [--warmup 2] [--small]

What is the same for both engines: the trainer's default GPT (`build_model(ModelConfig())`,
or a tiny one with --small), the stdlib corpus through `WindowSampler` (the same batches,
cut per rank by `rank_samples`), world 2 on gloo at 127.0.0.1 with one thread per rank,
AdamW from `build_optimizer`, the lr schedule, gradient clipping and the step itself: both run
the trainer's `train_step` (accumulation micro-steps under `no_sync()`, the last one synced,
each micro-batch's token-summed loss divided by the global token count), and one small
all-reduce per step for that count, as the trainer does. Both get the same bucket size, and
both keep gradients as bucket views (DDP's `gradient_as_bucket_view=True`, which is what
loomtrain always does).

Each engine trains in its own world of two spawned processes; both worlds live for the whole
run and take turns, the idle one blocked on a queue, so they never compute at the same time.
Each world first runs `warmup` untimed steps (DDP rebuilds its buckets after the first, AdamW
allocates its state on the first), then one timed round of `steps` steps per turn; round i of
both engines covers the same steps and batches. Turns go L D, D L, L D, ... so a drift in the
machine's load falls on both engines alike, and the ratio of the two rounds of a pair is
taken under (nearly) the same load. Separate processes are what lets peak memory be told
apart: a process's peak resident set size only grows, so two engines in one process would
share it; here each process holds one engine, and the processes of both worlds start
identically (same imports, corpus, model and optimizer), so the difference is the engine's.

The last line on stdout is one JSON object with the medians over rounds (see `summarize`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from worlds import World, closing_worlds, free_port, peak_rss_bytes, rss_bytes

from loomtrain import comm
from loomtrain.data import WindowSampler, load_corpus, rank_samples
from loomtrain.mesh import build_mesh
from loomtrain.models import IGNORE_INDEX, build_model
from loomtrain.optim import build_optimizer, lr_at, set_lr
from loomtrain.parallel.data import DataParallel
from loomtrain.train.config import config_from_dict
from loomtrain.train.trainer import train_step

WORLD = 2
ENGINES = ("loomtrain", "torch_ddp")
SMALL_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32}


class TorchDDP(DistributedDataParallel):
    """DDP plus the one method `train_step` asks of an engine, done as loomtrain does it."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        # loomtrain's order (reverse registration, its bucket order): the norm then sums in the
        # same order, and the two engines' runs can agree to the last bit
        params = list(self.module.parameters())[::-1]
        if max_norm > 0:
            return nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return nn.utils.get_total_norm([p.grad for p in params], foreach=True)


def wrap(engine: str, model: nn.Module, mesh, bucket_mb: float):
    """(wrapped model, factor on the global token count) so both engines get the same gradient:
    loomtrain sums over dp, DDP averages, so DDP's loss is divided by tokens / world instead."""
    if engine == "loomtrain":
        return DataParallel(model, mesh, "dp", bucket_mb, gradient_reduce="sum"), 1.0
    ddp = TorchDDP(model, process_group=mesh.group("dp"), bucket_cap_mb=bucket_mb,
                   gradient_as_bucket_view=True)
    return ddp, 1.0 / mesh.size("dp")


def _global_loss(loss_sum: torch.Tensor, global_tokens: float, mesh) -> float:
    total = loss_sum.clone()
    comm.all_reduce(total, mesh, "dp")
    return float(total) / global_tokens


class Trainer:
    """One rank of one engine's world: the trainer's step, from step 0 on, in rounds."""

    def __init__(self, engine: str, cfg):
        self.engine, self.cfg, self.step = engine, cfg, 0
        self.mesh = build_mesh({"dp": WORLD})
        corpus = load_corpus(cfg.data.source, cfg.data.val_fraction, cfg.model.vocab_size)
        self.sampler = WindowSampler(corpus.train, cfg.model.seq_len, cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        model = build_model(cfg.model)
        self.optimizer = build_optimizer(model, cfg.train)
        self.rss_before_wrap = rss_bytes()
        self.model, self.token_factor = wrap(engine, model, self.mesh, cfg.parallel.bucket_mb)

    def train(self, steps: int) -> float:
        """Run `steps` (at least 1) steps; returns the global loss of the last one."""
        t, mesh, dp_rank = self.cfg.train, self.mesh, self.mesh.local_rank("dp")
        for _ in range(steps):
            batches = [self.sampler.batch(rank_samples(self.step, t.global_batch, dp_rank, WORLD,
                                                       t.micro_batch, micro))
                       for micro in range(self.cfg.accumulation_steps)]
            local_tokens = sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)
            count = torch.tensor([local_tokens], dtype=torch.float64)
            comm.all_reduce(count, mesh, "dp")  # the trainer's per-step control all-reduce
            global_tokens = float(count)
            set_lr(self.optimizer, lr_at(self.step, t))
            loss_sum, _, stepped = train_step(self.model, self.optimizer, batches,
                                              global_tokens * self.token_factor, t.grad_clip)
            assert stepped, f"{self.engine}: non-finite gradient at step {self.step}"
            self.step += 1
        return _global_loss(loss_sum, global_tokens, mesh)

    def timed_round(self, steps: int) -> dict:
        comm.barrier(self.mesh)
        t0, cpu0 = time.perf_counter(), time.process_time()
        loss = self.train(steps)  # its loss all-reduce is the closing barrier
        cpu_s = time.process_time() - cpu0  # all threads of this rank, gloo's included
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        comm.all_reduce(elapsed, self.mesh, "dp", op="max")
        tokens = steps * self.cfg.train.global_batch * self.cfg.model.seq_len
        return {"tokens_per_s": tokens / float(elapsed), "step_s": float(elapsed) / steps,
                "cpu_s_per_step": cpu_s / steps, "last_step_loss": loss,
                "peak_mem_bytes": peak_rss_bytes(), "rss_before_wrap_bytes": self.rss_before_wrap}


def _rank_main(rank: int, engine: str, port: int, cfg_dict: dict, warmup: int,
               commands: list, results) -> None:
    """A spawned rank: set up, report the first step's loss after warm-up, then run one timed
    round per command (a step count) until the command None."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 2 cores, 2 ranks: the same for both engines
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    try:
        trainer = Trainer(engine, config_from_dict(cfg_dict))
        first_loss = trainer.train(1)
        if warmup > 1:
            trainer.train(warmup - 1)  # DDP has rebuilt its buckets after step 1
        results.put((rank, {"first_step_loss": first_loss}))
        while (steps := commands[rank].get()) is not None:
            results.put((rank, trainer.timed_round(steps)))
        comm.barrier(trainer.mesh)  # before destroy: avoids an intermittent abort (DESIGN.md)
    finally:
        dist.destroy_process_group()


def start_world(engine: str, cfg_dict: dict, warmup: int, timeout_s: float) -> World:
    """One engine's world of WORLD spawned ranks, idle (blocked on a queue) between rounds, so
    the two worlds never compute at the same time and each process holds one engine only."""
    world = World(engine, WORLD, _rank_main, (engine, free_port(), cfg_dict, warmup), timeout_s)
    try:
        world.first_step_loss = world.collect()[0]["first_step_loss"]
    except BaseException:
        world.kill()
        raise
    return world


def round_figures(world: World, steps: int) -> dict:
    """Rank 0's figures of one timed round, peak memory the max over ranks."""
    got = world.command(steps)
    out = dict(got[0])
    out["cpu_s_per_step"] = statistics.mean(r["cpu_s_per_step"] for r in got.values())
    out["peak_mem_bytes"] = max(r["peak_mem_bytes"] for r in got.values())
    out["peak_mem_over_wrap_bytes"] = max(r["peak_mem_bytes"] - r["rss_before_wrap_bytes"]
                                          for r in got.values())
    return out


def summarize(rounds: dict[str, list[dict]], first_loss: dict[str, float], cfg_dict: dict,
              args) -> dict:
    med = {e: {k: statistics.median(r[k] for r in rounds[e])
               for k in ("tokens_per_s", "step_s", "cpu_s_per_step")}
           for e in ENGINES}
    # the i-th rounds of the two engines ran next to each other, so their ratio sees (nearly)
    # the same machine load: the median of these ratios is the figure to read
    pair_ratios = [a["tokens_per_s"] / b["tokens_per_s"]
                   for a, b in zip(rounds["loomtrain"], rounds["torch_ddp"])]
    out = {"benchmark": "ddp", "world": WORLD, "steps": args.steps, "warmup_steps": args.warmup,
           "rounds": args.rounds}
    for e in ENGINES:
        out[f"{e}_tokens_per_s"] = med[e]["tokens_per_s"]
    out["ratio"] = statistics.median(pair_ratios)
    out["ratio_of_medians"] = med["loomtrain"]["tokens_per_s"] / med["torch_ddp"]["tokens_per_s"]
    if len(pair_ratios) > 1:
        q1, _, q3 = statistics.quantiles(pair_ratios, n=4, method="inclusive")
        out["pair_ratio_q1"], out["pair_ratio_q3"] = q1, q3
    out["pair_ratio_min"], out["pair_ratio_max"] = min(pair_ratios), max(pair_ratios)
    # the same for CPU seconds per step, DDP's over loomtrain's (> 1: loomtrain costs less)
    out["cpu_ratio"] = statistics.median(b["cpu_s_per_step"] / a["cpu_s_per_step"]
                                         for a, b in zip(rounds["loomtrain"], rounds["torch_ddp"]))
    for e in ENGINES:  # peak RSS only grows: the last round's is the process's peak
        out[f"{e}_step_s"] = med[e]["step_s"]
        # CPU seconds a rank spends per step (its threads, gloo's included): what the engine
        # costs, far less sensitive than wall time to what else runs on the machine
        out[f"{e}_cpu_s_per_step"] = med[e]["cpu_s_per_step"]
        out[f"{e}_peak_mem_bytes"] = rounds[e][-1]["peak_mem_bytes"]
        out[f"{e}_peak_mem_over_wrap_bytes"] = rounds[e][-1]["peak_mem_over_wrap_bytes"]
    for e in ENGINES:
        out[f"{e}_first_step_loss"] = first_loss[e]
    out["first_step_loss_equal"] = first_loss["loomtrain"] == first_loss["torch_ddp"]
    # the losses at the end of every round: equal (to rounding) only if the gradients are
    out["last_step_loss_max_rel_diff"] = max(
        abs(a["last_step_loss"] - b["last_step_loss"]) / abs(b["last_step_loss"])
        for a, b in zip(rounds["loomtrain"], rounds["torch_ddp"]))
    for e in ENGINES:
        out[f"{e}_last_step_loss"] = rounds[e][-1]["last_step_loss"]
    out["per_round_tokens_per_s"] = {e: [round(r["tokens_per_s"], 1) for r in rounds[e]]
                                     for e in ENGINES}
    t, m, p = cfg_dict["train"], cfg_dict["model"], cfg_dict["parallel"]
    out["config"] = {
        "model": m, "small": args.small, "data": "stdlib", "global_batch": t["global_batch"],
        "micro_batch": t["micro_batch"],
        "accumulation_steps": t["global_batch"] // (WORLD * t["micro_batch"]),
        "tokens_per_step": t["global_batch"] * m["seq_len"], "optimizer": "adamw",
        "grad_clip": t["grad_clip"], "bucket_mb": p["bucket_mb"],
        "ddp_bucket_cap_mb": p["bucket_mb"],
        "ddp_gradient_as_bucket_view": True, "threads_per_rank": 1, "backend": "gloo",
        "torch": torch.__version__,
    }
    return out


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line options `build_cfg_dict` reads."""
    parser.add_argument("--small", action="store_true", help="a tiny GPT (for the smoke test)")
    parser.add_argument("--global-batch", type=int, default=None, help="default: the trainer's")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: the trainer's")
    parser.add_argument("--bucket-mb", type=float, default=4.0,
                        help="loomtrain's bucket_mb = DDP's bucket_cap_mb (4: overlap exercised)")


def build_cfg_dict(args) -> dict:
    """The trainer's defaults, except what the command line sets; validated by the config."""
    train = {k: v for k, v in (("global_batch", args.global_batch),
                               ("micro_batch", args.micro_batch)) if v is not None}
    return config_from_dict({
        "model": SMALL_MODEL if args.small else {}, "train": train,
        "parallel": {"nproc": WORLD, "bucket_mb": args.bucket_mb},
    }).model_dump()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per engine")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps at the start of each engine's world")
    add_config_arguments(parser)
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="fail if a world gives no result for this long")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 1:
        parser.error("--rounds, --steps and --warmup must be at least 1 (the first step is the "
                     "loss check, and it is never timed)")
    cfg_dict = build_cfg_dict(args)
    start = time.perf_counter()
    with closing_worlds({}) as worlds:  # a failed or hung world must not outlive the run
        for engine in ENGINES:  # one after the other: set-up and warm-up never overlap
            worlds[engine] = start_world(engine, cfg_dict, args.warmup, args.timeout_s)
        rounds: dict[str, list[dict]] = {e: [] for e in ENGINES}
        for i in range(args.rounds):
            for engine in ENGINES if i % 2 == 0 else ENGINES[::-1]:
                r = round_figures(worlds[engine], args.steps)
                rounds[engine].append(r)
                print(f"round {i + 1}/{args.rounds} {engine:>9}: {r['tokens_per_s']:8.1f} tok/s, "
                      f"step {r['step_s'] * 1e3:6.1f} ms, peak {r['peak_mem_bytes'] / 2**20:6.1f} "
                      f"MiB ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    out = summarize(rounds, {e: w.first_step_loss for e, w in worlds.items()}, cfg_dict, args)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
