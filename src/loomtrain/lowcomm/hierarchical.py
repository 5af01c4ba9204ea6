"""Hierarchical DASO: a gradient average inside each node every step, a parameter average
between the nodes every H steps (blocking, or one step stale), H adapted to the loss trend.

Coquelin et al., arXiv 2104.05588. The maths, wire bytes, deviations from the paper and
failure semantics: docs/lowcomm-hierarchical.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from loomtrain import comm
from loomtrain.lowcomm.local_sgd import LocalSGD

# DASO's plateau test (the defaults of the authors' Heat implementation): a window improves
# when its loss is below (1 - PLATEAU_THRESHOLD) x the best window loss so far, and more than
# PLATEAU_PATIENCE windows in a row without improvement are a plateau
PLATEAU_THRESHOLD = 0.05
PLATEAU_PATIENCE = 2
LOSS_SLOTS = 2  # what each shard carries besides parameters: a loss sum and its target tokens


def build(model, optimizer, mesh, cfg, seed: int):
    """apply_lowcomm's builder for algorithm="hierarchical"."""
    return Hierarchical(model, mesh, cfg.inner_steps, cfg.overlap_steps,
                        cfg.adaptive_period), optimizer


@dataclass(frozen=True)
class Plateau:
    """The adaptive schedule: the global period now, the best window loss so far, and the
    windows in a row that did not improve on it."""

    period: int
    best: float = math.inf
    bad_windows: int = 0


def next_period(state: Plateau, window_loss: float, max_period: int) -> Plateau:
    """The schedule after a window whose mean loss is `window_loss` (DASO's plateau rule):
    an improvement resets the count; the third window in a row without one halves the period,
    or at period 1 resets it to `max_period`. Pure."""
    if window_loss < state.best * (1 - PLATEAU_THRESHOLD):
        return replace(state, best=window_loss, bad_windows=0)
    if state.bad_windows < PLATEAU_PATIENCE:
        return replace(state, bad_windows=state.bad_windows + 1)
    period = state.period // 2 if state.period > 1 else max_period
    return replace(state, period=period, bad_windows=0)


