"""`loom train` with `[async] mode = "ps"`: rank 0 is the parameter server (server.py), ranks
1..W its workers (worker.py); docs/async.md.

Every rank builds the model from `run.seed` (the same initial weights; the server sends its
parameters with every reply anyway) and keeps its parameters as views into one flat fp32
buffer, and their gradients as views into `flat.grad`, so the messages' bodies load and leave
without reshaping.

- A worker w (rank w + 1) at its own step s takes the rows the trainer's sampler gives dp rank w
  of W at step s: global_batch / W rows, in micro-batches of train.micro_batch (with
  data.partition = "by_file", rows k*b ... of its own part of the files: data/partition.py;
  b = global_batch / W, k = s). It loads the
  pulled parameters, runs forward and backward (the token-summed loss over its target tokens,
  as one dp rank of W would), clips its own gradient to train.grad_clip and pushes the
  gradient with its loss. With async.worker_slowdown factor f > 1 it then sleeps (f - 1) x its
  measured compute time: a straggler whose step is f times as long, whatever the machine.
  With async.adaptive it pushes the mean of k such gradients (its steps s .. s + k - 1), k
  chosen per push by adaptive.AdaptiveAccumulation from the round trips it measures.
- The server applies each update with the trainer's optimizer (train.optimizer, with its
  weight-decay groups) at lr = lr_at(version) x the policy's lr_scale; train.steps counts
  server updates. It writes metrics.jsonl (the trainer's RunLog), evaluates on its own (a
  one-rank mesh: no collective with the workers, who never evaluate) and saves the final model.

Not built yet: checkpoints during the run and resume (the server's optimizer, policy and
version), skipping non-finite gradients (the server applies what arrives).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from loomtrain.asyncsgd.adaptive import AdaptiveAccumulation
from loomtrain.asyncsgd.policies import build_policy
from loomtrain.asyncsgd.server import ParameterServer, serve
from loomtrain.asyncsgd.worker import run_worker
from loomtrain.data import WindowSampler, load_corpus, part_sampler, rank_samples
from loomtrain.errors import ConfigError
from loomtrain.mesh import AXES, Mesh
from loomtrain.models import build_model, token_loss_sum
from loomtrain.train import checkpoint
from loomtrain.train.metrics import RunLog, peak_mem_bytes
from loomtrain.train.optim import build_optimizer, lr_at
from loomtrain.train.trainer import _load, _target_tokens, evaluate

AXIS = "world"  # member 0: the server; members 1..: the workers


def train_async(cfg, run_dir: Path, resume: Path | None, mesh, stop) -> int:
    """Every rank of an `[async] mode = "ps"` run calls this (trainer._loop does)."""
    if resume is not None:
        raise ConfigError(f'--resume {resume}: async.mode="ps" saves only the final model; '
                          "resuming the parameter server (its optimizer, policy and version) is "
                          "not built yet")
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.run.seed)
    corpus = load_corpus(cfg.data.source, cfg.data.val_fraction, cfg.model.vocab_size)
    model = build_model(cfg.model).to(mesh.device)
    flat = flatten_parameters(model)
    if mesh.rank == 0:
        val_data = WindowSampler(corpus.val, cfg.model.seq_len, cfg.run.seed + 1,
                                 corpus.val_doc_starts)
        _serve(cfg, run_dir, mesh, stop, model, flat, val_data, corpus.description)
    else:
        if cfg.data.partition == "by_file":  # worker w reads only its own files
            train_data = part_sampler(corpus, cfg.model.seq_len, cfg.run.seed, mesh.rank - 1,
                                      mesh.world - 1)
        else:
            train_data = WindowSampler(corpus.train, cfg.model.seq_len, cfg.run.seed,
                                       corpus.train_doc_starts)
        a = cfg.asgd
        accumulation = (AdaptiveAccumulation(a.max_accumulation, a.comm_fraction)
                        if a.adaptive else 1)
        run_worker(mesh, WorkerStep(cfg, model, flat, train_data, mesh), flat.numel(), axis=AXIS,
                   accumulation=accumulation)
    return 0


def flatten_parameters(model) -> torch.Tensor:
    """Moves the model's parameters into one flat fp32 buffer (each parameter a view into it)
    and their gradients into `flat.grad` (views too); returns the buffer."""
    params = list(model.parameters())  # shared (tied) parameters once
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    flat.grad = torch.zeros_like(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat[offset:offset + n].view_as(p)
        p.grad = flat.grad[offset:offset + n].view_as(p)  # backward accumulates in place
        offset += n
    return flat


class WorkerStep:
    """A worker's `grad_fn`: (flat gradient, loss per target token) at the pulled parameters on
    its rows of its step (the sampler's dp rank w of W, or batch `step` of its own part)."""

    def __init__(self, cfg, model, flat: torch.Tensor, data: WindowSampler, mesh):
        self.cfg, self.model, self.flat, self.data = cfg, model, flat, data
        self.worker, self.workers = mesh.rank - 1, mesh.world - 1
        slowdown = cfg.asgd.worker_slowdown
        self.slowdown = slowdown[self.worker] if slowdown else 1.0
        self.device = mesh.device
        self.partitioned = cfg.data.partition == "by_file"

    def __call__(self, params: torch.Tensor, step: int) -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        t = self.cfg.train
        self.flat.copy_(params)
        self.flat.grad.zero_()
        batches = [_load(self.data, self._rows(step, micro), self.cfg, self.device)
                   for micro in range(self.cfg.accumulation_steps)]
        tokens = _target_tokens(batches)
        loss_sum = 0.0
        for x, y in batches:
            loss = token_loss_sum(self.model(x), y)
            (loss / tokens).backward()
            loss_sum += float(loss.detach())
        if t.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        if self.slowdown > 1.0:  # a straggler by its own measured compute time
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - started))
        return self.flat.grad, loss_sum / max(1, tokens)

    def _rows(self, step: int, micro: int) -> range:
        t = self.cfg.train
        if self.partitioned:  # samples numbered within the part: batch `step` of its own rows
            return rank_samples(step, t.global_batch // self.workers, 0, 1, t.micro_batch, micro)
        return rank_samples(step, t.global_batch, self.worker, self.workers, t.micro_batch, micro)


def alone(mesh) -> Mesh:
    """This rank as a mesh of one: every collective on it is a no-op, so the trainer's
    `evaluate` runs on the server without the workers."""
    return Mesh(sizes=dict.fromkeys(AXES, 1), rank=0, ranks_per_node=1, device=mesh.device)


def _serve(cfg, run_dir: Path, mesh, stop, model, flat, val_data, description: str) -> None:
    workers = mesh.world - 1
    a = cfg.asgd
    log = RunLog(run_dir, cfg.train.steps, 0, True, cfg.run.progress)
    try:
        log.message(f"{description}; {flat.numel():,} parameters; asynchronous SGD: parameter "
                    f"server on rank 0, {workers} workers, policy {a.policy!r}"
                    + (f", worker slowdown {a.worker_slowdown}" if a.worker_slowdown else "")
                    + (f", adaptive accumulation up to {a.max_accumulation} gradients per push "
                       f"(communication share <= {a.comm_fraction:g})" if a.adaptive else ""))
        if mesh.link is not None:
            log.message(mesh.link.describe())
        metrics = ServerMetrics(cfg, model, val_data, mesh, log, stop)
        mesh.meter.take()
        result = serve(mesh, flat, build_policy(a.policy, workers, a.max_staleness),
                       lr=cfg.train.lr, total_updates=cfg.train.steps,
                       worker_timeout_s=a.worker_timeout_s, axis=AXIS,
                       optimizer=build_optimizer(model, cfg.train),
                       lr_schedule=lambda version: lr_at(version, cfg.train),
                       on_update=metrics.after_update)
        metrics.finish()
        if result.lost:
            log.message(f"workers lost: {result.lost}")
        if result.version:
            path = save_model(run_dir, result.version, model, metrics.optimizer,
                              {"async": a.policy, "workers": workers})
            log.message(f"saved the model at update {result.version} to {path}")
    finally:
        log.close()


class ServerMetrics:
    """`on_update` of the server: a metrics.jsonl record every run.log_every updates (and at
    every evaluated update and the last), the validation loss every run.eval_every updates
    (and at the last), and the stop on SIGINT/SIGTERM."""

    def __init__(self, cfg, model, val_data, mesh, log: RunLog, stop):
        self.cfg, self.model, self.val_data, self.mesh, self.log, self.stop = (
            cfg, model, val_data, mesh, log, stop)
        self.server: ParameterServer | None = None
        self.optimizer = None
        self.seen = 0  # arrivals already in a record
        self.recorded = 0  # the version of the latest record
        self.window_t0 = self.advanced_t0 = self.t0 = time.perf_counter()
        self.advanced_seen = 0  # arrivals when the progress bar last moved
        # every gradient was computed on global_batch / workers rows (an arrival averages k)
        self.tokens_per_gradient = (cfg.train.global_batch // (mesh.world - 1)) * cfg.model.seq_len

    def after_update(self, server: ParameterServer) -> None:
        self.server, self.optimizer = server, server.optimizer
        version = server.version
        if self.stop.signum and version < server.total_updates:
            self.log.message(f"stopped by signal {self.stop.signum} at update {version}; the "
                             "model is saved (the server's state is not: no resume)")
            server.total_updates = version  # the workers get their stop at their next push
        last = version >= server.total_updates
        is_eval = version % self.cfg.run.eval_every == 0 or last
        loss = None
        if is_eval or version % self.cfg.run.log_every == 0:
            loss = self._record(server, is_eval, last)["loss"]
        now, arrivals = time.perf_counter(), len(server.staleness.arrivals)
        gradients = sum(server.accumulation[self.advanced_seen:arrivals])
        self.log.advance(loss, gradients * self.tokens_per_gradient
                         / max(now - self.advanced_t0, 1e-9))
        self.advanced_t0, self.advanced_seen = now, arrivals

    def finish(self) -> None:
        """A last record if the run ended before its last update (every worker lost)."""
        if self.server is not None and self.recorded < self.server.version:
            self._record(self.server, True, True)

    def _record(self, server: ParameterServer, is_eval: bool, last: bool) -> dict:
        arrivals = server.staleness.arrivals[self.seen:]
        reports = server.reports[self.seen:]
        counts = server.accumulation[self.seen:]  # gradients each arrival averages
        self.seen += len(arrivals)
        applied = [a.staleness for a in arrivals if a.applied]
        losses = [loss for a, (loss, _) in zip(arrivals, reports)
                  if a.applied and math.isfinite(loss)]
        now = time.perf_counter()
        elapsed = now - self.window_t0
        rec = {"step": server.version,
               "loss": sum(losses) / len(losses) if losses else float("nan"),
               "lr": server.last_lr, "grad_norm": float(server.params.grad.norm()),
               "tokens_per_s": sum(counts) * self.tokens_per_gradient / max(elapsed, 1e-9),
               "comm_bytes": self.mesh.meter.take(),
               "peak_mem_bytes": peak_mem_bytes(self.mesh.device),
               "staleness_mean": sum(applied) / len(applied) if applied else 0.0,
               "staleness_max": max(applied, default=0), "applied": len(applied),
               "discarded": sum(outcome == "discarded" for _, outcome in reports),
               "held": sum(outcome == "held" for _, outcome in reports),
               "workers_lost": len(server.lost),
               "elapsed_s": round(time.perf_counter() - self.t0, 3),
               "accumulation_mean": sum(counts) / len(counts) if counts else 0.0}
        if self.mesh.link is not None:  # the server's link: its PARAMS sends over its capacity
            rec["link_gbps"] = self.mesh.link.gbps_at(now)
            rec["link_utilization"] = round(rec["comm_bytes"].get("total", 0) / max(
                self.mesh.link.capacity_bytes(self.window_t0, now), 1e-9), 4)
        if is_eval:
            rec["val_loss"] = evaluate(self.model, self.val_data, self.cfg, alone(self.mesh),
                                       self.mesh.device)
        if last:  # over every applied gradient of the run
            rec["staleness_histogram"] = {str(k): v for k, v in
                                          server.staleness.histogram().items()}
            by_worker = [0] * len(server.peers)
            for arrival in server.staleness.arrivals:
                by_worker[arrival.worker] += arrival.applied
            rec["applied_by_worker"] = by_worker
        self.log.record(rec)
        self.recorded, self.window_t0 = server.version, time.perf_counter()
        return rec


def save_model(run_dir: Path, step: int, model, optimizer, extra: dict) -> Path:
    """The model and the server's optimizer in the checkpoint format (checkpoint.py's layout,
    written by this one rank: DCP without a process group), published as
    checkpoints/step_N/ by one rename; `loom export` and `loom generate` read it. No RNG
    states and no policy state: it is not a point to resume from."""
    final = checkpoint.step_dir(run_dir, step)
    partial = final.with_name(final.name + checkpoint.PARTIAL)
    final.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(partial, ignore_errors=True)
    state = checkpoint.training_state(model, optimizer) if optimizer is not None else {
        "model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(partial, sync_files=True),
                 no_dist=True)
    (partial / "loom.json").write_text(json.dumps(
        {"step": step, "world": 1, "sizes": dict.fromkeys(AXES, 1), "server_only": True,
         **extra}, indent=1))
    shutil.rmtree(final, ignore_errors=True)  # a fresh run under torchrun may reuse a folder
    os.replace(partial, final)
    return final
