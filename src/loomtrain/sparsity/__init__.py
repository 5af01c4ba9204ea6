"""Sparse training: masks on nn.Linear weights (static, N:M, gradual magnitude pruning, SET,
RigL) and sharpness-aware gradients (SAM, ZO-SAM) that keep the masks. masks.py and dst.py
are pure; sparsifier.py keeps a model's masks in step with training (split.py on a split
model, sharded.py in the ZeRO engine); sam.py computes SAM and ZO-SAM gradients; training.py
is the [sparsity] section inside `loom train`.
Guide: docs/sparsity.md.
"""

from loomtrain.sparsity.dst import cosine_fraction, rigl_update, set_update, swap_count
from loomtrain.sparsity.masks import (active_count, cubic_density, erk_densities, magnitude_mask,
                                      nm_group_counts, nm_mask, pack_mask, random_mask,
                                      uniform_densities, unpack_mask)
from loomtrain.sparsity.sam import MaskedPerturber, SharpnessAware
from loomtrain.sparsity.sparsifier import Sparsifier, sparse_layers

__all__ = ["MaskedPerturber", "SharpnessAware", "Sparsifier", "active_count", "cosine_fraction",
           "cubic_density", "erk_densities", "magnitude_mask", "nm_group_counts", "nm_mask",
           "pack_mask", "random_mask", "rigl_update", "set_update", "sparse_layers", "swap_count",
           "uniform_densities", "unpack_mask"]
