"""The asynchronous parameter server as a component (docs/async.md): its keys and rules, and
the straggler switch (async.worker_slowdown), which also slows the synchronous trainer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loomtrain.component import Built, Component, Refusal, Section, Switch, changed_keys


class AsyncConfig(Section):
    # asynchronous SGD with a parameter server (asyncsgd/, docs/async.md): mode "ps" makes
    # rank 0 the server and ranks 1.. its workers; the other keys are read only then
    mode: Literal["none", "ps"] = "none"
    # server ranks sharding the parameters (asyncsgd/shard.py): ranks 0..servers-1 each own a
    # contiguous slice, ranks servers.. are the workers
    servers: int = Field(1, ge=1)
    # the staleness policy (asyncsgd/policies.py: POLICIES)
    policy: Literal["plain", "bounded", "drop_stale", "staleness_scaled", "ringleader"] = "plain"
    max_staleness: int = Field(4, ge=0)  # "bounded": the spread s; "drop_stale": the threshold
    # per worker (ranks servers..), a factor >= 1 on its step time: it sleeps (f - 1) x its measured
    # compute time after each gradient; empty: every worker at full speed. With mode "none",
    # one factor per rank of the synchronous trainer (a straggler for synchronous DP)
    worker_slowdown: list[float] = []
    # a worker that sends nothing for this long after the server expects it is dropped
    worker_timeout_s: float = Field(60.0, gt=0.0)
    # adaptive communication load (asyncsgd/adaptive.py): each worker pushes the mean of k
    # gradients, k in [1, max_accumulation] chosen from its measured round trip so that at
    # most comm_fraction of its cycle is spent not computing
    adaptive: bool = False
    max_accumulation: int = Field(8, ge=1)
    comm_fraction: float = Field(0.25, gt=0.0, lt=1.0)


_WHOLE = ("the server and every worker hold the whole fp32 model, each worker computes its "
          "gradient alone, with no collective")


class AsyncSGD(Component):
    """[async] mode="ps": ranks 0..servers-1 serve fp32 parameters (all, or a slice each) to
    plain single-rank workers; its keys mean nothing without it, except worker_slowdown, which
    with mode "none" slows ranks of the synchronous trainer: one factor per rank."""

    name = "asyncsgd"
    section, keys = "async", AsyncConfig
    switches = (Switch("async.mode", "none"),)
    summary = "parameter-server ASGD: staleness policies, Ringleader, adaptive load, shards"
    refuses = {**{other: Refusal(_WHOLE, yet=False) for other in
                  ("tensor", "pipeline", "context", "zero", "bf16", "lowcomm", "compression",
                   "packing", "balance", "timeline")}}

    @classmethod
    def batch_ranks(cls, cfg) -> tuple[int, str] | None:
        """The workers (nproc - servers) share each step's global batch."""
        if cfg.asgd.mode != "ps":
            return None
        return cfg.parallel.nproc - cfg.asgd.servers, "workers"

    @classmethod
    def validate(cls, cfg) -> None:
        a, p, t = cfg.asgd, cfg.parallel, cfg.train
        if a.mode == "none":
            changed = [k for k in changed_keys(a) if k not in ("mode", "worker_slowdown")]
            if changed:
                raise ValueError(f'async.{changed[0]} is a setting of the asynchronous parameter '
                                 f'server, which is off (async.mode="none"): set async.mode="ps" '
                                 "or leave the key unset")
            if a.worker_slowdown and len(a.worker_slowdown) != p.nproc:
                raise ValueError(f'async.worker_slowdown={a.worker_slowdown} with async.mode="none" '
                                 "slows ranks of synchronous training: it needs one factor per rank, "
                                 f"parallel.nproc={p.nproc} (got {len(a.worker_slowdown)}); leave it "
                                 "empty for all at full speed")
            _check_slowdown_factors(a.worker_slowdown)
            return
        if cfg.run.max_restarts:
            raise ValueError(f'run.max_restarts={cfg.run.max_restarts} does not apply to async.mode="ps": '
                             "a lost worker does not end a parameter-server run (restart it with "
                             "`loom train --rejoin RUN_DIR --worker W`), and a lost server ends it "
                             "(continue with `loom train --resume RUN_DIR`); leave run.max_restarts at 0")
        if p.nproc < a.servers + 1:
            raise ValueError(f'async.mode="ps" runs the parameter server on ranks 0..{a.servers - 1} '
                             f"(async.servers={a.servers}) and workers on ranks {a.servers}..: it "
                             f"needs parallel.nproc >= {a.servers + 1} (got {p.nproc})")
        workers = p.nproc - a.servers
        if a.worker_slowdown and len(a.worker_slowdown) != workers:
            servers = ("rank 0 is the server" if a.servers == 1
                       else f"ranks 0..{a.servers - 1} are servers")
            raise ValueError(f"async.worker_slowdown={a.worker_slowdown} needs one factor per worker: "
                             f"parallel.nproc={p.nproc} gives {workers} (ranks {a.servers}.."
                             f"{p.nproc - 1}; {servers}); leave it empty for all at full speed")
        _check_slowdown_factors(a.worker_slowdown)
        _check_adaptive(a)
        _check_sharded_servers(a, cfg.checkpoint)


