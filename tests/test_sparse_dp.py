"""Sparse-aware data parallel: with fixed masks only the kept gradient entries travel.

The oracle: dense data parallel on the masked model (the reduced gradient masked, the
weights masked after every step) gives the same gradients and weights; the bytes per step are
the formula's and the density's share of the dense ones; the masks travel once per change,
and rank 0's win."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from harness import run_world
from loomtrain.comm.mask_sync import mask_bytes, mask_sync_payload_bytes, pack_mask, unpack_mask
from loomtrain.comm.meter import wire_bytes
from loomtrain.parallel.sparse_dp import bucket_keep, check_masks, values_wire_bytes


@pytest.mark.parametrize("density", [0.0, 0.01, 0.03, 0.2, 1.0])
@pytest.mark.parametrize("shape", [(37, 11), (64,), (5, 8, 3)])
def test_mask_packing_round_trips_in_the_smaller_format(density, shape):
    g = torch.Generator().manual_seed(7)
    mask = torch.rand(shape, generator=g) < density
    fmt, packed = pack_mask(mask)
    nnz, numel = int(mask.sum()), mask.numel()
    # int32 indices (4 bytes a kept entry) against a bitmap (ceil(numel / 8) bytes)
    assert fmt == ("indices" if 4 * nnz <= math.ceil(numel / 8) else "bitmap"), (fmt, nnz, numel)
    assert packed.dtype == torch.uint8 and packed.numel() == mask_bytes(nnz, numel)
    assert torch.equal(unpack_mask(fmt, packed, mask), mask)
    # a slice of a payload at an odd offset (how it arrives): the bytes get aligned
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), packed])[3:]
    assert torch.equal(unpack_mask(fmt, shifted, mask), mask)


def test_masks_are_checked_and_laid_out_per_bucket():
    a, b, c = (nn.Parameter(torch.zeros(s)) for s in ((2, 3), (4,), (3, 2)))
    mask_a = torch.tensor([[True, False, True], [False, False, True]])
    mask_c = torch.zeros(3, 2, dtype=torch.bool)
    aligned = check_masks({c: mask_c, a: mask_a}, [a, b, c])
    assert aligned[0] is mask_a and aligned[1] is None and aligned[2] is mask_c
    keep = bucket_keep([a, b, c], aligned, torch.zeros(16))
    assert keep.tolist() == mask_a.view(-1).tolist() + [True] * 4 + [False] * 6
    assert bucket_keep([a, b], [None, None], torch.zeros(10)) is None
    assert check_masks(None, [a, b]) == [None, None]
    with pytest.raises(ValueError, match="bool tensor of that shape"):
        check_masks({a: mask_a.float()}, [a, b])
    with pytest.raises(ValueError, match="bool tensor of that shape"):
        check_masks({a: mask_c}, [a, b])
    with pytest.raises(ValueError, match="does not reduce"):
        check_masks({c: mask_c}, [a, b])
    # 2 ranks: one all-reduce of 4 x kept bytes per bucket, each rank sending half of it twice
    assert values_wire_bytes([10, 3], 2) == 40 + 12
    assert mask_sync_payload_bytes([(3, 6), None, (0, 6)]) == 48 + 1 + 0


def test_packed_cuts_reduce_scatter_to_each_range_its_kept_sums():
    """ZeRO's packed reduce-scatter (parallel/zero/sparse.py) simulated over 4 ranks: every
    rank packs its own values at the same cut, the packed vectors are summed and chunk r goes
    to rank r, whose unpacked range equals the masked dense sum's range r; the chunks are as
    long as the most kept entries in one range (an empty range gets them padded)."""
    from loomtrain.parallel.zero.sparse import packed_cut

    keep = torch.rand(48, generator=torch.Generator().manual_seed(0)) < 0.3
    keep[12:24] = False  # range 1 keeps nothing
    values = [torch.randn(48) for _ in range(4)]
    cuts = [packed_cut(keep, 4, r) for r in range(4)]
    assert cuts[0].width == max(int(part.sum()) for part in keep.chunk(4))
    summed = sum(cuts[0].pack(v) for v in values)
    dense = sum(values) * keep
    for r, cut in enumerate(cuts):
        chunk = summed.chunk(4)[r]
        assert torch.equal(cut.unpack(chunk, torch.full((12,), 7.0)), dense.chunk(4)[r])
    assert packed_cut(torch.zeros(8, dtype=torch.bool), 2, 0).width == 1  # never a 0-long chunk


def _masks(model, seed: int) -> dict:
    """Random masks of a few densities for every Linear weight of the blocks and for the tied
    embedding/head weight."""
    g = torch.Generator().manual_seed(seed)
    weights = [m.weight for m in model.blocks.modules() if isinstance(m, nn.Linear)]
    weights.append(model.tok_emb.weight)
    densities = [0.5, 0.2, 0.1, 0.05]
    return {w: torch.rand(w.shape, generator=g) < densities[i % len(densities)]
            for i, w in enumerate(weights)}


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)


def _backward(dp, x, y):
    from loomtrain.models import token_loss_sum

    (token_loss_sum(dp(x), y) / y.numel()).backward()


def _kept(dp, masks) -> tuple[list[int], list[int]]:
    """Per bucket: the entries kept under `masks`, and all its entries."""
    kept = [sum(int(masks[p].sum()) if p in masks else p.numel() for p in b.params)
            for b in dp.buckets]
    return kept, [b.buffer.numel() for b in dp.buckets]


def _sparse_dp_world(rank, world, steps):
    from loomtrain.comm.compress import build_compressor
    from loomtrain.mesh import build_mesh
    from loomtrain.models import GPT
    from loomtrain.parallel.data import DataParallel

    mesh = build_mesh({"dp": world})
    meter = mesh.meter
    torch.manual_seed(0)

    def make():
        return GPT(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
    sparse_model, dense_model = make(), make()
    dense_model.load_state_dict(sparse_model.state_dict())
    # 10 KiB buckets: 9 of them for this 64k-parameter GPT, masked, unmasked and mixed
    sparse = DataParallel(sparse_model, mesh, bucket_mb=0.01)
    dense = DataParallel(dense_model, mesh, bucket_mb=0.01)

    # every rank computes different masks; rank 0's are used and copied into everyone's
    mine = _masks(sparse_model, seed=100 + rank)
    meter.take()
    sparse.set_gradient_masks(mine)
    masks = _masks(sparse_model, seed=100)  # rank 0's, recomputed
    assert all(torch.equal(mine[p], masks[p]) for p in masks)
    shapes = {p: p.numel() for p in masks}
    params = [p for b in sparse.buckets for p in b.params]
    payload = mask_sync_payload_bytes(
        [(int(masks[p].sum()), shapes[p]) if p in masks else None for p in params])
    sync = meter.counts[("dp", "mask_sync")]
    assert (sync.calls, sync.payload_bytes) == (2, payload)  # a header, then the packed masks
    header = 16 * len(params)
    assert sync.wire_bytes == sum(wire_bytes("tree_broadcast", s, world, from_root=rank)
                                  for s in (header, payload - header))
    assert sparse.metrics()["mask_sync_wire_bytes"] == sync.wire_bytes

    dense_masks = {dict(zip(sparse_model.parameters(), dense_model.parameters()))[p]: m
                   for p, m in masks.items()}
    with torch.no_grad():
        for model, ms in ((sparse_model, masks), (dense_model, dense_masks)):
            for p, m in ms.items():
                p.mul_(m)
    # overlap: when pos_emb's gradient is ready (near the end of backward; this hook runs
    # after the engine's) the compact all-reduces of the later layers' buckets are in flight
    in_flight = []
    sparse_model.pos_emb.weight.register_post_accumulate_grad_hook(lambda p: in_flight.append(
        sum(b.launched and b.compact is not None for b in sparse.buckets)))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (sparse_model, dense_model)]
    kept, numel = _kept(sparse, masks)
    n_ratio, worst = [], 0.0
    sent_total = 0
    for step in range(steps):
        x, y = _batch(rank, step)
        meter.take()
        _backward(sparse, x, y)
        sent = meter.take()["all_reduce"]
        _backward(dense, x, y)
        dense_sent = meter.take()["all_reduce"]
        assert sent == values_wire_bytes(kept, world)  # the formula, per bucket
        assert dense_sent == values_wire_bytes(numel, world)
        n_ratio.append(sent / dense_sent)
        sent_total += sent
        with torch.no_grad():
            for p, m in dense_masks.items():
                p.grad.mul_(m)  # the oracle: dense all-reduce, then mask
        for p, m in masks.items():
            assert not p.grad[~m].any()  # masked-out entries are zero
        norms = [dp.clip_grad_norm_(0.05) for dp in (sparse, dense)]
        for a, b in zip(sparse_model.parameters(), dense_model.parameters()):
            if world == 2:
                assert torch.equal(a.grad, b.grad), step
            worst = max(worst, (a.grad - b.grad).abs().max().item())
        torch.testing.assert_close(norms[0], norms[1], rtol=1e-6, atol=0)
        for opt, model, ms in zip(opts, (sparse_model, dense_model), (masks, dense_masks)):
            opt.step()
            opt.zero_grad(set_to_none=False)
            with torch.no_grad():
                for p, m in ms.items():
                    p.mul_(m)
    assert len(in_flight) == steps and min(in_flight) >= 4, in_flight
    weights_diff = max((a - b).abs().max().item()
                       for a, b in zip(sparse_model.parameters(), dense_model.parameters()))
    figures = sparse.metrics()
    assert figures["sparse_comm_wire_bytes"] == sent_total
    assert figures["mask_sync_wire_bytes"] == 0  # none since the last record
    assert sync.calls == 2  # fixed masks: no sync after the first

    # changed masks: one more sync; None: a header only, and the dense path again
    sparse.set_gradient_masks(_masks(sparse_model, seed=200))
    assert sync.calls == 4
    sparse.set_gradient_masks(None)
    assert sync.calls == 5 and sparse.metrics() == {}
    with torch.no_grad():
        for a, b in zip(sparse_model.parameters(), dense_model.parameters()):
            a.copy_(b)
    x, y = _batch(rank, steps)
    meter.take()
    _backward(sparse, x, y)
    sent = meter.take()["all_reduce"]
    _backward(dense, x, y)
    assert sent == meter.take()["all_reduce"] == values_wire_bytes(numel, world)
    for a, b in zip(sparse_model.parameters(), dense_model.parameters()):
        assert torch.equal(a.grad, b.grad)

    # refused: masks with a compressor, and a mask of the wrong shape (before any collective)
    topk = DataParallel(make(), mesh, bucket_mb=0.01,
                        compressor=build_compressor("topk", 0.1, 1, True, 0))
    weight = topk.module.blocks[0].mlp.fc.weight
    for dp, mask in ((topk, torch.ones_like(weight, dtype=torch.bool)),
                     (sparse, torch.ones(3, dtype=torch.bool))):
        try:
            dp.set_gradient_masks({weight if dp is topk else sparse_model.head.weight: mask})
        except ValueError:
            pass
        else:
            raise AssertionError("not refused")
    return {"masks": list(masks.values()),
            "ratio": n_ratio[0], "density": sum(kept) / sum(numel), "grad_diff": worst,
            "weights_diff": weights_diff}


@pytest.mark.parametrize("world", [2, 4])
def test_sparse_dp_equals_dense_dp_on_the_masked_model(world):
    steps = 4
    results = run_world(_sparse_dp_world, world, steps, timeout_s=90)
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["masks"], results[0]["masks"]))
    for r in results:
        # the kept share of the entries: 2(N-1)/N x 4 bytes each, floored per bucket
        assert r["ratio"] == pytest.approx(r["density"], rel=1e-3) and r["density"] < 0.5
        if world == 2:  # a + b == b + a: the same bits (asserted per step in the ranks)
            assert r["grad_diff"] == 0 and r["weights_diff"] == 0
        else:
            # 4 values summed in another order where the compact buffer's ring chunks start
            # at another rank than the dense buffer's: an ulp of the largest gradients (9e-10
            # here, of values ~1e-2), which AdamW's division by sqrt(v) turns into 3e-7 in
            # the weights after 4 steps at lr 1e-2
            assert r["grad_diff"] < 1e-8 and r["weights_diff"] < 1e-5, r
