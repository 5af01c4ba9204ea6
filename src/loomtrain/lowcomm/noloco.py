"""NoLoCo: no all-reduce; at every outer step each replica meets one peer drawn at random and
takes a modified momentum step on what the two hold.

Kolehmainen et al., arXiv 2506.10911. The outer step, what is sent, its relation to DiLoCo,
deviations and failure semantics: docs/lowcomm-noloco.md.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from loomtrain import comm
from loomtrain.lowcomm.local_sgd import LocalSGD

EXCHANGE_TAG = 0x4E4C  # "NL": the pair exchange's point-to-point messages (0 is comm's default)


def partners(replicas: int, seed: int, step: int) -> list[int]:
    """partner[r] for every replica r: a matching (partner[partner[r]] == r), the same on every
    replica for the same (seed, step).

    Pure. The pairs are a uniformly random perfect matching: a permutation seeded by
    (seed, step), cut into consecutive pairs. With an odd number of replicas the last one in the
    permutation sits the step out (its own partner), a different one each step."""
    if replicas < 1:
        raise ValueError(f"need at least one replica, got {replicas}")
    order = np.random.default_rng([seed, step]).permutation(replicas).tolist()
    partner = list(range(replicas))
    for a, b in zip(order[0::2], order[1::2]):
        partner[a], partner[b] = b, a
    return partner


def pair_message(fast: torch.Tensor, outer: torch.Tensor, outer_lr: float,
                 pull: float) -> torch.Tensor:
    """s = beta theta - (beta - gamma) phi: all a partner needs of this replica's weights
    (`fast` = theta, `outer` = phi) for its outer step. Pure (a new tensor)."""
    return fast.mul(outer_lr).sub_(outer, alpha=outer_lr - pull)


def outer_update(momentum: torch.Tensor, outer: torch.Tensor, own: torch.Tensor,
                 received: torch.Tensor, outer_momentum: float, pull: float) -> None:
    """NoLoCo's outer step in place: delta <- alpha delta + (s_own + s_received) / 2 - gamma phi,
    then phi <- phi + delta (`momentum` = delta, `outer` = phi, s: `pair_message`). A replica
    without a partner passes its own message twice: delta <- alpha delta - beta Delta."""
    momentum.mul_(outer_momentum).add_(own.add(received).mul_(0.5)).sub_(outer, alpha=pull)
    outer.add_(momentum)


def exchange(message: torch.Tensor, mesh, axis: str, partner: int) -> torch.Tensor:
    """Swap `message` with replica `partner` (its index on `axis`): one receive and one send,
    both started before either is waited on, so neither end blocks the other. Returns the
    partner's message."""
    received = torch.empty_like(message)
    pending = [comm.recv(received, mesh, axis, partner, async_op=True, tag=EXCHANGE_TAG),
               comm.send(message, mesh, axis, partner, async_op=True, tag=EXCHANGE_TAG)]
    for op in pending:
        op.wait()
    return received


def build(model, optimizer, mesh, cfg, seed: int):
    """apply_lowcomm's builder for algorithm="noloco"."""
    return NoLoCo(model, mesh, cfg.inner_steps, seed, cfg.outer_lr, cfg.outer_momentum,
                  cfg.outer_pull), optimizer


