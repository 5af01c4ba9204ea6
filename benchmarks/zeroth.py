"""Zeroth-order fine-tuning (MeZO, MeZO-SVRG, HELENE) against backprop on one 50.6 M-parameter
GPT: peak memory, validation loss after a fine-tune at a fixed wall-clock budget and at a
fixed number of forward passes, and the bytes a distributed ZO step sends.

    .venv/bin/python benchmarks/zeroth.py              # ~17 min on 2 idle CPU cores
    .venv/bin/python benchmarks/zeroth.py --small      # smoke test: tiny model, ~20 s
        [--pretrain-steps 60] [--wall-s 150] [--forwards 150] [--batch 4] [--world 4]
        [--hyper JSON] [--only mezo,adamw] [--parts memory,distributed,finetune]
        [--pretrained FILE | --save-pretrained FILE]

Model: the trainer's GPT (`build_task_model`) at d_model 512, 16 blocks, 8 heads, seq_len 128,
byte vocabulary, tied head: 50,635,776 parameters, fp32, one torch thread everywhere (the
machine's 2 cores are shared). Every fine-tune batch is `--batch` rows (4) of 128 tokens.

Parts, in this order:
1. Peak memory (`zeroth.memory.measure_in_subprocess`, method in memory.py and
   docs/zeroth.md): a fresh process measures, on this model and batch, the peak resident
   memory above the baseline of one inference forward (no_grad), one MeZO step, two
   backprop+SGD and two backprop+AdamW steps.
2. Distributed bytes: `--world` (4) spawned gloo ranks on 127.0.0.1, each with this model
   from the same seed, take 3 MeZO steps on their own rows of stdlib-tests through
   `SeedScalarExchange`; per step, the wire bytes `mesh.meter` counted on every rank (every
   op), against `pair_exchange_bytes`, and the bytes a data-parallel ring all-reduce of the
   fp32 gradients would send per rank, 2 (world - 1) / world x 4 x params; the ranks'
   parameters are compared bitwise (a SHA-256 of their bytes).
3. Pretraining: the same model, from the seed, trained with backprop (the trainer's AdamW,
   `build_optimizer`: lr 1e-3, 10% linear warmup then cosine to 0.1x, clipping at 1.0) on
   `stdlib-code` (the standard library without its test modules) for `--pretrain-steps` (60)
   steps of 8 rows: about 61 k tokens, a few minutes. A short pretraining: the model has
   learnt bytes and common words of Python, not much more; its validation loss is reported on
   both domains.
4. Fine-tuning on the held-out domain `stdlib-tests` (the test modules) from the pretrained
   weights, one copy per method, with a constant lr (no schedule, so a run's path does not
   depend on its budget): adamw (backprop, `build_optimizer`, clipping at 1.0), mezo,
   mezo_svrg and helene (`build_zo_optimizer`; hyperparameters in HYPER, chosen by the sweep
   in docs/zeroth.md). Every method reads the same stream of training rows, one batch per
   step (MeZO-SVRG's refresh reads the next `svrg_batches`). Two budgets, served by one run
   per method: the validation loss is taken when the run's training time reaches
   `--wall-s` (150 s) and when its forward-equivalents reach `--forwards` (150), whichever
   comes first, and the run goes on to the other. A step starts only if it fits: its forwards
   within the forward budget, and (by the method's previous step's time) its time within the
   wall budget. Forward-equivalents: a ZO probe's forward is 1, a backprop step 3 (its forward
   and a backward of about two forwards' FLOPs, the 6N-vs-2N count); `forward_passes` is the
   raw count of forwards run (a backprop step: 1). The runs are interleaved: turns of
   `--turn-s` (10 s) of training time, each round in a rotated order, so a change of the
   machine's load falls on every method alike; the evaluations are outside the clock.
   Validation: the trainer's `validate` on its fixed set of stdlib-tests validation rows
   (`--eval-batches` (24) batches of `--batch` rows). gap_closed(method) = (before - after) /
   (before - after of adamw) at the same budget.

The last line on stdout is one JSON object: `params`, `peak_mem_bytes` (`inference`, `mezo`,
`backprop_sgd`, `backprop_adamw`) and its ratios, `pretrain`, `finetune` (the fixed
wall-clock budget) and `finetune_fixed_forwards`, each {method: `val_loss_before`,
`val_loss_after`, `forward_passes`, `forward_equivalents`, `steps`, `wall_s`, `gap_closed`},
`distributed_bytes_per_step`, `load_avg` (1-minute, at the start and end) and `targets`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import sys
import time

import torch
import torch.multiprocessing as mp
from worlds import free_port, joined_world

from loomtrain.zeroth.distributed import pair_exchange_bytes

MODEL = {"d_model": 512, "n_layers": 16, "n_heads": 8, "seq_len": 128}
SMALL_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32}
PRETRAIN = {"rows": 8, "lr": 1e-3, "warmup_fraction": 0.1}
# per method: "optimizer" is "backprop" (AdamW) or a build_zo_optimizer name; the rest its keys
# lr: the best of the sweep in docs/zeroth.md (90 forward-equivalents from the same start)
HYPER = {
    "adamw": {"optimizer": "backprop", "lr": 1e-4},
    "mezo": {"optimizer": "mezo", "lr": 3e-4, "eps": 1e-3},
    "mezo_svrg": {"optimizer": "mezo-svrg", "lr": 3e-5, "eps": 1e-3, "svrg_every": 10,
                  "svrg_batches": 4},
    "helene": {"optimizer": "helene", "lr": 3e-4, "eps": 1e-3},
}
BACKPROP_FORWARDS = 3  # forward-equivalents of a backprop step: forward + backward (~2)
# the share of AdamW's closed gap MeZO is stated to close, at either budget: stated before the
# final run, from the sweep (MeZO closed 20% of it at 90 forward-equivalents); docs/zeroth.md
GAP_SHARE_TARGET = 0.15
DIST_STEPS = 3


def config_tree(model: dict, source: str, rows: int, args, nproc: int = 1) -> dict:
    """The trainer's config of a run on `source` with `rows` rows per rank and step (its
    [train] lr schedule is the pretraining's)."""
    steps = max(1, args.pretrain_steps)
    return {"run": {"seed": 0, "eval_batches": args.eval_batches, "device": "cpu"},
            "model": model, "data": {"source": source}, "parallel": {"nproc": nproc},
            "train": {"global_batch": rows * nproc, "micro_batch": rows, "steps": steps,
                      "lr": PRETRAIN["lr"],
                      "warmup_steps": int(PRETRAIN["warmup_fraction"] * steps)}}


