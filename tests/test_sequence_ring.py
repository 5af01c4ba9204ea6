"""Context-parallel attention (issue 6): ring attention and DeepSpeed-Ulysses against the dense
single-process reference (outputs and q, k, v gradients) at cp = 2 and 4, zig-zag and contiguous
layouts, with and without packed documents; the bytes each kernel sends; the pure tile plan."""

from __future__ import annotations

import pytest
import torch

from harness import run_world
from loomtrain.mesh import build_mesh
from loomtrain.parallel.sequence.context import (
    Ring,
    SeqContext,
    chunk_positions,
    dense_attention,
    grouped_kv,
)
from loomtrain.parallel.sequence import ring as ring_module
from loomtrain.parallel.sequence.ring import (
    block_tiles,
    coalesced,
    merge,
    ring_attention,
    tile_forward,
)
from loomtrain.parallel.sequence.ulysses import check_heads, ulysses_attention

B, HEADS, T, D = 2, 4, 32, 8
KERNELS = {"ring": ring_attention, "ulysses": ulysses_attention}
CASES = [(kernel, layout, with_docs) for kernel in KERNELS
         for layout in ("zigzag", "contiguous") for with_docs in (False, True)]
# grouped-query k and v (2 or 1 heads for 4 query heads) and a sliding window of 7 (it ends
# inside chunks at cp 2 and 4); contiguous rows also carry documents
GROUPED_CASES = [("ring", "zigzag", 2, 7), ("ring", "contiguous", 1, 7),
                 ("ulysses", "contiguous", 2, 0), ("ulysses", "contiguous", 1, 7)]
# fp32 throughout. The kernels sum the same products as the reference in another order (tile by
# tile, merged through exp/log of the lse): a few float32 roundings (eps 1.2e-7) per element over
# 32 keys, measured at most 4e-7 of the largest value. 1e-4 leaves that a wide margin, while a
# wrong mask, a lost block or a lost accumulator moves results by 1e-2 and more (checked by
# breaking each on purpose: errors of 0.1 and more).
RTOL = 1e-4


def _docs() -> torch.Tensor:
    """Document ids of B rows of T tokens. Boundaries: 16 is a chunk edge in every layout at
    cp 2 and 4, 8 in all but contiguous cp 2; 13, 3 and 27 fall inside chunks."""
    docs = torch.zeros(B, T, dtype=torch.long)
    for row, starts in enumerate(([8, 13], [3, 16, 27])):
        for start in starts:
            docs[row, start:] += 1
    return docs


def _inputs(kv_heads: int = HEADS) -> list[torch.Tensor]:
    """q, k, v and the upstream gradient of the full rows: the same on every rank; k and v
    with `kv_heads` heads (grouped-query attention when fewer than HEADS)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(B, heads, T, D, generator=gen)
            for heads in (HEADS, kv_heads, kv_heads, HEADS)]


def _relative_errors(kernel, seq: SeqContext, docs, kv_heads: int = HEADS) -> list[float]:
    """Max-abs error of my slice of out, dq, dk, dv, relative to the reference's max-abs. The
    reference repeats grouped k and v to the query heads (autograd sums their gradients) and
    masks the context's window."""
    *qkv, grad = _inputs(kv_heads)
    ref = [x.clone().requires_grad_() for x in qkv]
    mask = SeqContext.local(T, docs, seq.window).visible(0, 0)
    want_out = dense_attention(ref[0], *(grouped_kv(x, HEADS) for x in ref[1:]), mask)
    want_out.backward(grad)
    want = [want_out.detach()] + [x.grad for x in ref]
    mine = seq.local_positions
    full = [x.clone().requires_grad_() for x in qkv]
    out = kernel(*(x[:, :, mine] for x in full), seq)
    out.backward(grad[:, :, mine])
    got = [out.detach()] + [x.grad[:, :, mine] for x in full]
    return [float((g - w[:, :, mine]).abs().max() / w.abs().max()) for g, w in zip(got, want)]


def _sent(mesh, op: str, field: str = "wire_bytes") -> int:
    return mesh.meter.total(field, op=op, axis="cp")


