"""loomtrain against torch's own composition of the same 3-D layout, world 8: dp2 x tp2 x pp2
and ZeRO-3 x tp2 x pp2 on a Llama (issue 28).

    .venv/bin/python benchmarks/weave.py [--rounds 3] [--steps 2] [--warmup 2]   # ~6 min, 2 cores
    .venv/bin/python benchmarks/weave.py --small                               # smoke test

What is the same on both sides: loomtrain's Llama (`build_model` of a `ModelConfig(name=
"llama")`: d_model 256, 8 layers, 8 heads, 4 kv heads, vocabulary 8192, untied head, seq_len
128; 10.0M parameters) built from one seed; the mesh (pp outermost, then dp, tp innermost:
ranks 0-3 hold stage 0); the split (embedding and blocks 0-3 on stage 0, blocks 4-7, the
final norm and the head on stage 1); the global batch of every step (benchmarks/tensor.py's
`batch_at`), each dp rank's half of it in micro-batches of one sequence under 1F1B; the loss
(the token-summed cross entropy over the step's tokens); gradients clipped to norm 1.0 over
the whole model; torch's AdamW (lr 1e-3, foreach) over the rank's parameters; fp32, gloo on
127.0.0.1, one thread per rank.

The two sides (each engine in its own world of 8 spawned processes, `worlds.World`; the two
worlds take turns L T, T L, ... as in benchmarks/llama.py):
- loomtrain: the library's own path, what `loom train` builds (`train.apply.build` of a
  Config with parallel.pp=2, tp=2, schedule="1f1b" and zero_stage 0 or 3), one step being
  `train.trainer.step` (the pipeline runtime over the tensor-parallel stages, the gradient
  engine over dp: DataParallel, or ZeRO-3 holding the step: units gathered once per step and
  reduce-scattered once, parallel/zero/engine.py `pipelined`).
- torch, the way TorchTitan composes them: this rank's stage (a copy of its layers) made
  tensor-parallel by `parallelize_module` over the tp mesh (embedding RowwiseParallel, q/k/v
  and gate/up ColwiseParallel, o/down RowwiseParallel, head ColwiseParallel with its logits
  left sharded over the vocabulary and the loss computed under `loss_parallel`, as
  TorchTitan's), then `fully_shard` on every block and on the stage over the dp mesh with
  reshard_after_forward=False (TorchTitan's default under pipeline parallelism), then a
  `PipelineStage` under `Schedule1F1B`. FSDP2 averages the gradients over dp, so each dp rank
  divides its loss by its own tokens: the same gradient as loomtrain's sum of losses divided
  by the global batch's tokens (the clip's norms agree: 4.0378 on the first step). For
  dp2 x tp2 x pp2 the dp mesh is FSDP2's HSDP mesh of 2 replicas x 1 shard: replicated
  parameters and all-reduced gradients, DDP's layout (TorchTitan refuses torch DDP with tp or
  pp). The clip: the norm of the DTensor gradients,
  squared and summed over pp, as TorchTitan's `clip_grad_norm_`.

Memory is the process's peak RSS during the timed steps, max over ranks (benchmarks/
llama.py). loomtrain's wire bytes per step per axis are its meter's (rank 0, one timed step).
The last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
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

from loomtrain.models import build_model, token_loss_sum
from loomtrain.models.config import ModelConfig

WORLD, PP, DP, TP = 8, 2, 2, 2
MODEL = {"name": "llama", "vocab_size": 8192, "seq_len": 128, "d_model": 256, "n_layers": 8,
         "n_heads": 8, "n_kv_heads": 4}
SMALL_MODEL = {"name": "llama", "vocab_size": 256, "seq_len": 32, "d_model": 64, "n_layers": 2,
               "n_heads": 4, "n_kv_heads": 2}
LAYOUTS = {"dp2_tp2_pp2": 0, "zero3_tp2_pp2": 3}  # name -> ZeRO stage
LR, CLIP = 1e-3, 1.0
MMAP_THRESHOLD_KIB = 128


# --- loomtrain ----------------------------------------------------------------------------------

def loomtrain_side(model_cfg: dict, zero_stage: int, batch: int, seed: int):
    """(built, step function) of loomtrain's layout, as `loom train` builds it."""
    from loomtrain.train import trainer
    from loomtrain.train.apply import build
    from loomtrain.train.config import config_from_dict
    from loomtrain.train.launch import init_distributed

    cfg = config_from_dict({
        "model": model_cfg,
        "train": {"global_batch": batch, "micro_batch": 1, "lr": LR, "grad_clip": CLIP},
        "parallel": {"nproc": WORLD, "pp": PP, "tp": TP, "zero_stage": zero_stage,
                     "schedule": "1f1b"}})
    mesh = init_distributed(cfg)
    torch.manual_seed(seed)
    built = build(build_model(cfg.model), mesh, cfg,
                  lambda m: torch.optim.AdamW(m.parameters(), lr=LR))
    dp = mesh.local_rank("dp")

    def step(x, y) -> torch.Tensor:
        rows = x[dp * batch // DP:(dp + 1) * batch // DP]
        targets = y[dp * batch // DP:(dp + 1) * batch // DP]
        batches = [(rows[i:i + 1], targets[i:i + 1]) for i in range(len(rows))]
        loss_sum, _, _ = trainer.step(built, batches, float(y.numel()), CLIP)
        return loss_sum
    return built, step


# --- torch --------------------------------------------------------------------------------------

class LlamaStage(nn.Module):
    """Layers [start, end) of the Llama's [embed, block 0, ..., block n-1, head]: the stage
    keeps them (the whole model's other layers dropped), and runs them in order."""

    def __init__(self, model, start: int, end: int):
        super().__init__()
        n = len(model.blocks)
        self.tok_emb = model.tok_emb if start == 0 else None
        self.blocks = nn.ModuleList(model.blocks[max(start, 1) - 1:min(end, n + 1) - 1])
        last = end == n + 2
        self.ln_f, self.head = (model.ln_f, model.head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            x = self.tok_emb(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def torch_tp(stage: LlamaStage, tp_mesh) -> LlamaStage:
    """TorchTitan's tensor-parallel plan of the Llama, on this stage's layers."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {}
    if stage.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if stage.head is not None:
        plan["head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    for i in range(len(stage.blocks)):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o_proj", "mlp.down_proj"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(stage, tp_mesh, plan)


def torch_side(model_cfg: dict, zero_stage: int, batch: int, seed: int):
    """(stage module, step function) of torch's composition of the same layout."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import loss_parallel

    shard = DP if zero_stage == 3 else 1
    mesh = init_device_mesh("cpu", (PP, DP // shard, shard, TP),
                            mesh_dim_names=("pp", "replicate", "shard", "tp"))
    pp_rank = mesh.get_local_rank("pp")
    torch.manual_seed(seed)
    model = build_model(ModelConfig(**model_cfg))
    n = len(model.blocks)
    bounds = [0, 1 + n // 2, n + 2]
    stage = torch_tp(LlamaStage(model, bounds[pp_rank], bounds[pp_rank + 1]), mesh["tp"])
    dp_mesh = mesh["replicate", "shard"]
    for block in stage.blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False)
    tokens = batch * model_cfg["seq_len"]
    # FSDP2 averages gradients over dp (a divide factor of 1 needs PREMUL_SUM, which gloo
    # lacks): each dp rank divides by its own tokens, so the mean is the global batch's gradient
    rank_tokens = tokens // DP

    def loss_fn(logits, y):
        # under the step's loss_parallel (a nested one would switch it off on leaving); the
        # schedule's backward seeds a plain tensor: the loss leaves the DTensor world here
        return token_loss_sum(logits, y).to_local() / rank_tokens

    micro = batch // DP
    pipe = Schedule1F1B(PipelineStage(stage, pp_rank, PP, torch.device("cpu"),
                                      group=mesh.get_group("pp")),
                        n_microbatches=micro, loss_fn=loss_fn, scale_grads=False)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=LR)
    dp = mesh.get_local_rank("replicate") * shard + mesh.get_local_rank("shard")
    first, last = pp_rank == 0, pp_rank == PP - 1

    def step(x, y) -> torch.Tensor:
        rows, targets = x[dp * micro:(dp + 1) * micro], y[dp * micro:(dp + 1) * micro]
        losses: list[torch.Tensor] = []
        with loss_parallel():  # the backward of the vocabulary-parallel loss too
            pipe.step(*((rows,) if first else ()), target=targets if last else None,
                      losses=losses if last else None)
        clip(stage, mesh)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not last:
            return torch.zeros(())
        return sum(losses).detach() * rank_tokens
    return stage, step


def clip(stage: nn.Module, mesh) -> None:
    """TorchTitan's clip under pipeline parallelism: the norm of the stage's DTensor gradients
    (summed over dp and tp by DTensor; the norms' weights, sharded over dp only, live on
    another mesh: one norm per mesh), its square summed over pp, then the clip."""
    by_mesh: dict = {}
    for p in stage.parameters():
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p)
    square = sum(torch.nn.utils.get_total_norm([p.grad for p in ps]).full_tensor().pow(2)
                 for ps in by_mesh.values())
    dist.all_reduce(square, group=mesh.get_group("pp"))
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, CLIP, square.sqrt())


# --- one rank of one engine ---------------------------------------------------------------------

class Trainer:
    def __init__(self, engine: str, model_cfg: dict, zero_stage: int, batch: int, seed: int):
        self.engine, self.model_cfg, self.batch, self.seed, self.step_i = engine, model_cfg, batch, seed, 0
        side = loomtrain_side if engine == "loomtrain" else torch_side
        self.model, self._step = side(model_cfg, zero_stage, batch, seed)

    def train(self, steps: int) -> float:
        """`steps` steps; the mean token loss of the last over the global batch."""
        for _ in range(steps):
            x, y = batch_at(self.step_i, self.seed, self.batch, self.model_cfg["seq_len"],
                            self.model_cfg["vocab_size"])
            loss_sum = self._step(x, y).double()
            self.step_i += 1
        total = loss_sum.reshape(1).clone()
        dist.all_reduce(total)  # the last stage's dp ranks hold the loss sums
        return float(total) / (self.batch * self.model_cfg["seq_len"] * TP)

    def timed_round(self, steps: int) -> dict:
        dist.barrier()
        wire = _wire_bytes(self.model) if self.engine == "loomtrain" else None
        t0 = time.perf_counter()
        loss = self.train(steps)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        out = {"tokens_per_s": steps * self.batch * self.model_cfg["seq_len"] / float(elapsed),
               "step_s": float(elapsed) / steps, "last_step_loss": loss,
               "peak_mem_bytes": peak_rss_bytes()}
        if wire is not None:
            after = _wire_bytes(self.model)
            out["wire_bytes_per_step"] = {a: (after.get(a, 0) - b) // steps for a, b in
                                          {**dict.fromkeys(after, 0), **wire}.items()}
        return out


def _wire_bytes(built) -> dict[str, int]:
    """loomtrain's meter on this rank: wire bytes so far, per axis."""
    meter = built.mesh.meter
    return {axis: meter.total("wire_bytes", axis=axis) for axis in ("dp", "tp", "pp", "world")}


def _rank_main(rank: int, engine: str, port: int, model_cfg: dict, zero_stage: int, batch: int,
               seed: int, warmup: int, commands: list, results) -> None:
    pin_mmap_threshold(MMAP_THRESHOLD_KIB)
    # what torchrun sets, and `init_distributed` reads: one thread per rank of the host
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    with joined_world(rank, WORLD, port):
        trainer = Trainer(engine, model_cfg, zero_stage, batch, seed)
        first_loss = trainer.train(1)
        if warmup > 1:
            trainer.train(warmup - 1)
        results.put((rank, {"first_step_loss": first_loss, "peak_reset": reset_peak_rss()}))
        serve_commands(rank, commands, results, {"round": trainer.timed_round})
        dist.barrier()  # before destroy: avoids an intermittent abort (DESIGN.md)


def run_layout(zero_stage: int, args, model_cfg: dict, start: float) -> tuple[dict, dict]:
    """Both engines' worlds of one layout side by side, `args.rounds` rounds in turns."""
    with closing_worlds({}) as worlds:
        for e in ("loomtrain", "torch"):
            worlds[e] = World(e, WORLD, _rank_main, (e, free_port(), model_cfg, zero_stage,
                                                     args.batch, args.seed, args.warmup),
                              args.timeout_s)
        return take_turns(worlds, args.rounds, args.steps, f"zero {zero_stage} ", start)


def summarize(results: dict, args, model_cfg: dict, parameters: int) -> dict:
    out = {"benchmark": "weave", "world": WORLD, "date": datetime.date.today().isoformat(),
           "cpu_count": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()],
           "rounds": args.rounds, "steps": args.steps, "warmup_steps": args.warmup}
    targets = {}
    for name, (rounds, first) in results.items():
        row = pair_figures(rounds, first, "loomtrain", "torch")
        row["loomtrain_wire_bytes_per_step"] = rounds["loomtrain"][-1]["wire_bytes_per_step"]
        targets[f"{name}_ratio_ge_1"] = row["ratio"] >= 1.0
        targets[f"{name}_mem_le_torch"] = row["mem_ratio"] <= 1.0
        out[name] = row
    main = out[next(iter(results))]  # dp2 x tp2 x pp2: the top-level fields
    for key in ("loomtrain_tokens_per_s", "torch_tokens_per_s", "loomtrain_peak_mem_bytes",
                "torch_peak_mem_bytes", "loomtrain_wire_bytes_per_step"):
        out[key] = main[key]
    out["targets"] = targets
    out["config"] = {"model": model_cfg, "parameters": parameters, "small": args.small,
                     "global_batch": args.batch, "micro_batch": 1, "schedule": "1f1b",
                     "tokens_per_step": args.batch * model_cfg["seq_len"], "seed": args.seed,
                     "optimizer": f"AdamW lr {LR}, clip {CLIP}", "dtype": "fp32",
                     "backend": "gloo on 127.0.0.1", "threads_per_rank": 1,
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
    parser.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small", action="store_true", help="a tiny Llama (the smoke test)")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="fail if a world gives no result for this long")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 1 or args.batch % (2 * DP):
        parser.error("--rounds, --steps and --warmup must be at least 1 (the first step is the "
                     f"loss check, never timed), --batch a multiple of {2 * DP} (two micro-batches "
                     "per dp rank at least: 1F1B over 2 stages)")
    model_cfg = SMALL_MODEL if args.small else MODEL
    with torch.device("meta"):
        parameters = sum(p.numel() for p in build_model(ModelConfig(**model_cfg)).parameters())
    start = time.perf_counter()
    results = {name: run_layout(z, args, model_cfg, start) for name, z in LAYOUTS.items()}
    out = summarize(results, args, model_cfg, parameters)
    out["wall_s"] = time.perf_counter() - start
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
