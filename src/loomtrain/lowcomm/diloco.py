"""DiLoCo: H inner optimizer steps per replica, then one outer step (Nesterov SGD) on the
averaged pseudo-gradient.

Douillard et al., arXiv 2311.08105, Algorithm 1. The maths, bytes, state and checkpoints:
docs/lowcomm.md, "Local SGD and DiLoCo".
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from loomtrain import comm
from loomtrain.lowcomm.local_sgd import LocalSGD
from loomtrain.comm.compress import relative_error
from loomtrain.parallel.data import CompressionWindow


def build(model, optimizer, mesh, cfg, seed: int):
    """apply_lowcomm's builder for algorithm="diloco"."""
    return DiLoCo(model, mesh, cfg.inner_steps, cfg.outer_lr, cfg.outer_momentum,
                  nesterov=cfg.outer_optimizer == "nesterov"), optimizer


class DiLoCo(LocalSGD):
    """`model = DiLoCo(model, mesh, inner_steps=H)`; the inner optimizer is the caller's (the
    trainer's AdamW); the outer one belongs to the wrapper: `nesterov=True` is SGD with
    Nesterov momentum `outer_momentum`, `nesterov=False` plain SGD (no momentum)."""

    def __init__(self, module: nn.Module, mesh, inner_steps: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, axis: str | None = None):
        super().__init__(module, mesh, inner_steps, axis)
        # theta: after the broadcast, every replica's copy is dp rank 0's parameters
        self.global_params = self.flat_params()
        momentum = outer_momentum if nesterov else 0.0
        self.outer = torch.optim.SGD([self.global_params], lr=outer_lr, momentum=momentum,
                                     nesterov=nesterov)
        # `[compression] applies_to = "pseudo_gradients"`: the trainer sets a compressor
        # (comm/compress/) for the outer all-reduce; its figures go to metrics()
        self.compressor, self.compression = None, CompressionWindow()
        self._measure = False

    def measure_error(self) -> None:
        """With a compressor: measure the next outer all-reduce's error against the dense one."""
        self._measure = self.compressor is not None

    def metrics(self) -> dict:
        """With a compressor: the compression figures since the previous record."""
        return {} if self.compressor is None else self.compression.take()

    @torch.no_grad()
    def synchronize(self) -> None:
        """The outer step: average the pseudo-gradient over the axis, step theta, and copy
        theta into this replica's parameters."""
        local = self.flat_params()
        pseudo_gradient = torch.sub(self.global_params, local)
        if self.compressor is None:
            comm.all_reduce(pseudo_gradient, self.mesh, self.axis)
        else:  # the sum of every replica's compressed pseudo-gradient
            dense = pseudo_gradient.clone() if self._measure else None
            exchange = self.compressor.start("pseudo_gradient", pseudo_gradient,
                                             [p.shape for p in self.params], self.mesh, self.axis)
            self.compression.add(exchange.wait())
            if dense is not None:  # the error diagnostic: off the link, counted apart
                comm.all_reduce(dense, self.mesh, self.axis, diagnostic=True)
                self.compression.error = relative_error(pseudo_gradient, dense)
                self._measure = False
        pseudo_gradient.div_(self.mesh.size(self.axis))
        self.global_params.grad = pseudo_gradient
        self.outer.step()
        self.global_params.grad = None
        self._set_params(self.global_params)

    def outer_state(self) -> dict[str, torch.Tensor]:
        """The outer momentum per parameter name, as fresh tensors (DCP saves from them or
        loads into them). Empty without momentum."""
        if self.outer.defaults["momentum"] == 0:
            return {}
        buffer = self.outer.state[self.global_params].get("momentum_buffer")
        if buffer is None:  # before the first outer step: zero momentum, the same update
            buffer = torch.zeros_like(self.global_params)
        views = _unflatten_dense_tensors(buffer, self.params)
        return {f"momentum_buffer.{n}": v.clone() for n, v in zip(self.names, views)}

    @torch.no_grad()
    def load_outer_state(self, state: dict[str, torch.Tensor]) -> None:
        """After the model's parameters were loaded: theta is them (a checkpoint is written
        at a sync), the momentum is the saved one."""
        super().load_outer_state(state)
        self.global_params.copy_(self.flat_params())
        if state:
            buffer = _flatten_dense_tensors([state[f"momentum_buffer.{n}"] for n in self.names])
            self.outer.state[self.global_params]["momentum_buffer"] = buffer

    def replica_state(self) -> dict[str, torch.Tensor]:
        """The outer momentum and theta: a replica may join between two outer steps, where
        theta is not its parameters."""
        return {**self.outer_state(), "global": self.global_params.clone()}

    @torch.no_grad()
    def load_replica_state(self, state: dict[str, torch.Tensor]) -> None:
        self.load_outer_state({k: v for k, v in state.items() if k != "global"})
        self.global_params.copy_(state["global"])