def loss_of(model, batch):
    from loomtrain.models import token_loss_sum

    x, y = batch
    return lambda: token_loss_sum(model(x), y) / y.numel()


# --- 2. distributed: seeds and scalars only ---

def _zo_rank(rank: int, world: int, port: int, tree: dict, out) -> None:
    from loomtrain.mesh import build_mesh
    from loomtrain.train.batches import batches_of_step
    from loomtrain.train.config import config_from_dict
    from loomtrain.train.task import build_task_model, load_task_data
    from loomtrain.zeroth import SeedScalarExchange, build_zo_optimizer

    with joined_world(rank, world, port, timeout_s=600):
        mesh = build_mesh({"dp": world})
        cfg = config_from_dict(tree)
        torch.manual_seed(cfg.run.seed)
        model = build_task_model(cfg)
        data = load_task_data(cfg, world)
        opt = build_zo_optimizer("mezo", model, lr=HYPER["mezo"]["lr"], eps=HYPER["mezo"]["eps"])
        exchange = SeedScalarExchange(mesh)
        mesh.meter.take()
        per_step = []
        for step in range(DIST_STEPS):
            batch, = batches_of_step(data.train, cfg, mesh, step, torch.device("cpu"))
            opt.step(loss_of(model, batch), exchange)
            per_step.append(mesh.meter.take())
        flat = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
        gathered = mesh.meter.counts[("dp", "all_gather")].payload_bytes
        out.put((rank, {"per_step": per_step, "payload": gathered // DIST_STEPS,
                        "sha256": hashlib.sha256(flat.tobytes()).hexdigest()}))


