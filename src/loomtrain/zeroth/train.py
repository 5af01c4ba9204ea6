"""`loom train` with `[optim] name` a zeroth-order method: `train_zeroth`, which run.train_loop
calls, trains from forward passes alone (MeZO, Malladi et al., arXiv 2305.17333), the dp ranks
exchanging only seeds and scalars. The step, its bytes, checkpoints and what is refused:
docs/zeroth.md, "Training with loom train".
"""

from __future__ import annotations

import fnmatch
import signal
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from loomtrain import comm
from loomtrain.component import Built
from loomtrain.errors import CheckpointError, ConfigError
from loomtrain.models import token_loss_sum
from loomtrain.optim import lr_at
from loomtrain.train import checkpoint, trainer
from loomtrain.train.batches import batches_of_step, target_tokens
from loomtrain.train.init_from import load_init_weights
from loomtrain.train.metrics import RunLog, truncate_metrics
from loomtrain.train.task import build_task_model, load_task_data
from loomtrain.train.trainer import log_start, nonfinite_streak, validate, write_config
from loomtrain.zeroth import (STATE_PER_PARAMETER, SeedScalarExchange, ZOOptimizer,
                              build_zo_optimizer, hyper_keys)
from loomtrain.zeroth.state import ZEROTH


def train_zeroth(cfg, run_dir: Path, resume: Path | None, mesh, stop) -> int:
    """Every rank of a run with a zeroth-order `optim.name` calls this (run.train_loop does)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.run.seed)
    data = load_task_data(cfg, mesh.size("dp"))
    model = build_task_model(cfg).to(mesh.device)
    init = None
    if resume is None and cfg.train.init_from is not None:
        init = load_init_weights(model, cfg)
    opt = build_optimizer(cfg, model)
    # no components apply: the plain model, and a checkpoint layout of its own; loom.json
    # names the method, which alone resumes it
    built = Built(model=model, mesh=mesh, cfg=cfg, loss_sum=token_loss_sum, optimizer=opt,
                  layout=ZEROTH, meta={"optim": opt.name})
    start = 0
    if resume is not None:
        start = trainer.restore(built, resume)["step"]
        if mesh.rank == 0:  # only now that the checkpoint fits: a failed resume changes nothing
            truncate_metrics(run_dir, start)
            write_config(run_dir, cfg)
    log = RunLog(run_dir, cfg.train.steps, start, mesh.rank == 0, cfg.run.progress)
    try:
        log_start(log, f"{data.description}; {describe(model, opt)}", mesh, start, resume, init,
                  lambda: validate(built, data.val, mesh.device))
        return _steps(cfg, run_dir, built, data, stop, log, start)
    finally:
        log.close()


def build_optimizer(cfg, model: nn.Module) -> ZOOptimizer:
    """The [optim] method over the parameters `optim.trainable` selects, with every parameter's
    requires_grad turned off; unset keys take the method's defaults, seeds derive from
    run.seed."""
    o = cfg.optim
    trainable = select_trainable(model, o.trainable)
    model.requires_grad_(False)
    hyper = {k: getattr(o, k) for k in hyper_keys(o.name)
             if k not in ("lr", "seed") and getattr(o, k) is not None}
    return build_zo_optimizer(o.name, model, trainable, lr=schedule(cfg).lr, seed=cfg.run.seed,
                              **hyper)


def schedule(cfg):
    """[train] with the zeroth-order peak lr: lr_at(step, schedule(cfg)) is a step's lr."""
    return cfg.train if cfg.optim.lr is None else cfg.train.model_copy(update={"lr": cfg.optim.lr})


