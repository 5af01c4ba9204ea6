"""The backprop training loop every rank runs (`train_backprop`; train/run.py chooses it by
mode), and the pieces the zeroth-order and parameter-server loops share with it.

The loop knows no technique: it calls the components' hooks in their order. One step:
docs/training.md, "One step"; the loop: docs/architecture.md, "The run loop".
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import torch

from loomtrain import comm
from loomtrain.component import Built
from loomtrain.data import eval_samples
from loomtrain.errors import CheckpointError
from loomtrain.models import IGNORE_INDEX, token_loss_sum
from loomtrain.optim import build_optimizer, lr_at, set_lr
from loomtrain.parallel.state import PLAIN
from loomtrain.timeline import Timeline
from loomtrain.train import checkpoint
from loomtrain.train.apply import build_run
from loomtrain.train.batches import batches_of_step, load_rows, target_tokens
from loomtrain.train.config import Config, config_to_toml
from loomtrain.train.metrics import RunLog, peak_mem_bytes, truncate_metrics
from loomtrain.train.task import is_classification, load_task_data


class NonFiniteError(RuntimeError):
    pass


class StopFlag:
    """Set by SIGINT/SIGTERM; acted on at the next step boundary, on every rank together."""

    def __init__(self):
        self.signum = 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._set)

    def _set(self, signum, _frame):
        self.signum = signum


def first(hooks):
    """The first answer that is not None (the component that owns this part of the step)."""
    return next((answer for answer in hooks if answer is not None), None)


def _local(built: Built, batch) -> tuple:
    """(inputs, targets) of this rank: under context parallelism (or packing) the sequence
    runtime keeps this rank's tokens of the full rows and notes their documents."""
    for component in built.applied:
        batch = component.local_batch(built, batch)
    return batch


def train_step(model, optimizer, batches, global_tokens: float, grad_clip: float,
               loss_fn=token_loss_sum):
    """One step of a plain (or engine-wrapped) model, outside any run: `step` with no
    components (the benchmarks time the engines through this)."""
    built = Built(model=model, mesh=None, cfg=None, loss_sum=loss_fn, optimizer=optimizer)
    return step(built, batches, global_tokens, grad_clip)


def step(built: Built, batches, global_tokens: float, grad_clip: float):
    """Forward/backward over the micro-batches, clip, step. Returns (local loss sum, grad norm,
    stepped). The loss of every micro-batch is divided by `global_tokens`: the global token
    count (or what a component normalizes by). A component may own the whole step (the
    asynchronous pipeline), the forward and backward (a pipeline schedule), or take several
    passes for the gradient (SAM); `after_update` follows the optimizer step."""
    model, optimizer, loss_fn = built.model, built.optimizer, built.loss_sum
    owned = first(c.train_step(built, batches, global_tokens, loss_fn) for c in built.applied)
    if owned is not None:
        return owned

    def forward_backward():
        loss_sum = first(c.forward_backward(built, batches, global_tokens, loss_fn)
                         for c in built.applied)
        return loss_sum if loss_sum is not None else _forward_backward(built, batches, global_tokens)

    loss_sum = first(c.gradient(built, forward_backward, lambda: _forward_loss(built, batches))
                     for c in built.applied)
    if loss_sum is None:
        loss_sum = forward_backward()
    grad_norm = model.clip_grad_norm_(grad_clip)
    stepped = bool(torch.isfinite(grad_norm))
    if stepped:
        optimizer.step()
    for component in built.applied:
        component.after_update(built, stepped)
    optimizer.zero_grad(set_to_none=False)  # keep grads as views into the engine's buckets
    return loss_sum, grad_norm, stepped