def distributed_bytes(model: dict, params: int, args) -> dict:
    """`args.world` ranks take DIST_STEPS MeZO steps (K = 1); what the meter counted."""
    from loomtrain import comm

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    tree = config_tree(model, "stdlib-tests", args.batch, args, nproc=args.world)
    procs = [ctx.Process(target=_zo_rank, args=(r, args.world, port, tree, out))
             for r in range(args.world)]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    while len(got) < len(procs):
        try:
            rank, result = out.get(timeout=5)
            got[rank] = result
        except queue.Empty:  # a rank that died ends the benchmark
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                sys.exit(f"a distributed rank failed (exit codes {[p.exitcode for p in procs]})")
    for p in procs:
        p.join()
    formula = pair_exchange_bytes(args.world, 1)
    expected = {"all_gather": formula["wire"], "total": formula["wire"]}
    steps = [got[r]["per_step"] for r in range(args.world)]
    dp_wire = comm.wire_bytes("ring_all_reduce", 4 * params, args.world)
    return {"world": args.world, "n_perturbations": 1, "steps": DIST_STEPS,
            "wire": steps[0][0]["total"], "payload": got[0]["payload"],
            "formula": formula, "per_rank_per_step": steps,
            "every_step_equals_formula": all(s == expected for rank in steps for s in rank),
            "parameters_bitwise_identical": len({got[r]["sha256"] for r in got}) == 1,
            "dp_allreduce_wire": dp_wire, "dp_allreduce_over_zo": round(dp_wire / formula["wire"])}


# --- 3. pretraining and 4. fine-tuning: in this process, a world of one (the trainer's helpers) ---

CPU = torch.device("cpu")


def pretrain(cfg, mesh, args) -> tuple[dict, dict]:
    """Backprop AdamW on cfg's source from the seed; the weights and what the run was."""
    from loomtrain.optim import build_optimizer, lr_at, set_lr
    from loomtrain.train import trainer
    from loomtrain.train.batches import batches_of_step
    from loomtrain.train.task import build_task_model, load_task_data

    torch.manual_seed(cfg.run.seed)
    model = build_task_model(cfg)
    data = load_task_data(cfg, 1)
    opt = build_optimizer(model, cfg.train)
    start = time.perf_counter()
    for step in range(args.pretrain_steps):
        set_lr(opt, lr_at(step, cfg.train))
        batch, = batches_of_step(data.train, cfg, mesh, step, CPU)
        loss_of(model, batch)().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    wall = time.perf_counter() - start
    val = trainer.evaluate(model, data.val, cfg, mesh, CPU)
    info = {"source": cfg.data.source, "steps": args.pretrain_steps, **PRETRAIN,
            "tokens": args.pretrain_steps * cfg.train.micro_batch * cfg.model.seq_len,
            "wall_s": round(wall, 1), "val_loss_own_domain": round(val, 4)}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, info


class FineTune:
    """One method's fine-tune: its copy of the model, its optimizer, its clock and counters,
    and `results[budget]` once the budget ("wall", "forwards") is spent."""

    def __init__(self, name: str, hyper: dict, weights: dict, cfg, mesh, data):
        from loomtrain.optim import build_optimizer
        from loomtrain.train.task import build_task_model
        from loomtrain.zeroth import build_zo_optimizer

        self.name, self.cfg, self.mesh, self.data = name, cfg, mesh, data
        self.model = build_task_model(cfg)
        self.model.load_state_dict(weights)
        keys = {k: v for k, v in hyper.items() if k != "optimizer"}
        if hyper["optimizer"] == "backprop":
            self.zo = None
            self.opt = build_optimizer(self.model, cfg.train.model_copy(update=keys))
        else:
            self.opt = self.zo = build_zo_optimizer(hyper["optimizer"], self.model, **keys)
        self.train_s = self.last_step_s = 0.0
        self.steps = self.batches_read = self.backprop_steps = 0
        self.results: dict[str, dict] = {}

    def forward_passes(self) -> int:
        return self.zo.forward_passes if self.zo else self.backprop_steps

    def forward_equivalents(self) -> int:
        return self.zo.forward_passes if self.zo else BACKPROP_FORWARDS * self.backprop_steps

    def next_step_forwards(self) -> int:
        if self.zo is None:
            return BACKPROP_FORWARDS
        k = self.zo.n_perturbations
        if self.zo.name == "mezo-svrg":  # 4 K per step; 2 K per batch at a refresh
            return 2 * k * self.zo.svrg_batches if self.zo.needs_refresh() else 4 * k
        return 2 * k

    def _loss_fn(self):
        """The loss on the next batch of the method's stream of training rows."""
        from loomtrain.train.batches import batches_of_step

        batch, = batches_of_step(self.data.train, self.cfg, self.mesh, self.batches_read, CPU)
        self.batches_read += 1
        return loss_of(self.model, batch)

    def step(self) -> None:
        start = time.perf_counter()
        if self.zo is None:
            self._loss_fn()().backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.backprop_steps += 1
        elif self.zo.needs_refresh():
            self.zo.refresh([self._loss_fn() for _ in range(self.zo.svrg_batches)])
        else:
            self.zo.step(self._loss_fn())
        self.last_step_s = time.perf_counter() - start
        self.train_s += self.last_step_s
        self.steps += 1

    def advance(self, wall_s: float, forwards: int, evaluate) -> bool:
        """One step, or the evaluation of a budget the next step would exceed (the time of a
        step taken as the previous one's); False once both budgets are recorded."""
        if "forwards" not in self.results and \
                self.forward_equivalents() + self.next_step_forwards() > forwards:
            self._record("forwards", evaluate)
        elif "wall" not in self.results and self.steps and \
                self.train_s + self.last_step_s > wall_s:
            self._record("wall", evaluate)
        elif len(self.results) == 2:
            return False
        else:
            self.step()
        return True

    def _record(self, budget: str, evaluate) -> None:
        self.results[budget] = {
            "val_loss_after": round(evaluate(self.model), 4), "steps": self.steps,
            "forward_passes": self.forward_passes(),
            "forward_equivalents": self.forward_equivalents(), "wall_s": round(self.train_s, 1)}


