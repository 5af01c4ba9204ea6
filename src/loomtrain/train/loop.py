"""The one run loop every training mode goes through (`run_loop`): the step cadence, stop
signals, the non-finite streak, throughput windows, logs, the progress bar and checkpoints.
A `Mode` supplies its step and what its records and checkpoints hold: backprop
(train/backprop.py), zeroth-order (zeroth/train.py), the parameter server and its workers
(asyncsgd/train.py). The loop and its stop rule: docs/architecture.md, "The run loop".
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from loomtrain import comm
from loomtrain.component import Built
from loomtrain.train import trainer
from loomtrain.train.batches import batches_of_step
from loomtrain.train.metrics import RunLog, truncate_metrics
from loomtrain.train.mfu import Utilization, run_utilization
from loomtrain.train.task import load_task_data


@dataclass
class Stepped:
    """What one step of a mode did."""

    stepped: bool = True  # False: skipped for a non-finite loss or gradient
    tokens: float = 0.0  # the tokens it trained on, over every rank (for throughput)
    loss: float | None = None  # for the progress bar on steps without a record; None: unknown
    detail: Any = None  # the mode's own, for its record
    figures: dict = field(default_factory=dict)  # extra record fields (a timeline's)


class Mode:
    """A training mode as `run_loop` drives it. Every method has the synchronous meaning
    (every rank steps together) unless a mode says otherwise."""

    cfg: Any
    mesh: Any
    log: RunLog
    nonfinite: str = "loss or gradient"  # what a skipped step had that was not finite
    last: int | None = None  # the step after which the loop ends (None: cfg.train.steps)
    streak: int = 0  # this rank's non-finite streak after its last step (the loop keeps it)

    def begin(self, step: int, stop) -> tuple[Any, bool]:
        """Before step `step` (counted from 0): (what `run` needs, whether any rank was asked
        to stop): agreed by every rank that steps together, so that they stop together."""
        raise NotImplementedError

    def run(self, step: int, work) -> Stepped | None:
        """The step; None: the mode has ended on its own (the server: every worker lost)."""
        raise NotImplementedError

    def record(self, done: int, result: Stepped, evaluate: bool, tokens_per_s: float,
               elapsed_s: float) -> dict | None:
        """The metrics.jsonl record of step `done` (with validation when `evaluate`); None:
        this rank writes none (collective where the mode's ranks reduce the loss)."""
        raise NotImplementedError

    def save(self, done: int, extra: dict | None = None) -> None:
        """Checkpoint the state after step `done` (collective)."""
        raise NotImplementedError

    def in_streak(self, done: int) -> bool:
        """Whether a non-finite streak is in progress after step `done` on any rank that
        saves with this one: then no checkpoint is written. Asked by every rank together
        before a checkpoint (collective where the ranks' streaks may differ). Here: this
        rank's own, which is every rank's where they step on one gradient."""
        return self.streak > 0

    def end(self) -> None:
        """After the last step or at a stop, before the final checkpoint (the server: tells
        its workers to stop and waits for them)."""

    def close(self) -> None:
        """After the final checkpoint: may still fail the run (the server: workers lost)."""


def run_loop(mode: Mode, run_dir: Path, start: int, stop, saved_at: int | None = None) -> int:
    """Steps start .. (mode.last or train.steps) - 1 of `mode`. A stop signal is acted on at
    a step boundary, before the next step, the same in every mode: the state after the last
    step is checkpointed (unless it already is) and the run returns 0, to be resumed with
    `loom train --resume`. No checkpoint is written while a non-finite streak is in progress
    (the periodic one is skipped, with a warning): the newest predates the streak.
    `saved_at`: the step the newest checkpoint holds, if not `start` (a rejoined replica's:
    the others', so that it saves at a stop exactly when they do)."""
    cfg, log = mode.cfg, mode.log
    last = cfg.train.steps if mode.last is None else mode.last
    meter = mode.mesh.meter
    meter.take()
    meter.take_simulated()
    meter.take_link_wait()
    saved_at = start if saved_at is None else saved_at  # the newest checkpoint's step
    loop_t0 = window_t0 = time.perf_counter()
    window_tokens = 0.0
    done = start
    for step in range(start, last):
        step_t0 = time.perf_counter()
        work, stopping = mode.begin(step, stop)
        if stopping:
            return _stop(mode, run_dir, step, saved_at, stop)
        result = mode.run(step, work)
        if result is None:
            break
        done = step + 1
        mode.streak = trainer.nonfinite_streak(mode.streak, result.stepped, done, cfg, log,
                                               mode.nonfinite)
        window_tokens += result.tokens
        loss = None
        evaluate = done % cfg.run.eval_every == 0 or done == last
        if evaluate or done % cfg.run.log_every == 0:  # an evaluated step is always logged
            now = time.perf_counter()
            rec = mode.record(done, result, evaluate, window_tokens / (now - window_t0),
                              now - loop_t0)
            if rec is not None:
                log.record(rec)
                loss = rec["loss"]
            window_t0, window_tokens = time.perf_counter(), 0.0
        log.advance(loss if loss is not None else result.loss,
                    result.tokens / (time.perf_counter() - step_t0))
        if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < last:
            if mode.in_streak(done):  # the weights may be what made it: keep the older one
                log.message(f"warning: no checkpoint at step {done}: a non-finite streak is in "
                            f"progress ({_newest(saved_at)} stays the newest)")
            else:
                mode.save(done)
                saved_at = done
    mode.end()
    if done > saved_at and mode.in_streak(done):
        log.message(f"warning: the run ended in a non-finite streak: no checkpoint of step "
                    f"{done} ({_newest(saved_at)} stays the newest)")
    elif done > saved_at:  # the last step's checkpoint
        mode.save(done)
    elif start >= last:
        log.message(f"nothing to do: the checkpoint is at step {start}, train.steps="
                    f"{cfg.train.steps} (raise it with --set train.steps=N to continue)")
    mode.close()
    return 0


def _stop(mode: Mode, run_dir: Path, step: int, saved_at: int, stop) -> int:
    name = signal.Signals(stop.signum).name if stop.signum else "a signal to another rank"
    mode.end()
    if step > saved_at and mode.in_streak(step):  # no checkpoint during a non-finite streak
        saved = f"a non-finite streak is in progress: {_newest(saved_at)} stays the newest"
    else:
        if step > saved_at:
            mode.save(step, {"stopped_by": name})
            saved_at = step
        saved = (f"{_newest(saved_at)} is saved" if saved_at
                 else "no step was done, so there is no checkpoint")
    if saved_at:
        saved += f"; continue with: loom train --resume {run_dir}"
    mode.log.message(f"stopped by {name} before step {step + 1}; {saved}")
    mode.close()
    return 0


def _newest(saved_at: int) -> str:
    return f"checkpoint step {saved_at}" if saved_at else "no checkpoint"


def resume_run(built, run_dir: Path, resume: Path | None) -> int:
    """The step `resume` holds, restored into `built` (0 without one). Only once it has loaded
    are metrics.jsonl cut back to it and config.toml rewritten (with this resume's --set
    overrides): a failed resume changes nothing."""
    if resume is None:
        return 0
    start = trainer.restore(built, resume)["step"]
    if built.mesh.rank == 0:
        truncate_metrics(run_dir, start)
        trainer.write_config(run_dir, built.cfg)
    return start


@dataclass
class SyncStep:
    """What a synchronous step leaves for its record."""

    loss_sum: torch.Tensor  # this rank's loss summed over its targets (float64)
    global_tokens: float  # the targets of the step over every rank
    lr: float
    # the mode's own record fields, read only when the step is logged (a device sync on GPU)
    fields: Callable[[], dict] = dict


class SyncMode(Mode):
    """A mode whose ranks step together (backprop, zeroth-order): each step begins with one
    all-reduce over the world of (target tokens, stop flag), and a logged step all-reduces
    its loss. Subclasses set `built` and `description` and give `load` and `run`."""

    built: Built
    description: str
    init: tuple | None = None  # a fine-tune's (checkpoint, its step): train.init_from

    def __init__(self, built: Built, data):
        self.built, self.cfg, self.mesh, self.data = built, built.cfg, built.mesh, data
        self.ranks = trainer.loaded_ranks(built)

    def load(self, step: int) -> tuple[Any, list]:
        """(what `run` takes, the micro-batches whose targets the step trains on)."""
        batches = batches_of_step(self.data.train, self.cfg, self.mesh, step, self.mesh.device,
                                  self.ranks)
        return batches, batches

    def begin(self, step: int, stop):
        work, batches = self.load(step)
        global_tokens, stopping = trainer._control(batches, stop, self.mesh, len(self.ranks))
        return (work, global_tokens), stopping

    def utilization(self) -> Utilization:
        """How its records' tokens/s become MFU: a backprop step's model FLOPs, every rank a
        device."""
        return run_utilization(self.cfg, self.mesh.device, self.mesh.world)

    def record(self, done, result, evaluate, tokens_per_s, elapsed_s):
        built, mesh, step = self.built, self.mesh, result.detail
        for axis in ("dp", "cp", "pp"):  # pp: the last stage holds the loss; cp: its tokens'
            comm.all_reduce(step.loss_sum, mesh, axis)
        rec = {"step": done, "loss": float(step.loss_sum) / step.global_tokens, "lr": step.lr,
               **step.fields(), "tokens_per_s": tokens_per_s, **trainer.measured(mesh),
               "elapsed_s": round(elapsed_s, 3)}
        if not result.stepped:
            rec["skipped"] = True
        rec.update(result.figures)
        for component in built.applied:  # each technique's own figures
            rec.update(component.metrics(built, evaluate))
        if evaluate:
            rec.update(trainer.validate(built, self.data.val, mesh.device))
        return rec

    def save(self, done, extra=None):
        trainer.save(self.built, self.run_dir, done, extra)

    def in_streak(self, done: int) -> bool:
        """Where replicas step apart (the low-communication wrappers, lowcomm/: each skips a
        step on its own gradient), a streak is one replica's: agreed in a one-number
        all-reduce, so that no replica skips a checkpoint the others write."""
        if not getattr(self.built.model, "replicas_apart", False):
            return self.streak > 0
        return self.agree_streak()

    def agree_streak(self) -> bool:
        """Whether any rank is in a non-finite streak: one all-reduce over the world."""
        streaking = torch.tensor([float(self.streak > 0)], dtype=torch.float64,
                                 device=self.mesh.device)
        comm.all_reduce(streaking, self.mesh, "world")
        return bool(streaking)


def train_sync(make_mode, cfg, run_dir: Path, resume: Path | None, mesh, stop) -> int:
    """A run of a synchronous mode: `make_mode(cfg, mesh, data, fresh)` builds it (the model,
    and for a fresh fine-tune its initial weights), then resume, the first log lines and the
    loop."""
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.run.seed)
    data = load_task_data(cfg, mesh.size("dp"))  # text windows or labelled examples
    mode = make_mode(cfg, mesh, data, resume is None)
    mode.run_dir = run_dir
    built = mode.built
    start = resume_run(built, run_dir, resume)
    mode.log = log = RunLog(run_dir, cfg.train.steps, start, mesh.rank == 0, cfg.run.progress,
                            mode.utilization())
    try:
        log_first_lines(mode, data, start, resume)
        return run_loop(mode, run_dir, start, stop)
    finally:
        log.close()


def log_first_lines(mode: SyncMode, data, start: int, resume: Path | None) -> None:
    """What the run trains (or where it resumed) and each component's line (collective: a
    fine-tune validates its initial weights)."""
    built, mesh, log = mode.built, mode.mesh, mode.log
    trainer.log_start(log, mode.description, mesh, start, resume, mode.init,
                      lambda: trainer.validate(built, data.val, mesh.device))
    for component in built.applied:
        line = component.describe(built)
        if line is not None:
            log.message(line)
