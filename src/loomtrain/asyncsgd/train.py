"""`loom train` with `[async] mode = "ps"`: rank 0 is the parameter server (server.py), ranks
1..W its workers (worker.py); with async.servers = S > 1, ranks 0..S-1 are servers each owning
a slice of the parameters (shard.py). What each rank does, stragglers, metrics, checkpoints
and `loom train --rejoin`: docs/async.md, "The training mode".
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch

from loomtrain import comm
from loomtrain.asyncsgd import state as server_state
from loomtrain.asyncsgd.adaptive import AdaptiveAccumulation
from loomtrain.asyncsgd.policies import build_policy
from loomtrain.asyncsgd.rejoin import (
    ADDRESS_FILE,
    publish_address,
    read_address,
    rejoin_worker,
    withdraw_address,
)
from loomtrain.asyncsgd.server import ParameterServer, build_server
from loomtrain.asyncsgd.shard import (
    gather_final,
    owned_parameters,
    send_final,
    server_slice,
    shard_bounds,
)
from loomtrain.asyncsgd.worker import worker_pushes
from loomtrain.data import WindowSampler, load_data, part_sampler, rank_samples
from loomtrain.errors import ConfigError, UserError
from loomtrain.mesh import AXES, Mesh
from loomtrain.models import build_model, token_loss_sum
from loomtrain.optim import build_optimizer, lr_at
from loomtrain.train.batches import load_rows, target_tokens
from loomtrain.train.launch import pick_device
from loomtrain.train.loop import Mode, Stepped, run_loop
from loomtrain.train.metrics import RunLog, peak_mem_bytes, truncate_metrics
from loomtrain.train.trainer import NonFiniteError, evaluate, write_config

AXIS = "world"  # members 0..S-1: the servers; members S..: the workers
_END = object()  # the end of a server's updates


class WorkersLostError(comm.CollectiveError):
    """Every worker was lost before train.steps updates (they died; the launcher in
    train/launch.py lets the server go on without them): the run failed, exit code 4 as for a
    failed collective, after the server saved its state."""


def train_async(cfg, run_dir: Path, resume: Path | None, mesh, stop) -> int:
    """Every rank of an `[async] mode = "ps"` run calls this (run.train_loop does). `resume`: the
    checkpoint the server restores (the CLI has checked that it fits: asyncsgd/state.py)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.run.seed)
    corpus = load_data(cfg.data, cfg.model.vocab_size)
    model = build_model(cfg.model).to(mesh.device)
    flat = flatten_parameters(model)
    servers = cfg.asgd.servers
    try:
        bounds = shard_bounds([p.numel() for p in model.parameters()], servers)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    assert resume is None or servers == 1, "state.check_resume refuses sharded servers"
    if mesh.rank == 0:
        val_data = WindowSampler(corpus.val, cfg.model.seq_len, cfg.run.seed + 1,
                                 corpus.val_doc_starts)
        _serve(cfg, run_dir, mesh, stop, model, flat, val_data, corpus.description, resume,
               bounds)
    elif mesh.rank < servers:
        _serve_slice(cfg, run_dir, mesh, stop, model, flat, bounds)
    else:
        if resume is not None and not _restored(mesh, True):
            return 0  # the server could not load its checkpoint: it reports why
        train_data = worker_data(cfg, corpus, mesh.rank - servers, mesh.world - servers)
        pushes = worker_pushes(mesh, WorkerStep(cfg, model, flat, train_data, mesh), flat.numel(),
                               axis=AXIS, accumulation=worker_accumulation(cfg),
                               shards=[hi - lo for lo, hi in bounds])
        log = RunLog(run_dir, cfg.train.steps, 0, False, False)
        run_loop(WorkerMode(cfg, mesh, log, pushes), run_dir, 0, stop)
    return 0


