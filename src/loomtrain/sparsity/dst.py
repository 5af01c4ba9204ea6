"""Dynamic sparse training: SET and RigL mask updates, pure functions of (weight, mask, ...):
drop the k smallest active weights, regrow k inactive ones (SET at random, RigL by the dense
gradient's magnitude), so each layer's density stays exactly constant.

SET: Mocanu et al., Nature Comms 2018; RigL: Evci et al., arXiv 1911.11134, Algorithm 1.
The rules, RigL's cosine fraction and determinism: docs/sparsity.md, "Methods".
"""

from __future__ import annotations

import math

import torch

from loomtrain.sparsity.masks import ranked


def cosine_fraction(t: int, alpha: float, end: int) -> float:
    """RigL's update fraction at step t: alpha/2 (1 + cos(pi t / end)), 0 from `end` on."""
    return 0.5 * alpha * (1.0 + math.cos(math.pi * t / end)) if t < end else 0.0


def swap_count(active: int, numel: int, fraction: float) -> int:
    """k = round(fraction x active), at most the inactive positions before the drop (all of
    them regrown would need more than there are, with a density above 1/2 and a large f)."""
    return min(round(fraction * active), numel - active)


def _drop(weight: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """`mask` less its k active weights of smallest magnitude."""
    score = weight.detach().abs().float().masked_fill(~mask, float("inf"))
    dropped = ranked(score, k, largest=False)
    kept = mask.clone().flatten()
    kept[dropped] = False
    return kept.view(mask.shape)


def _grow(kept: torch.Tensor, score: torch.Tensor, k: int) -> torch.Tensor:
    """`kept` plus the k positions it lacks of largest `score`."""
    score = score.float().masked_fill(kept, -float("inf"))
    grown = kept.clone().flatten()
    grown[ranked(score, k, largest=True)] = True
    return grown.view(kept.shape)


def set_update(weight: torch.Tensor, mask: torch.Tensor, k: int,
               generator: torch.Generator) -> torch.Tensor:
    """SET: drop the k smallest |w| among the active, regrow k inactive at random (uniform
    scores from `generator`, which must sit on the weight's device)."""
    if k == 0:
        return mask.clone()
    kept = _drop(weight, mask, k)
    random = torch.rand(mask.shape, generator=generator, device=generator.device)
    return _grow(kept, random.to(mask.device), k)


def rigl_update(weight: torch.Tensor, mask: torch.Tensor, k: int,
                dense_grad: torch.Tensor) -> torch.Tensor:
    """RigL: drop the k smallest |w| among the active, regrow the k inactive of largest
    |dense_grad|."""
    if k == 0:
        return mask.clone()
    kept = _drop(weight, mask, k)
    return _grow(kept, dense_grad.detach().abs(), k)
