"""The whole-tensor statistics of sparse MeZO and HELENE on a tensor-parallel replica, whose
ranks each hold a piece of a tensor: sparse MeZO's magnitude threshold is a k-th value of the
whole tensor, taken from the tp pieces gathered into it (sparsity/split.py `Pieces`, every
`mask_every` steps), and HELENE's clipping floor is the whole tensor's mean, from the pieces'
sums all-reduced over tp (every step, one float64 per split tensor). Bytes: docs/zeroth.md,
"Split replicas".
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from loomtrain import comm
from loomtrain.parallel.placement import placement_of
from loomtrain.sparsity.split import Pieces
from loomtrain.zeroth.perturb import Perturber, magnitude_thresholds


def pieces_of(perturber: Perturber) -> list[Pieces]:
    """Per trainable position, how the tp ranks' pieces make the whole tensor (nothing
    travels for a tensor whole on every rank, or in one process)."""
    return [Pieces(p, perturber.mesh) for p in perturber.params]


def whole_thresholds(perturber: Perturber, pieces: Sequence[Pieces],
                     sparsity: float) -> list[float]:
    """`magnitude_thresholds` of the whole tensors, gathered one at a time (collective over
    tp: every tp rank gets the same thresholds)."""
    wholes = (piece.whole(p.detach()) for p, piece in zip(perturber.params, pieces))
    return magnitude_thresholds(wholes, sparsity)


def whole_means(perturber: Perturber, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per position, the mean of the whole tensor of which `tensors[pos]` is this rank's piece
    (laid out as the parameter at `pos`): its own mean where the parameter is whole, else the
    pieces' sums added over tp in one all-reduce for every split tensor, over the whole
    tensor's size (a padded vocabulary's rows hold zeros: their z is zero)."""
    split = [pos for pos, p in enumerate(perturber.params) if placement_of(p) is not None]
    means = [t.mean() for t in tensors]
    if not split:
        return means
    sums = torch.stack([tensors[pos].double().sum() for pos in split])
    comm.all_reduce(sums, perturber.mesh, "tp")
    for total, pos in zip(sums, split):
        size = math.prod(placement_of(perturber.params[pos]).shape)
        means[pos] = (total / size).to(tensors[pos].dtype)
    return means