def shard_numel(parameters: int, ranks_per_node: int) -> int:
    """Elements one rank all-reduces across nodes per global sync: its shard of the flat
    parameters (padded: gloo gathers only equal chunks) and the loss slots."""
    return -(-parameters // ranks_per_node) + LOSS_SLOTS


def cross_wire_bytes(parameters: int, ranks_per_node: int, nodes: int, element_bytes: int = 4) -> int:
    """Wire bytes one rank sends across nodes per global sync (a ring all-reduce of its
    shard over the n nodes: 2(n-1)/n x the shard's bytes, comm/meter.py). Pure."""
    payload = shard_numel(parameters, ranks_per_node) * element_bytes
    return comm.wire_bytes("ring_all_reduce", payload, nodes)


@dataclass
class _InFlight:
    """A global sync started and not merged: this rank's shard being summed over the nodes,
    the window steps whose loss it carries, and the step after which it was launched."""

    work: comm.Pending
    shard: torch.Tensor
    steps: int
    launched_at: int


class Hierarchical(LocalSGD):
    """`model = Hierarchical(model, mesh, inner_steps=H, overlap_steps=1)`; then per step
    `loss.backward(); model.clip_grad_norm_(c); optimizer.step();
    model.observe_loss(loss_sum, tokens); model.after_step(step)` (`clip_grad_norm_` runs the
    node-local gradient average; `observe_loss` feeds the adaptive period). A replica split
    over tp, pp or cp: each rank averages its own pieces' gradients over dp.local and its own
    parameters over dp.cross, with the ranks that hold the same pieces."""

    def __init__(self, module: nn.Module, mesh, inner_steps: int, overlap_steps: int = 1,
                 adaptive_period: bool = False):
        super().__init__(module, mesh, inner_steps)
        assert overlap_steps in (0, 1), overlap_steps
        self.overlap_steps, self.adaptive_period = overlap_steps, adaptive_period
        self.local, self.nodes = mesh.size("dp.local"), mesh.size("dp.cross")
        assert self.local * self.nodes == mesh.size("dp"), "dp must split evenly into nodes"
        self.numel = sum(p.numel() for p in self.params)
        self.shard_numel = shard_numel(self.numel, self.local)
        self.plateau = Plateau(period=inner_steps)
        self.step = self.synced_at = self.global_syncs = 0
        self.since_launch = 0  # steps since the last global sync was started
        device = self.params[0].device
        # this replica's loss sum and target tokens since the last sync started, and the
        # window's global ones (identical on every rank: the syncs summed them)
        self.loss_partial = torch.zeros(LOSS_SLOTS, dtype=torch.float64, device=device)
        self.partial_steps = 0
        self.window = torch.zeros(LOSS_SLOTS, dtype=torch.float64, device=device)
        self.window_steps = 0
        self.window_loss = math.nan  # the last window's global mean loss
        self.in_flight: _InFlight | None = None

    @torch.no_grad()
    def before_update(self) -> None:
        """The node-local gradient average: one flat all-reduce over "dp.local", divided."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = _flatten_dense_tensors([p.grad for p in self.params])
        comm.all_reduce(flat, self.mesh, "dp.local")
        flat.div_(self.local)
        for p, g in zip(self.params, _unflatten_dense_tensors(flat, self.params)):
            p.grad.copy_(g)

    def observe_loss(self, loss_sum: torch.Tensor, tokens: int) -> None:
        """This replica's summed token loss of the step and its target tokens."""
        self.loss_partial[0] += loss_sum.detach().to(self.loss_partial)
        self.loss_partial[1] += tokens

    def after_step(self, step: int, last: bool = False) -> bool:
        """Call after optimizer step `step` on every replica: merges the sync in flight (one
        step stale), then starts a global sync when the period is up (blocking with
        `overlap_steps` = 0, and always on the `last` step). Returns whether one started."""
        self.step = step
        self.steps_since_sync += 1
        self.since_launch += 1
        self.partial_steps += 1
        if self.in_flight is not None:
            stale_steps = step - self.in_flight.launched_at
            self._merge(self._finish(), stale_steps)
        due = self.since_launch >= self.plateau.period
        if last or (due and self.overlap_steps == 0):
            self.synchronize()
        elif due:
            self.in_flight = self._launch()
        else:
            return False
        return True

    def end_period(self) -> None:
        """Finish the sync in flight and average exactly: one model, nothing in flight."""
        if self.in_flight is not None:  # launched after this step: nothing moved since
            stale_steps = self.step - self.in_flight.launched_at
            self._merge(self._finish(), stale_steps)
        if self.steps_since_sync:
            self.synchronize()

    @torch.no_grad()
    def synchronize(self) -> None:
        """A blocking global sync: every replica's parameters become the mean over the nodes
        (the nodes' ranks are already equal), reduced shard by shard."""
        assert self.in_flight is None
        self.in_flight = self._launch()
        self._merge(self._finish(), stale_steps=0)

    @torch.no_grad()
    def _launch(self) -> _InFlight:
        """Start the cross-node all-reduce of this rank's shard (and the loss slots)."""
        flat = _flatten_dense_tensors([p.detach() for p in self.params])
        size = self.shard_numel - LOSS_SLOTS
        start = self.mesh.local_rank("dp.local") * size
        mine = flat[start:start + size]
        shard = torch.zeros(self.shard_numel, dtype=flat.dtype, device=flat.device)
        shard[:mine.numel()] = mine
        shard[size:] = self.loss_partial
        work = comm.all_reduce(shard, self.mesh, "dp.cross", async_op=True)
        flight = _InFlight(work, shard, self.partial_steps, self.step)
        self.loss_partial.zero_()
        self.partial_steps = self.since_launch = 0
        self.synced_at, self.global_syncs = self.step, self.global_syncs + 1
        return flight

    @torch.no_grad()
    def _finish(self) -> torch.Tensor:
        """Wait for the sync in flight and gather the node's shards: returns the sum over the
        nodes of the flat parameters; the loss slots go to the window."""
        flight, self.in_flight = self.in_flight, None
        flight.work.wait()
        gathered = torch.empty(self.local * self.shard_numel, dtype=flight.shard.dtype,
                               device=flight.shard.device)
        comm.all_gather(gathered, flight.shard, self.mesh, "dp.local")
        rows = gathered.view(self.local, self.shard_numel)
        # summed in local-rank order on every rank: bitwise the same number everywhere
        self._close_window(rows[:, -LOSS_SLOTS:].double().sum(0), flight.steps)
        return rows[:, :-LOSS_SLOTS].reshape(-1)[:self.numel]

    def _close_window(self, loss_tokens: torch.Tensor, steps: int) -> None:
        """Add a sync's global loss sum and tokens to the window; once the window holds
        `inner_steps` steps, its mean loss decides the next period (when adaptive)."""
        self.window += loss_tokens
        self.window_steps += steps
        if self.window_steps < self.inner_steps:
            return
        loss, tokens = self._replica_window()
        if self.adaptive_period and tokens == 0:
            raise RuntimeError("lowcomm adaptive_period follows the loss: call "
                               "model.observe_loss(loss_sum, tokens) after every step")
        self.window_loss = loss / tokens if tokens else math.nan
        if self.adaptive_period:
            self.plateau = next_period(self.plateau, self.window_loss, self.inner_steps)
        self.window.zero_()
        self.window_steps = 0

    def _replica_window(self) -> tuple[float, float]:
        """The window's loss sum and target tokens over whole replicas. A replica split over
        pp or cp holds its loss in pieces (the last stage's; each context rank's tokens'):
        summed over those axes, so that every rank of it decides the same period (its tp
        ranks hold the same loss, and every rank its rows' tokens)."""
        loss = self.window[:1].clone()
        for axis in ("pp", "cp"):
            comm.all_reduce(loss, self.mesh, axis)
        return float(loss), float(self.window[1])

    @torch.no_grad()
    def _merge(self, node_sum: torch.Tensor, stale_steps: int) -> None:
        """Parameters from the global sum: its mean when nothing moved since the launch
        (stale_steps = 0), else DASO's weighting (2S x + sum) / (2S + n)."""
        if stale_steps == 0:
            merged = node_sum.div_(self.nodes)
        else:
            weight = 2 * stale_steps
            merged = _flatten_dense_tensors([p.detach() for p in self.params])
            merged.mul_(weight).add_(node_sum).div_(weight + self.nodes)
        for p, value in zip(self.params, _unflatten_dense_tensors(merged, self.params)):
            p.copy_(value)
        if stale_steps == 0:
            self.steps_since_sync = 0

    def metrics(self) -> dict:
        """The period now, whether a global sync started at the logged step, the wire bytes
        this rank has sent across nodes so far, and the last window's global mean loss."""
        out = {"global_period_steps": self.plateau.period, "global_sync": self.synced_at == self.step,
               "cross_node_wire_bytes": self.mesh.meter.total(axis="dp.cross")}
        if not math.isnan(self.window_loss):
            out["global_window_loss"] = round(self.window_loss, 6)
        return out

    # checkpoint hooks (lowcomm/state.py): the schedule, identical on every replica at a save
    _STATE = ("period", "best", "bad_windows", "since_launch", "window_loss_sum",
              "window_tokens", "window_steps", "window_loss")

    def outer_state(self) -> dict[str, torch.Tensor]:
        assert self.in_flight is None and self.partial_steps == 0, "save after end_period()"
        p = self.plateau
        values = [p.period, p.best, p.bad_windows, self.since_launch, *self.window.tolist(),
                  self.window_steps, self.window_loss]
        return {"schedule": torch.tensor(values, dtype=torch.float64)}

    def load_outer_state(self, state: dict[str, torch.Tensor]) -> None:
        super().load_outer_state(state)
        v = dict(zip(self._STATE, state["schedule"].tolist()))
        self.plateau = Plateau(int(v["period"]), v["best"], int(v["bad_windows"]))
        self.since_launch, self.window_steps = int(v["since_launch"]), int(v["window_steps"])
        self.window.copy_(torch.tensor([v["window_loss_sum"], v["window_tokens"]]))
        self.window_loss = v["window_loss"]
