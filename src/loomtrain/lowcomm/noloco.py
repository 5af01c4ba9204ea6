"""NoLoCo (arXiv 2506.10911), the pairing part: no all-reduce; at each outer step every
replica averages with one peer chosen at random, the pairs drawn from a seed every replica
shares, so that both ends of a pair choose each other without a message.

Pure: (replicas, seed, outer step) in, each replica's partner out. The pairs are a uniformly
random perfect matching: a permutation seeded by (seed, step), cut into consecutive pairs.
With an odd number of replicas the last one in the permutation sits the step out (its own
partner), a different one each step. The outer step that uses the pairs is a later part of
issue 7.
"""

from __future__ import annotations

import numpy as np


def partners(replicas: int, seed: int, step: int) -> list[int]:
    """partner[r] for every replica r: a matching (partner[partner[r]] == r), the same on every
    replica for the same (seed, step)."""
    if replicas < 1:
        raise ValueError(f"need at least one replica, got {replicas}")
    order = np.random.default_rng([seed, step]).permutation(replicas).tolist()
    partner = list(range(replicas))
    for a, b in zip(order[0::2], order[1::2]):
        partner[a], partner[b] = b, a
    return partner
