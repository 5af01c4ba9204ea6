"""`loom train` with `[optim] name` a zeroth-order method: `train_zeroth`, which run.train_loop
calls, trains from forward passes alone (MeZO, Malladi et al., arXiv 2305.17333), the dp ranks
exchanging only seeds and scalars. The step, its bytes, checkpoints and what is refused:
docs/zeroth.md, "Training with loom train".
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from loomtrain.component import CONTEXT, PIPELINE, SPLIT
from loomtrain.errors import CheckpointError
from loomtrain.optim import lr_at
from loomtrain.train import checkpoint
from loomtrain.train.apply import build_run
from loomtrain.train.batches import batches_of_step, target_tokens
from loomtrain.train.components import COMPONENTS
from loomtrain.train.loop import Stepped, SyncMode, SyncStep, train_sync
from loomtrain.train.mfu import Utilization
from loomtrain.train.task import build_task_model
from loomtrain.train.trainer import forward_loss
from loomtrain.zeroth import (STATE_PER_PARAMETER, LocalExchange, SeedScalarExchange,
                              ZOOptimizer, build_zo_optimizer, hyper_keys)
from loomtrain.zeroth.distributed import shared_loss
from loomtrain.zeroth.perturb import parameter_indices
from loomtrain.zeroth.trainable import select_trainable
from loomtrain.zeroth.state import ZEROTH


class ZerothMode(SyncMode):
    """The zeroth-order mode of the run loop (train/loop.py): the model split by the
    components that split it (tensor, pipeline and context parallelism), with those that
    build nothing (data.balance's choice of the rows a rank loads, its metrics), no replica
    engine; a step probes the loss and the dp ranks exchange only seeds and scalars."""

    nonfinite = "projected gradient"

    def utilization(self) -> Utilization:
        """No MFU: the model FLOPs count a backward pass, which a zeroth-order step never runs."""
        return Utilization(None, None, self.mesh.world, "zeroth-order: no backward pass")

    def __init__(self, cfg, mesh, data, fresh: bool):
        with torch.device("meta"):  # the whole model's names: they index each piece's seeds
            whole = build_task_model(cfg)
        splits = [c for c in type(cfg).components or COMPONENTS
                  if c.stage in (None, SPLIT, PIPELINE, CONTEXT)]
        built, setup = build_run(cfg, mesh,
                                 lambda model: build_optimizer(cfg, model, whole, mesh),
                                 fresh, splits)
        # a checkpoint layout of its own; loom.json names the method, which alone resumes it
        built.layout, built.meta["optim"] = ZEROTH, built.optimizer.name
        super().__init__(built, data)
        self.init = setup.init
        self.description = f"{data.description}; {describe(setup.parameters, built.optimizer)}"
        # a rank that loads several dp ranks' rows (data.balance: the pool's, dealt over dp x
        # cp by work) holds no batch of its own: the dp ranks probe the same seeds on the
        # whole batch, each forward's loss sums added over dp x cp, and exchange nothing
        pooled = len(self.ranks) > 1
        self.loss_axis = "dpcp" if pooled else "cp"
        self.exchange = KeptPairs(LocalExchange() if pooled else SeedScalarExchange(mesh, "dp"))
        self.schedule = schedule(cfg)
        # every stage and cp rank (pooled: every dp rank) learns the whole loss; one of them
        # records it (the loop sums the records over dp, cp and pp)
        self.records_loss = (mesh.local_rank("pp") == mesh.size("pp") - 1
                             and mesh.local_rank("cp") == 0
                             and (not pooled or mesh.local_rank("dp") == 0))

    def load(self, step: int):
        """Step `step`'s rows (a refresh: those of steps step .. step + svrg_batches - 1)."""
        opt, cfg, mesh = self.built.optimizer, self.cfg, self.mesh
        refresh = opt.needs_refresh()
        groups = [batches_of_step(self.data.train, cfg, mesh, step + b, mesh.device, self.ranks)
                  for b in range(opt.svrg_batches if refresh else 1)]
        return (groups, refresh), [batch for batches in groups for batch in batches]

    def run(self, step: int, work) -> Stepped:
        (groups, refresh), global_tokens = work
        opt, exchange = self.built.optimizer, self.exchange
        lr = lr_at(step, self.schedule)
        skipped = opt.skipped_steps
        targets = sum(target_tokens(batches) for batches in groups)
        if refresh:
            loss = opt.refresh([batch_loss(self.built, b, self.loss_axis) for b in groups],
                               exchange, lr)
        else:
            loss = opt.step(batch_loss(self.built, groups[0], self.loss_axis), exchange, lr)
        loss_sum = torch.tensor(loss * targets * self.records_loss, dtype=torch.float64,
                                device=self.mesh.device)
        return Stepped(opt.skipped_steps == skipped, global_tokens,
                       detail=SyncStep(loss_sum, global_tokens, lr, self._fields))

    def _fields(self) -> dict:
        """zo_grad: the mean of the step's exchanged scalars (MeZO-SVRG: g(theta) -
        g(snapshot) on minibatch steps, the large batch's g on a refresh); forward_passes: the
        probes' forwards so far over all replicas (each runs the same ones; a pool of dp
        ranks is one replica)."""
        grads = [p.grad for p in self.exchange.pairs]
        return {"zo_grad": sum(grads) / len(grads),
                "forward_passes": self.built.optimizer.forward_passes * self.exchange.world}


def train_zeroth(cfg, run_dir: Path, resume: Path | None, mesh, stop) -> int:
    """Every rank of a run with a zeroth-order `optim.name` calls this (run.train_loop does)."""
    return train_sync(ZerothMode, cfg, run_dir, resume, mesh, stop)


def build_optimizer(cfg, model: nn.Module, whole: nn.Module | None = None,
                    mesh=None) -> ZOOptimizer:
    """The [optim] method over the parameters `optim.trainable` selects, with every parameter's
    requires_grad turned off; unset keys take the method's defaults, seeds derive from
    run.seed. `whole`: the whole model (on the meta device) of which `model` is this rank's
    part, split by tensor or pipeline parallelism over `mesh`: its parameters' indices seed
    the pieces."""
    o = cfg.optim
    trainable = select_trainable(model, o.trainable, whole)
    model.requires_grad_(False)
    hyper = {k: getattr(o, k) for k in hyper_keys(o.name)
             if k not in ("lr", "seed") and getattr(o, k) is not None}
    return build_zo_optimizer(o.name, model, trainable, lr=schedule(cfg).lr, seed=cfg.run.seed,
                              whole=None if whole is None else parameter_indices(whole),
                              mesh=mesh, **hyper)


def schedule(cfg):
    """[train] with the zeroth-order peak lr: lr_at(step, schedule(cfg)) is a step's lr."""
    return cfg.train if cfg.optim.lr is None else cfg.train.model_copy(update={"lr": cfg.optim.lr})


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


def describe(parameters: int, opt: ZOOptimizer) -> str:
    """`parameters`: the whole model's; the trained ones are this rank's (its pieces under
    tensor or pipeline parallelism)."""
    trained = opt.perturber.numel()
    state = STATE_PER_PARAMETER[opt.name]
    return (f"{parameters:,} parameters, {trained:,} trained by {opt.name} on this rank "
            f"({opt.n_perturbations} probe(s) per rank and step; state {state} x {trained:,} "
            "values)")


def batch_loss(built, batches: list, axis: str = "cp") -> Callable[[], torch.Tensor]:
    """The mean target loss of `batches` (micro-batches summed, divided by their targets),
    through the split model's forward (a pipeline's stage after stage, each cp rank on its
    tokens of the rows, under packing with its documents' masks: `Built.local`, as the
    backprop step's loss), on every rank: the sums of the ranks of `axis` added ("cp", or
    "dpcp" for a pool that deals the rows over dp x cp), a pipeline's last stage sending the
    loss to the others (`shared_loss`)."""
    targets = target_tokens(batches)

    def loss_fn() -> torch.Tensor:
        return shared_loss(forward_loss(built, batches), targets, built.mesh, axis)
    return loss_fn


class KeptPairs:
    """The exchange, keeping the pairs of its last call (every rank's) for the metrics."""

    def __init__(self, exchange: SeedScalarExchange):
        self.exchange, self.rank, self.world = exchange, exchange.rank, exchange.world
        self.pairs: list = []

    def __call__(self, pairs):
        self.pairs = self.exchange(pairs)
        return self.pairs
