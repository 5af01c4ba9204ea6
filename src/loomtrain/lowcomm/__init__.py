"""Low-communication data parallelism: replicas that train apart and synchronize rarely.

A strategy is `apply_lowcomm(model, optimizer, mesh, cfg)` over the dp axis, applied in place
of the data-parallel engine (parallel/__init__.py): no per-step gradient all-reduce over the
whole dp axis; the replicas meet as their algorithm says, which the loop drives by calling
`model.after_step(step)` after every optimizer step.

Every algorithm is a subclass of `LocalSGD` (local_sgd.py, the wrapper interface) in its own
module, which has `build(model, optimizer, mesh, cfg, seed) -> (wrapped model, optimizer)`
(`seed`: run.seed, for what the replicas draw in common):

- local_sgd.py: local SGD, the parameters averaged every H steps;
- diloco.py: DiLoCo, H inner steps then an outer optimizer step on the averaged
  pseudo-gradient;
- streaming.py: streaming DiLoCo, fragments synced at staggered steps, overlapped;
- noloco.py: NoLoCo, each outer step averaged with one random peer, no all-reduce;
- dreamddp.py: DreamDDP, layer-wise partial syncs scheduled behind backward (its schedule:
  dreamddp_schedule.py, pure);
- hpsgd.py: HPSGD, each step's sync in flight during the next step;
- hierarchical.py: DASO, node-local every step, across nodes every H steps;
- lordo.py: LoRDO, a rank-r projected optimizer with infrequent syncs (its optimizer:
  lowrank_adamw.py);
- state.py: their checkpoints.
Guide: docs/lowcomm.md.
"""

from __future__ import annotations

import importlib

from loomtrain.lowcomm.diloco import DiLoCo
from loomtrain.lowcomm.local_sgd import LocalSGD

MODULES = {"local_sgd": "local_sgd", "diloco": "diloco", "streaming_diloco": "streaming",
           "noloco": "noloco", "dreamddp": "dreamddp", "hpsgd": "hpsgd",
           "hierarchical": "hierarchical", "lordo": "lordo"}


def apply_lowcomm(model, optimizer, mesh, cfg, seed: int = 0):
    """The dp-axis strategy for `cfg` (the LowcommConfig): returns (wrapped model, optimizer):
    the trainer's optimizer unchanged, as the inner one, or the algorithm's own (LoRDO).
    `seed` (run.seed): what every replica draws in common (NoLoCo's pairs) derives from it."""
    module = importlib.import_module(f"loomtrain.lowcomm.{MODULES[cfg.algorithm]}")
    return module.build(model, optimizer, mesh, cfg, seed)


__all__ = ["DiLoCo", "LocalSGD", "MODULES", "apply_lowcomm"]
