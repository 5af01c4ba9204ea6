"""loomtrain's pipeline schedules against torch.distributed.pipelining's, in one run.

    .venv/bin/python benchmarks/pipeline.py [--pp 2] [--rounds 5] [--steps 3] [--warmup 1]
    .venv/bin/python benchmarks/pipeline.py --timeline-dir DIR  # also each schedule's Gantt chart
    .venv/bin/python benchmarks/pipeline.py --small             # smoke test: tiny GPT, one round

Other options: `--schedules 1f1b,zb-h1` (a subset), `--layers`, `--microbatches`,
`--micro-batch`, `--timeout-s`. Progress goes to stderr, a line per schedule and round.

The same for both engines: one world of `pp` spawned gloo ranks on 127.0.0.1 (one torch thread
each), loomtrain's GPT (tied head, fp32; d_model 128, 4 heads, seq_len 128, vocab 256,
n_layers 2 x pp so that pp x 2 virtual stages have a block each) from one seed, cut at the
stage bounds loomtrain's `split_model` chooses (balanced by parameters; torch's stages get
the same `bounds`), stage s on rank s % pp; M = 8 microbatches of 4 sequences, random
tokens from a fixed seed per step (`torch_pipeline.token_batch`); the loss token-summed and
divided by the step's tokens; AdamW (lr 1e-3, torch's defaults) over the rank's parameters.

| loomtrain's schedule | torch's peer (torch_pipeline.py)                      |
|----------------------|-------------------------------------------------------|
| gpipe                | ScheduleGPipe                                         |
| 1f1b                 | Schedule1F1B                                          |
| interleaved (V = 2)  | ScheduleInterleaved1F1B, V = 2                        |
| zb-h1                | ScheduleInterleavedZeroBubble at V = 1: ZB-H1's order |
| optimal              | none (OptPipe's MILP plan under ZB-H1's memory)       |

Where loomtrain does more: it sums the tied embedding/head gradient over pp every step (one
all-reduce of vocab x d_model; torch's peer trains the untied model, torch_pipeline.py), and
its dp engine (over a dp axis of size 1) reduces nothing but points the gradients back at
its buckets.

What is timed (`tokens_per_s`, both engines alike): on each rank, from a barrier, `steps`
steps, each the schedule's forward and backward of the M microbatches with their sends and
receives, then `optimizer.step()` and `zero_grad()`; the slowest rank's time counts.
`warmup` steps before are untimed (torch infers its stage shapes in the first). Rounds go
ours, torch, ours, torch, ... schedule by schedule, the pair reversed every other round, so a
pair sees (nearly) the same load; `ratio` is the median over rounds of ours over torch's
tokens/s in the same pair, the tokens/s medians over rounds.

What is not timed: one more step per round with the runtime recording every action's span
(`runtime.spans`, gathered over pp); from it, the schedule's bubble:
- `bubble_measured`: `timeline.measured_bubble` (idle share of the ranks over the forward/
  backward phase), the median over rounds; the other figures below come from that round;
- `bubble_theory`: the closed form (`schedules.bubble_theory`) with uniform stages and the
  papers' F = I = W, B = 2F; `bubble_theory_measured_times` the same with the step's mean
  F, B, I and W durations (only zb-h1's formula depends on them);
- `bubble_simulated`: `schedules.simulate` replaying the step's own compute durations, each
  action its measured span, with free, instant communication: the bubble of this stage
  imbalance alone; measured - simulated is what communication and the runtime cost;
- `compute_ms`: an F's, B's, I's, W's duration (mean over stages); `step_ms`: the phase and, per rank, its
  work, its waits for receives, its gradient sync and its idle time in the phase;
- `peak_activation_bytes`: the runtime's stash peak (`stash.peak_bytes`), max over ranks.

`peak_activation_bytes` (top level): gpipe, which stashes all M microbatches on every rank,
one step each: as is, with every microbatch's activations offloaded (fraction 1.0, reloaded
one compute ahead of its backward), and with full recomputation (only stage inputs kept).

`optimal` (OptPipe's plan, parallel/pipeline/optimal.py) is planned with ZB-H1's measured
peak activation bytes as its memory budget; `optimal_vs_zb_h1` sets the two side by side:
peak bytes, bubble measured and simulated, idle rank-milliseconds of the recorded step.

The last line on stdout is one JSON object: `schedules` {name: the figures above, with
`torch_tokens_per_s` and `ratio` null where torch has no peer}, `peak_activation_bytes`,
`optimal_vs_zb_h1`, `config`. `--timeline-dir` also writes, per schedule, the recorded step
of the median-bubble round as pipeline_timeline_NAME.json and its Gantt chart as .png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch_pipeline import LR, MODEL_SEED, measure_torch, token_batch
from torch_pipeline import SCHEDULES as TORCH_SCHEDULES
from worlds import World, closing_worlds, free_port, joined_world, serve_commands

from loomtrain import comm
from loomtrain.mesh import build_mesh
from loomtrain.models import GPT, token_loss_sum
from loomtrain.parallel.data import apply_data_parallel
from loomtrain.parallel.pipeline import (
    apply_pipeline,
    build_schedule,
    schedules,
    split_model,
)
from loomtrain.parallel.pipeline.optimal import compare
from loomtrain.parallel.pipeline.runtime import PipelineRuntime
from loomtrain.timeline import WORK_KINDS, measured_bubble
from loomtrain.train.config import Config, config_from_dict

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "optimal")
VIRTUAL_STAGES = 2  # of interleaved; every other schedule runs one stage per rank
MODEL = {"vocab_size": 256, "seq_len": 128, "d_model": 128, "n_heads": 4}
SMALL_MODEL = {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_heads": 2}
OFFLOAD_SCHEDULE, OFFLOAD_FRACTION = "gpipe", 1.0


@dataclass(frozen=True)
class Setup:
    """What every engine and round shares: the world, the model, the batch, the step counts."""
    pp: int
    model_cfg: dict
    micro_batch: int
    microbatches: int
    steps: int
    warmup: int

    @property
    def tokens_per_step(self) -> int:
        return self.microbatches * self.micro_batch * self.model_cfg["seq_len"]

    def config(self, schedule: str, offload: float = 0.0, recompute: str = "none",
               budget_bytes: float | None = None) -> Config:
        v = VIRTUAL_STAGES if schedule == "interleaved" else 1
        budget = {"activation_budget_mb": budget_bytes / 2**20} if budget_bytes else {}
        return config_from_dict({
            "model": self.model_cfg,
            "train": {"global_batch": self.microbatches * self.micro_batch,
                      "micro_batch": self.micro_batch, "lr": LR},
            "parallel": {"nproc": self.pp, "pp": self.pp, "schedule": schedule,
                         "virtual_stages": v, "offload_activations": offload,
                         "recompute": recompute, **budget}})


# --- one rank ----------------------------------------------------------------------------------


class OurPipeline:
    """One rank's loomtrain pipeline for `cfg` (or for `schedule`, a planned one): the GPT the
    torch peer builds (same seed), `split_model`'s stages, the runtime, the dp engine over the
    dp axis of size 1 (as `parallelize` composes them), AdamW as the peer's."""

    def __init__(self, setup: Setup, mesh, cfg: Config):
        self.setup, self.mesh = setup, mesh
        torch.manual_seed(MODEL_SEED)
        if cfg.parallel.schedule == "optimal":  # profiled, planned and sent as the trainer does
            module = apply_pipeline(GPT(**setup.model_cfg), mesh, cfg)
            self.runtime = module.runtime
        else:
            module, shapes, shared = split_model(GPT(**setup.model_cfg), mesh, cfg)
            self.runtime = PipelineRuntime(module.stage_modules(), mesh, build_schedule(cfg),
                                           shapes, shared, cfg.parallel.recompute)
        self.bounds = module.bounds
        self.planned = None
        if cfg.parallel.schedule == "optimal" and mesh.rank == 0:  # the plan's own model
            p = cfg.parallel
            costs, budget = self.runtime.costs, p.activation_budget_mb * 2**20
            # below ZB-H1's own peak, where its deferred W's cannot fit: half of it, but no
            # less than one micro-batch of the largest stage (nothing fits below that)
            tight = max(budget / 2, max(c.activation_bytes for c in costs))
            self.planned = {"budget_bytes": budget,
                            **compare(p.pp, setup.microbatches, costs, budget),
                            "half_budget": {"budget_bytes": tight,
                                            **compare(p.pp, setup.microbatches, costs, tight)}}
        self.model = apply_data_parallel(module, mesh, cfg.parallel)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.first_step_loss: float | None = None

    def step(self, i: int) -> None:
        """Training step `i` on batch `i`; the first one ever records the loss (collective)."""
        s = self.setup
        x, y = token_batch(s.model_cfg, s.microbatches * s.micro_batch, i)
        batches = list(zip(x.split(s.micro_batch), y.split(s.micro_batch)))
        loss_sum = self.runtime.train_step(self.model, batches, s.tokens_per_step, token_loss_sum)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # the grads are views into the dp buckets
        if self.first_step_loss is None:
            comm.all_reduce(loss_sum, self.mesh, "pp")  # zero off the last stage
            self.first_step_loss = float(loss_sum) / s.tokens_per_step

    def recorded_step(self, i: int) -> tuple[list[dict], int]:
        """Step `i` with its spans recorded: (every rank's spans, peak activation bytes of the
        step, max over ranks)."""
        self.runtime.spans = []
        self.runtime.measure_activations = True  # the stash's hooks: only on this step
        self.step(i)
        self.runtime.measure_activations = False
        ranks = self.runtime.gather_spans()
        peak = torch.tensor([self.runtime.stash.peak_bytes], dtype=torch.float64)
        comm.all_reduce(peak, self.mesh, "pp", op="max")
        return ranks, int(peak)

    def timed_round(self) -> dict:
        s = self.setup
        for i in range(s.warmup):
            self.step(i)
        comm.barrier(self.mesh)
        start = time.perf_counter()
        for i in range(s.warmup, s.warmup + s.steps):
            self.step(i)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        comm.all_reduce(elapsed, self.mesh, "pp", op="max")  # the slowest rank's time
        ranks, peak = self.recorded_step(s.warmup + s.steps)
        return {"tokens_per_s": s.steps * s.tokens_per_step / float(elapsed), "planned": self.planned,
                "virtual_stages": self.runtime.schedule.virtual_stages, "bounds": self.bounds,
                "first_step_loss": self.first_step_loss, "peak_activation_bytes": peak,
                **bubble_figures(self.runtime.schedule, ranks), "ranks": ranks}


