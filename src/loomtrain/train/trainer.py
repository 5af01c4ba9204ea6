"""One training step of what `build` built (`step`), and what every mode of the run loop
(train/loop.py) shares: validation, checkpoints and their restore, the control all-reduce,
the non-finite streak, the first log lines and the stop flag.

The step knows no technique: it calls the components' hooks in their order. One step:
docs/training.md, "One step"; the loop: docs/architecture.md, "The run loop".
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from loomtrain import comm
from loomtrain.component import Built
from loomtrain.data import eval_samples
from loomtrain.errors import CheckpointError
from loomtrain.models import IGNORE_INDEX, token_loss_sum
from loomtrain.parallel.state import PLAIN
from loomtrain.timeline import Timeline
from loomtrain.train import checkpoint
from loomtrain.train.config import Config, config_to_toml
from loomtrain.train.batches import load_rows, target_tokens
from loomtrain.train.metrics import RunLog, peak_mem_bytes
from loomtrain.train.stop import StopFlag
from loomtrain.train.task import is_classification
from loomtrain.writes import write_atomic


class NonFiniteError(RuntimeError):
    pass


def first(hooks):
    """The first answer that is not None (the component that owns this part of the step)."""
    return next((answer for answer in hooks if answer is not None), None)


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

    loss_sum = first(c.gradient(built, forward_backward, lambda: forward_loss(built, batches))
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
        x, y = built.local(batch)
        last = i == len(batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss = loss_fn(model(x), y)
            (loss / global_tokens).backward()
        loss_sum += loss.detach()
    return loss_sum


@torch.no_grad()
def forward_loss(built: Built, batches) -> torch.Tensor | None:
    """This rank's loss sum over the micro-batches (float64), forwards only (zeroth-order
    probes); None off a pipeline's last stage, which holds no output."""
    total = None
    for x, y in (built.local(b) for b in batches):
        out = forward_only(built, x)
        if out is not None:
            loss = built.loss_sum(out, y).double()
            total = loss if total is None else total + loss
    return total


def forward_only(built: Built, x):
    """The output for `x` of a forward without backward: the pipeline's stage after stage
    (None off its last stage) where one runs the model, else the model's own."""
    owned = first(c.forward_only(built, x) for c in built.applied)
    return owned[0] if owned is not None else built.model(x)


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
        x, y = built.local(load_rows(sampler, samples, cfg, device))
        out = forward_only(built, x)
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
    return ranks_loaded(built.applied, built.cfg, built.mesh)


def ranks_loaded(components, cfg, mesh) -> list[int]:
    """`loaded_ranks` under the `components` that apply (the dry run's, before a build)."""
    ranks = first(c.loaded_ranks(cfg, mesh) for c in components)
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


def measured(mesh) -> dict:
    """A record's wire bytes per op since the previous record and this process's peak memory;
    with a simulated link, also its simulated seconds and the seconds waited on it."""
    rec = {"comm_bytes": mesh.meter.take(), "peak_mem_bytes": peak_mem_bytes(mesh.device)}
    if mesh.link is not None:
        rec["comm_simulated_s"] = round(mesh.meter.take_simulated()["total"], 6)
        rec["comm_link_wait_s"] = round(mesh.meter.take_link_wait(), 6)
    return rec


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


def start_timeline(built: Built, step_index: int):
    """Step `run.timeline_step` (counted from 1) records its timeline, if a component records
    (the pipeline runtime its actions, the ZeRO engine its units): (that component, the
    Timeline) or None."""
    if built.cfg.run.timeline_step != step_index + 1:
        return None
    recorder = Timeline()
    owner = next((c for c in built.applied if c.start_timeline(built, recorder)), None)
    return None if owner is None else (owner, recorder)


def write_config(run_dir: Path, cfg: Config) -> None:
    """The resolved config as RUN_DIR/config.toml, replaced atomically (WriteError: the old
    one stays)."""
    write_atomic(run_dir / "config.toml", config_to_toml(cfg))


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
