"""Distributed zeroth-order training that sends only seeds and scalars: every dp rank probes its
own seeds on its own batch, the ranks all-gather their (seed, projected gradient) pairs and
every rank applies them all, so the parameters stay bitwise identical with no parameter or
gradient communication. Packing, bytes per step and the seed check: docs/zeroth.md,
"Distributed: seeds and scalars only". A replica split into pipeline stages: its last stage
sends each probe's loss to the others; split by context parallelism: its cp ranks add their
tokens' loss sums (`shared_loss`; docs/zeroth.md, "Split replicas"); under data.balance the
dp x cp pool is one replica that adds them over dp x cp.
"""

from __future__ import annotations

from typing import Sequence

import torch

from loomtrain import comm
from loomtrain.zeroth.optimizers import Pair

PAIR_BYTES = 12  # an int64 seed and a float32 projected gradient
LOSS_BYTES = 8  # a probe's loss, float64 (exactly the last stage's float32 loss), over pp


def pair_exchange_bytes(world: int, n_perturbations: int) -> dict[str, int]:
    """The bytes of one step's exchange: {"payload": gathered tensor, "wire": sent per rank}."""
    payload = world * n_perturbations * PAIR_BYTES
    return {"payload": payload, "wire": comm.wire_bytes("ring_all_gather", payload, world)}


def loss_broadcast_bytes(pp: int, pp_rank: int, forwards: int) -> dict[str, int]:
    """The bytes `forwards` probe forwards send over pp on pipeline rank `pp_rank`: one
    broadcast of LOSS_BYTES each from the last stage (rank pp - 1) down gloo's binomial
    tree ({"calls", "payload", "wire"}: the wire bytes this rank sends; over the pp group,
    (pp - 1) x LOSS_BYTES per forward)."""
    if pp == 1:
        return {"calls": 0, "payload": 0, "wire": 0}
    wire = comm.wire_bytes("tree_broadcast", LOSS_BYTES, pp, from_root=(pp_rank + 1) % pp)
    return {"calls": forwards, "payload": forwards * LOSS_BYTES, "wire": forwards * wire}


def loss_reduce_bytes(cp: int, forwards: int) -> dict[str, int]:
    """The bytes `forwards` probe forwards send over cp on each cp rank: one ring all-reduce
    of LOSS_BYTES each, the cp ranks' loss sums ({"calls", "payload", "wire"})."""
    if cp == 1:
        return {"calls": 0, "payload": 0, "wire": 0}
    wire = comm.wire_bytes("ring_all_reduce", LOSS_BYTES, cp)
    return {"calls": forwards, "payload": forwards * LOSS_BYTES, "wire": forwards * wire}


def shared_loss(total: torch.Tensor | None, targets: float, mesh,
                axis: str = "cp") -> torch.Tensor:
    """A probe's loss, the mean over the whole rows' `targets`, on every rank of a replica.
    `total`: this rank's loss sum (float64; None off a pipeline's last stage, which holds no
    output). Under context parallelism each cp rank holds its tokens of every row: their sums
    are all-reduced over `axis` (one float64; "dpcp" where data.balance deals the rows of
    the whole dp x cp pool). Under a pipeline the last stage broadcasts the loss over pp (one
    float64). Tensor-parallel ranks already share it (the vocabulary-parallel loss)."""
    if total is not None and mesh.size(axis) > 1:
        total = total.detach().reshape(1)
        comm.all_reduce(total, mesh, axis)
        total = total[0]
    loss = None if total is None else total / targets
    pp = mesh.size("pp")
    if pp == 1:
        return loss
    sent = (torch.empty(1, dtype=torch.float64, device=mesh.device) if loss is None
            else loss.detach().double().reshape(1))
    comm.broadcast(sent, mesh, "pp", src_local=pp - 1, name="zo_loss")
    return sent[0]


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