def _ring_cases(mesh):
    """Every parity case, the bytes each kernel sends, and Ulysses' refusal, on `mesh`'s cp."""
    ring = Ring(mesh, "cp")
    errors = {}
    for kernel, layout, with_docs in CASES:
        docs = _docs() if with_docs else None
        seq = SeqContext.of_ring(ring, T, layout, docs)
        errors[(kernel, layout, with_docs)] = _relative_errors(KERNELS[kernel], seq, docs)
    for kernel, layout, kv_heads, window in GROUPED_CASES:
        docs = _docs() if layout == "contiguous" else None
        seq = SeqContext.of_ring(ring, T, layout, docs, window)
        errors[(kernel, layout, kv_heads, window)] = _relative_errors(
            KERNELS[kernel], seq, docs, kv_heads)

    seq = SeqContext.of_ring(ring, T, "zigzag")
    sent = {}
    for kv_heads in (HEADS, 2):  # 2 kv heads: grouped, split evenly at cp 2 but not at 4
        local = [x[:, :, seq.local_positions].requires_grad_() for x in _inputs(kv_heads)[:3]]
        for name, kernel, op in (("ring", ring_attention, "send"),
                                 ("ulysses", ulysses_attention, "all_to_all")):
            before = _sent(mesh, op), _sent(mesh, op, "payload_bytes")
            out = kernel(*local, seq)
            forward = _sent(mesh, op) - before[0], _sent(mesh, op, "payload_bytes") - before[1]
            out.sum().backward()
            sent[name, kv_heads] = forward, (_sent(mesh, op) - before[0] - forward[0])

    try:  # 3 heads over 2 or 4 members: refused before any communication
        ulysses_attention(*(x[:, :3] for x in local), seq)
        refusal = None
    except ValueError as err:
        refusal = str(err)
    return errors, sent, refusal


