"""The runs of benchmarks/lowcomm.py against torchft (issue 30): loomtrain's replica wrappers
(lowcomm/) and torchft's `DiLoCo` and `LocalSGD` (torchft.local_sgd) train the same model on
the same rows in the same bare loop, the user's loop of docs/lowcomm.md ("What a step does")
without the trainer, one spawned process per replica, on 127.0.0.1, gloo, one torch thread
each, no simulated link.

What is the same for both: the config tree of the trainer's runs (model, steps, rows, seed,
[train] AdamW, its lr schedule and clipping at train.grad_clip, [lowcomm] inner_steps and
the outer Nesterov SGD's lr and momentum), the model built from torch's generator seeded with
run.seed (so every replica starts identical: loomtrain broadcasts replica 0's weights anyway,
torchft is told so with `init_sync=False`, its setting for replicas seeded alike), each
replica's rows (`batches_of_step`, as the trainer deals them) and the step (the trainer's
`train_step`: the loss divided by this replica's target tokens, the replica's own gradient
clipped, AdamW). What differs is the sync and what it needs around it. loomtrain: a gloo
world and its mesh, the wrapper's broadcast of replica 0's weights, then every H steps one
flat all-reduce (`after_step`). torchft (torchft.local_sgd, as its integration tests run
it): each replica is a replica group of one process with its own TCPStore and `Manager`
(synchronous quorum, `ProcessGroupGloo`) and a lighthouse in the parent process that forms
the quorum of all `world` replicas; every H steps its optimizer hook asks the lighthouse for
a quorum (the first one configures the gloo group), all-reduces each parameter's tensor
(DiLoCo: pseudo-gradient) on its own (torchft's default, no bucketing) and commits.

Per job and replica: `socket_bytes`, the growth of `wchar` in /proc/self/io from before the
replica joins its peers to after its last step: the bytes every thread of the process handed
to write()/writev(), here only the sockets (gloo, the TCPStores, torchft's gRPC to its manager
and lighthouse: heartbeats every 100 ms, quorums, commits); the loop writes no file and prints
nothing, and torchft's logs are set to errors (Python) and warnings (Rust). `loop_s`: the
seconds of that same span (the peers' rendezvous, the wrapping, the steps and their syncs),
of which `sync_steps_s` in the steps that ended in a sync (every H-th, its compute included)
and `steps_s` in the others. `wire_bytes`: for loomtrain, what its meter (comm/meter.py)
counted in that span; None for torchft, whose collectives do not go through it. `loss_sum`
and `tokens` of the last step; `val_sum` and `val_tokens`: this replica's share of the
validation rows on the final model (dealt as the trainer deals them to dp ranks);
`fingerprint`: a CRC-32 of its final parameters (after the last sync every replica's is the
same).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import time
import zlib

import torch
import torch.multiprocessing as mp
import torch.nn as nn
from trainruns import collect
from worlds import free_port, joined_world, wchar_bytes

from loomtrain.data import eval_samples
from loomtrain.lowcomm import apply_lowcomm
from loomtrain.mesh import build_mesh
from loomtrain.models import IGNORE_INDEX, token_loss_sum
from loomtrain.optim import build_optimizer, lr_at, set_lr
from loomtrain.train.batches import batches_of_step, load_rows, target_tokens
from loomtrain.train.config import config_from_dict
from loomtrain.train.task import build_task_model, load_task_data
from loomtrain.train.trainer import train_step

# torchft's Rust side (lighthouse, manager) logs every quorum at info; it reads this when
# torchft is first imported, here or in a spawned replica
os.environ.setdefault("RUST_LOG", "warn")
TIMEOUT_S = 600  # a collective, a quorum or a commit of a loaded machine's replicas
TORCHFT_MISSING = ('benchmarks/lowcomm.py compares against torchft, which is not installed: '
                   'pip install -e ".[peers]"')


def torchft_missing() -> bool:
    try:
        import torchft  # noqa: F401
    except ImportError:
        return True
    return False


class Replica(nn.Module):
    """A torchft replica's model as `train_step` takes it: its own gradient clipped as
    loomtrain clips a whole replica's (parallel/data.py `clip_replica_grads`)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return nn.utils.clip_grad_norm_(self.module.parameters(), max_norm, foreach=True)


@contextlib.contextmanager
def loomtrain_replicas(model, optimizer, cfg, rank: int, world: int, port: int):
    """(the wrapped model, its hook after every optimizer step, the wire bytes its meter
    counted so far): apply_lowcomm over a dp mesh of the world."""
    with joined_world(rank, world, port, timeout_s=TIMEOUT_S):
        mesh = build_mesh({"dp": world})
        wrapped, _ = apply_lowcomm(model, optimizer, mesh, cfg.lowcomm, cfg.run.seed)
        yield (wrapped, lambda done: wrapped.after_step(done, last=done == cfg.train.steps),
               lambda: mesh.meter.total("wire_bytes"))


