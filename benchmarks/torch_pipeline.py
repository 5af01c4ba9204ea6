"""The torch peer of benchmarks/pipeline.py: torch.distributed.pipelining on loomtrain's GPT.

    .venv/bin/python benchmarks/torch_pipeline.py   # 2 gloo ranks, ~30 s

prints one JSON line: tokens/s of gpipe, 1f1b, interleaved (V = 2), zb-h1 (V = 2) and
zb-h1_v1 (V = 1) on a small GPT (d_model 128, 4 layers, seq 64, 8 microbatches of 4).

`measure_torch(rank, world, schedule=...)` runs inside an initialized gloo world (every rank
calls it) and returns the tokens/s of one of torch's schedules on a GPT cut into
world x virtual_stages stages, stage s on rank s % world (Megatron's interleaved placement,
the one loomtrain's schedules use):

| loomtrain's name | torch 2.13 class                | stages per rank                       |
|------------------|---------------------------------|---------------------------------------|
| gpipe            | ScheduleGPipe                   | 1 (a PipelineScheduleSingle)          |
| 1f1b             | Schedule1F1B                    | 1; refuses microbatches < stages      |
| interleaved      | ScheduleInterleaved1F1B         | any V; microbatches % rounds == 0,    |
|                  |                                 | rounds = max(1, microbatches // pp)   |
| zb-h1            | ScheduleInterleavedZeroBubble   | any V; same rule as interleaved       |

What torch 2.13 offers for zero bubble (arXiv 2401.10241), and why the choice above:
ScheduleInterleavedZeroBubble (the backward split into I, the input gradient, and W, the
weight gradient, with PipelineStage's default split of autograd) on the interleaved
placement, any V. At V = 1 its order is ZB-H1's (read from torch's `_get_1f1b_rank_ops`,
pp = 4): rank r runs 1F1B's pp - 1 - r warm-up forwards, then F I pairs, its W's r
microbatches behind its I's, the rest in the cool-down, so every rank holds at most pp
microbatches' activations, 1F1B's peak. ScheduleZBVZeroBubble (the paper's ZB-V) and
ScheduleDualPipeV (DeepSeek-V3) need exactly 2 stages per rank on the V placement (rank r
holds stages r and 2 pp - 1 - r), not the interleaved one, so they are not a peer of the
same split (both run here on gloo with that placement and give the single-process loss,
probed once).
ScheduleLoopedBFS is the breadth-first loop over local stages (no 1F1B steady state).

The model: `gpt_stage_modules` cuts the layer sequence [embed, block 0, ..., block n-1, head]
at `bounds`, each stage a deep copy owning its parameters. The GPT ties its head to the
token embedding; here the first and the last stage each hold a copy of that weight and
nothing keeps the two in step, so after the first optimizer step the peer trains the untied
model (torch's pipelining has no tied-weight support; its users all-reduce the two gradients
themselves). Its first step computes the tied GPT's loss, to fp32 rounding
(tests/test_benchmark_torch_pipeline.py).

The loss: token-summed cross entropy (`loomtrain.models.token_loss_sum`) over each
microbatch, divided by the tokens of the whole step (microbatches x micro_batch x seq_len),
with `scale_grads=False`: the microbatches' losses add up to the mean token loss of the step
and the gradients to its gradient, as in a single-process step over the whole batch.

What is timed, per rank: from a barrier, `steps` steps, each `schedule.step(inputs on the
rank of stage 0, target on the rank of the last stage)` (the torch schedule splits the
batch into microbatches, runs forward and backward with its point-to-point sends), then
AdamW (lr 1e-3, torch's defaults) over the rank's stage parameters and `zero_grad`. The
`warmup` steps before are untimed; the first of them also infers the stages' input and
output shapes (dynamic metadata inference: one exchange of tensor metadata between
neighbouring stages). `tokens_per_s` = steps x tokens per step / the slowest rank's time;
`step_s` = the median over steps of the slowest rank's step time. Batches are random tokens
(`token_batch`), a new one per step from a fixed seed, the same on every rank.
"""

from __future__ import annotations

import copy
import json
import statistics
import time

