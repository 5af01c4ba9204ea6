"""DeepSpeed-Ulysses (Jacobs et al., arXiv 2309.14509): sequence parallelism by trading the
sequence shard for a head shard, one all-to-all before attention and one after; the ring size
must divide the number of heads. Details: docs/sequence.md, "Ulysses".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loomtrain import comm
from loomtrain.parallel.sequence.context import SeqContext, grouped_kv, visible_mask


def check_heads(n_heads: int, cp: int) -> None:
    """Raise ValueError unless `cp` members can split `n_heads` heads evenly."""
    if n_heads % cp:
        raise ValueError(f"Ulysses sequence parallelism over cp={cp} ranks needs a number of "
                         f"attention heads divisible by {cp}, got n_heads={n_heads}")


def _exchange(x: torch.Tensor, ring, split_dim: int, cat_dim: int) -> torch.Tensor:
    """Chunk j of `x` along `split_dim` goes to member j; what member j sends back is chunk j
    of the result along `cat_dim`."""
    n = ring.size
    sent = torch.stack(x.chunk(n, split_dim)).contiguous()
    received = torch.empty_like(sent)
    comm.all_to_all(received, sent, ring.mesh, ring.axis)
    return torch.cat(received.unbind(0), dim=cat_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ring, split_dim, cat_dim):
        fctx.ring, fctx.dims = ring, (split_dim, cat_dim)
        return _exchange(x, ring, split_dim, cat_dim)

    @staticmethod
    def backward(fctx, grad):
        split_dim, cat_dim = fctx.dims
        return _exchange(grad.contiguous(), fctx.ring, cat_dim, split_dim), None, None, None


def _attend(q, k, v, positions: torch.Tensor, docs: torch.Tensor | None,
            window: int = 0) -> torch.Tensor:
    """Attention over the gathered sequence whose tokens sit at global `positions`; k and v
    may hold fewer (grouped) heads than q."""
    k, v = grouped_kv(k, q.shape[1]), grouped_kv(v, q.shape[1])
    if docs is None and not window and torch.equal(positions, torch.arange(len(positions))):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = visible_mask(positions, positions, docs, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None].to(q.device))


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      ctx: SeqContext, attend=_attend) -> torch.Tensor:
    """Causal (and same-document, windowed) softmax attention of my (b, heads, t_local,
    head_dim) queries over the whole ring's sequence, through two all-to-alls on the ring's
    mesh axis. Grouped-query k and v (fewer heads) travel unrepeated when the ring splits
    their heads evenly (member j's query heads then use exactly its kv heads: each kv head
    serves consecutive query heads), repeated to the query heads otherwise.

    `attend(q, k, v, positions, docs, window)` is the attention over the gathered heads; the
    default is softmax, and linear attention passes its own (Ulysses does not care what runs
    in between)."""
    ring = ctx.ring
    positions = torch.cat(ctx.positions)
    if ring is None or ring.size == 1:
        return attend(q, k, v, positions, ctx.docs, ctx.window)
    check_heads(q.shape[1], ring.size)
    assert ring.members == list(range(ring.mesh.size(ring.axis))), \
        "Ulysses all-to-alls over the whole mesh axis: the ring must be the axis in member order"
    assert all(len(p) == q.shape[2] for p in ctx.positions), "members hold unequal token counts"
    if k.shape[1] % ring.size:
        k, v = grouped_kv(k, q.shape[1]), grouped_kv(v, q.shape[1])
    if k.shape[1] == q.shape[1]:
        # q, k, v in one exchange: (3, b, h, t_local, d) -> (3, b, h/n, T, d)
        heads = _AllToAll.apply(torch.stack([q, k, v]), ring, 2, 3).unbind(0)
    else:
        kv = _AllToAll.apply(torch.stack([k, v]), ring, 2, 3).unbind(0)
        heads = (_AllToAll.apply(q, ring, 1, 2), *kv)
    out = attend(*heads, positions, ctx.docs, ctx.window)
    return _AllToAll.apply(out, ring, 2, 1)  # (b, h/n, T, d) -> (b, h, t_local, d)
