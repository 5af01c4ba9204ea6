"""Expert parallelism against the experts sharded by ZeRO-3, world 4, on a mixture-of-experts
Llama (issue 29): 8 experts, top 2.

    .venv/bin/python benchmarks/moe.py [--rounds 3] [--steps 2] [--warmup 2]   # ~3 min, 2 cores
    .venv/bin/python benchmarks/moe.py --small                               # smoke test

Both sides are `loom train`'s own path (`train.apply.build` of a Config, one step being
`train.trainer.step`) on the same model, data and step: dp 4, each rank one quarter of the
global batch in micro-batches of one sequence, the token-summed cross entropy over the step's
tokens, AdamW (lr 1e-3), clip 1.0, fp32, gloo on 127.0.0.1, one thread per rank.
- ep4: `parallel.ep = 4`, each rank holds 2 of the 8 experts of every MoE block, the tokens
  travel to their experts and back by all-to-all (parallel/expert/), the other parameters
  replicated and all-reduced over dp (the expert ones over the one-rank edp group).
- zero3: `parallel.ep = 1, zero_stage = 3`: every rank routes its tokens to all 8 experts
  itself, each expert's weights sharded over the 4 ranks and gathered for each forward and
  backward, as DeepSpeed or FSDP runs a mixture of experts without expert parallelism.

The worlds take turns L T, T L, ... (benchmarks/worlds.py). Memory is the process's peak RSS
during the timed steps, max over ranks. The all-to-all bytes are the meter's, summed over the
four ranks, per step; the formula's are the dry run's (`loom train --dry-run`: per MoE block
and micro-batch, the counts 8E and four exchanges of the T k d c bytes of the token copies),
payload exact whatever the routing, wire (ep - 1) / ep of it under even routing (a copy
routed to its own rank does not travel). The last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
from tensor import batch_at
from worlds import (
    World,
    closing_worlds,
    free_port,
    joined_world,
    pair_figures,
    peak_rss_bytes,
    pin_mmap_threshold,
    reset_peak_rss,
    serve_commands,
    take_turns,
)

from loomtrain.models import build_model
from loomtrain.models.config import ModelConfig

WORLD = 4
MODEL = {"name": "llama", "vocab_size": 4096, "seq_len": 128, "d_model": 256, "n_layers": 4,
         "n_heads": 8, "n_kv_heads": 4, "n_experts": 8, "experts_per_token": 2,
         "moe_hidden": 512}
SMALL_MODEL = {"name": "llama", "vocab_size": 256, "seq_len": 32, "d_model": 64, "n_layers": 2,
               "n_heads": 4, "n_kv_heads": 2, "n_experts": 8, "experts_per_token": 2}
SIDES = {"ep": {"ep": 4}, "zero3": {"zero_stage": 3}}
LR, CLIP = 1e-3, 1.0


def config(model_cfg: dict, side: str, batch: int):
    from loomtrain.train.config import config_from_dict

    return config_from_dict({
        "model": model_cfg,
        "train": {"global_batch": batch, "micro_batch": 1, "lr": LR, "grad_clip": CLIP},
        "parallel": {"nproc": WORLD, **SIDES[side]}})


class Trainer:
    """One side's rank: the built run and its step over this rank's quarter of the batch."""

    def __init__(self, side: str, model_cfg: dict, batch: int, seed: int):
        from loomtrain.train.apply import build
        from loomtrain.train.launch import init_distributed

        self.cfg, self.model_cfg, self.batch, self.seed, self.step_i = \
            config(model_cfg, side, batch), model_cfg, batch, seed, 0
        mesh = init_distributed(self.cfg)
        torch.manual_seed(seed)
        self.built = build(build_model(self.cfg.model), mesh, self.cfg,
                           lambda m: torch.optim.AdamW(m.parameters(), lr=LR))
        self.dp = mesh.local_rank("dp")

    def train(self, steps: int) -> float:
        """`steps` steps; the mean token loss of the last over the global batch."""
        from loomtrain.train import trainer

        share = self.batch // WORLD
        for _ in range(steps):
            x, y = batch_at(self.step_i, self.seed, self.batch, self.model_cfg["seq_len"],
                            self.model_cfg["vocab_size"])
            rows, targets = (t[self.dp * share:(self.dp + 1) * share] for t in (x, y))
            batches = [(rows[i:i + 1], targets[i:i + 1]) for i in range(share)]
            loss_sum, _, _ = trainer.step(self.built, batches, float(y.numel()), CLIP)
            self.step_i += 1
        total = loss_sum.double().reshape(1).clone()
        dist.all_reduce(total)
        return float(total) / (self.batch * self.model_cfg["seq_len"])

    def timed_round(self, steps: int) -> dict:
        meter = self.built.mesh.meter
        dist.barrier()
        before = _all_to_all(meter)
        t0 = time.perf_counter()
        loss = self.train(steps)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        sent = torch.tensor([a - b for a, b in zip(_all_to_all(meter), before)],
                            dtype=torch.float64)
        dist.all_reduce(sent)  # summed over the ranks
        return {"tokens_per_s": steps * self.batch * self.model_cfg["seq_len"] / float(elapsed),
                "step_s": float(elapsed) / steps, "last_step_loss": loss,
                "peak_mem_bytes": peak_rss_bytes(),
                "all_to_all_wire_bytes_per_step": float(sent[0]) / steps,
                "all_to_all_payload_bytes_per_step": float(sent[1]) / steps}


def _all_to_all(meter) -> tuple[int, int]:
    return (meter.total("wire_bytes", op="all_to_all"),
            meter.total("payload_bytes", op="all_to_all"))


def formula(model_cfg: dict, batch: int) -> tuple[float, float]:
    """The dry run's all-to-all (wire, payload) bytes per step, rank 0's times the ranks (the
    training step's collectives, `every_steps` 1)."""
    from loomtrain.train import dryrun

    rows = [c for c in dryrun.estimate(config(model_cfg, "ep", batch)).collectives
            if c.op == "all_to_all" and c.every_steps == 1]
    return (WORLD * sum(c.calls * c.wire_bytes for c in rows),
            WORLD * sum(c.calls * c.payload_bytes for c in rows))


def _rank_main(rank: int, side: str, port: int, model_cfg: dict, batch: int, seed: int,
               warmup: int, commands: list, results) -> None:
    pin_mmap_threshold(128)
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    with joined_world(rank, WORLD, port):
        trainer = Trainer(side, model_cfg, batch, seed)
        first_loss = trainer.train(1)
        if warmup > 1:
            trainer.train(warmup - 1)
        results.put((rank, {"first_step_loss": first_loss, "peak_reset": reset_peak_rss()}))
        serve_commands(rank, commands, results, {"round": trainer.timed_round})
        dist.barrier()  # before destroy: avoids an intermittent abort (DESIGN.md)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per side")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps at the start of each world (the first: the loss check)")
    parser.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small", action="store_true", help="a tiny model (the smoke test)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 1 or args.batch % WORLD:
        parser.error(f"--rounds, --steps and --warmup must be at least 1, --batch a multiple "
                     f"of {WORLD}")
    model_cfg = SMALL_MODEL if args.small else MODEL
    start = time.perf_counter()
    with closing_worlds({}) as worlds:
        for side in SIDES:
            worlds[side] = World(side, WORLD, _rank_main, (side, free_port(), model_cfg,
                                                           args.batch, args.seed, args.warmup),
                                 args.timeout_s)
        rounds, first = take_turns(worlds, args.rounds, args.steps, "", start)
    row = pair_figures(rounds, first, "ep", "zero3")
    wire, payload = formula(model_cfg, args.batch)
    measured = rounds["ep"][-1]
    with torch.device("meta"):
        parameters = sum(p.numel() for p in build_model(ModelConfig(**model_cfg)).parameters())
    out = {"benchmark": "moe", "world": WORLD, "date": datetime.date.today().isoformat(),
           "cpu_count": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()],
           "rounds": args.rounds, "steps": args.steps, "warmup_steps": args.warmup,
           "ep_tokens_per_s": row["ep_tokens_per_s"],
           "zero3_tokens_per_s": row["zero3_tokens_per_s"],
           "ep_peak_mem_bytes": row["ep_peak_mem_bytes"],
           "zero3_peak_mem_bytes": row["zero3_peak_mem_bytes"],
           "all_to_all_bytes": measured["all_to_all_wire_bytes_per_step"],
           "all_to_all_formula_bytes": wire,
           "all_to_all_payload_bytes": measured["all_to_all_payload_bytes_per_step"],
           "all_to_all_formula_payload_bytes": payload,
           "ratio": row["ratio"], "mem_ratio": row["mem_ratio"],
           "first_step_loss_rel_diff": row["first_step_loss_rel_diff"],
           "per_round": {k: v for k, v in row.items() if k.endswith("per_round_tokens_per_s")},
           "config": {"model": model_cfg, "parameters": parameters, "small": args.small,
                      "global_batch": args.batch, "micro_batch": 1, "dtype": "fp32",
                      "optimizer": f"AdamW lr {LR}, clip {CLIP}", "torch": torch.__version__,
                      "backend": "gloo on 127.0.0.1", "threads_per_rank": 1}}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