import torch
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from loomtrain import comm
from loomtrain.mesh import build_mesh
from loomtrain.models import GPT, token_loss_sum

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "interleaved": ScheduleInterleaved1F1B, "zb-h1": ScheduleInterleavedZeroBubble}
SINGLE_STAGE = {"gpipe", "1f1b"}  # torch's PipelineScheduleSingle: one stage per rank
LR = 1e-3
MODEL_SEED, DATA_SEED = 0, 1


class GPTStage(nn.Module):
    """Layers [start, end) of the GPT's sequence [embed, block 0, ..., block n-1, head],
    deep-copied so that the stage owns its parameters."""

    def __init__(self, model: GPT, start: int, end: int):
        super().__init__()
        n = len(model.blocks)
        first, last = start == 0, end == n + 2
        # copied one by one: the head's weight is the embedding's, and each copy gets its own
        self.tok_emb = copy.deepcopy(model.tok_emb) if first else None
        self.pos_emb = copy.deepcopy(model.pos_emb) if first else None
        self.drop = copy.deepcopy(model.drop) if first else None
        self.blocks = copy.deepcopy(model.blocks[max(start, 1) - 1:min(end, n + 1) - 1])
        self.ln_f = copy.deepcopy(model.ln_f) if last else None
        self.head = copy.deepcopy(model.head) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (b, t) on the first stage, the hidden (b, t, d) after; logits on the last."""
        if self.tok_emb is not None:  # GPT.embed at position 0
            x = self.drop(self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def gpt_stage_modules(model: GPT, bounds: list[int]) -> list[GPTStage]:
    """One module per stage, stage i holding layers bounds[i]:bounds[i+1] of
    [embed, block 0, ..., block n-1, head]."""
    layers = len(model.blocks) + 2
    assert bounds[0] == 0 and bounds[-1] == layers, (bounds, layers)
    assert all(a < b for a, b in zip(bounds, bounds[1:])), f"empty stage in {bounds}"
    return [GPTStage(model, a, b) for a, b in zip(bounds, bounds[1:])]


def even_bounds(n_layers: int, stages: int) -> list[int]:
    """Blocks split as evenly as whole blocks allow, the embedding with the first stage and
    the head with the last."""
    assert n_layers >= stages, f"{n_layers} blocks cannot fill {stages} stages"
    return [0] + [1 + i * n_layers // stages for i in range(1, stages)] + [n_layers + 2]


def token_batch(model_cfg: dict, rows: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of step `step`, each (rows, seq_len): random tokens from a seed
    fixed per step, the targets the inputs shifted by one."""
    tokens = torch.randint(0, model_cfg["vocab_size"], (rows, model_cfg["seq_len"] + 1),
                           generator=torch.Generator().manual_seed(DATA_SEED * 1_000_003 + step))
    return tokens[:, :-1], tokens[:, 1:]