class Straggler(Component):
    """async.worker_slowdown: ranks slowed on purpose (async workers, or the synchronous
    trainer's ranks with async.mode="none")."""

    name = "straggler"
    switches = (Switch("async.worker_slowdown", []),)
    summary = "ranks slowed on purpose by a factor on their step time"

    @classmethod
    def applies(cls, cfg) -> bool:
        """In the synchronous trainer; the asynchronous workers slow themselves."""
        return cls.active(cfg) and cfg.asgd.mode == "none"

    @classmethod
    def before_step(cls, built: Built, step: int) -> None:
        import time

        built.parts[cls.name] = time.perf_counter()

    @classmethod
    def after_step(cls, built: Built, done: int, last: bool, loss_sum, loss_tokens: float) -> None:
        """The async workers' rule: sleep (f - 1) x this step's measured forward, backward and
        update time; the other ranks wait for it at the next collective."""
        import time

        factor = built.cfg.asgd.worker_slowdown[built.mesh.rank]
        if factor > 1.0:
            time.sleep((factor - 1.0) * (time.perf_counter() - built.parts[cls.name]))


def _check_sharded_servers(a: AsyncConfig, c) -> None:
    """What several servers (asyncsgd/shard.py) cannot do: hold workers back each on its own
    (bounded), and save their independent states as one checkpoint while they serve."""
    if a.servers == 1:
        return
    if a.policy == "bounded":
        raise ValueError(f'async.servers={a.servers} with async.policy="bounded" is not supported: '
                         "each server would hold workers back by its own versions, and a worker "
                         "that one server has answered can be held by another, so two servers can "
                         "each wait for a worker the other holds (a deadlock until "
                         'worker_timeout_s); use "plain", "drop_stale", "staleness_scaled" or '
                         '"ringleader", which never hold a worker back, or async.servers=1')
    if c.every:
        raise ValueError(f"async.servers={a.servers} with checkpoint.every={c.every} is not "
                         "supported: the servers keep independent versions and never wait for "
                         "one another, so no moment holds a consistent state of all of them; "
                         "only the final model is saved (whole, at the end or at a stop). Set "
                         "checkpoint.every=0")


def _check_adaptive(a: AsyncConfig) -> None:
    """max_accumulation and comm_fraction are read by the adaptive controller only; the bounded
    policy's waits would read to it as link time."""
    if not a.adaptive:
        changed = [k for k in ("max_accumulation", "comm_fraction")
                   if getattr(a, k) != AsyncConfig.model_fields[k].default]
        if changed:
            raise ValueError(f"async.{changed[0]}={getattr(a, changed[0])} belongs to the adaptive "
                             "communication load, which is off: set async.adaptive=true or leave "
                             "the key unset")
    elif a.policy == "bounded":
        raise ValueError('async.adaptive=true with async.policy="bounded" is not supported: a '
                         "worker measures the time the server holds it back as round-trip time "
                         "and would raise its accumulation for it, not for the link; use "
                         '"plain", "drop_stale", "staleness_scaled" or "ringleader"')


def _check_slowdown_factors(factors: list[float]) -> None:
    if any(f < 1.0 for f in factors):
        raise ValueError(f"async.worker_slowdown={factors}: each factor must be >= 1 "
                         "(a worker with factor f sleeps (f - 1) x its compute time per step)")