class RankBench:
    """What one rank answers: a round of ours or of torch's for a schedule, the memory figures.
    Every rank gets the same commands in the same order (each is collective)."""

    def __init__(self, world: int, setup: Setup):
        self.world, self.setup = world, setup
        self.mesh = build_mesh({"pp": world})
        self.engines: dict[tuple, OurPipeline] = {}

    def engine(self, schedule: str, offload: float = 0.0, recompute: str = "none") -> OurPipeline:
        key = (schedule, offload, recompute)
        if key not in self.engines:
            budget = self.engine("zb-h1").recorded_step(0)[1] if schedule == "optimal" else None
            cfg = self.setup.config(schedule, offload, recompute, budget)
            self.engines[key] = OurPipeline(self.setup, self.mesh, cfg)
        return self.engines[key]

    def ours(self, schedule: str) -> dict:
        return self.engine(schedule).timed_round()

    def torch_peer(self, schedule: str) -> dict:
        """torch's counterpart of our `schedule` on the same stage bounds (same V)."""
        ours, s = self.engine(schedule), self.setup
        r = measure_torch(self.mesh.rank, self.world, schedule=schedule,
                          microbatches=s.microbatches,
                          virtual_stages=ours.runtime.schedule.virtual_stages,
                          model_cfg=s.model_cfg, micro_batch=s.micro_batch, steps=s.steps,
                          warmup=s.warmup, bounds=ours.bounds, mesh=self.mesh)
        return {"tokens_per_s": r["tokens_per_s"], "error": r.get("error"),
                "first_step_loss": r["losses"][0] if "losses" in r else None}

    def peak_bytes(self, schedule: str, offload: float = 0.0, recompute: str = "none") -> int:
        return self.engine(schedule, offload, recompute).recorded_step(0)[1]

    def memory(self, _=None) -> dict:
        return {"schedule": OFFLOAD_SCHEDULE, "offload_fraction": OFFLOAD_FRACTION,
                "no_offload": self.peak_bytes(OFFLOAD_SCHEDULE),
                "offload": self.peak_bytes(OFFLOAD_SCHEDULE, OFFLOAD_FRACTION),
                "recompute_full": self.peak_bytes(OFFLOAD_SCHEDULE, recompute="full")}