def tokens_per_gradient(cfg, mesh) -> int:
    """Every gradient is computed on global_batch / workers rows (an arrival averages k)."""
    return (cfg.train.global_batch // (mesh.world - cfg.asgd.servers)) * cfg.model.seq_len


class WorkerMode(Mode):
    """A worker in the run loop: a step is one push (of k gradients) to its server(s), which
    decide when it ends: the server's stop reaches it in its next reply, so a worker does not
    act on its own stop flag (the launcher forwards a signal to the servers too). It records
    and saves nothing: the server does."""

    last = sys.maxsize  # until the server says stop

    def __init__(self, cfg, mesh, log: RunLog, pushes):
        self.cfg, self.mesh, self.log, self.pushes = cfg, mesh, log, pushes
        self.tokens_per_gradient = tokens_per_gradient(cfg, mesh)

    def begin(self, step, stop):
        return None, False

    def run(self, step, work) -> Stepped | None:
        k = next(self.pushes, None)
        return None if k is None else Stepped(True, k * self.tokens_per_gradient)

    def record(self, done, result, evaluate, tokens_per_s, elapsed_s):
        return None

    def save(self, done, extra=None):
        pass


def worker_accumulation(cfg) -> int | AdaptiveAccumulation:
    """Gradients per push of a worker: 1, or a controller with async.adaptive."""
    a = cfg.asgd
    return AdaptiveAccumulation(a.max_accumulation, a.comm_fraction) if a.adaptive else 1


def worker_data(cfg, corpus, worker: int, workers: int) -> WindowSampler:
    """The sampler of worker `worker` of `workers`: its own files with data.partition =
    "by_file", else the shared windows (WorkerStep picks its rows)."""
    if cfg.data.partition == "by_file":
        return part_sampler(corpus, cfg.model.seq_len, cfg.run.seed, worker, workers)
    return WindowSampler(corpus.train, cfg.model.seq_len, cfg.run.seed, corpus.train_doc_starts)


def _restored(mesh, loaded: bool) -> bool:
    """Resume only, before any message: whether the server loaded its checkpoint (its value of
    `loaded`), in one broadcast from it. Without it a worker would wait for a reply that never
    comes, and the failed server in its exit barrier for the worker."""
    flag = torch.tensor([int(loaded)], device=mesh.device)
    comm.broadcast(flag, mesh, AXIS, 0)
    return bool(flag.item())


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
        servers = cfg.asgd.servers
        self.worker, self.workers = mesh.rank - servers, mesh.world - servers
        slowdown = cfg.asgd.worker_slowdown
        self.slowdown = slowdown[self.worker] if slowdown else 1.0
        self.device = mesh.device
        self.partitioned = cfg.data.partition == "by_file"

    def __call__(self, params: torch.Tensor, step: int) -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        t = self.cfg.train
        torch.manual_seed((((self.cfg.run.seed << 16) + self.worker) << 32) + step
                          & 0xFFFF_FFFF_FFFF_FFFF)  # dropout as a function of the step
        self.flat.copy_(params)
        self.flat.grad.zero_()
        batches = [load_rows(self.data, self._rows(step, micro), self.cfg, self.device)
                   for micro in range(self.cfg.accumulation_steps)]
        tokens = target_tokens(batches)
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


def _server_parts(cfg, mesh, model, bounds: list[tuple[int, int]]):
    """This server's (policy, optimizer over the parameters of its slice)."""
    a = cfg.asgd
    owned = owned_parameters(list(model.parameters()), bounds[mesh.rank])
    return (build_policy(a.policy, mesh.world - len(bounds), a.max_staleness),
            build_optimizer(model, cfg.train, owned))


def _build_server(cfg, mesh, flat, bounds, policy, optimizer, state=None,
                  rejoin=None) -> ParameterServer:
    """The server of this rank's slice of `flat`, with the trainer's lr schedule."""
    return build_server(mesh, server_slice(flat, bounds[mesh.rank]), policy, lr=cfg.train.lr,
                        total_updates=cfg.train.steps,
                        worker_timeout_s=cfg.asgd.worker_timeout_s, axis=AXIS,
                        optimizer=optimizer, lr_schedule=lambda version: lr_at(version, cfg.train),
                        state=state, max_nonfinite=cfg.run.max_nonfinite_steps, rejoin=rejoin,
                        servers=len(bounds))


class ServerMode(Mode):
    """A parameter server in the run loop (train/loop.py): a step is one update, the step
    boundary the moment after it (the worker whose gradient made it waits for its reply). A
    server acts on its own stop flag: its workers hear the stop in their next reply. Server 0
    records, evaluates and checkpoints; sharded servers (shard.py) send it their final slices,
    and it saves the gathered model only, at the end."""

    def __init__(self, cfg, mesh, log: RunLog, run_dir: Path, server: ParameterServer, model,
                 optimizer, flat, bounds, metrics: "ServerMetrics | None"):
        self.cfg, self.mesh, self.log, self.run_dir = cfg, mesh, log, run_dir
        self.server, self.model, self.optimizer, self.flat = server, model, optimizer, flat
        self.bounds, self.metrics = bounds, metrics
        self.updates = server.updates()
        self.sharded = len(bounds) > 1
        self.tokens_per_gradient = tokens_per_gradient(cfg, mesh)
        self.ended = self.exhausted = self.stopped = False
        if metrics is not None:
            metrics.server = server

    def begin(self, step, stop):
        self.stopped = bool(stop.signum)
        return None, self.stopped

    def run(self, step, work) -> Stepped | None:
        server = self.server
        before = len(server.staleness.arrivals)
        if next(self.updates, _END) is _END:
            self.exhausted = True  # served to the end without another update
            return None
        gradients = sum(server.accumulation[before:])
        return Stepped(True, gradients * self.tokens_per_gradient)

    def record(self, done, result, evaluate, tokens_per_s, elapsed_s):
        if self.metrics is None or (self.sharded and done >= self.server.total_updates):
            return None  # sharded: the last record is written on the gathered model (end)
        return self.metrics.record(self.server, evaluate and not self.sharded,
                                   done >= self.server.total_updates, tokens_per_s, elapsed_s)

    def save(self, done, extra=None):
        if self.metrics is None or (self.sharded and not self.ended):
            return  # the model is whole only once the slices are gathered
        extra = {"async": self.cfg.asgd.policy, "workers": len(self.server.peers), **(extra or {})}
        if self.sharded:
            path = server_state.save(self.run_dir, done, self.model, None, None,
                                     self.cfg.checkpoint.keep,
                                     {**extra, "servers": len(self.bounds)})
            self.log.message(f"saved the final model {path} at update {done} of server 0 "
                             "(sharded servers: not resumable)")
            return
        state = {"server": self.server.state_dict(), "metrics": self.metrics.state_dict()}
        server_state.save(self.run_dir, done, self.model, self.optimizer, state,
                          self.cfg.checkpoint.keep, extra)

    def end(self):
        """Lower the run's end to this update. The workers hear it in their replies once the
        server serves on: here for sharded servers (server 0 then gathers the slices, to save
        them), after the final checkpoint otherwise (`close`), as they waited for it before."""
        server = self.server
        server.total_updates = min(server.total_updates, server.version)
        if self.sharded or self.exhausted:
            self._serve_out()

    def close(self):
        if not self.ended:
            self._serve_out()
        result = self.result
        if self.metrics is not None and result.version < self.cfg.train.steps and not self.stopped:
            raise WorkersLostError(
                f"async SGD: every worker was lost, after {result.version} of "
                f"{self.cfg.train.steps} updates; the server's state at update {result.version} "
                f"is saved: continue with `loom train --resume {self.run_dir}`")

    def _serve_out(self) -> None:
        """Serve until every worker has its stop (late gradients make no update now), then
        the slices to server 0 (sharded), the last record and the workers lost. Non-finite
        gradients that ended the run fail it here, before any checkpoint."""
        for _ in self.updates:
            pass
        self.ended = True
        self.result = result = self.server.result()
        if self.metrics is None:  # server s >= 1 of sharded servers
            send_final(self.mesh, AXIS, result.params, result.version, result.aborted is not None)
            aborted = result.aborted and f"server {self.mesh.rank}: {result.aborted}"
        else:
            others = gather_final(self.mesh, AXIS, self.flat, self.bounds)  # (version, aborted)
            # the run's summary record, whatever ended it (its last update, a stop, the
            # workers lost), unless the last update's record holds it
            self.metrics.finish({"server_versions": [result.version, *(v for v, _ in others)]}
                                if others else None)
            if result.lost:
                self.log.message(f"workers lost: {result.lost}; rejoins: "
                                 f"{[(m.worker, m.event) for m in result.membership if m.event != 'lost']}")
            aborted = result.aborted or next((f"server {s} aborted at its version {v}" for s, (v, ab)
                                              in enumerate(others, 1) if ab), None)
        if aborted:  # like the synchronous modes: no checkpoint, exit code 3
            raise NonFiniteError(f"async SGD: {aborted} (run.max_nonfinite_steps="
                                 f"{self.cfg.run.max_nonfinite_steps}); aborting")


def _serve_slice(cfg, run_dir: Path, mesh, stop, model, flat, bounds) -> None:
    """Server s >= 1 of sharded servers (shard.py): serves its slice with its own policy and
    optimizer through the run loop, then sends server 0 its final slice. It writes nothing:
    server 0 writes the metrics and the final model."""
    policy, optimizer = _server_parts(cfg, mesh, model, bounds)
    server = _build_server(cfg, mesh, flat, bounds, policy, optimizer)
    log = RunLog(run_dir, cfg.train.steps, 0, False, False)
    run_loop(ServerMode(cfg, mesh, log, run_dir, server, model, optimizer, flat, bounds, None),
             run_dir, 0, stop)


def _serve(cfg, run_dir: Path, mesh, stop, model, flat, val_data, description: str,
           resume: Path | None, bounds: list[tuple[int, int]]) -> None:
    servers = len(bounds)
    workers = mesh.world - servers
    a = cfg.asgd
    policy, optimizer = _server_parts(cfg, mesh, model, bounds)
    saved = _restore(cfg, run_dir, resume, model, optimizer, policy, mesh)
    start = 0 if saved is None else saved["server"]["version"]
    log = RunLog(run_dir, cfg.train.steps, start, True, cfg.run.progress)
    try:
        if saved is None:
            where = ("parameter server on rank 0" if servers == 1 else
                     f"{servers} parameter servers on ranks 0..{servers - 1} (slices of "
                     f"{', '.join(f'{hi - lo:,}' for lo, hi in bounds)} parameters; only the "
                     "final model is evaluated and saved)")
            log.message(f"{description}; {flat.numel():,} parameters; asynchronous SGD: {where}, "
                        f"{workers} workers, policy {a.policy!r}"
                        + (f", worker slowdown {a.worker_slowdown}" if a.worker_slowdown else "")
                        + (f", adaptive accumulation up to {a.max_accumulation} gradients per "
                           f"push (communication share <= {a.comm_fraction:g})"
                           if a.adaptive else ""))
        else:
            log.message(f"resumed from {resume} at update {start}; the workers continue at "
                        f"their steps {saved['server']['worker_steps']}")
        if mesh.link is not None:
            log.message(mesh.link.describe())
        metrics = ServerMetrics(cfg, model, val_data, mesh, log, start)
        if saved is not None:
            metrics.load_state_dict(saved["metrics"])
        rejoin = None  # sharded: a restarted worker would need a channel to every server
        if servers == 1:
            rejoin = comm.PairHost(cfg.parallel.timeout_s)
            publish_address(run_dir, rejoin.address, workers, flat.numel())
        try:
            server = _build_server(cfg, mesh, flat, bounds, policy, optimizer,
                                   None if saved is None else saved["server"], rejoin)
            run_loop(ServerMode(cfg, mesh, log, run_dir, server, model, optimizer, flat, bounds,
                                metrics), run_dir, start, stop)
        finally:
            withdraw_address(run_dir)
    finally:
        log.close()


def _restore(cfg, run_dir: Path, resume: Path | None, model, optimizer, policy, mesh
             ) -> dict | None:
    """Resume: the model and optimizer loaded from the checkpoint, its server state returned
    (None for a fresh run) and the outcome told to the workers. Only once it has loaded are
    metrics.jsonl cut back to its update and config.toml rewritten (with this resume's --set
    overrides), as the synchronous modes do: a failed resume changes nothing."""
    if resume is None:
        return None
    try:
        saved = server_state.restore(resume, model, optimizer, policy, alone(mesh))
    except Exception:
        _restored(mesh, False)
        raise
    _restored(mesh, True)
    truncate_metrics(run_dir, saved["server"]["version"])
    write_config(run_dir, cfg)
    return saved


class ServerMetrics:
    """Server 0's metrics.jsonl records (`record`, when the run loop logs an update), with the
    run-wide counts of applied gradients; after a resume those include the checkpoint's
    (`load_state_dict`). Sharded servers: this server's counts; no evaluation during the run
    (the other slices are elsewhere), and the last record is written by `finish`, on the
    model gathered after the run."""

    def __init__(self, cfg, model, val_data, mesh, log: RunLog, start: int = 0):
        self.cfg, self.model, self.val_data, self.mesh, self.log = cfg, model, val_data, mesh, log
        self.server: ParameterServer | None = None
        self.seen = 0  # arrivals already in a record
        self.recorded = start  # the version of the latest record
        self.recorded_lost = 0  # the workers lost by then
        self.summarized = False  # the latest record holds the run's summary
        # the run-wide counts up to the checkpoint resumed from: {staleness: applied}, per worker
        self.histogram_before: dict[int, int] = {}
        workers = mesh.world - cfg.asgd.servers
        self.applied_before = [0] * workers
        self.window_t0 = self.t0 = time.perf_counter()
        self.tokens_per_gradient = tokens_per_gradient(cfg, mesh)

    def finish(self, extra: dict | None = None) -> None:
        """The run's summary (validation, the run-wide counts, `extra` fields) in its last
        record, however it ended: a record of its own if the run ended after its latest record
        (a stop, every worker lost; sharded: always), or added to the latest record when that
        one is of the last update (a stop right after a logged update), so that each update
        keeps one record. When the workers were lost right after a record, the last record
        repeats its update with the losses counted."""
        server = self.server
        if server is None or self.summarized:
            return
        if self.recorded < server.version or self.recorded_lost != len(server.lost):
            now = time.perf_counter()
            counts = sum(server.accumulation[self.seen:])
            self.log.record(self.record(server, True, True, counts * self.tokens_per_gradient
                                        / max(now - self.window_t0, 1e-9), now - self.t0, extra))
        else:
            self.log.amend({**self._summary(True), **(extra or {})})

    def record(self, server: ParameterServer, is_eval: bool, last: bool, tokens_per_s: float,
               elapsed_s: float, extra: dict | None = None) -> dict:
        self.server = server
        arrivals = server.staleness.arrivals[self.seen:]
        reports = server.reports[self.seen:]
        counts = server.accumulation[self.seen:]  # gradients each arrival averages
        self.seen += len(arrivals)
        applied = [a.staleness for a in arrivals if a.applied]
        losses = [loss for a, (loss, _) in zip(arrivals, reports)
                  if a.applied and math.isfinite(loss)]
        now = time.perf_counter()
        rec = {"step": server.version,
               "loss": sum(losses) / len(losses) if losses else float("nan"),
               "lr": server.last_lr, "grad_norm": float(server.params.grad.norm()),
               "tokens_per_s": tokens_per_s,
               "comm_bytes": self.mesh.meter.take(),
               "peak_mem_bytes": peak_mem_bytes(self.mesh.device),
               "staleness_mean": sum(applied) / len(applied) if applied else 0.0,
               "staleness_max": max(applied, default=0), "applied": len(applied),
               "discarded": sum(outcome == "discarded" for _, outcome in reports),
               "held": sum(outcome == "held" for _, outcome in reports),
               "nonfinite": sum(outcome == "nonfinite" for _, outcome in reports),
               "workers_lost": len(server.lost),
               "workers_rejoined": sum(m.event != "lost" for m in server.membership),
               "elapsed_s": round(elapsed_s, 3),
               "accumulation_mean": sum(counts) / len(counts) if counts else 0.0}
        if self.mesh.link is not None:  # the server's link: its PARAMS sends over its capacity
            rec["link_gbps"] = self.mesh.link.gbps_at(now)
            rec["link_utilization"] = round(rec["comm_bytes"].get("total", 0) / max(
                self.mesh.link.capacity_bytes(self.window_t0, now), 1e-9), 4)
        if last:
            rec.update(self._summary(is_eval))
        elif is_eval:
            rec["val_loss"] = self._val_loss()
        self.recorded, self.window_t0 = server.version, time.perf_counter()
        self.recorded_lost, self.summarized = rec["workers_lost"], last
        return {**rec, **(extra or {})}

    def _val_loss(self) -> float:
        return evaluate(self.model, self.val_data, self.cfg, alone(self.mesh), self.mesh.device)

    def _summary(self, is_eval: bool) -> dict:
        """The last record's fields: validation, and the counts over every applied gradient
        of the run."""
        counts = self.state_dict()
        out = {"val_loss": self._val_loss()} if is_eval else {}
        return {**out, "staleness_histogram": {str(k): v for k, v in
                                               counts["staleness_histogram"].items()},
                "applied_by_worker": counts["applied_by_worker"]}

    def state_dict(self) -> dict:
        """The run-wide counts so far, resumed ones included: {staleness: applied gradients}
        and the applied gradients per worker."""
        histogram = dict(self.histogram_before)
        by_worker = list(self.applied_before)
        for arrival in self.server.staleness.arrivals:
            if arrival.applied:
                histogram[arrival.staleness] = histogram.get(arrival.staleness, 0) + 1
                by_worker[arrival.worker] += 1
        return {"staleness_histogram": dict(sorted(histogram.items())),
                "applied_by_worker": by_worker}

    def load_state_dict(self, state: dict) -> None:
        self.histogram_before = {int(k): int(v) for k, v in state["staleness_histogram"].items()}
        self.applied_before = [int(n) for n in state["applied_by_worker"]]


def rejoin_async(cfg, run_dir: Path, worker: int) -> int:
    """`loom train --rejoin RUN_DIR --worker W`: this process takes lost worker W's place in
    the running server of RUN_DIR (cfg: its config.toml) and works until the server stops it.
    Bad input (not a running parameter-server run, W out of range or not lost) is a UserError,
    raised before anything is computed."""
    where = f"--rejoin {run_dir} --worker {worker}"
    workers = cfg.parallel.nproc - cfg.asgd.servers
    if cfg.asgd.mode != "ps":
        raise ConfigError(f'{where}: the run has async.mode={cfg.asgd.mode!r}; only the workers '
                          f'of a parameter server (async.mode="ps") rejoin')
    if cfg.asgd.servers > 1:
        raise ConfigError(f"{where}: the run has async.servers={cfg.asgd.servers}; a restarted "
                          "worker rejoins one server, and sharded servers would each have to "
                          "take it back: rejoining needs async.servers=1")
    if not 0 <= worker < workers:
        raise ConfigError(f"{where}: the run has {workers} workers, numbered 0..{workers - 1}")
    published = read_address(run_dir)
    if published is None:
        raise UserError(f"{where}: no parameter server of this run is running (no "
                        f"{ADDRESS_FILE} there: it has finished, or not started)")
    try:
        comm.probe(published["address"], cfg.parallel.timeout_s)
    except comm.PairError as err:
        raise UserError(f"{where}: the run's server does not answer ({err}): it has ended "
                        f"(killed before it could remove {ADDRESS_FILE})") from None
    device = pick_device(cfg.run, 0)
    if device.type == "cpu":
        # a rank's share of the host's cores, as launch.init_distributed gives the run's
        # processes: with every core its threads fought the run's (measured with two busy
        # processes beside a local 3-rank run on 2 cores: under 7 gradients/s instead of 73)
        on_host = cfg.parallel.ranks_per_node or cfg.parallel.nproc
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // on_host))
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model).to(device)
    flat = flatten_parameters(model)
    if flat.numel() != published["numel"]:
        raise ConfigError(f"{where}: {run_dir}/config.toml builds {flat.numel():,} parameters, "
                          f"the running server has {published['numel']:,}: the config changed")
    corpus = load_data(cfg.data, cfg.model.vocab_size)
    # the world's geometry as rank worker + 1 saw it, without its process groups: WorkerStep
    # reads only the rank, the world size and the device
    place = Mesh(sizes={**dict.fromkeys(AXES, 1), "dp": workers + 1}, rank=worker + 1,
                 ranks_per_node=workers + 1, device=device)
    grad_fn = WorkerStep(cfg, model, flat, worker_data(cfg, corpus, worker, workers), place)
    try:
        result = rejoin_worker(published["address"], worker, grad_fn, flat.numel(),
                               timeout_s=cfg.parallel.timeout_s, meter=place.meter, axis=AXIS,
                               accumulation=worker_accumulation(cfg))
    except comm.PairRefused as err:
        raise UserError(f"{where}: the server refused: {err}") from None
    except comm.PairError as err:
        raise UserError(f"{where}: {err}") from None
    print(f"worker {worker} stopped by the server at update {result.version} after "
          f"{result.steps} gradients", file=sys.stderr)
    return 0
