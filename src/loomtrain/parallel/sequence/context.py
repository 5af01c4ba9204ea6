"""What a sequence-parallel attention kernel knows about the tokens it holds: where every ring
member's tokens sit in the full sequence (the contiguous and zig-zag layouts), the documents
of the full rows, and the ring to talk over. Masks come from global positions, never from
local indices. Details: docs/sequence.md, "Layouts" and "The context a kernel sees". And,
for what is taken per whole row outside attention (the mixture of experts' balance loss),
which rows a rank's tokens belong to (`SharedRows`, docs/moe.md "Context parallelism").
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch

from loomtrain import comm
from loomtrain.parallel.tensor_comm import ReduceFromTP

LAYOUTS = ("contiguous", "zigzag")


def chunk_positions(seq_len: int, members: int, member: int, layout: str) -> torch.Tensor:
    """Global positions (ascending) of `member`'s tokens among `members` sharing a row."""
    if layout == "contiguous":
        if seq_len % members:
            raise ValueError(f"a row of {seq_len} tokens does not split evenly over {members} ranks")
        size = seq_len // members
        return torch.arange(member * size, (member + 1) * size)
    if layout == "zigzag":
        if seq_len % (2 * members):
            raise ValueError(f"a zig-zag split of {seq_len} tokens over {members} ranks needs a "
                             f"multiple of 2 x {members} = {2 * members}")
        size = seq_len // (2 * members)
        first, second = member, 2 * members - 1 - member
        return torch.cat([torch.arange(first * size, (first + 1) * size),
                          torch.arange(second * size, (second + 1) * size)])
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


class Ring:
    """Members of one ring (local indices on a mesh axis's group, in ring order) and this rank's
    place in it; p2p to the next and from the previous member through `comm`, each exchange
    tagged identically on every member (members issue the same exchanges in the same order)."""

    def __init__(self, mesh, axis: str, members: list[int] | None = None):
        self.mesh, self.axis = mesh, axis
        self.members = list(range(mesh.size(axis))) if members is None else list(members)
        self.me = self.members.index(mesh.local_rank(axis))
        self._key = f"ring:{axis}:{','.join(map(str, self.members))}"

    @property
    def size(self) -> int:
        return len(self.members)

    def _tag(self, op: str) -> int:
        seq = self.mesh.ring_sequence.get((self._key, op), 0) + 1
        self.mesh.ring_sequence[(self._key, op)] = seq
        return 1 + zlib.crc32(f"{self._key}/{op}/{seq}".encode()) % (2**31 - 2)

    def shift(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], step: int = 1):
        """Start sending `sends` to the member `step` places ahead and receiving `recvs` (same
        shapes) from the member `step` places behind. Returns the pending ops: `wait()` each."""
        n = self.size
        dst, src = self.members[(self.me + step) % n], self.members[(self.me - step) % n]
        pending = []
        for i, (s, r) in enumerate(zip(sends, recvs)):
            tag = self._tag(f"shift{step}.{i}")
            pending.append(comm.recv(r, self.mesh, self.axis, src, async_op=True, tag=tag))
            pending.append(comm.send(s, self.mesh, self.axis, dst, async_op=True, tag=tag))
        return pending


def visible_mask(pq: torch.Tensor, pk: torch.Tensor, docs: torch.Tensor | None = None,
                 window: int = 0) -> torch.Tensor:
    """Boolean (b or 1, tq, tk): which keys at global positions `pk` each query at `pq` attends
    to: causal, within one document of `docs` (b, T), and, with a `window`, within the last
    `window` positions (itself included: Mistral's sliding window)."""
    if docs is not None:  # documents may live on the accelerator
        pq, pk = pq.to(docs.device), pk.to(docs.device)
    offset = pq[:, None] - pk[None, :]
    mask = (offset >= 0)[None]
    if window:
        mask = mask & (offset < window)
    if docs is not None:
        mask = mask & (docs[:, pq][:, :, None] == docs[:, pk][:, None, :])
    return mask