class NoLoCo(LocalSGD):
    """`model = NoLoCo(model, mesh, inner_steps=H, seed=run.seed)`; the inner optimizer is the
    caller's. State per replica: its outer weights phi (`outer_params`, one flat copy) and its
    momentum delta (`momentum`, another)."""

    def __init__(self, module: nn.Module, mesh, inner_steps: int, seed: int,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, outer_pull: float = 0.7,
                 axis: str | None = None):
        super().__init__(module, mesh, inner_steps, axis)
        self.seed, self.outer_lr, self.outer_momentum = seed, outer_lr, outer_momentum
        self.outer_pull = outer_pull
        self.outer_params = self.flat_params()
        self.momentum = torch.zeros_like(self.outer_params)
        self.one_model = True  # every replica holds the same parameters (after the broadcast)
        self.step = 0  # the last optimizer step seen by after_step
        # what a benchmark reads: the last exchange's partner and spread, and the simulated
        # seconds the exchanges took on the slow link since the last metrics() (the send and
        # the receive run at once: one exchange takes the longer of the two, the same here)
        self.partner: int | None = None
        self.param_spread: float | None = None
        self.exchange_simulated_s = 0.0

    def after_step(self, step: int, last: bool = False) -> bool:
        """Call after optimizer step `step` (counted from 1) on every replica: an outer step
        with this outer step's partner when `step` is a multiple of `inner_steps`; after the
        run's `last` step, the final average too. Returns whether it took an outer step."""
        self.steps_since_sync += 1
        self.one_model = False
        self.step = step
        outer = step % self.inner_steps == 0
        if outer:
            self.outer_step(step // self.inner_steps)
        if last:
            self.end_period()
        return outer

    def end_period(self) -> None:
        """One model on every replica, nothing in flight: the pending outer step (drawn as the
        next regular one) if the replicas stepped since the last, then the average."""
        if self.steps_since_sync:
            self.outer_step(self.step // self.inner_steps + 1)
        if not self.one_model:
            self.synchronize()

    @torch.no_grad()
    def outer_step(self, index: int) -> None:
        """Outer step number `index`: swap messages with this step's partner and update."""
        fast = self.flat_params()
        own = pair_message(fast, self.outer_params, self.outer_lr, self.outer_pull)
        partner = partners(self.mesh.size(self.axis), self.seed, index)[self.replica]
        received = own
        if partner != self.replica:
            received = exchange(own, self.mesh, self.axis, partner)
            self.partner = partner
            self.param_spread = None
            if self.outer_pull == self.outer_lr:  # the messages are beta x the weights
                distance = torch.linalg.vector_norm(own - received)
                self.param_spread = float(distance / torch.linalg.vector_norm(own))
            if self.mesh.link is not None:
                ranks = self.mesh.group_ranks(self.axis)
                self.exchange_simulated_s += self.mesh.link.delay_s(
                    (ranks[self.replica], ranks[partner]), own.numel() * own.element_size())
        outer_update(self.momentum, self.outer_params, own, received, self.outer_momentum,
                     self.outer_pull)
        self._set_params(self.outer_params)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Every replica's parameters and outer weights become their mean over the axis (one
        all-reduce): only at the end of a run and before a checkpoint."""
        super().synchronize()
        self.outer_params.copy_(self.flat_params())
        self.one_model = True

    def metrics(self) -> dict:
        """This replica's last partner and `param_spread` (when known), and with a slow link
        `exchange_simulated_s`: the exchanges' simulated seconds since the last record."""
        out = {}
        if self.partner is not None:
            out["partner"] = self.partner
        if self.param_spread is not None:
            out["param_spread"] = round(self.param_spread, 6)
        if self.mesh.link is not None:
            out["exchange_simulated_s"] = round(self.exchange_simulated_s, 6)
            self.exchange_simulated_s = 0.0
        return out

    def outer_state(self) -> dict[str, torch.Tensor]:
        """This replica's momentum per parameter name, under its own key (the replicas' momenta
        differ), as fresh tensors (DCP saves from them or loads into them)."""
        views = _unflatten_dense_tensors(self.momentum, self.params)
        return {f"replica{self.replica}.momentum.{n}": v.clone() for n, v in zip(self.names, views)}

    @torch.no_grad()
    def load_outer_state(self, state: dict[str, torch.Tensor]) -> None:
        """After the model's parameters were loaded: they are every replica's outer weights (a
        checkpoint holds the average), the momentum is this replica's saved one."""
        super().load_outer_state(state)
        self.outer_params.copy_(self.flat_params())
        self.momentum.copy_(_flatten_dense_tensors(
            [state[f"replica{self.replica}.momentum.{n}"] for n in self.names]))
        self.one_model = True
