"""Ring attention: exact causal attention over a sequence sharded around a ring of ranks (Liu,
Zaharia & Abbeel, arXiv 2310.01889), blocks merged by the online softmax (Milakov &
Gimelshein, arXiv 1805.02867), masked zig-zag tiles skipped, and flash-attention's backward
per tile (Dao et al., arXiv 2205.14135). On CPU each tile runs torch's fused flash-attention
kernel, which returns the tile's log-sum-exp, and its fused backward; elsewhere the tiles are
explicit fp32 products. The formulas: docs/sequence.md, "Ring attention".
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from loomtrain.parallel.sequence.context import SeqContext, fold_kv, grouped_kv, visible_mask

NEG_INF = float("-inf")


def _halves(t: int) -> list[slice]:
    return [slice(0, t)] if t < 2 or t % 2 else [slice(0, t // 2), slice(t // 2, t)]


class Tile(NamedTuple):
    rows: slice  # my query rows
    cols: slice  # the source block's key rows
    mask: torch.Tensor | None  # (b or 1, 1, tq, tk) boolean; None: no mask to read
    causal: bool  # no mask, and each query sees the keys up to its own row (the lower triangle)

    @property
    def full(self) -> bool:
        """Every query sees every key."""
        return self.mask is None and not self.causal


def block_tiles(seq: SeqContext, source: int, device=None) -> list[Tile]:
    """The tiles of my queries x member `source`'s keys worth computing; tiles the mask hides
    entirely are left out. Pure: depends on positions and documents only. The plan is made
    where the positions live (the CPU), so that deciding costs no device synchronisation; only
    the masks kept move to `device`. Positions ascend within a member, so causality alone is
    decided from a tile's positions without building its mask."""
    mine, theirs = seq.positions[seq.me], seq.positions[source]
    tiles = []
    for rows in _halves(len(mine)):
        for cols in _halves(len(theirs)):
            pq, pk = mine[rows], theirs[cols]
            if pk[0] > pq[-1]:
                continue  # every key after every query
            if seq.dense and pk[-1] <= pq[0]:
                tiles.append(Tile(rows, cols, None, False))
            elif seq.dense and torch.equal(pq, pk):  # ascending: q_i sees k_j iff j <= i
                tiles.append(Tile(rows, cols, None, True))
            else:
                mask = visible_mask(pq, pk, seq.docs, seq.window)
                if mask.all():
                    tiles.append(Tile(rows, cols, None, False))
                elif mask.any():
                    tiles.append(Tile(rows, cols, mask[:, None].to(device), False))
    return tiles


def coalesced(tiles: list[Tile], triangles: bool = False) -> list[Tile]:
    """Two fully visible tiles side by side (the same rows, adjacent keys, or the same keys,
    adjacent rows) as one: one kernel call and one merge instead of two. Under zig-zag every
    other member's block is two such tiles. With `triangles`, a block's own tiles, two causal
    diagonal tiles around the full one below them, become one causal tile over the block: for
    a kernel that skips the hidden key blocks itself (flash attention) one call instead of
    three."""
    out: list[Tile] = []
    for tile in tiles:
        last = out[-1] if out else None
        if last is None or not (tile.full and last.full):
            out.append(tile)
        elif last.rows == tile.rows and last.cols.stop == tile.cols.start:
            out[-1] = Tile(last.rows, slice(last.cols.start, tile.cols.stop), None, False)
        elif last.cols == tile.cols and last.rows.stop == tile.rows.start:
            out[-1] = Tile(slice(last.rows.start, tile.rows.stop), last.cols, None, False)
        else:
            out.append(tile)
    if triangles and len(out) == 3:
        upper, below, lower = out
        if (upper.causal and lower.causal and below.full and below.rows == lower.rows
                and below.cols == upper.cols and upper.rows.stop == lower.rows.start):
            whole = slice(upper.rows.start, lower.rows.stop)
            return [Tile(whole, whole, None, True)]
    return out


def _scores(q, k, mask, scale, causal):
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    return s if mask is None else s.masked_fill(~mask, NEG_INF)


def _finite(x):
    """-inf (a row that sees no key) replaced by 0, so exp(s - x) gives 0 there, not NaN."""
    return x.masked_fill(x == NEG_INF, 0.0)


def _fused(q) -> bool:
    """Whether the tiles run torch's fused flash-attention kernel: its CPU form returns the
    log-sum-exp and takes an additive mask (aten._scaled_dot_product_flash_attention_for_cpu)."""
    return q.device.type == "cpu"


