"""The backprop training loop every rank runs (`train_backprop`; train/run.py chooses it by
mode), and the pieces the zeroth-order and parameter-server loops share with it.

One optimizer step:
1. the step's micro-batches for this dp rank come from the sampler (a pure function of step;
   train/batches.py);
2. one small all-reduce carries the global target-token count and the "stop" flag (SIGINT or
   SIGTERM on any rank), so every rank agrees on both before any gradient work;
3. micro-batches run forward/backward, all but the last under `no_sync()`; each loss is the
   token-summed cross-entropy divided by the global token count, and the engine sums
   gradients over dp, so the gradient equals the single-process one on the global batch
   (low-communication replicas, lowcomm/, never reduce gradients: each divides by its own
   token count, and the replicas synchronize in `after_step` every `inner_steps` steps);
4. gradients are clipped; a non-finite gradient norm (identical on every rank after the
   all-reduce) skips the step, and too many in a row abort the run;
5. AdamW steps; the loss is all-reduced only on logged steps.
With [sparsity] (sparsity/training.py) the gradient of step 3 may take several passes (SAM,
ZO-SAM) and is masked before step 4, and the masks are re-applied (and updated) after step 5.

What is learnt comes from train/task.py: the model and the samplers for `data.source` (text
windows, or labelled examples for the digits classifier, whose "tokens" are examples). A run
with `train.init_from` loads that checkpoint's weights into the model before `parallelize`
splits it (train/init_from.py), and validates it once before its first step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import torch

from loomtrain import comm
from loomtrain.data import eval_samples
from loomtrain.models import IGNORE_INDEX, token_loss_sum
from loomtrain.optim import build_optimizer, lr_at, set_lr
from loomtrain.parallel import parallelize
from loomtrain.parallel.pipeline import runtime_of
from loomtrain.parallel.sequence import sequence_of
from loomtrain.sparsity.training import build_sparse_training
from loomtrain.timeline import Timeline
from loomtrain.train import checkpoint
from loomtrain.train.batches import batches_of_step, load_rows, target_tokens
from loomtrain.train.config import Config, config_to_toml
from loomtrain.train.init_from import load_init_weights
from loomtrain.train.metrics import RunLog, peak_mem_bytes, truncate_metrics
from loomtrain.train.task import build_task_model, is_classification, load_task_data


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


def _local(model, batch):
    """(inputs, targets) of this rank: under context parallelism (or packing) the sequence
    runtime keeps this rank's tokens of the full rows and notes their documents."""
    sequence = sequence_of(model)
    return sequence.shard(*batch) if sequence is not None else batch


def train_step(model, optimizer, batches, global_tokens: float, grad_clip: float,
               loss_fn=token_loss_sum, sparse=None):
    """Forward/backward over the micro-batches, clip, step. Returns (local loss sum, grad norm,
    stepped). The loss of every micro-batch is divided by `global_tokens`: the global token
    count (this rank's own for low-communication replicas, which step on their own rows).
    `sparse` (sparsity/training.py): its passes (SAM's two, ZO-SAM's probes) make the
    gradient, which it masks before clipping, and it re-applies its masks after the step."""
    runtime = runtime_of(model)
    if getattr(runtime, "owns_optimizer", False):  # schedule="async": it steps per micro-batch
        loss_sum = runtime.train_step(model, batches, global_tokens, loss_fn)
        return loss_sum, runtime.grad_norm, runtime.stepped
    if runtime is not None:  # the schedule runs every micro-batch's forward and backward
        loss_sum = runtime.train_step(model, batches, global_tokens, loss_fn)
    elif sparse is not None:
        loss_sum = sparse.gradient(lambda: _forward_backward(model, batches, global_tokens, loss_fn),
                                   lambda: _forward_loss(model, batches, loss_fn))
    else:
        loss_sum = _forward_backward(model, batches, global_tokens, loss_fn)
    grad_norm = model.clip_grad_norm_(grad_clip)
    stepped = bool(torch.isfinite(grad_norm))
    if stepped:
        optimizer.step()
    if sparse is not None:
        sparse.after_step(stepped)
    optimizer.zero_grad(set_to_none=False)  # keep grads as views into the engine's buckets
    return loss_sum, grad_norm, stepped


