"""Low-communication data parallelism: dp replicas that train apart and synchronize rarely,
partially, with one peer or late (local SGD, DiLoCo, streaming DiLoCo, NoLoCo, DreamDDP, HPSGD,
DASO, LoRDO), one module per algorithm. `apply_lowcomm` puts the chosen wrapper in place of
the data-parallel engine. Guide, module map and the wrapper interface: docs/lowcomm.md.
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
