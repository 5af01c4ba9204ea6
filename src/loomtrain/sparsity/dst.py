"""Dynamic sparse training: SET and RigL mask updates, pure functions of (weight, mask, ...).

Both drop the k active weights of smallest magnitude and regrow k inactive ones, so a layer's
active count, and the density, stay exactly constant:
- SET (Mocanu et al., Nature Comms 2018): regrow uniformly at random;
- RigL (Evci et al., "Rigging the Lottery", arXiv 1911.11134, Algorithm 1): regrow the k
  inactive positions of largest |dense gradient|, the gradient of the loss with respect to
  every weight, masked or not (computed only at update steps).
The regrowth candidates are the positions inactive after the drop, the dropped ones included
(as RigL's reference code does); a connection that was not active before the update (a new
one) starts at weight 0, set by the caller when it applies the new mask; a dropped connection
regrown at once keeps its weight.

k = round(f_t x active), with RigL's cosine-decaying fraction f_t = alpha/2 (1 + cos(pi t /
t_end)) for t < t_end and no updates from t_end on (alpha 0.3, t_end at 75% of training in the
paper), or SET's constant f_t = alpha.

Determinism: scores are ranked by a stable sort (ties to the lower index), and SET's random
scores come from a generator seeded by the caller, so ranks that hold the same weights, the
same (all-reduced) gradient and the same seed compute the same masks without communicating.
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