def finetune(weights: dict, cfg, mesh, args, hyper: dict) -> tuple[float, dict, dict]:
    """Every method's run from `weights`, interleaved in turns of args.turn_s seconds of
    training, each round in a rotated order. Returns the validation loss before, and the
    fixed-wall and fixed-forwards tables."""
    from loomtrain.train import trainer
    from loomtrain.train.task import load_task_data

    data = load_task_data(cfg, 1)

    def evaluate(model) -> float:
        return trainer.evaluate(model, data.val, cfg, mesh, CPU)

    runs = [FineTune(name, h, weights, cfg, mesh, data) for name, h in hyper.items()]
    before = evaluate(runs[0].model)
    live, turn = list(runs), 0
    while live:
        for run in live[turn % len(live):] + live[:turn % len(live)]:
            until = run.train_s + args.turn_s
            while run.train_s < until and run.advance(args.wall_s, args.forwards, evaluate):
                pass
        live = [r for r in live if len(r.results) < 2]
        turn += 1
        print(f"  round {turn}: " + ", ".join(
            f"{r.name} {r.train_s:.0f} s {r.forward_equivalents()} f" for r in runs),
            file=sys.stderr, flush=True)
    tables = []
    for budget in ("wall", "forwards"):
        adamw = next((r.results[budget]["val_loss_after"] for r in runs if r.name == "adamw"), None)
        tables.append({r.name: {"val_loss_before": round(before, 4), **r.results[budget],
                                "gap_closed": gap_closed(before, r.results[budget], adamw)}
                       for r in runs})
    return before, *tables


def gap_closed(before: float, result: dict, adamw_after: float | None) -> float | None:
    """(before - after) / (before - after of AdamW); None without an AdamW run that gained."""
    if adamw_after is None or before - adamw_after <= 0:
        return None
    return round((before - result["val_loss_after"]) / (before - adamw_after), 4)


def run_finetune(model: dict, args, hyper: dict) -> dict:
    from loomtrain.mesh import build_mesh
    from loomtrain.train.config import config_from_dict

    pre_cfg = config_from_dict(config_tree(model, "stdlib-code", PRETRAIN["rows"], args))
    ft_cfg = config_from_dict(config_tree(model, "stdlib-tests", args.batch, args))
    with joined_world(0, 1, free_port()):
        mesh = build_mesh({"dp": 1})
        if args.pretrained:
            weights, pre = torch.load(args.pretrained), {"loaded": args.pretrained}
        else:
            weights, pre = pretrain(pre_cfg, mesh, args)
            print(f"  pretrain: {pre}", file=sys.stderr, flush=True)
        if args.save_pretrained:
            torch.save(weights, args.save_pretrained)
        before, wall, forwards = finetune(weights, ft_cfg, mesh, args, hyper)
    return {"pretrain": {**pre, "val_loss_held_out": round(before, 4)},
            "finetune": wall, "finetune_fixed_forwards": forwards,
            "finetune_setup": {"source": "stdlib-tests", "wall_budget_s": args.wall_s,
                               "forward_budget": args.forwards, "turn_s": args.turn_s,
                               "eval_tokens": args.eval_batches * args.batch * model["seq_len"],
                               "hyper": hyper}}