def _forward_backward(model, batches, global_tokens: float, loss_fn) -> torch.Tensor:
    """Forward and backward of every micro-batch, all but the last under `no_sync()`;
    returns this rank's loss sum."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=batches[0][0].device)
    for i, batch in enumerate(batches):
        x, y = _local(model, batch)
        last = i == len(batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss = loss_fn(model(x), y)
            (loss / global_tokens).backward()
        loss_sum += loss.detach()
    return loss_sum


@torch.no_grad()
def _forward_loss(model, batches, loss_fn) -> torch.Tensor:
    """This rank's loss sum over the micro-batches, forwards only (zeroth-order probes)."""
    return sum(loss_fn(model(x), y).double() for x, y in (_local(model, b) for b in batches))


def evaluate(model, sampler, cfg: Config, mesh, device, loss_fn=token_loss_sum) -> float:
    """Mean validation loss per token (per example for a classification task)."""
    return validate(model, sampler, cfg, mesh, device, loss_fn)["val_loss"]


@torch.no_grad()
def validate(model, sampler, cfg: Config, mesh, device, loss_fn=token_loss_sum) -> dict:
    """{"val_loss": the mean validation loss per token over the fixed validation set, dealt to
    the dp ranks}, and for a classification task (train/task.py) "val_accuracy": the share of
    those examples whose largest logit is their label's (the counts ride in the same
    all-reduce).

    Every rank runs the same number of forwards: a ZeRO-3 forward gathers parameters, a
    collective, so a rank with fewer batches (eval_batches not a multiple of dp) repeats its
    first one (or batch 0) and does not count it."""
    _drain(model)
    model.eval()
    classify = is_classification(cfg)
    total = torch.zeros(3 if classify else 2, dtype=torch.float64, device=device)
    dp = mesh.size("dp")
    mine = eval_samples(cfg.run.eval_batches, cfg.train.micro_batch, mesh.local_rank("dp"), dp)
    rounds = -(-cfg.run.eval_batches // dp)
    if cfg.data.balance:  # the pool deals each round's rows of every dp rank, once
        every = [eval_samples(cfg.run.eval_batches, cfg.train.micro_batch, r, dp) for r in range(dp)]
        mine = [[g for share in every for g in (share[i] if i < len(share) else [])]
                for i in range(rounds)]
    runtime = runtime_of(model)
    for i in range(rounds):
        samples = mine[i] if i < len(mine) else (mine or [range(cfg.train.micro_batch)])[0]
        x, y = _local(model, load_rows(sampler, samples, cfg, device))
        out = runtime.forward_only(model, x) if runtime is not None else model(x)
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


def _drain(model) -> None:
    """schedule="async" completes the micro-batches in flight, so that what is evaluated or
    saved has learnt from every micro-batch so far on every stage."""
    runtime = runtime_of(model)
    if getattr(runtime, "owns_optimizer", False):
        runtime.drain()


def _control(batches, stop: StopFlag, mesh, balanced: bool = False) -> tuple[float, bool]:
    """(global target tokens, whether any rank got SIGINT/SIGTERM), agreed by all ranks in
    one all-reduce."""
    control = torch.tensor([target_tokens(batches), bool(stop.signum)], dtype=torch.float64,
                           device=mesh.device)
    comm.all_reduce(control, mesh, "world")
    replicas = mesh.world // mesh.size("dp")  # tp/pp/cp peers count the same tokens
    if balanced:  # every rank loaded the whole pool's rows
        replicas = mesh.world
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
    model = build_task_model(cfg).to(device)
    parameters = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    init = None  # a fresh run from a checkpoint's weights: before any layout splits them
    if resume is None and cfg.train.init_from is not None:
        init = load_init_weights(model, cfg)
    # the strategies take the model and return it wrapped with its optimizer (built after
    # tensor parallelism, rebuilt by ZeRO over this rank's shard) and the loss its outputs
    # need; the checkpoint then loads into the wrapped pair
    model, optimizer, loss_sum_fn = parallelize(model, mesh, cfg,
                                             lambda m: build_optimizer(m, cfg.train))
    if getattr(runtime_of(model), "owns_optimizer", False):
        optimizer = runtime_of(model).optimizer  # schedule="async": the one its runtime steps
    sparse = build_sparse_training(model, optimizer, cfg, mesh)  # masks the weights at once
    start = 0
    if resume is not None:
        masks = sparse.placeholders(resume) if sparse is not None else {}
        start = checkpoint.load(resume, model, optimizer, mesh, masks)["step"]
        if sparse is not None:
            sparse.load_state_dict(masks)
        if mesh.rank == 0:  # only now that the checkpoint fits: a failed resume changes nothing
            truncate_metrics(run_dir, start)
            write_config(run_dir, cfg)  # with the resume's --set overrides
    log = RunLog(run_dir, cfg.train.steps, start, mesh.rank == 0, cfg.run.progress)
    log_start(log, f"{data.description}; {parameters:,} parameters", mesh, start, resume, init,
              lambda: validate(model, val_data, cfg, mesh, device, loss_sum_fn))
    plan = getattr(sequence_of(model), "plan", None)  # cp_method="auto": what it chose
    if plan is not None:
        log.message(f"automatic sequence parallelism: {plan.describe()}")
    tokens_per_step = cfg.train.global_batch * data.targets_per_row
    nonfinite, window_t0, window_steps = 0, time.perf_counter(), 0
    loop_t0 = window_t0  # each record's elapsed_s counts from here
    # async.worker_slowdown with async.mode="none": this rank a straggler on purpose
    slowdown = cfg.asgd.worker_slowdown[mesh.rank] if cfg.asgd.worker_slowdown else 1.0
    saved_at = start  # the newest checkpoint (if any) holds the state after this step
    lowcomm = cfg.lowcomm.algorithm != "none"
    compressed = cfg.compression.method != "none"
    mesh.meter.take()
    mesh.meter.take_simulated()
    mesh.meter.take_link_wait()
    try:
        for step in range(start, cfg.train.steps):
            step_t0 = time.perf_counter()
            batches = batches_of_step(train_data, cfg, mesh, step, device)
            global_tokens, stopping = _control(batches, stop, mesh, cfg.data.balance)
            if stopping:
                name = signal.Signals(stop.signum).name if stop.signum else "a signal to another rank"
                if step > saved_at:
                    save(cfg, run_dir, step, model, optimizer, mesh, {"stopped_by": name}, sparse)
                log.message(f"stopped by {name} before step {step + 1}; " + (
                    f"checkpoint step {step} is saved; continue with: loom train --resume {run_dir}"
                    if step else "no step was done, so there is no checkpoint"))
                return 0
            lr = lr_at(step, cfg.train)
            set_lr(optimizer, lr)
            timeline = _start_timeline(model, step, cfg)
            every = cfg.compression.error_every
            if every and (step + 1) % every == 0 and hasattr(model, "measure_error"):
                model.measure_error()  # compressed gradients: this step's error against dense
            # low-communication replicas step on their own rows: each normalizes by its tokens
            loss_tokens = target_tokens(batches) if lowcomm else global_tokens
            if sparse is not None:
                sparse.before_step(step)
            compute_t0 = time.perf_counter()
            loss_sum, grad_norm, stepped = train_step(model, optimizer, batches, loss_tokens,
                                                      cfg.train.grad_clip, loss_sum_fn, sparse)
            if slowdown > 1.0:  # the async workers' rule: sleep (f - 1) x this step's measured
                # forward/backward/step time; the other ranks wait for it at the next collective
                time.sleep((slowdown - 1.0) * (time.perf_counter() - compute_t0))
            done = step + 1
            if lowcomm:  # every inner_steps steps, and after the last, the replicas synchronize
                model.observe_loss(loss_sum, loss_tokens)
                model.after_step(done, last=done == cfg.train.steps)
            bubble = None
            if timeline is not None:
                bubble = _write_timeline(model, timeline, run_dir, step, mesh, cfg)
            nonfinite = nonfinite_streak(nonfinite, stepped, done, cfg, log, "loss or gradient")
            window_steps += 1
            loss = None
            is_eval = done % cfg.run.eval_every == 0 or done == cfg.train.steps
            if is_eval or done % cfg.run.log_every == 0:  # an evaluated step is always logged
                rec = _record(done, loss_sum, global_tokens, lr, grad_norm, stepped, mesh,
                              window_steps * tokens_per_step / (time.perf_counter() - window_t0))
                loss = rec["loss"]
                rec["elapsed_s"] = round(time.perf_counter() - loop_t0, 3)
                if bubble is not None:
                    rec["bubble"] = bubble
                if cfg.data.balance:  # the step's last micro-batch: dealt, and whole rows per rank
                    sequence = sequence_of(model)
                    rec["work_imbalance"] = round(sequence.imbalance, 4)
                    rec["dp_work_imbalance"] = round(sequence.dp_imbalance, 4)
                if lowcomm or compressed or (sparse is not None and sparse.sparse_comm):
                    # the algorithm's own figures (a spread, a ratio, the sparse bytes, ...)
                    rec.update(model.metrics())
                if sparse is not None:  # passes per step, density (per layer when evaluated)
                    rec.update(sparse.metrics(per_layer=is_eval))
                if is_eval:
                    rec.update(validate(model, val_data, cfg, mesh, device, loss_sum_fn))
                log.record(rec)
                window_t0, window_steps = time.perf_counter(), 0
            log.advance(loss, tokens_per_step / (time.perf_counter() - step_t0))
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < cfg.train.steps:
                save(cfg, run_dir, done, model, optimizer, mesh, None, sparse)
                saved_at = done
        return finish(cfg, run_dir, start, model, optimizer, mesh, log, sparse)
    finally:
        log.close()


def finish(cfg: Config, run_dir: Path, start: int, model, optimizer, mesh, log: RunLog,
           sparse=None) -> int:
    """After the loop: the last step's checkpoint, or why a resumed run had nothing to do."""
    if start < cfg.train.steps:
        save(cfg, run_dir, cfg.train.steps, model, optimizer, mesh, None, sparse)
    else:
        log.message(f"nothing to do: the checkpoint is at step {start}, train.steps="
                    f"{cfg.train.steps} (raise it with --set train.steps=N to continue)")
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


def _start_timeline(model, step: int, cfg: Config):
    """Step `run.timeline_step` (counted from 1) records its timeline, if the engine records
    (the pipeline runtime records its actions, the ZeRO engine its units)."""
    if cfg.run.timeline_step != step + 1:
        return None
    runtime = runtime_of(model)
    if runtime is not None:
        runtime.spans = []
        return runtime
    if not hasattr(model, "timeline"):
        return None
    model.timeline = Timeline()
    return model.timeline


def _write_timeline(model, timeline, run_dir: Path, step: int, mesh, cfg: Config) -> float | None:
    """Writes the recorded step; returns the pipeline's measured bubble fraction (None
    without a pipeline)."""
    if timeline is runtime_of(model):
        return _write_pipeline_timeline(timeline, run_dir, step, mesh, cfg)
    model.timeline = None
    if mesh.rank == 0:
        timeline.write(run_dir / "timeline.json", step=step + 1, rank=0)
    return None


def _write_pipeline_timeline(runtime, run_dir: Path, step: int, mesh, cfg: Config) -> float:
    from loomtrain.timeline import PIPELINE_TIMELINE_JSON, measured_bubble, write_pipeline_timeline

    ranks = runtime.gather_spans()
    bubble = measured_bubble(ranks)
    s = runtime.schedule
    theory = runtime.bubble_theory()
    if mesh.rank == 0:
        write_pipeline_timeline(run_dir / PIPELINE_TIMELINE_JSON, ranks, step=step + 1, pp=s.pp,
                                schedule=s.name, microbatches=s.microbatches,
                                bubble_measured=bubble, bubble_theory=theory)
    return bubble


def write_config(run_dir: Path, cfg: Config) -> None:
    """The resolved config as RUN_DIR/config.toml, replaced atomically."""
    tmp = run_dir / "config.toml.tmp"
    tmp.write_text(config_to_toml(cfg))
    os.replace(tmp, run_dir / "config.toml")


def save(cfg: Config, run_dir: Path, step: int, model, optimizer, mesh, extra: dict | None = None,
         sparse=None) -> None:
    _drain(model)
    if cfg.lowcomm.algorithm != "none":  # a stop between syncs: one model to save
        model.end_period()
    checkpoint.save(run_dir, step, model, optimizer, mesh, cfg.checkpoint.keep, extra or {},
                    sparse.state_dict() if sparse is not None else None)