def _rank_main(rank: int, world: int, port: int, setup: Setup, commands, results) -> None:
    with joined_world(rank, world, port):
        bench = RankBench(world, setup)
        serve_commands(rank, commands, results, {"ours": bench.ours, "torch": bench.torch_peer,
                                                 "memory": bench.memory})
        comm.barrier(bench.mesh)  # before destroy: avoids an intermittent abort (DESIGN.md)


# --- figures of one recorded step (pure) -------------------------------------------------------


def _action_spans(ranks: list[dict]) -> list[dict]:
    """The spans of schedule actions (compute and host copies), each named as its Action."""
    return [s for r in ranks for s in r["spans"]
            if s["kind"] in (*WORK_KINDS, schedules.OFFLOAD, schedules.RELOAD)]


def stage_times(ranks: list[dict]) -> dict[tuple[str, int], float]:
    """{(kind, stage): mean seconds} of the recorded compute actions."""
    times: dict[tuple[str, int], list[float]] = {}
    for s in _action_spans(ranks):
        stage = int(s["name"].rsplit(".", 1)[1])
        times.setdefault((s["kind"], stage), []).append(s["end_s"] - s["start_s"])
    return {k: statistics.fmean(v) for k, v in times.items()}


def step_breakdown_ms(ranks: list[dict]) -> dict:
    """The forward/backward phase and, per rank, its work (F, B, I, W), waits for receives,
    gradient sync, and idle time inside the phase (the phase less its work)."""
    work = [s for r in ranks for s in r["spans"] if s["kind"] in WORK_KINDS]
    phase = max(s["end_s"] for s in work) - min(s["start_s"] for s in work)

    def total(rank: dict, kinds) -> float:
        return 1e3 * sum(s["end_s"] - s["start_s"] for s in rank["spans"] if s["kind"] in kinds)
    return {"phase": 1e3 * phase, "work": [total(r, WORK_KINDS) for r in ranks],
            "wait": [total(r, ("WAIT",)) for r in ranks], "sync": [total(r, ("SYNC",)) for r in ranks],
            "idle": [1e3 * phase - total(r, WORK_KINDS) for r in ranks]}


