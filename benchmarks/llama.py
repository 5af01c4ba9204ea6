"""loomtrain against torch on a 33.6M-parameter Llama: DDP, ZeRO-3 / FSDP2 and tp 2, world 2.

    .venv/bin/python benchmarks/llama.py [--rounds 3] [--steps 2] [--warmup 2]  # ~3 min, 2 cores
    .venv/bin/python benchmarks/llama.py --small                               # smoke test

What is the same for both sides of every pair: loomtrain's Llama (`build_model` of a
`ModelConfig(name="llama")`: d_model 512, 8 layers, 8 heads, 4 kv heads, SwiGLU width 1536,
vocabulary 8192, untied head, seq_len 128; 33.6M parameters) built from one seed, so the same
initial weights; the same global batch at every step (benchmarks/tensor.py's `batch_at`, a
bigram source the model learns), the mean token loss over the global batch, backward, and
torch's AdamW (lr 1e-3, foreach) over the rank's parameters, all in fp32, world 2 on gloo at
127.0.0.1 with one thread per rank. No gradient clipping, no accumulation.

Pairs (loomtrain | torch; the torch side wraps the same model class itself):
- ddp:   `DataParallel` (gradient_reduce "mean") | `DistributedDataParallel`; each rank
         takes half of the global batch.
- zero3: `shard(..., stage=3, prefetch=1)` | `fully_shard` on every block, then the root
         (FSDP2, 1-D cpu DeviceMesh); half of the batch per rank.
- tp:    `parallelize_tensor(model, mesh)` (q/k/v and gate/up column-split, o/down row-split,
         kv heads split, embedding and head replicated: no vocab_parallel, so the head is the
         peer of torch's) | `parallelize_module` with ColwiseParallel on q/k/v/gate/up and
         RowwiseParallel on o/down (DTensor parameters); each rank runs the whole batch.

How (the scheme of benchmarks/ddp.py): every engine trains in its own world of two spawned
processes (`worlds.World`), one engine per process, so each process's peak RSS is that
engine's. A pair's two worlds live together and take turns, the idle one blocked on a queue,
in the order L T, T L, L T, ... so a drift of the machine's load falls on both alike; the
pairs run one after the other. Memory is the process's peak resident set size during the
timed steps (ru_maxrss, restarted after set-up by `worlds.reset_peak_rss`, with glibc's
mmap threshold pinned by `worlds.pin_mmap_threshold` so RSS follows the live tensors),
the max over ranks: the same measure on both sides (torch has no allocator statistics on CPU).

The last line on stdout is one JSON object (see `summarize`).
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel
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

from loomtrain.mesh import build_mesh
from loomtrain.models import build_model, token_loss_sum
from loomtrain.models.config import ModelConfig
from loomtrain.parallel.data import DataParallel
from loomtrain.parallel.tensor import parallelize_tensor
from loomtrain.parallel.zero import shard

WORLD = 2
MODEL = {"name": "llama", "vocab_size": 8192, "seq_len": 128, "d_model": 512, "n_layers": 8,
         "n_heads": 8, "n_kv_heads": 4}
SMALL_MODEL = {"name": "llama", "vocab_size": 256, "seq_len": 32, "d_model": 64, "n_layers": 2,
               "n_heads": 4, "n_kv_heads": 2}
PAIRS = {"ddp": ("loomtrain_ddp", "torch_ddp"), "zero3": ("loomtrain_zero3", "torch_fsdp2"),
         "tp": ("loomtrain_tp", "torch_tp")}
LR = 1e-3
MMAP_THRESHOLD_KIB = 128  # benchmarks/zero.py's default


def torch_tp_plan(model) -> dict:
    """torch's plan for the Llama's Megatron pairs. The attention reads its local head count
    from q/k/v's output widths, and a contiguous column split of k/v keeps whole kv heads, the
    ones rank r's contiguous query heads read (tp divides n_kv_heads)."""
    plan = {}
    for i in range(len(model.blocks)):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o_proj", "mlp.down_proj"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def wrap(engine: str, model):
    """(model, optimizer) of `engine`, the optimizer built over what the engine leaves."""
    if engine == "loomtrain_ddp":
        model = DataParallel(model, build_mesh({"dp": WORLD}), "dp")
    elif engine == "torch_ddp":
        model = DistributedDataParallel(model)
    elif engine == "loomtrain_zero3":
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        return shard(model, optimizer, build_mesh({"dp": WORLD}), 3, prefetch=1)
    elif engine == "torch_fsdp2":
        device_mesh = init_device_mesh("cpu", (WORLD,))
        for block in model.blocks:
            fully_shard(block, mesh=device_mesh)
        fully_shard(model, mesh=device_mesh)
    elif engine == "loomtrain_tp":
        model = parallelize_tensor(model, build_mesh({"tp": WORLD}))
    else:
        model = parallelize_module(model, init_device_mesh("cpu", (WORLD,)), torch_tp_plan(model))
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