@contextlib.contextmanager
def torchft_replicas(model, optimizer, cfg, rank: int, world: int, lighthouse: str):
    """(the model, a hook that does nothing: torchft syncs from its optimizer hooks, no
    meter): this replica as a torchft replica group of one process."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo, LocalSGD

    logging.getLogger("torchft").setLevel(logging.ERROR)  # a warning: no NCCL recorder on gloo
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def state_dict():  # what a healing replica would fetch (none heals here)
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
                      state_dict=state_dict, min_replica_size=world, use_async_quorum=False,
                      timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                      rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                      lighthouse_addr=lighthouse, replica_id=f"replica_{rank}",
                      hostname="127.0.0.1", init_sync=False)
    lc = cfg.lowcomm
    if lc.algorithm == "diloco":
        nesterov = lc.outer_optimizer == "nesterov"
        outer = torch.optim.SGD(model.parameters(), lr=lc.outer_lr,
                                momentum=lc.outer_momentum if nesterov else 0.0, nesterov=nesterov)
        method = DiLoCo(manager, [model], optimizer, outer, sync_every=lc.inner_steps)
    else:
        assert lc.algorithm == "local_sgd", lc.algorithm
        method = LocalSGD(manager, model, optimizer, sync_every=lc.inner_steps)
    try:
        with method:
            yield Replica(model), lambda done: None, lambda: None
    finally:
        manager.shutdown(wait=False)


REPLICAS = {"loomtrain": loomtrain_replicas, "torchft": torchft_replicas}


def _replica(rank: int, world: int, kind: str, tree: dict, rendezvous, out) -> None:
    torch.set_num_threads(1)
    cfg = config_from_dict(tree)
    torch.manual_seed(cfg.run.seed)  # the trainer's order: seed, data, model
    data = load_task_data(cfg, world)
    model = build_task_model(cfg)
    optimizer = build_optimizer(model, cfg.train)
    wchar0, start = wchar_bytes(), time.perf_counter()
    with REPLICAS[kind](model, optimizer, cfg, rank, world, rendezvous) as (replica, after_step,
                                                                          wire_bytes):
        figures = _train(replica, optimizer, after_step, data.train, cfg, rank, world)
        figures.update(loop_s=time.perf_counter() - start, socket_bytes=wchar_bytes() - wchar0,
                       wire_bytes=wire_bytes())
        figures.update(_validate(model, data.val, cfg, rank, world))
    out.put((rank, kind, figures))


def _train(replica, optimizer, after_step, sampler, cfg, rank: int, world: int) -> dict:
    """The steps of this replica, as the trainer's loop takes them for a low-communication
    run (train/backprop.py): its rows, the lr of the step, its loss over its own tokens."""
    step_s = [0.0, 0.0]  # seconds of the steps without a sync, of those with one
    for step in range(cfg.train.steps):
        step_start = time.perf_counter()
        batches = batches_of_step(sampler, cfg, None, step, "cpu", [rank], world)
        tokens = target_tokens(batches)
        set_lr(optimizer, lr_at(step, cfg.train))
        loss_sum, _, _ = train_step(replica, optimizer, batches, tokens, cfg.train.grad_clip)
        after_step(step + 1)
        step_s[(step + 1) % cfg.lowcomm.inner_steps == 0] += time.perf_counter() - step_start
    return {"steps": cfg.train.steps, "steps_s": step_s[0], "sync_steps_s": step_s[1],
            "loss_sum": float(loss_sum), "tokens": tokens}


@torch.no_grad()
def _validate(model, sampler, cfg, rank: int, world: int) -> dict:
    """This replica's share of the validation rows on its final model (dealt as the trainer
    deals them to dp ranks, train/trainer.py `validate`) and the CRC-32 of its parameters."""
    val_sum = val_tokens = 0.0
    model.eval()
    for samples in eval_samples(cfg.run.eval_batches, cfg.train.micro_batch, rank, world):
        x, y = load_rows(sampler, samples, cfg, "cpu")[:2]
        val_sum += float(token_loss_sum(model(x), y))
        val_tokens += int((y != IGNORE_INDEX).sum())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"val_sum": val_sum, "val_tokens": val_tokens,
            "fingerprint": zlib.crc32(flat.numpy().tobytes())}


@contextlib.contextmanager
def _rendezvous(kind: str, world: int):
    """Where the replicas of one job meet: loomtrain's, a free port for their gloo world;
    torchft's, a lighthouse in this process that waits for all `world` replicas."""
    if kind == "loomtrain":
        yield free_port()
        return
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=world)
    try:
        yield lighthouse.address()
    finally:
        lighthouse.shutdown()


def run_bare_jobs(jobs: list[tuple[str, str, dict]], world: int) -> dict[str, dict[int, dict]]:
    """Run each job (label, "loomtrain" or "torchft", config tree) in turn, each in `world`
    freshly spawned replica processes; returns {label: {rank: figures}}. Exits if one dies."""
    ctx = mp.get_context("spawn")
    got = {}
    for label, kind, tree in jobs:
        out = ctx.Queue()
        with _rendezvous(kind, world) as rendezvous:
            procs = [ctx.Process(target=_replica, args=(r, world, kind, tree, rendezvous, out))
                     for r in range(world)]
            for p in procs:
                p.start()
            got[label] = {rank: figures for rank, _, figures in collect(procs, out, world)}
            for p in procs:
                p.join()
        print(f"  {label}: done", file=sys.stderr, flush=True)
    return got