def _world_cases(rank, world):
    # one world of 4 for both ring sizes (process start-up dominates this test): cp=4, then
    # dp=2 x cp=2, whose second ring (ranks 2, 3) also checks local-to-global rank mapping
    return {n: _ring_cases(build_mesh({"dp": world // n, "cp": n})) for n in (4, 2)}


def test_ring_and_ulysses_match_dense_attention():
    for by_cp in run_world(_world_cases, 4, timeout_s=90):
        for n, (errors, sent, refusal) in by_cp.items():
            for case, errs in errors.items():
                assert max(errs) < RTOL, (n, case, dict(zip(("out", "dq", "dk", "dv"), errs)))
            block = B * HEADS * (T // n) * D * 4  # one member's k (or v) in fp32, bytes
            # ring: k and v passed on n-1 times in forward; in backward again, plus the dk, dv
            # accumulators (fp32), which each make n-1 hops back to their owner; 2 kv heads
            # of 4 travel unrepeated, half of it
            for kv_heads in (HEADS, 2):
                kv_block = block * kv_heads // HEADS
                (ring_forward, _), ring_backward = sent["ring", kv_heads]
                assert ring_forward == 2 * (n - 1) * kv_block
                assert ring_backward == 4 * (n - 1) * kv_block
            # Ulysses: one all-to-all of q, k, v and one of the output each way, each sending
            # (n-1)/n of what it covers; grouped k and v unrepeated when n splits their heads
            (wire, payload), backward = sent["ulysses", HEADS]
            assert payload == 4 * block and wire == (n - 1) * 4 * block // n
            assert backward == wire
            (_, payload), _ = sent["ulysses", 2]
            assert payload == (3 * block if n == 2 else 4 * block)
            assert refusal is not None and "n_heads=3" in refusal and f"cp={n}" in refusal


@pytest.mark.parametrize("with_docs", [False, True])
def test_ring_kernel_without_a_ring_is_dense_attention(with_docs):
    docs = _docs() if with_docs else None
    errs = _relative_errors(ring_attention, SeqContext.local(T, docs), docs)
    assert max(errs) < RTOL, errs


def test_the_fused_kernel_gets_one_call_per_block_under_zigzag():
    """Causal rows without documents: a member's own block is one causal call and every other
    member's visible block one full call, at every member."""
    n = 4
    positions = [chunk_positions(T, n, m, "zigzag") for m in range(n)]
    for me in range(n):
        seq = SeqContext(positions, me)
        calls = [coalesced(block_tiles(seq, source), triangles=True) for source in range(n)]
        assert [len(c) for c in calls] == [1] * n, (me, calls)
        assert [c[0].causal for c in calls] == [source == me for source in range(n)]


def test_zigzag_gives_every_member_the_same_tiles_and_contiguous_does_not():
    """Tiles computed per member over a whole ring pass (causal, no documents): zig-zag 3 of its
    own block (the diagonal chunks' upper halves hidden) and 2 of every other member's; contiguous
    3 of its own and 4 of each earlier member's, none of a later one."""
    n = 4
    for layout, expected in (("zigzag", [3 + 2 * (n - 1)] * n),
                             ("contiguous", [3 + 4 * m for m in range(n)])):
        positions = [chunk_positions(T, n, m, layout) for m in range(n)]
        tiles = [sum(len(block_tiles(SeqContext(positions, me), src)) for src in range(n))
                 for me in range(n)]
        assert tiles == expected, (layout, tiles)


@pytest.mark.parametrize("with_docs", [False, True])
def test_explicit_tiles_without_the_fused_kernel_are_dense_attention(monkeypatch, with_docs):
    """Off the CPU the tiles are explicit fp32 products (no fused kernel with the lse there):
    the same parity, run here by turning the fused kernel off."""
    monkeypatch.setattr(ring_module, "_fused", lambda q: False)
    docs = _docs() if with_docs else None
    errs = _relative_errors(ring_attention, SeqContext.local(T, docs), docs)
    assert max(errs) < RTOL, errs


def _covered(seq: SeqContext, source: int, triangles: bool) -> torch.Tensor:
    """The (b, tq, tk) mask that the coalesced tile plan of `source`'s block computes."""
    visible = torch.zeros(seq.visible(seq.me, source).shape, dtype=torch.bool)
    for tile in coalesced(block_tiles(seq, source), triangles):
        part = visible[:, tile.rows, tile.cols]
        if tile.causal:
            part |= torch.ones(part.shape[-2:], dtype=torch.bool).tril()
        else:
            part |= True if tile.mask is None else tile.mask[:, 0]
    return visible


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_the_tile_plan_covers_exactly_the_visible_keys(layout):
    """The plan decides full, causal and skipped tiles from positions alone, and coalesces full
    neighbours (and, for the fused kernel, a block's own three tiles into one causal tile):
    what it computes is the mask, at every member and source, with and without documents and
    a window."""
    for n in (1, 2, 4):
        positions = [chunk_positions(T, n, m, layout) for m in range(n)]
        for docs, window in ((None, 0), (_docs(), 0), (None, 7), (_docs(), 7)):
            for me in range(n):
                seq = SeqContext(positions, me, docs, None, window)
                for source, triangles in [(s, t) for s in range(n) for t in (False, True)]:
                    want = seq.visible(me, source).expand(B, -1, -1)
                    got = _covered(seq, source, triangles).expand(B, -1, -1)
                    assert torch.equal(got, want), (n, me, source, triangles)


def test_a_query_that_sees_no_key_gets_zeros():
    q, k, v = (torch.randn(1, 1, 3, D) for _ in range(3))
    mask = torch.tensor([[True, False], [False, False], [True, True]])[None, None]
    out = torch.zeros(1, 1, 3, D)
    lse = torch.full((1, 1, 3), float("-inf"))
    part_out, part_lse = tile_forward(q, k[..., :2, :], v[..., :2, :], mask, D ** -0.5)
    assert torch.isneginf(part_lse[0, 0, 1]) and not part_out.isnan().any()
    merge(out, lse, slice(0, 3), part_out, part_lse)
    merge(out, lse, slice(0, 3), part_out, part_lse)  # merging a partial twice changes nothing
    assert torch.equal(out[0, 0, 1], torch.zeros(D)) and not out.isnan().any()
    assert torch.allclose(out, part_out, atol=1e-6)


def test_ulysses_refuses_heads_that_do_not_split():
    check_heads(8, 4)
    with pytest.raises(ValueError, match="n_heads=6"):
        check_heads(6, 4)