def _closed_form(schedule: schedules.Schedule, times: dict | None) -> float:
    """The papers' bubble for a built-in schedule; for a planned one (optimal), the simulated
    bubble of its actions at the same times."""
    if schedule.name in schedules.SCHEDULES:
        return schedules.bubble_theory(schedule.name, schedule.pp, schedule.microbatches,
                                       schedule.virtual_stages, times)
    return schedules.simulate(schedule, times).bubble


def bubble_figures(schedule: schedules.Schedule, ranks: list[dict]) -> dict:
    """The bubble of one recorded step, measured and in theory (see the module docstring)."""
    per_stage = stage_times(ranks)
    means = {k: statistics.fmean(t for (kind, _), t in per_stage.items() if kind == k)
             for k in dict.fromkeys(kind for kind, _ in per_stage)}
    durations = {s["name"]: s["end_s"] - s["start_s"] for s in _action_spans(ranks)}
    simulated = schedules.simulate(schedule, lambda a: durations.get(str(a), 0.0))
    return {"bubble_measured": measured_bubble(ranks),
            "bubble_theory": _closed_form(schedule, None),
            "bubble_theory_measured_times": _closed_form(schedule, means),
            "bubble_simulated": simulated.bubble,
            "compute_ms": {k: 1e3 * t for k, t in means.items()},
            "step_ms": step_breakdown_ms(ranks)}


