"""Low-communication data parallelism: replicas that train apart and synchronize rarely.

A strategy is `apply_lowcomm(model, optimizer, mesh, cfg)` over the dp axis, applied in place
of the data-parallel engine (parallel/__init__.py): no gradient all-reduce at all; the
replicas meet every `inner_steps` optimizer steps, which the loop signals by calling
`model.after_step(step)` after every optimizer step.

- local_sgd.py: local SGD, the parameters averaged every H steps;
- diloco.py: DiLoCo, H inner steps then an outer optimizer step on the averaged
  pseudo-gradient;
- state.py: their checkpoints;
- noloco.py: NoLoCo's pairing of replicas (pure; its outer step comes later).
Guide: docs/lowcomm.md.
"""

from __future__ import annotations

from loomtrain.lowcomm.diloco import DiLoCo
from loomtrain.lowcomm.local_sgd import LocalSGD


def apply_lowcomm(model, optimizer, mesh, cfg):
    """The dp-axis strategy for `cfg` (the LowcommConfig): returns (wrapped model, optimizer).
    The optimizer is the inner one, unchanged; DiLoCo's outer optimizer lives in the
    wrapper."""
    if cfg.algorithm == "local_sgd":
        return LocalSGD(model, mesh, cfg.inner_steps), optimizer
    if cfg.algorithm == "diloco":
        return DiLoCo(model, mesh, cfg.inner_steps, cfg.outer_lr, cfg.outer_momentum,
                      nesterov=cfg.outer_optimizer == "nesterov"), optimizer
    raise AssertionError(f"lowcomm.algorithm={cfg.algorithm!r} passed config validation")


__all__ = ["DiLoCo", "LocalSGD", "apply_lowcomm"]
