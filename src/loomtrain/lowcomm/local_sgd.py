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
from loomtrain.parallel.data import broadcast_state, clip_replica_grads


def build(model, optimizer, mesh, cfg, seed: int):
    """apply_lowcomm's builder for algorithm="local_sgd"."""
    return LocalSGD(model, mesh, cfg.inner_steps), optimizer


class LocalSGD(nn.Module):
    """`model = LocalSGD(model, mesh, inner_steps=H)`; then per step
    `loss.backward(); optimizer.step(); model.after_step(step)`.

    The wrapped module is `.module` (its state_dict keys are unchanged there)."""

    replicas_apart = True  # each replica steps on its own gradient (train/loop.py in_streak)

    def __init__(self, module: nn.Module, mesh, inner_steps: int, axis: str = "dp"):
        super().__init__()
        assert inner_steps >= 1, inner_steps
        self.module, self.mesh, self.axis = module, mesh, axis
        self.inner_steps = inner_steps
        self.steps_since_sync = 0
        # a run that outlives lost replicas (lowcomm/replicas.py) sets these: the replica's own
        # index, kept when the group shrinks, and the guard that re-runs a sync that failed
        # in a re-formed group: `sync_guard(attempt, settle)` returns attempt()'s value, or
        # None where this replica took the outcome from a peer
        self.replica_index: int | None = None
        self.sync_guard = None
        broadcast_state(module, mesh, axis)  # replicas start identical, whatever their seeds
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # tied: once
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        dtypes = {p.dtype for p in self.params}
        assert len(dtypes) == 1, f"one flat buffer per sync needs one dtype, got {dtypes}"

    @property
    def replica(self) -> int:
        """This replica's index on the dp axis (checkpoint keys of its own state use it)."""
        return self.mesh.local_rank(self.axis) if self.replica_index is None else self.replica_index

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Nothing is communicated during backward at any micro-step: a no-op, for the loop."""
        yield

    def sync_gradients(self) -> None:
        """Gradients stay local: nothing to reduce."""

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
        return clip_replica_grads(self.params, max_norm, self.mesh)

    @torch.no_grad()
    def replica_gradient(self) -> None:
        """Under context parallelism each rank of a replica holds the gradient of its own
        tokens (the loss is divided by the replica's token count): one all-reduce over cp
        makes it the replica's, on each of them, every step: traffic inside the replica, as
        the data-parallel engine's reduction over dp and cp together is (parallel/data.py).
        Tensor and pipeline ranks need nothing: each holds its own pieces' whole gradient."""
        if self.mesh.size("cp") == 1:
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
        flat = _flatten_dense_tensors([p.detach() for p in self.params])
        comm.all_reduce(flat, self.mesh, self.axis)
        flat.div_(self.mesh.size(self.axis))
        self._set_params(flat)

    def _set_params(self, flat: torch.Tensor) -> None:
        for p, value in zip(self.params, _unflatten_dense_tensors(flat, self.params)):
            p.copy_(value)
        self.steps_since_sync = 0

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