def _bias(mask, dtype):
    """The fused kernel's mask: additive, in the queries' dtype (0 visible, -inf hidden)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, NEG_INF)


def tile_forward(q, k, v, mask, scale, causal=False):
    """Softmax attention of one tile: (out, lse) in fp32; a row with no visible key gets
    out = 0 and lse = -inf, the identity of the merge. `causal` (then `mask` is None): the
    lower triangle."""
    if _fused(q):
        fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = fused(q, k, v, 0.0, causal, attn_mask=_bias(mask, q.dtype), scale=scale)
        if mask is not None:  # the kernel gives a row with no visible key lse 0
            lse = lse.masked_fill(~mask.any(-1), NEG_INF)
        return out.float(), lse
    s = _scores(q, k, mask, scale, causal)
    top = _finite(s.amax(-1, keepdim=True))
    p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)
    out = (p @ v.float()) / total.masked_fill(total == 0, 1.0)
    return out, (top + torch.log(total)).squeeze(-1)


def merge(out, lse, rows, part_out, part_lse) -> None:
    """Fold a partial (out, lse) for query `rows` into the running (out, lse), in place."""
    old = lse[..., rows]
    new = torch.logaddexp(old, part_lse)
    safe = _finite(new)
    out[..., rows, :] = (out[..., rows, :] * torch.exp(old - safe)[..., None]
                         + part_out * torch.exp(part_lse - safe)[..., None])
    lse[..., rows] = new


def tile_backward(q, k, v, dout, out, lse, delta, mask, scale, causal=False):
    """Gradients (dq, dk, dv) of one tile in fp32, from the final out and lse and delta =
    rowsum(dO*O): the fused backward computes delta itself from `out` (q's dtype), the
    explicit one takes `delta`."""
    if _fused(q):
        fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grads = fused(dout, q, k, v, out, lse, 0.0, causal, attn_mask=_bias(mask, q.dtype),
                      scale=scale)
        return tuple(g.float() for g in grads)
    p = torch.exp(_scores(q, k, mask, scale, causal) - _finite(lse)[..., None])
    dout = dout.float()
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.float().transpose(-2, -1) - delta[..., None])
    return (ds @ k.float()) * scale, (ds.transpose(-2, -1) @ q.float()) * scale, dv


def _ring_of(seq: SeqContext):
    ring = seq.ring
    if ring is None or ring.size == 1:
        return None, 1
    assert ring.me == seq.me and ring.size == seq.members, "SeqContext and its ring disagree"
    return ring, ring.size


def _forward(q, k, v, seq: SeqContext):
    ring, n = _ring_of(seq)
    scale = q.shape[-1] ** -0.5
    b, h, t, d = q.shape
    out = torch.zeros(b, h, t, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, t), NEG_INF, dtype=torch.float32, device=q.device)
    current = [k.contiguous(), v.contiguous()]
    buffers = [[torch.empty_like(x) for x in current] for _ in range(2)]
    for step in range(n):
        # start passing the block on before computing with it; the receive buffers alternate:
        # the pair written now was sent on in the previous step, and that send is complete
        pending = ring.shift(current, buffers[step % 2]) if step < n - 1 else []
        kb, vb = (grouped_kv(x, h) for x in current)  # grouped kv heads travel unrepeated
        tiles = coalesced(block_tiles(seq, (seq.me - step) % n, q.device), _fused(q))
        for rows, cols, mask, causal in tiles:
            part = tile_forward(q[..., rows, :], kb[..., cols, :], vb[..., cols, :], mask, scale,
                                causal)
            merge(out, lse, rows, *part)
        for p in pending:
            p.wait()
        current = buffers[step % 2]
    return out, lse


def _backward(dout, q, k, v, out, lse, seq: SeqContext):
    ring, n = _ring_of(seq)
    scale = q.shape[-1] ** -0.5
    delta = (dout.float() * out).sum(-1)
    out = out.to(q.dtype)  # the fused backward's out: q's dtype, as in flash-attention's own
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    current = [k.contiguous(), v.contiguous()]
    buffers = [[torch.empty_like(x) for x in current] for _ in range(2)]
    arriving = [torch.empty(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
    arrival = []  # the accumulator of the block I hold, sent by the previous member last step
    for step in range(n):
        kv_pending = ring.shift(current, buffers[step % 2]) if step < n - 1 else []
        dk = torch.zeros(current[0].shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros_like(dk)
        kb, vb = (grouped_kv(x, q.shape[1]) for x in current)
        tiles = coalesced(block_tiles(seq, (seq.me - step) % n, q.device), _fused(q))
        for rows, cols, mask, causal in tiles:
            dq_t, dk_t, dv_t = tile_backward(q[..., rows, :], kb[..., cols, :], vb[..., cols, :],
                                             dout[..., rows, :], out[..., rows, :], lse[..., rows],
                                             delta[..., rows], mask, scale, causal)
            dq[..., rows, :] += dq_t
            dk[..., cols, :] += fold_kv(dk_t, k.shape[1])
            dv[..., cols, :] += fold_kv(dv_t, k.shape[1])
        for p in arrival:
            p.wait()
        if arrival:
            dk += arriving[0]
            dv += arriving[1]
        if step == 0:
            own = (dk, dv)  # my block's own contribution stays home
        else:  # pass the accumulator on: at step n - 1 the next member is its owner
            arrival = ring.shift([dk, dv], arriving)
        for p in kv_pending:
            p.wait()
        current = buffers[step % 2]
    dk, dv = own
    if n > 1:
        for p in arrival:
            p.wait()
        dk, dv = dk + arriving[0], dv + arriving[1]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, seq):
        out, lse = _forward(q, k, v, seq)
        fctx.seq = seq
        fctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(fctx, dout):
        q, k, v, out, lse = fctx.saved_tensors
        return (*_backward(dout, q, k, v, out, lse, fctx.seq), None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   ctx: SeqContext) -> torch.Tensor:
    """Exact causal (and same-document, windowed) softmax attention of my (b, heads, t_local,
    head_dim) queries over every ring member's keys and values, scale head_dim**-0.5 as in
    torch SDPA; grouped-query keys and values (fewer heads) go round the ring unrepeated.
    Without a ring (or a ring of one) the same kernel runs on the local block alone."""
    return _RingAttention.apply(q, k, v, ctx)
