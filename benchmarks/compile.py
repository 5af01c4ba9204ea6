"""loomtrain eager, loomtrain with `train.compile`, and torch compiled the same way, in one run.

    .venv/bin/python benchmarks/compile.py [--rounds 10] [--steps 2] [--warmup 3] [--small]
                                            [--backend inductor]

Three engines train the same model on the same data, each in its own world of two spawned
gloo ranks (data parallelism, one thread per rank), as benchmarks/ddp.py runs them and with
its step (ddp.py `Trainer`: the trainer's default GPT or a tiny one with --small, the stdlib
corpus through `WindowSampler`, AdamW, the lr schedule, clipping):
- loomtrain_eager: loomtrain's DataParallel, every block eager;
- loomtrain_compiled: the same, each block's forward compiled by `compile_blocks`, the
  function `train.compile = true` runs (parallel/compile.py);
- torch_compiled: torch's DistributedDataParallel over the model whose blocks are compiled as
  TorchTitan compiles them (`apply_compile`: each block replaced by `torch.compile(block,
  fullgraph=True)`).
The worlds compile in their untimed warm-up steps (the first step traces and compiles forward
and backward), then take turns, one timed round of `steps` steps each, in the order A B C,
C B A, ... so that a drift of the machine's load falls on all alike; the paired ratios of
round i ran next to each other.

The last line on stdout is one JSON object: the median tokens/s of each engine, the medians
of the paired ratios, the losses (the compiled runs reproduce the eager one to fp32 rounding)
and the load average before and after (timings mean little while anything else runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from ddp import Trainer, add_config_arguments, build_cfg_dict
from worlds import (
    World,
    closing_worlds,
    free_port,
    joined_world,
    reset_peak_rss,
    serve_commands,
    take_turns,
)

from loomtrain import comm
from loomtrain.parallel.compile import compile_blocks
from loomtrain.train.config import config_from_dict

WORLD = 2
ENGINES = ("loomtrain_eager", "loomtrain_compiled", "torch_compiled")


def torchtitan_compile(model: torch.nn.Module, backend: str) -> None:
    """TorchTitan's `apply_compile`: every block of `model.blocks` replaced by its compiled
    module (`torch.compile(block, fullgraph=True)`, an OptimizedModule around it)."""
    for name, block in model.blocks.named_children():
        model.blocks.register_module(name, torch.compile(block, backend=backend, fullgraph=True))


def _trainer(engine: str, cfg, backend: str) -> Trainer:
    """ddp.py's trainer of loomtrain's DataParallel or of torch's DDP, blocks compiled as
    `engine` says. Compiling after the wrap changes nothing of it: neither engine calls a
    block; their hooks are on the parameters."""
    trainer = Trainer("torch_ddp" if engine == "torch_compiled" else "loomtrain", cfg)
    if engine == "loomtrain_compiled":
        compile_blocks(trainer.model.module, backend)
    elif engine == "torch_compiled":
        torchtitan_compile(trainer.model.module, backend)
    return trainer


def _rank_main(rank: int, engine: str, port: int, cfg_dict: dict, warmup: int, backend: str,
               commands: list, results) -> None:
    with joined_world(rank, WORLD, port):
        trainer = _trainer(engine, config_from_dict(cfg_dict), backend)
        first_loss = trainer.train(1)
        if warmup > 1:
            trainer.train(warmup - 1)
        results.put((rank, {"first_step_loss": first_loss, "peak_reset": reset_peak_rss()}))
        serve_commands(rank, commands, results, {"round": trainer.timed_round})
        comm.barrier(trainer.mesh)  # before destroy: avoids an intermittent abort (DESIGN.md)


def _paired(rounds: dict, ours: str, theirs: str) -> float:
    """The median over rounds of ours / theirs tokens/s (round i of both ran side by side)."""
    return statistics.median(a["tokens_per_s"] / b["tokens_per_s"]
                             for a, b in zip(rounds[ours], rounds[theirs]))


def summarize(rounds: dict, first: dict, cfg_dict: dict, args, load: tuple) -> dict:
    out = {"benchmark": "compile", "world": WORLD, "backend": args.backend, "rounds": args.rounds,
           "steps": args.steps, "warmup_steps": args.warmup}
    for e in ENGINES:
        out[f"{e}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in rounds[e])
    out["compiled_over_eager"] = _paired(rounds, "loomtrain_compiled", "loomtrain_eager")
    out["loomtrain_over_torch_compiled"] = _paired(rounds, "loomtrain_compiled", "torch_compiled")
    eager = rounds["loomtrain_eager"]
    for e in ENGINES:
        out[f"{e}_first_step_loss"] = first[e]["first_step_loss"]
        # the last step of every round against the eager run's: fp32 rounding apart
        out[f"{e}_last_step_loss_max_rel_diff"] = max(
            abs(a["last_step_loss"] - b["last_step_loss"]) / abs(b["last_step_loss"])
            for a, b in zip(rounds[e], eager))
        out[f"{e}_per_round_tokens_per_s"] = [round(r["tokens_per_s"], 1) for r in rounds[e]]
    out["load_average_before"], out["load_average_after"] = load
    t, m = cfg_dict["train"], cfg_dict["model"]
    out["config"] = {"model": m, "small": args.small, "data": "stdlib",
                     "global_batch": t["global_batch"], "micro_batch": t["micro_batch"],
                     "tokens_per_step": t["global_batch"] * m["seq_len"], "optimizer": "adamw",
                     "threads_per_rank": 1, "torch": torch.__version__}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per engine")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps at the start of each world (the first compiles)")
    add_config_arguments(parser)
    parser.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor",
                        help="torch.compile's backend for both compiled engines")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="fail if a world gives no result for this long (compiling included)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 1:
        parser.error("--rounds, --steps and --warmup must be at least 1")
    cfg_dict = build_cfg_dict(args)
    load_before, start = os.getloadavg()[0], time.perf_counter()
    with closing_worlds({}) as worlds:
        for engine in ENGINES:
            worlds[engine] = World(engine, WORLD, _rank_main,
                                   (engine, free_port(), cfg_dict, args.warmup, args.backend),
                                   args.timeout_s)
        rounds, first = take_turns(worlds, args.rounds, args.steps, "", start)
    out = summarize(rounds, first, cfg_dict, args, (load_before, os.getloadavg()[0]))
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