# --- the summary -------------------------------------------------------------------------------


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def schedule_figures(ours: list[dict], theirs: list[dict]) -> dict:
    """Medians over rounds of ours and torch's tokens/s, their pairwise ratio, and the bubble
    figures of the round whose measured bubble is the median (the lower one of an even count)."""
    bubble = statistics.median_low(r["bubble_measured"] for r in ours)
    typical = next(r for r in ours if r["bubble_measured"] == bubble)
    ratios = [o["tokens_per_s"] / t["tokens_per_s"] for o, t in zip(ours, theirs) if t["tokens_per_s"]]
    out = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in ours),
           "torch_tokens_per_s": _median(r["tokens_per_s"] for r in theirs),
           "ratio": _median(ratios),
           "per_round_tokens_per_s": [round(r["tokens_per_s"], 1) for r in ours],
           "per_round_torch_tokens_per_s": [r["tokens_per_s"] and round(r["tokens_per_s"], 1)
                                            for r in theirs],
           **{k: v for k, v in typical.items()
              if k not in ("tokens_per_s", "ranks") and not (k == "planned" and v is None)}}
    out["torch_first_step_loss"] = theirs[0]["first_step_loss"] if theirs else None
    if theirs and theirs[0]["error"]:
        out["torch_error"] = theirs[0]["error"]
    return out


def optimal_vs_zb_h1(figures: dict) -> dict:
    """The OptPipe claim: under ZB-H1's activation memory, the optimal schedule idles less."""
    opt, zb = figures["optimal"], figures["zb-h1"]
    return {"memory_budget_bytes": zb["peak_activation_bytes"],
            **{f"{k}_{name}": f[k] for name, f in (("optimal", opt), ("zb_h1", zb))
               for k in ("peak_activation_bytes", "bubble_measured", "bubble_simulated")},
            "idle_ms_optimal": sum(opt["step_ms"]["idle"]), "idle_ms_zb_h1": sum(zb["step_ms"]["idle"]),
            # the planner's comparison on the profiled stage costs: 1F1B and ZB-H1 fitted to
            # the same budget (offload or recompute where they exceed it) and the plan
            "planned": opt["planned"]}