def _matches(name: str, pattern: str) -> bool:
    """A glob (with * ? or [) matches the whole name; anything else is a prefix of it."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name.startswith(pattern)


def select_trainable(model: nn.Module, patterns: list[str]) -> list[nn.Parameter]:
    """The parameters whose names (any of a tied parameter's names) match a pattern, in model
    order, each once; all of them for no pattern. A pattern that matches nothing is a
    ConfigError naming the model's parameters."""
    named = list(model.named_parameters(remove_duplicate=False))
    if not patterns:
        return list(dict.fromkeys(p for _, p in named))
    for pattern in patterns:
        if not any(_matches(name, pattern) for name, _ in named):
            names = [name for name, _ in named]
            shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
            raise ConfigError(f"optim.trainable: {pattern!r} matches no parameter of the model; "
                              f"its parameters are {shown}. Give name prefixes (\"blocks.1.\": "
                              "everything under blocks.1) or globs (\"*.bias\", whole names)")
    return list(dict.fromkeys(p for name, p in named if any(_matches(name, pat) for pat in patterns)))


def check_trainable(cfg) -> None:
    """Before any process starts: `optim.trainable` selects something of the model `cfg`
    builds (on the meta device: no memory, no initialization)."""
    if cfg.optim.name != "backprop" and cfg.optim.trainable:
        with torch.device("meta"):
            select_trainable(build_task_model(cfg), cfg.optim.trainable)


def check_resume(cfg, path: Path) -> None:
    """Refuses (CheckpointError) to resume a checkpoint with another optimizer than the one
    that wrote it: its loom.json's "optim" (absent: backprop), before anything is written."""
    written = checkpoint.read_meta(path).get("optim", "backprop")
    if written != cfg.optim.name:
        raise CheckpointError(
            f"--resume: checkpoint {str(path)!r} was written with optim.name={written!r} and this "
            f"run has optim.name={cfg.optim.name!r}; their optimizer states differ. Resume with "
            f"optim.name={written!r}, or start a new run from its weights with "
            f"train.init_from={str(path)!r}; nothing in the run folder was changed")


def describe(model: nn.Module, opt: ZOOptimizer) -> str:
    total = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    trained = opt.perturber.numel()
    state = STATE_PER_PARAMETER[opt.name]
    return (f"{total:,} parameters, {trained:,} trained by {opt.name} ({opt.n_perturbations} "
            f"probe(s) per rank and step; state {state} x {trained:,} values)")


def batch_loss(model: nn.Module, batches: list) -> Callable[[], torch.Tensor]:
    """The mean target loss of `batches` (micro-batches summed, divided by their targets)."""
    targets = target_tokens(batches)

    @torch.no_grad()
    def loss_fn() -> torch.Tensor:
        return sum(token_loss_sum(model(x), y) for x, y in batches) / targets
    return loss_fn


class KeptPairs:
    """The exchange, keeping the pairs of its last call (every rank's) for the metrics."""

    def __init__(self, exchange: SeedScalarExchange):
        self.exchange, self.rank, self.world = exchange, exchange.rank, exchange.world
        self.pairs: list = []

    def __call__(self, pairs):
        self.pairs = self.exchange(pairs)
        return self.pairs


def zo_step(opt: ZOOptimizer, model, data, cfg, mesh, step: int, exchange, lr: float
            ) -> tuple[float, int]:
    """Step `step` on this rank's rows (a refresh on those of steps step .. step +
    svrg_batches - 1); returns (this rank's probed loss, its target count)."""
    refresh = opt.needs_refresh()
    groups = [batches_of_step(data.train, cfg, mesh, step + b, mesh.device)
              for b in range(opt.svrg_batches if refresh else 1)]
    targets = sum(target_tokens(batches) for batches in groups)
    if refresh:
        return opt.refresh([batch_loss(model, b) for b in groups], exchange, lr), targets
    return opt.step(batch_loss(model, groups[0]), exchange, lr), targets


def _control(loss: float, targets: int, stop, mesh) -> tuple[float, float, bool]:
    """(the step's loss per target over the global batch, its global targets, whether any rank
    got SIGINT/SIGTERM), agreed in one all-reduce."""
    control = torch.tensor([loss * targets, targets, bool(stop.signum)], dtype=torch.float64,
                           device=mesh.device)
    comm.all_reduce(control, mesh, "dp")
    return float(control[0] / control[1]), float(control[1]), bool(control[2])


def _steps(cfg, run_dir: Path, built: Built, data, stop, log: RunLog, start: int) -> int:
    model, opt, mesh = built.model, built.optimizer, built.mesh
    exchange = KeptPairs(SeedScalarExchange(mesh, "dp"))
    lrs = schedule(cfg)
    nonfinite, saved_at = 0, start  # the newest checkpoint holds the state after saved_at
    loop_t0 = window_t0 = time.perf_counter()
    window_targets = 0.0
    mesh.meter.take()
    mesh.meter.take_simulated()
    mesh.meter.take_link_wait()
    for step in range(start, cfg.train.steps):
        step_t0 = time.perf_counter()
        lr = lr_at(step, lrs)
        skipped = opt.skipped_steps
        loss, targets = zo_step(opt, model, data, cfg, mesh, step, exchange, lr)
        loss, targets, stopping = _control(loss, targets, stop, mesh)
        done = step + 1
        stepped = opt.skipped_steps == skipped
        nonfinite = nonfinite_streak(nonfinite, stepped, done, cfg, log, "projected gradient")
        window_targets += targets
        is_eval = done % cfg.run.eval_every == 0 or done == cfg.train.steps
        logged = None
        if is_eval or done % cfg.run.log_every == 0:
            now = time.perf_counter()
            rec = _record(done, loss, lr, opt, exchange, mesh, window_targets / (now - window_t0),
                          now - loop_t0, stepped)
            if is_eval:
                rec.update(validate(built, data.val, mesh.device))
            log.record(rec)
            logged, window_t0, window_targets = loss, time.perf_counter(), 0.0
        log.advance(logged, targets / (time.perf_counter() - step_t0))
        if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < cfg.train.steps:
            trainer.save(built, run_dir, done)
            saved_at = done
        if stopping and done < cfg.train.steps:
            name = signal.Signals(stop.signum).name if stop.signum else "a signal to another rank"
            if done > saved_at:
                trainer.save(built, run_dir, done, {"stopped_by": name})
            log.message(f"stopped by {name} after step {done}; checkpoint step {done} is saved; "
                        f"continue with: loom train --resume {run_dir}")
            return 0
    return trainer.finish(built, run_dir, start, log)


def _record(done: int, loss: float, lr: float, opt: ZOOptimizer, exchange: KeptPairs, mesh,
            tokens_per_s: float, elapsed_s: float, stepped: bool) -> dict:
    """One metrics.jsonl record. zo_grad: the mean of the step's exchanged scalars (MeZO-SVRG:
    g(theta) - g(snapshot) on minibatch steps, the large batch's g on a refresh);
    forward_passes: the probes' forwards so far over all ranks (each runs the same ones)."""
    grads = [p.grad for p in exchange.pairs]
    rec = {"step": done, "loss": loss, "lr": lr, "zo_grad": sum(grads) / len(grads),
           "forward_passes": opt.forward_passes * mesh.size("dp"), "tokens_per_s": tokens_per_s,
           **trainer.measured(mesh), "elapsed_s": round(elapsed_s, 3)}
    if not stepped:
        rec["skipped"] = True
    return rec