class Trainer:
    """One rank of one engine's world, training from step 0 on."""

    def __init__(self, engine: str, model_cfg: dict, batch: int, seed: int):
        self.engine, self.batch, self.seed, self.step = engine, batch, seed, 0
        self.cfg = ModelConfig(**model_cfg)
        torch.manual_seed(seed)
        self.model, self.optimizer = wrap(engine, build_model(self.cfg))

    def _batch(self, step: int):
        """The global batch of `step`; a data-parallel rank keeps its half."""
        x, y = batch_at(step, self.seed, self.batch, self.cfg.seq_len, self.cfg.vocab_size)
        if self.engine.endswith("_tp"):
            return x, y
        rank, per_rank = dist.get_rank(), self.batch // WORLD
        return x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]

    def train(self, steps: int) -> float:
        """`steps` steps; the mean token loss of the last over the global batch (each
        data-parallel rank's mean over its equal share, averaged over the ranks)."""
        for _ in range(steps):
            x, y = self._batch(self.step)
            loss = token_loss_sum(self.model(x), y) / y.numel()
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return float(mean) / WORLD

    def timed_round(self, steps: int) -> dict:
        dist.barrier()
        t0, cpu0 = time.perf_counter(), time.process_time()
        loss = self.train(steps)  # its loss all-reduce closes the round on both ranks
        cpu_s = time.process_time() - cpu0
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        tokens = steps * self.batch * self.cfg.seq_len
        return {"tokens_per_s": tokens / float(elapsed), "step_s": float(elapsed) / steps,
                "cpu_s_per_step": cpu_s / steps, "last_step_loss": loss,
                "peak_mem_bytes": peak_rss_bytes()}


def _rank_main(rank: int, engine: str, port: int, model_cfg: dict, batch: int, seed: int,
               warmup: int, commands: list, results) -> None:
    """A spawned rank: set up, report the first step's loss, warm up, restart the peak RSS,
    then run ("round", steps) commands until None."""
    pin_mmap_threshold(MMAP_THRESHOLD_KIB)
    with joined_world(rank, WORLD, port):
        trainer = Trainer(engine, model_cfg, batch, seed)
        first_loss = trainer.train(1)
        if warmup > 1:
            trainer.train(warmup - 1)
        results.put((rank, {"first_step_loss": first_loss, "peak_reset": reset_peak_rss()}))
        serve_commands(rank, commands, results, {"round": trainer.timed_round})
        dist.barrier()  # before destroy: avoids an intermittent abort (DESIGN.md)


def run_pair(pair: tuple[str, str], args, model_cfg: dict, start: float) -> tuple[dict, dict]:
    """The two worlds of a pair, set up side by side, then `args.rounds` rounds each in turns
    (L T, T L, ...); returns (rounds per engine, first-step figures per engine)."""
    with closing_worlds({}) as worlds:
        for e in pair:
            worlds[e] = World(e, WORLD, _rank_main, (e, free_port(), model_cfg, args.batch,
                                                     args.seed, args.warmup), args.timeout_s)
        return take_turns(worlds, args.rounds, args.steps, "", start)


def summarize(results: dict, args, model_cfg: dict, parameters: int) -> dict:
    """Per pair: medians of tokens/s, the median of the pair ratios loomtrain / torch (round i
    of both ran next to each other), peak memory (the last round's: it only grows), first-
    and last-step losses and whether the targets (ratio >= 1 at no more memory) are met."""
    out = {"benchmark": "llama", "world": WORLD, "date": datetime.date.today().isoformat(),
           "cpu_count": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()],
           "rounds": args.rounds, "steps": args.steps, "warmup_steps": args.warmup}
    targets = {}
    for name, (lt, tt) in PAIRS.items():
        rounds, first = results[name]
        figures = pair_figures(rounds, first, lt, tt)
        for key in ("ratio", "mem_ratio", "first_step_loss_rel_diff"):  # named by the pair
            figures[f"{name}_{key}"] = figures.pop(key)
        out.update(figures)
        targets[f"{name}_ratio_ge_1"] = out[f"{name}_ratio"] >= 1.0
        targets[f"{name}_mem_le_torch"] = out[f"{name}_mem_ratio"] <= 1.0
    out["targets"] = targets
    out["config"] = {"model": model_cfg, "parameters": parameters, "small": args.small,
                     "global_batch": args.batch, "tokens_per_step": args.batch * model_cfg["seq_len"],
                     "seed": args.seed, "optimizer": f"AdamW lr {LR} (torch defaults: foreach)",
                     "dtype": "fp32", "backend": "gloo on 127.0.0.1", "threads_per_rank": 1,
                     "memory": "peak RSS during the timed steps (reset after set-up), max over "
                               "ranks, mmap threshold pinned at 128 KiB",
                     "peak_reset_after_setup": all(f["peak_reset"] for _, first in results.values()
                                                   for f in first.values()),
                     "torch": torch.__version__}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps at the start of each world (the first: the loss check)")
    parser.add_argument("--batch", type=int, default=4, help="global batch, in sequences")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small", action="store_true", help="a tiny Llama (the smoke test)")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="fail if a world gives no result for this long")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 1 or args.batch % WORLD:
        parser.error("--rounds, --steps and --warmup must be at least 1 (the first step is the "
                     f"loss check, and it is never timed), --batch a multiple of {WORLD}")
    model_cfg = SMALL_MODEL if args.small else MODEL
    with torch.device("meta"):
        parameters = sum(p.numel() for p in build_model(ModelConfig(**model_cfg)).parameters())
    load_avg_start = [round(x, 2) for x in os.getloadavg()]
    start = time.perf_counter()
    results = {name: run_pair(pair, args, model_cfg, start) for name, pair in PAIRS.items()}
    out = summarize(results, args, model_cfg, parameters)
    out["wall_s"] = time.perf_counter() - start
    out["load_avg_start"] = load_avg_start  # load_avg (1, 5, 15 min) is at the end: ours included
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