def write_timelines(directory: Path, typical: dict[str, list[dict]], figures: dict, pp: int,
                    microbatches: int) -> None:
    """Each schedule's recorded step as pipeline_timeline_NAME.json and its Gantt chart .png."""
    from loomtrain.gantt import draw_pipeline_timeline
    from loomtrain.timeline import read_pipeline_timeline, write_pipeline_timeline

    directory.mkdir(parents=True, exist_ok=True)
    for name, ranks in typical.items():
        path = directory / f"pipeline_timeline_{name}.json"
        write_pipeline_timeline(path, ranks, pp=pp, schedule=name, microbatches=microbatches,
                                bubble_measured=figures[name]["bubble_measured"],
                                bubble_theory=figures[name]["bubble_theory"])
        fig = draw_pipeline_timeline(read_pipeline_timeline(path), "benchmarks/pipeline.py")
        fig.savefig(path.with_suffix(".png"), format="png", dpi=100)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (2; 4 if time allows)")
    parser.add_argument("--layers", type=int, default=None, help="GPT blocks (2 x pp)")
    parser.add_argument("--microbatches", type=int, default=None, help="M (8; 4 with --small)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences (4; 2 with --small)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per engine (5; 1 with --small)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps a round (3; 1 with --small)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"comma-separated, of {', '.join(SCHEDULES)} (all)")
    parser.add_argument("--timeline-dir", type=Path, default=None,
                        help="write each schedule's recorded step (JSON and PNG) here")
    parser.add_argument("--small", action="store_true", help="a tiny GPT, one round (smoke test)")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="fail if the world gives no result for this long")
    args = parser.parse_args(argv)
    small = args.small
    setup = Setup(pp=args.pp, model_cfg={**(SMALL_MODEL if small else MODEL),
                                         "n_layers": args.layers or 2 * args.pp},
                  micro_batch=args.micro_batch or (2 if small else 4),
                  microbatches=args.microbatches or (4 if small else 8),
                  steps=args.steps or (1 if small else 3), warmup=args.warmup)
    rounds = args.rounds or (1 if small else 5)
    if min(rounds, setup.steps, setup.warmup) < 1 or args.pp < 2:
        parser.error("--rounds, --steps and --warmup must be at least 1 (torch infers its shapes "
                     "in the first, untimed step) and --pp at least 2")
    names = args.schedules.split(",")
    if not set(names) <= set(SCHEDULES):
        parser.error(f"--schedules {args.schedules}: choose among {', '.join(SCHEDULES)}")
    start = time.perf_counter()
    runs = {name: {"ours": [], "torch": []} for name in names}
    with closing_worlds({}) as worlds:
        world = worlds["pipeline"] = World("pipeline", args.pp, _rank_main,
                                           (args.pp, free_port(), setup), args.timeout_s)
        memory = world.command(("memory", None))[0]
        for i in range(rounds):
            for name in names:
                engines = [e for e in ("ours", "torch") if e == "ours" or name in TORCH_SCHEDULES]
                for engine in engines if i % 2 == 0 else engines[::-1]:
                    runs[name][engine].append(world.command((engine, name))[0])
                ours, theirs = runs[name]["ours"][-1], (runs[name]["torch"] or [{}])[-1]
                print(f"round {i + 1}/{rounds} {name:>11}: ours {ours['tokens_per_s']:8.0f} tok/s, "
                      f"torch {theirs.get('tokens_per_s') or 0:8.0f} tok/s, bubble "
                      f"{ours['bubble_measured']:.3f} ({time.perf_counter() - start:.0f} s)",
                      file=sys.stderr, flush=True)
    figures = {name: schedule_figures(r["ours"], r["torch"]) for name, r in runs.items()}
    for name, f in figures.items():
        f["torch_schedule"] = TORCH_SCHEDULES[name].__name__ if name in TORCH_SCHEDULES else None
    out = {"benchmark": "pipeline", "pp": args.pp, "microbatches": setup.microbatches,
           "date": datetime.date.today().isoformat(), "schedules": figures,
           "peak_activation_bytes": memory}
    if {"optimal", "zb-h1"} <= set(figures):
        out["optimal_vs_zb_h1"] = optimal_vs_zb_h1(figures)
    out["config"] = {"model": setup.model_cfg, "micro_batch": setup.micro_batch,
                     "tokens_per_step": setup.tokens_per_step, "rounds": rounds,
                     "steps": setup.steps, "warmup": setup.warmup, "small": small,
                     "virtual_stages_interleaved": VIRTUAL_STAGES, "optimizer": f"AdamW lr {LR}",
                     "backend": "gloo on 127.0.0.1", "threads_per_rank": 1,
                     "torch": torch.__version__}
    if args.timeline_dir is not None:
        typical = {name: next(r["ranks"] for r in runs[name]["ours"]
                              if r["bubble_measured"] == figures[name]["bubble_measured"])
                   for name in names}
        write_timelines(args.timeline_dir, typical, figures, args.pp, setup.microbatches)
    out["wall_s"] = time.perf_counter() - start
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