def _forward_backward(built: Built, batches, global_tokens: float) -> torch.Tensor:
    """Forward and backward of every micro-batch, all but the last under `no_sync()`;
    returns this rank's loss sum."""
    model, loss_fn = built.model, built.loss_sum
    loss_sum = torch.zeros((), dtype=torch.float64, device=batches[0][0].device)
    for i, batch in enumerate(batches):
        x, y = _local(built, batch)
        last = i == len(batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss = loss_fn(model(x), y)
            (loss / global_tokens).backward()
        loss_sum += loss.detach()
    return loss_sum


@torch.no_grad()
def _forward_loss(built: Built, batches) -> torch.Tensor:
    """This rank's loss sum over the micro-batches, forwards only (zeroth-order probes)."""
    return sum(built.loss_sum(built.model(x), y).double()
               for x, y in (_local(built, b) for b in batches))


def evaluate(model, sampler, cfg: Config, mesh, device, loss_fn=token_loss_sum) -> float:
    """Mean validation loss per token (per example for a classification task) of a model
    built without components."""
    built = Built(model=model, mesh=mesh, cfg=cfg, loss_sum=loss_fn)
    return validate(built, sampler, device)["val_loss"]


@torch.no_grad()
def validate(built: Built, sampler, device) -> dict:
    """{"val_loss": the mean validation loss per token over the fixed validation set, dealt to
    the dp ranks}, and for a classification task (train/task.py) "val_accuracy": the share of
    those examples whose largest logit is their label's (the counts ride in the same
    all-reduce).

    Every rank runs the same number of forwards: a ZeRO-3 forward gathers parameters, a
    collective, so a rank with fewer batches (eval_batches not a multiple of dp) repeats its
    first one (or batch 0) and does not count it."""
    model, cfg, mesh, loss_fn = built.model, built.cfg, built.mesh, built.loss_sum
    for component in built.applied:
        component.before_evaluate(built)
    model.eval()
    classify = is_classification(cfg)
    total = torch.zeros(3 if classify else 2, dtype=torch.float64, device=device)
    dp = mesh.size("dp")
    rounds = -(-cfg.run.eval_batches // dp)
    every = [eval_samples(cfg.run.eval_batches, cfg.train.micro_batch, r, dp)
             for r in loaded_ranks(built)]
    mine = every[0]
    if len(every) > 1:  # a pool (data.balance) deals each round's rows of those ranks, once
        mine = [[g for share in every for g in (share[i] if i < len(share) else [])]
                for i in range(rounds)]
    for i in range(rounds):
        samples = mine[i] if i < len(mine) else (mine or [range(cfg.train.micro_batch)])[0]
        x, y = _local(built, load_rows(sampler, samples, cfg, device))
        owned = first(c.forward_only(built, x) for c in built.applied)
        out = owned[0] if owned is not None else model(x)
        if i < len(mine) and out is not None:  # under pp, the last stage has the output
            total[0] += loss_fn(out, y).double()
            total[1] += (y != IGNORE_INDEX).sum()
            if classify:
                total[2] += (out.argmax(-1) == y).sum()
    for axis in ("dp", "cp", "pp"):
        comm.all_reduce(total, mesh, axis)
    model.train()
    metrics = {"val_loss": float(total[0] / total[1])}
    if classify:
        metrics["val_accuracy"] = float(total[2] / total[1])
    return metrics


def loaded_ranks(built: Built) -> list[int]:
    """The dp ranks whose rows this rank loads (its own, unless a component loads more)."""
    mesh = built.mesh
    ranks = first(c.loaded_ranks(built.cfg, mesh) for c in built.applied)
    return [mesh.local_rank("dp")] if ranks is None else ranks


def _control(batches, stop: StopFlag, mesh, shares: int = 1) -> tuple[float, bool]:
    """(global target tokens, whether any rank got SIGINT/SIGTERM), agreed by all ranks in
    one all-reduce."""
    control = torch.tensor([target_tokens(batches), bool(stop.signum)], dtype=torch.float64,
                           device=mesh.device)
    comm.all_reduce(control, mesh, "world")
    # tp/pp/cp peers count the same tokens, and a rank that loaded `shares` dp ranks' rows
    # counts each of them
    replicas = mesh.world // mesh.size("dp") * shares
    return float(control[0]) / replicas, bool(control[1])


def _record(done: int, loss_sum, global_tokens: float, lr: float, grad_norm, stepped: bool,
            mesh, tokens_per_s: float) -> dict:
    """One metrics.jsonl record; the loss all-reduce happens only on logged steps (over pp
    too: the pipeline's last stage holds the loss; over cp: each peer has its tokens' loss).
    With a simulated inter-node link, also this rank's simulated link seconds since the
    previous record, and of those the seconds it waited (not hidden by computation)."""
    for axis in ("dp", "cp", "pp"):
        comm.all_reduce(loss_sum, mesh, axis)
    rec = {"step": done, "loss": float(loss_sum) / global_tokens, "lr": lr,
           "grad_norm": float(grad_norm), "tokens_per_s": tokens_per_s, **measured(mesh)}
    if not stepped:
        rec["skipped"] = True
    return rec


def measured(mesh) -> dict:
    """A record's wire bytes per op since the previous record and this process's peak memory;
    with a simulated link, also its simulated seconds and the seconds waited on it."""
    rec = {"comm_bytes": mesh.meter.take(), "peak_mem_bytes": peak_mem_bytes(mesh.device)}
    if mesh.link is not None:
        rec["comm_simulated_s"] = round(mesh.meter.take_simulated()["total"], 6)
        rec["comm_link_wait_s"] = round(mesh.meter.take_link_wait(), 6)
    return rec


def train_backprop(cfg: Config, run_dir: Path, resume: Path | None, mesh, stop: StopFlag) -> int:
    """Every rank of a run with `optim.name = "backprop"` and no parameter server calls this
    (run.train_loop does)."""
    device = mesh.device
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.run.seed)
    data = load_task_data(cfg, mesh.size("dp"))  # text windows or labelled examples
    train_data, val_data = data.train, data.val
    # the components take the model, built on the meta device, in the apply order: split, then
    # this rank's pieces made real, then wrapped, with its optimizer (built after the split,
    # rebuilt by ZeRO over this rank's shard) and the loss its outputs need; a fresh run from
    # train.init_from loads the whole model before the split. A checkpoint loads into the pair
    built, setup = build_run(cfg, mesh, lambda m: build_optimizer(m, cfg.train), resume is None)
    parameters, init = setup.parameters, setup.init
    start = 0
    if resume is not None:
        start = restore(built, resume)["step"]
        if mesh.rank == 0:  # only now that the checkpoint fits: a failed resume changes nothing
            truncate_metrics(run_dir, start)
            write_config(run_dir, cfg)  # with the resume's --set overrides
    log = RunLog(run_dir, cfg.train.steps, start, mesh.rank == 0, cfg.run.progress)
    log_start(log, f"{data.description}; {parameters:,} parameters", mesh, start, resume, init,
              lambda: validate(built, val_data, device))
    for component in built.applied:
        line = component.describe(built)
        if line is not None:
            log.message(line)
    tokens_per_step = cfg.train.global_batch * data.targets_per_row
    ranks = loaded_ranks(built)
    nonfinite, window_t0, window_steps = 0, time.perf_counter(), 0
    loop_t0 = window_t0  # each record's elapsed_s counts from here
    saved_at = start  # the newest checkpoint (if any) holds the state after this step
    mesh.meter.take()
    mesh.meter.take_simulated()
    mesh.meter.take_link_wait()
    try:
        for step_index in range(start, cfg.train.steps):
            step_t0 = time.perf_counter()
            batches = batches_of_step(train_data, cfg, mesh, step_index, device, ranks)
            global_tokens, stopping = _control(batches, stop, mesh, len(ranks))
            if stopping:
                name = signal.Signals(stop.signum).name if stop.signum else "a signal to another rank"
                if step_index > saved_at:
                    save(built, run_dir, step_index, {"stopped_by": name})
                log.message(f"stopped by {name} before step {step_index + 1}; " + (
                    f"checkpoint step {step_index} is saved; continue with: loom train --resume "
                    f"{run_dir}" if step_index else "no step was done, so there is no checkpoint"))
                return 0
            lr = lr_at(step_index, cfg.train)
            set_lr(built.optimizer, lr)
            timeline = _start_timeline(built, step_index)
            local_tokens = target_tokens(batches)
            loss_tokens = first(c.loss_tokens(built, local_tokens, global_tokens)
                                for c in built.applied)
            loss_tokens = global_tokens if loss_tokens is None else loss_tokens
            for component in built.applied:
                component.before_step(built, step_index)
            loss_sum, grad_norm, stepped = step(built, batches, loss_tokens, cfg.train.grad_clip)
            done = step_index + 1
            for component in built.applied:
                component.after_step(built, done, done == cfg.train.steps, loss_sum, loss_tokens)
            figures = {}
            if timeline is not None:
                owner, recorder = timeline
                figures = owner.write_timeline(built, recorder, run_dir, step_index, mesh)
            nonfinite = nonfinite_streak(nonfinite, stepped, done, cfg, log, "loss or gradient")
            window_steps += 1
            loss = None
            is_eval = done % cfg.run.eval_every == 0 or done == cfg.train.steps
            if is_eval or done % cfg.run.log_every == 0:  # an evaluated step is always logged
                rec = _record(done, loss_sum, global_tokens, lr, grad_norm, stepped, mesh,
                              window_steps * tokens_per_step / (time.perf_counter() - window_t0))
                loss = rec["loss"]
                rec["elapsed_s"] = round(time.perf_counter() - loop_t0, 3)
                rec.update(figures)
                for component in built.applied:  # each technique's own figures
                    rec.update(component.metrics(built, is_eval))
                if is_eval:
                    rec.update(validate(built, val_data, device))
                log.record(rec)
                window_t0, window_steps = time.perf_counter(), 0
            log.advance(loss, tokens_per_step / (time.perf_counter() - step_t0))
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < cfg.train.steps:
                save(built, run_dir, done)
                saved_at = done
        return finish(built, run_dir, start, log)
    finally:
        log.close()


def finish(built: Built, run_dir: Path, start: int, log: RunLog) -> int:
    """After the loop: the last step's checkpoint, or why a resumed run had nothing to do."""
    steps = built.cfg.train.steps
    if start < steps:
        save(built, run_dir, steps)
    else:
        log.message(f"nothing to do: the checkpoint is at step {start}, train.steps="
                    f"{steps} (raise it with --set train.steps=N to continue)")
    return 0


def log_start(log: RunLog, description: str, mesh, start: int, resume: Path | None,
              init: tuple[Path, int] | None, validate_now) -> None:
    """The run's first lines: what it trains and the mesh, or where it resumed; for a fine-tune
    (`init`: load_init_weights' checkpoint and step) that checkpoint's figures on this run's
    validation set, `validate_now()` (collective: every rank calls this)."""
    if start == 0:
        log.message(f"{description}; {mesh.describe()}")
        if mesh.link is not None:
            log.message(mesh.link.describe())
    else:
        log.message(f"resumed from {resume} at step {start}")
    if init is not None:
        before = validate_now()
        log.message(f"initialized from {init[0]} (step {init[1]} of its run); before training: "
                    + ", ".join(f"{k} {v:.4f}" for k, v in before.items()))


def nonfinite_streak(streak: int, stepped: bool, done: int, cfg: Config, log: RunLog,
                     what: str) -> int:
    """The skipped steps in a row once step `done` (counted from 1) has stepped or been
    skipped for a non-finite `what`: each skip is warned about, and run.max_nonfinite_steps
    in a row raise NonFiniteError (exit code 3)."""
    if stepped:
        return 0
    streak += 1
    limit = cfg.run.max_nonfinite_steps
    log.message(f"warning: step {done} skipped: non-finite {what} ({streak} in a row, limit {limit})")
    if streak >= limit:
        raise NonFiniteError(f"{streak} consecutive steps had a non-finite {what} "
                             f"(run.max_nonfinite_steps={limit}); aborting")
    return streak


def _start_timeline(built: Built, step_index: int):
    """Step `run.timeline_step` (counted from 1) records its timeline, if a component records
    (the pipeline runtime its actions, the ZeRO engine its units): (that component, the
    Timeline) or None."""
    if built.cfg.run.timeline_step != step_index + 1:
        return None
    recorder = Timeline()
    owner = next((c for c in built.applied if c.start_timeline(built, recorder)), None)
    return None if owner is None else (owner, recorder)


def write_config(run_dir: Path, cfg: Config) -> None:
    """The resolved config as RUN_DIR/config.toml, replaced atomically."""
    tmp = run_dir / "config.toml.tmp"
    tmp.write_text(config_to_toml(cfg))
    os.replace(tmp, run_dir / "config.toml")


def save(built: Built, run_dir: Path, step_done: int, extra: dict | None = None) -> None:
    """Checkpoint step `step_done`: what the components must finish first (micro-batches in
    flight, one model from the replicas), then the model and optimizer in their layout and
    each component's own state (collective: every rank calls it)."""
    for component in built.applied:
        component.before_save(built)
    rank = built.mesh.rank
    tensors = {k: v for c in built.applied for k, v in c.state(built, rank).items()}
    checkpoint.save(run_dir, step_done, built.model, built.optimizer, built.mesh,
                    built.cfg.checkpoint.keep, {**built.meta, **(extra or {})}, tensors,
                    built.layout or PLAIN)


def restore(built: Built, path: Path, extra: dict | None = None) -> dict:
    """Load checkpoint `path` into what `build` built and into each component's state;
    returns its loom.json (collective). A component's state that does not fit is a
    CheckpointError naming the checkpoint."""
    saved = checkpoint.saved_tensors(path, "")
    rank = built.mesh.rank
    holders = {c.name: c.placeholders(built, path, saved, rank) for c in built.applied}
    every = {k: v for part in holders.values() for k, v in part.items()}
    every.update(extra or {})
    meta = checkpoint.load(path, built.model, built.optimizer, built.mesh, every,
                           built.layout or PLAIN)
    try:
        for component in built.applied:
            component.load_state(built, {k: every[k] for k in holders[component.name]}, rank)
    except ValueError as err:
        raise CheckpointError(f"checkpoint {str(path)!r} does not match this run: {err}") from None
    for key in extra or {}:
        extra[key] = every[key]
    return meta
