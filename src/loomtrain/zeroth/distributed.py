"""Distributed zeroth-order training that sends only seeds and scalars: every dp rank probes its
own seeds on its own batch, the ranks all-gather their (seed, projected gradient) pairs and
every rank applies them all, so the parameters stay bitwise identical with no parameter or
gradient communication. Packing, bytes per step and the seed check: docs/zeroth.md,
"Distributed: seeds and scalars only".
"""

from __future__ import annotations

from typing import Sequence

import torch

from loomtrain import comm
from loomtrain.zeroth.optimizers import Pair

PAIR_BYTES = 12  # an int64 seed and a float32 projected gradient


def pair_exchange_bytes(world: int, n_perturbations: int) -> dict[str, int]:
    """The bytes of one step's exchange: {"payload": gathered tensor, "wire": sent per rank}."""
    payload = world * n_perturbations * PAIR_BYTES
    return {"payload": payload, "wire": comm.wire_bytes("ring_all_gather", payload, world)}


def pack_pairs(pairs: Sequence[Pair], device) -> torch.Tensor:
    seeds = torch.tensor([p.seed for p in pairs], dtype=torch.int64)
    grads = torch.tensor([p.grad for p in pairs], dtype=torch.float32)
    return torch.cat([seeds.view(torch.uint8), grads.view(torch.uint8)]).to(device)


def unpack_pairs(packed: torch.Tensor, count: int) -> list[Pair]:
    """The pairs of `count` K-pair chunks, in chunk order."""
    chunks = packed.cpu().view(count, -1)
    k = chunks.shape[1] // PAIR_BYTES
    out = []
    for chunk in chunks:
        # cloned: a view as int64 needs an 8-byte aligned start, which odd K does not give
        seeds = chunk[: 8 * k].clone().view(torch.int64).tolist()
        grads = chunk[8 * k:].clone().view(torch.float32).tolist()
        out.extend(Pair(s, g) for s, g in zip(seeds, grads))
    return out


class SeedScalarExchange:
    """`optimizer.step(loss_fn, exchange=SeedScalarExchange(mesh))`: gathers every rank's pairs
    over `axis`, in rank order. `rank` and `world` are this rank's place on that axis (the
    optimizer seeds its probes with `rank`)."""

    def __init__(self, mesh, axis: str = "dp"):
        self.mesh, self.axis = mesh, axis
        self.rank, self.world = mesh.local_rank(axis), mesh.size(axis)

    def __call__(self, pairs: Sequence[Pair]) -> list[Pair]:
        mine = pack_pairs(pairs, self.mesh.device)
        gathered = torch.empty(self.world * mine.numel(), dtype=torch.uint8, device=mine.device)
        comm.all_gather(gathered, mine, self.mesh, self.axis)
        return unpack_pairs(gathered, self.world)