def run_memory(model: dict, args) -> dict:
    from loomtrain.zeroth.memory import measure_in_subprocess

    mem = measure_in_subprocess(model, args.batch, threads=1)
    out = {"params": mem.pop("params"), "param_bytes": mem.pop("param_bytes"),
           "peak_mem_bytes": mem,
           "peak_mem_vs_inference": {k: round(v / mem["inference"], 3) for k, v in mem.items()}}
    print(f"  memory: {mem}", file=sys.stderr, flush=True)
    return out


def run_distributed(model: dict, args) -> dict:
    from loomtrain.models import build_model
    from loomtrain.models.config import ModelConfig

    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(ModelConfig(**model)).parameters())
    dist = distributed_bytes(model, params, args)
    print(f"  distributed: {dist['wire']} B/step", file=sys.stderr, flush=True)
    return {"params": params, "distributed_bytes_per_step": dist}


def targets(line: dict) -> dict:
    out = {}
    mem = line.get("peak_mem_bytes")
    if mem:
        out["mezo_peak_le_1.1x_inference"] = mem["mezo"] <= 1.1 * mem["inference"]
        out["mezo_peak_4x_below_backprop_adamw"] = mem["backprop_adamw"] >= 4 * mem["mezo"]
    for key, budget in (("finetune", "wall"), ("finetune_fixed_forwards", "forwards")):
        share = line.get(key, {}).get("mezo", {}).get("gap_closed")
        if share is not None:
            name = f"mezo_closes_{GAP_SHARE_TARGET:.0%}_of_adamw_gap_at_fixed_{budget}"
            out[name] = share >= GAP_SHARE_TARGET
    dist = line.get("distributed_bytes_per_step")
    if dist:
        out["distributed_bytes_equal_pair_exchange"] = dist["every_step_equals_formula"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="smoke test: tiny model and budgets")
    parser.add_argument("--batch", type=int, default=4, help="rows of every fine-tune step")
    parser.add_argument("--pretrain-steps", type=int, default=60)
    parser.add_argument("--wall-s", type=float, default=150.0, help="fine-tune seconds budget")
    parser.add_argument("--forwards", type=int, default=150,
                        help="fine-tune forward-equivalents budget")
    parser.add_argument("--turn-s", type=float, default=10.0)
    parser.add_argument("--eval-batches", type=int, default=24)
    parser.add_argument("--world", type=int, default=4, help="ranks of the distributed part")
    parser.add_argument("--hyper", default="{}", help="JSON {method: {key: value}} over HYPER; "
                        "a new method name adds a run (an lr sweep), with an \"optimizer\" key")
    parser.add_argument("--only", default="", help="comma-separated fine-tune methods")
    parser.add_argument("--parts", default="memory,distributed,finetune")
    parser.add_argument("--pretrained", help="the pretrained weights from FILE (no pretraining)")
    parser.add_argument("--save-pretrained", help="save the pretrained weights to FILE")
    args = parser.parse_args()
    if args.small:
        args.pretrain_steps, args.wall_s, args.forwards = 10, 1.0, 24
        args.turn_s, args.eval_batches, args.world = 0.5, 2, 2
    model = SMALL_MODEL if args.small else MODEL
    parts = args.parts.split(",")
    extra = json.loads(args.hyper)
    hyper = {name: {**HYPER.get(name, {}), **extra.get(name, {})} for name in {**HYPER, **extra}
             if not args.only or name in args.only.split(",")}
    line = {"benchmark": "zeroth", "small": args.small, "model": model, "batch_rows": args.batch,
            "threads": 1, "load_avg": [round(os.getloadavg()[0], 2)]}
    if "memory" in parts:
        line.update(run_memory(model, args))
    if "distributed" in parts:
        line.update(run_distributed(model, args))
    if "finetune" in parts:
        line.update(run_finetune(model, args, hyper))
    line["load_avg"].append(round(os.getloadavg()[0], 2))
    line["targets"] = targets(line)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
