"""Local SGD: every replica steps its own optimizer on its own data, and the replicas average
their parameters every H optimizer steps (`inner_steps`). `LocalSGD` is also the replica
wrapper every low-communication algorithm subclasses.

Stich, arXiv 1805.09767; Lin et al., arXiv 1808.07217. Guide: docs/lowcomm.md.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from loomtrain import comm
from loomtrain.parallel.data import broadcast_state, broadcast_tensors, clip_replica_grads
from loomtrain.parallel.zero.engine import ShardedDataParallel
from loomtrain.parallel.zero.flat import ShardPlan


def build(model, optimizer, mesh, cfg, seed: int):
    """apply_lowcomm's builder for algorithm="local_sgd"."""
    return LocalSGD(model, mesh, cfg.inner_steps), optimizer


class LocalSGD(nn.Module):
    """`model = LocalSGD(model, mesh, inner_steps=H)`; then per step
    `loss.backward(); optimizer.step(); model.after_step(step)`.

    The wrapped module is `.module` (its state_dict keys are unchanged there): the model, or
    the sharded engine (parallel/zero/) that runs each replica in bf16 or ZeRO-shards it over
    the dp ranks of a node (each of them a tp, pp or cp piece or the whole model); the wrapper
    then syncs each rank's own fp32 master weights over the replicas' axis (`replica_axis`)
    and publishes them to the engine's parameters."""

    replicas_apart = True  # each replica steps on its own gradient (train/loop.py in_streak)

    def __init__(self, module: nn.Module, mesh, inner_steps: int, axis: str | None = None):
        super().__init__()
        assert inner_steps >= 1, inner_steps
        self.engine = module if isinstance(module, ShardedDataParallel) else None
        self.module, self.mesh, self.axis = module, mesh, axis or replica_axis(
            None if self.engine is None else self.engine.plan)
        self.inner_steps = inner_steps
        self.steps_since_sync = 0
        # a run that outlives lost replicas (lowcomm/replicas.py) sets these: the replica's own
        # index, kept when the group shrinks, and the guard that re-runs a sync that failed
        # in a re-formed group: `sync_guard(attempt, settle)` returns attempt()'s value, or
        # None where this replica took the outcome from a peer
        self.replica_index: int | None = None
        self.sync_guard = None
        # what each rank syncs: its parameters (tied: once), or its slices of the master weights
        if self.engine is None:
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            self.slices = None
        else:
            pieces = self.engine.master_slices()
            self.slices = [piece for piece, _ in pieces]
            named = [(piece.slot.name, view) for piece, view in pieces]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self._start_identical()
        dtypes = {p.dtype for p in self.params}
        assert len(dtypes) == 1, f"one flat buffer per sync needs one dtype, got {dtypes}"

    def _start_identical(self) -> None:
        """Replicas start identical, whatever their seeds: the axis member 0's parameters."""
        if self.engine is None:
            broadcast_state(self.module, self.mesh, self.axis)
        else:
            flat = self.flat_params()
            broadcast_tensors([flat], self.mesh, self.axis)
            self._set_params(flat)

    @property
    def replica(self) -> int:
        """This replica's index on the dp axis (checkpoint keys of its own state use it)."""
        return self.mesh.local_rank(self.axis) if self.replica_index is None else self.replica_index

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Nothing is communicated between replicas during backward at any micro-step; a
        sharded replica's engine reduces inside the replica as it does alone."""
        with self.engine.no_sync() if self.engine is not None else contextlib.nullcontext():
            yield

    def sync_gradients(self) -> None:
        """Gradients stay in the replica: nothing to reduce but a sharded replica's own."""
        if self.engine is not None:
            self.engine.sync_gradients()

    def unreduced_grad(self, p: nn.Parameter) -> torch.Tensor:
        """`p`'s gradient summed over the step's micro-batches, which the pipeline sums over
        pp for the parameters several stages share: a sharded replica's engine holds it
        outside `.grad` at stages 2-3 (ShardedDataParallel.unreduced_grad)."""
        return p.grad if self.engine is None else self.engine.unreduced_grad(p)

    def replica_tokens(self, local_tokens: int) -> float:
        """The target tokens this replica's gradient is normalized by: this rank's own, or,
        where the replica is ZeRO-sharded over a node's ranks, each with rows of its own,
        their sum (one all-reduce inside the replica)."""
        if self.axis == "dp" or self.mesh.size("dp.local") == 1:
            return local_tokens
        tokens = torch.tensor([float(local_tokens)], dtype=torch.float64, device=self.mesh.device)
        comm.all_reduce(tokens, self.mesh, "dp.local")
        return float(tokens)

    def before_update(self) -> None:
        """Called once per step after the last backward and before the optimizer step (from
        `clip_grad_norm_`, which the loop calls there): where an algorithm finishes the
        communication of the step's backward. Nothing here."""

    def observe_loss(self, loss_sum: torch.Tensor, tokens: int) -> None:
        """Called by the loop after every optimizer step, before `after_step`, with this
        replica's summed token loss of the step and its target tokens: for an algorithm whose
        schedule follows the loss (DASO's adaptive period, hierarchical.py). Nothing here."""

    def metrics(self) -> dict:
        """What the algorithm adds to the step's metrics.jsonl record (a logged step): here
        nothing."""
        return {}

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this replica's own gradient; returns its norm before clipping, of the whole
        replica's gradient where its tp and pp ranks hold pieces of it. First the context
        peers' gradients are summed (`replica_gradient`), then `before_update()` runs."""
        self.replica_gradient()
        self.before_update()
        if self.engine is not None:  # the norm over the replica's gradient shards
            return self.engine.clip_grad_norm_(max_norm)
        return clip_replica_grads(self.params, max_norm, self.mesh)

    @torch.no_grad()
    def replica_gradient(self) -> None:
        """Under context parallelism each rank of a replica holds the gradient of its own
        tokens (the loss is divided by the replica's token count): one all-reduce over cp
        makes it the replica's, on each of them, every step: traffic inside the replica, as
        the data-parallel engine's reduction over dp and cp together is (parallel/data.py).
        Tensor and pipeline ranks need nothing: each holds its own pieces' whole gradient,
        nor does a replica run by the sharded engine, which sums over cp as it reduces."""
        if self.mesh.size("cp") == 1 or self.engine is not None:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        comm.all_reduce(flat, self.mesh, "cp")
        for g, value in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(value)

    def after_step(self, step: int, last: bool = False) -> bool:
        """Call after optimizer step `step` (counted from 1) on every replica. Synchronizes
        when `step` is a multiple of `inner_steps`, or when `last` (the run's final step, so
        it ends on one model). Returns whether it synchronized."""
        self.steps_since_sync += 1
        if step % self.inner_steps and not last:
            return False
        self._sync()
        return True

    def end_period(self) -> None:
        """Synchronize now unless the replicas have not stepped since the last sync: what a
        checkpoint needs, since it holds one model for all replicas."""
        if self.steps_since_sync:
            self._sync(settle=True)

    def _sync(self, settle: bool = False) -> None:
        """`synchronize`, through the guard where there is one (`settle`: the sync that brings
        the replicas to one model before a checkpoint, a phase of its own there)."""
        if self.sync_guard is None:
            self.synchronize()
        else:
            self.sync_guard(self.synchronize, settle)

    @torch.no_grad()
    def synchronize(self) -> None:
        """The parameters of every replica become their mean over the axis: one flat
        all-reduce (sum, then divide)."""
        flat = self.flat_params()
        comm.all_reduce(flat, self.mesh, self.axis)
        flat.div_(self.mesh.size(self.axis))
        self._set_params(flat)

    def flat_params(self, params: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The values of `params` (default: all this rank syncs) as one fresh flat tensor on
        the mesh's device, where the collectives run: a sharded replica with
        `offload_optimizer` keeps its master weights in host memory, which NCCL cannot
        reduce (a copy there; on the device already, none)."""
        params = self.params if params is None else params
        return _flatten_dense_tensors([p.detach() for p in params]).to(self.mesh.device)

    def _set_params(self, flat: torch.Tensor) -> None:
        for p, value in zip(self.params, _unflatten_dense_tensors(flat, self.params)):
            p.copy_(value)
        self.published()
        self.steps_since_sync = 0

    def published(self) -> None:
        """After the synced tensors were written: a sharded replica's engine casts its master
        weights into its parameters and gathers them where its ranks keep them."""
        if self.engine is not None:
            self.engine.publish()

    # a run that outlives lost replicas (lowcomm/replicas.py) asks these
    def one_model(self) -> bool:
        """Whether every replica holds the same parameters now: after a sync."""
        return self.steps_since_sync == 0

    def joinable(self) -> bool:
        """Whether a replica may join here, taking its whole state from one peer
        (`replica_state`) and the model the others hold: after a sync."""
        return self.one_model()

    # checkpoint hooks (lowcomm/state.py): local SGD keeps no state of its own
    def outer_state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_outer_state(self, state: dict[str, torch.Tensor]) -> None:
        self.steps_since_sync = 0

    def replica_state(self) -> dict[str, torch.Tensor]:
        """What a replica that joins the others takes from a peer besides the parameters and
        its inner optimizer (lowcomm/replicas.py), as fresh tensors: the outer state."""
        return self.outer_state()

    def load_replica_state(self, state: dict[str, torch.Tensor]) -> None:
        """After the parameters were copied: `replica_state`'s tensors from a peer."""
        self.load_outer_state(state)


def replica_axis(plan: ShardPlan | None) -> str:
    """The axis the replicas' peers lie on: "dp", or "dp.cross" ("dpcp.cross" under cp) for
    replicas each ZeRO-sharded over the dp ranks of a node (`replica_shard_axis`), where a
    rank syncs its shard with the ranks that hold the same one in the other replicas: the
    same place in their node's shard group."""
    if plan is None or not plan.shard_axis.endswith(".local"):
        return "dp"
    return plan.shard_axis.replace(".local", ".cross")


def replica_shard_axis(p) -> str:
    """The axis the sharded engine runs each replica over (`p`: the [parallel] keys; the
    Lowcomm component shards with it, lowcomm/config.py): with ZeRO the dp ranks of a node,
    "dp.local" ("dpcp.local" under cp, whose peers hold the same replica, so that the engine
    sums their tokens' gradients as it shards); at stage 0 (bf16) nothing is sharded: "self"
    ("cp" under cp: the engine all-reduces the peers' gradients over it)."""
    if p.zero_stage:
        return "dpcp.local" if p.cp > 1 else "dp.local"
    return "cp" if p.cp > 1 else "self"