def grouped_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys or values (b, kv_heads, t, d) repeated to `heads` query heads: each kv head serves
    heads/kv_heads consecutive query heads (grouped-query attention, models/llama.py)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def fold_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of grouped_kv's input: (b, heads, t, d) summed over each kv head's group."""
    b, heads, t, d = grad.shape
    if heads == kv_heads:
        return grad
    return grad.view(b, kv_heads, heads // kv_heads, t, d).sum(2)


@dataclass
class SeqContext:
    """The tokens this rank holds of rows shared by a ring (or a whole row when `ring` is None)."""

    positions: list[torch.Tensor]  # per ring member: global positions (t_local,) of its tokens
    me: int = 0  # my index among the members
    docs: torch.Tensor | None = None  # (b, T) document id of every position of the full rows
    ring: Ring | None = None
    window: int = 0  # a sliding window: each query sees at most this many keys (0: none)

    @classmethod
    def local(cls, seq_len: int, docs: torch.Tensor | None = None, window: int = 0) -> SeqContext:
        return cls([torch.arange(seq_len)], 0, docs, None, window)

    @classmethod
    def of_ring(cls, ring: Ring, seq_len: int, layout: str,
                docs: torch.Tensor | None = None, window: int = 0) -> SeqContext:
        positions = [chunk_positions(seq_len, ring.size, m, layout) for m in range(ring.size)]
        return cls(positions, ring.me, docs, ring, window)

    @property
    def dense(self) -> bool:
        """Whether the only mask is causality over consecutive positions from 0 (SDPA's
        is_causal does it without a mask)."""
        return self.docs is None and not self.window

    @property
    def members(self) -> int:
        return len(self.positions)

    @property
    def local_positions(self) -> torch.Tensor:
        return self.positions[self.me]

    def visible(self, q_member: int, k_member: int, device=None) -> torch.Tensor:
        """Boolean mask (b or 1, tq, tk): which of `k_member`'s keys each of `q_member`'s
        queries attends to (visible_mask: causal, one document, the window)."""
        mask = visible_mask(self.positions[q_member], self.positions[k_member], self.docs,
                            self.window)
        return mask if device is None else mask.to(device)


@dataclass
class SharedRows:
    """How a micro-batch's rows lie over the ranks of `axis` that share them, for a statistic
    taken per whole row (the mixture of experts' balance loss, models/moe.py): `rows` rows of
    `length` tokens; this rank's tokens (b, t) are, when `tokens` is None, some of each row's
    (local row i: row i; context parallelism), else the local tokens `tokens[j]` of the
    flattened (b * t) are row `row[j]`'s and the others padding (data.balance's pool)."""

    mesh: Any
    axis: str
    rows: int
    length: int
    tokens: torch.Tensor | None = None
    row: torch.Tensor | None = None

    def own(self, values: torch.Tensor) -> torch.Tensor:
        """(b, t, ...) per local token -> those of the tokens that belong to a row."""
        return values if self.tokens is None else values.flatten(0, 1).index_select(0, self.tokens)

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        """(b, t, C) per local token -> (rows, C): each row's sums over all its tokens, on
        every rank of the axis. All-reduced forward, identity backward (Megatron's `g`): every
        rank computes the same function of the sums, and its gradient reaches each rank's own
        tokens from that rank's copy, so it counts once."""
        if self.tokens is None:
            local = values.sum(1)
        else:
            mine = values.flatten(0, 1).index_select(0, self.tokens)
            local = mine.new_zeros(self.rows, mine.shape[1]).index_add_(0, self.row, mine)
        return ReduceFromTP.apply(local, self.mesh, self.axis)

    @property
    def counted(self) -> int:
        """The rows this rank counts in a statistic summed over the axis (its first member
        counts them all)."""
        return self.rows if self.mesh.local_rank(self.axis) == 0 else 0


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """Reference softmax attention of (b, h, tq, d) queries over (b, h, tk, d) keys with a
    boolean (b or 1, tq, tk) mask; a query that sees no key gets zeros."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v