def build_schedule(name: str, stages: list[PipelineStage], microbatches: int, loss_fn):
    """torch's schedule `name` over this rank's stages (one for the single-stage ones)."""
    cls = SCHEDULES[name]
    if name in SINGLE_STAGE:
        # given a list, torch fails late: "'list' object has no attribute 'num_stages'"
        if len(stages) != 1:
            raise ValueError(f"torch's {cls.__name__} runs one stage per rank, not {len(stages)}")
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def measure_torch(rank: int, world: int, *, schedule: str, microbatches: int,
                  virtual_stages: int, model_cfg: dict, micro_batch: int, steps: int,
                  warmup: int, bounds: list[int] | None = None, mesh=None) -> dict:
    """tokens/s of torch's `schedule` on this world (see the module docstring for what is
    timed). `bounds` (default `even_bounds`) cuts the GPT into world x virtual_stages stages.
    `mesh` (built if None) carries only the barrier and the timing reductions. Returns
    `tokens_per_s`, `step_s` and `losses` (the step losses, warm-up included, on every rank),
    or, where torch refuses the configuration, `tokens_per_s` None and torch's `error`."""
    assert schedule in SCHEDULES, f"schedule {schedule!r} not in {sorted(SCHEDULES)}"
    mesh = mesh or build_mesh({"pp": world})
    n_stages = world * virtual_stages
    torch.manual_seed(MODEL_SEED)  # every rank builds the same weights
    model = GPT(**model_cfg)
    modules = gpt_stage_modules(model, bounds or even_bounds(model_cfg["n_layers"], n_stages))
    assert len(modules) == n_stages, (len(modules), n_stages)
    own = range(rank, n_stages, world)
    stages = [PipelineStage(modules[s], s, n_stages, torch.device("cpu")) for s in own]
    rows = microbatches * micro_batch
    tokens_per_step = rows * model_cfg["seq_len"]
    loss_fn = lambda logits, y: token_loss_sum(logits, y) / tokens_per_step  # noqa: E731
    try:
        # refusals are raised here, the same on every rank (pure checks of the arguments)
        pipe = build_schedule(schedule, stages, microbatches, loss_fn)
    except (ValueError, AssertionError, NotImplementedError) as err:
        return {"tokens_per_s": None, "step_s": None, "error": f"{type(err).__name__}: {err}"}
    optimizer = torch.optim.AdamW([p for s in own for p in modules[s].parameters()], lr=LR)
    has_first, has_last = 0 in own, n_stages - 1 in own
    losses, step_s = [], []

    def train_step(i: int) -> None:
        x, y = token_batch(model_cfg, rows, i)
        mb_losses: list[torch.Tensor] = []
        pipe.step(*((x,) if has_first else ()), target=y if has_last else None,
                  losses=mb_losses if has_last else None, return_outputs=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(sum(mb_losses).detach()) if has_last else 0.0)

    for i in range(warmup):
        train_step(i)
    comm.barrier(mesh)
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        t0 = time.perf_counter()
        train_step(i)
        step_s.append(time.perf_counter() - t0)
    timed = torch.tensor([time.perf_counter() - start] + step_s, dtype=torch.float64)
    comm.all_reduce(timed, mesh, "world", op="max")  # the slowest rank's times
    shared = torch.tensor(losses, dtype=torch.float64)
    comm.broadcast(shared, mesh, "world", src_local=(n_stages - 1) % world)
    return {"tokens_per_s": steps * tokens_per_step / float(timed[0]),
            "step_s": statistics.median(timed[1:].tolist()), "losses": shared.tolist()}


# --- the script: the four schedules in one 2-rank world ----------------------------------------

WORLD = 2
MODEL = {"vocab_size": 256, "seq_len": 64, "d_model": 128, "n_layers": 4, "n_heads": 4}
# (label, schedule, virtual stages); zb-h1_v1: torch's zero bubble at V = 1, ZB-H1's order
RUNS = (("gpipe", "gpipe", 1), ("1f1b", "1f1b", 1), ("interleaved", "interleaved", 2),
        ("zb-h1", "zb-h1", 2), ("zb-h1_v1", "zb-h1", 1))


def _measure_in_world(rank: int, world: int, mesh, **kwargs) -> dict:
    """`worlds.tp_rank`'s measure: its mesh's world axis serves for the timing collectives."""
    return measure_torch(rank, world, mesh=mesh, **kwargs)


def main() -> dict:
    from worlds import World, closing_worlds, free_port, tp_rank

    start = time.perf_counter()
    common = {"microbatches": 8, "model_cfg": MODEL, "micro_batch": 4, "steps": 8, "warmup": 2}
    out = {"benchmark": "torch_pipeline", "world": WORLD,
           "config": {**common, "torch": torch.__version__}}
    with closing_worlds({}) as worlds:
        worlds["torch"] = World("torch", WORLD, tp_rank,
                                (WORLD, free_port(), _measure_in_world), timeout_s=300)
        for label, name, v in RUNS:
            r = worlds["torch"].command({"schedule": name, "virtual_stages": v, **common})[0]
            out[label] = {"virtual_stages": v, **{k: r[k] for k in r if k != "losses"}}
            if r["tokens_per_s"] is not None:
                out[label]["first_step_loss"] = r["losses"][0]
    out["wall_s"] = time.perf_counter() - start
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
