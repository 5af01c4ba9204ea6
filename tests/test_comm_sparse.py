"""The sparse all-reduce (comm/sparse.py): both schemes and "auto" against the dense all-reduce
of the same tensors on 2 and 4 ranks, the same bits on every rank and from both schemes, the
wire bytes against the meter and the formulas, and the pure parts (the hash partition's load
balance, the scheme rule, the union sketch, input validation)."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from harness import run_world

from loomtrain import comm
from loomtrain.comm.sparse import sparse_all_reduce
from loomtrain.comm.sparse_plan import (
    FORMATS,
    Encoding,
    best_format,
    bottom_hashes,
    choose_scheme,
    chunk_bytes,
    estimate_union,
    estimated_wire_bytes,
    gap_decode,
    gap_encode,
    index_wire_dtype,
    owner_of,
    pack_bits,
    partition_layout,
    partition_loads,
    sketch_size,
    true_positions,
    unpack_bits,
)
from loomtrain.mesh import build_mesh

CASES = ("overlapping", "overlapping_fp32", "disjoint", "scattered", "empty_rank", "all_empty",
         "complete", "hot")
SCHEMES = ("allgather", "balanced", "auto")
INDEX_BYTES = 4  # every case has fewer than 2^31 elements


def _case(name: str, rank: int, world: int):
    """(numel, indices, values) of `rank`: a pure function, so the parent can rebuild every
    rank's input. Counts differ between ranks, so chunks are padded."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{rank}/{world}".encode()))
    numel = {"complete": 64, "scattered": 100_000, "hot": 1 << 18}.get(name, 1000)
    dtype = torch.float32 if name in ("overlapping_fp32", "hot") else torch.float64
    if name == "disjoint":
        indices = torch.arange(rank, numel, world)[:60 + 10 * rank]
    elif name == "all_empty" or (name == "empty_rank" and rank == 1):
        indices = torch.empty(0, dtype=torch.int64)
    elif name == "complete":  # every index but rank's residue: the union is all of out
        indices = torch.arange(numel)[torch.arange(numel) % world != rank]
    elif name == "hot":  # 15% of 2^18 from a shared hot range: "auto" picks balanced at N = 4
        indices = torch.randperm(60_000, generator=g)[:40_000]
    elif name == "scattered":  # 0.05%: positions travel as pairs
        indices = torch.randperm(numel, generator=g)[:50]
    else:  # overlapping: all ranks draw from the same 400 indices, as bitmaps
        indices = torch.randperm(400, generator=g)[:150 + 20 * rank]
    return numel, indices, torch.randn(indices.numel(), generator=g, dtype=dtype)


def _world(rank, world):
    mesh = build_mesh({"dp": world})
    results = {}
    for name in CASES:
        numel, indices, values = _case(name, rank, world)
        dense = torch.zeros(numel, dtype=values.dtype)
        dense[indices] = values
        comm.all_reduce(dense, mesh, "dp")
        row = {"dense": dense}
        for scheme in SCHEMES:
            out = torch.full((numel,), math.nan, dtype=values.dtype)  # every element is written
            before = mesh.meter.total()
            result = sparse_all_reduce(indices, values, out, mesh, "dp", scheme)
            row[scheme] = (out, result, mesh.meter.total() - before)
            later = torch.full((4, numel // 4), math.nan, dtype=values.dtype)  # any shape
            pending = sparse_all_reduce(indices, values, later, mesh, "dp", scheme, async_op=True)
            untouched = bool(later.isnan().all())
            waited = pending.wait()
            row[f"{scheme} async"] = (later.view(-1), waited, untouched and pending.result is waited)
        results[name] = row
    return results


@pytest.fixture(scope="module", params=[2, 4])
def worlds(request):
    return request.param, run_world(_world, request.param, timeout_s=120)


def test_every_scheme_equals_the_dense_all_reduce(worlds):
    world, results = worlds
    for name in CASES:
        for r in results:
            for scheme in (*SCHEMES, *(f"{s} async" for s in SCHEMES)):
                out = r[name][scheme][0]
                # the dense ring adds in another order: a few ulps of a sum of <= 4 terms
                tol = 1e-12 if out.dtype == torch.float64 else 1e-6
                torch.testing.assert_close(out, r[name]["dense"], rtol=tol, atol=tol,
                                           msg=f"{name} {scheme} world {world}")


def test_every_rank_and_every_scheme_hold_the_same_bits(worlds):
    world, results = worlds
    for name in CASES:
        reference = results[0][name]["allgather"][0]
        for r in results:
            for scheme in (*SCHEMES, *(f"{s} async" for s in SCHEMES)):
                # both schemes add each element's contributions in rank order from zero
                assert torch.equal(r[name][scheme][0], reference), (name, scheme, world)


def test_async_writes_out_only_at_wait_and_keeps_the_result(worlds):
    _, results = worlds
    for r in results:
        for name in CASES:
            for scheme in SCHEMES:
                assert r[name][f"{scheme} async"][2], (name, scheme)
                assert r[name][f"{scheme} async"][1] == r[name][scheme][1]


def _expected_phases(name: str, world: int, requested: str, ran: str) -> dict[str, int]:
    """This rank's wire bytes per phase, from every rank's input (the same on every rank)."""
    inputs = [_case(name, r, world) for r in range(world)]
    numel, n, value = inputs[0][0], world, inputs[0][2].element_size()
    # a row per rank: allgather its count without and with gap fillers, balanced its count
    # per owner, auto both and its sketch
    counts = {"allgather": 16, "balanced": 8 * n, "auto": 8 * (n + 1 + sketch_size(numel))}
    phases = {"counts": (n - 1) * counts[requested]}
    if ran == "allgather":
        k_max = max(idx.numel() for _, idx, _ in inputs)
        filled = max(gap_encode(idx.sort().values, v)[0].numel() for _, idx, v in inputs)
        chunk = min(filled * (2 + value), k_max * (INDEX_BYTES + value))  # int16 gaps if fewer
        return phases | ({"pairs": (n - 1) * chunk} if k_max else {})
    to_owners = max(max(partition_loads(idx, n, numel)) for _, idx, _ in inputs)
    if to_owners == 0:
        return phases
    sizes = partition_loads(torch.arange(numel), n, numel)
    union = partition_loads(torch.unique(torch.cat([idx for _, idx, _ in inputs])), n, numel)
    from_owners = max(min(chunk_bytes(f, u, s, INDEX_BYTES, value) for f in FORMATS)
                      for u, s in zip(union, sizes))
    return phases | {"to_owners": (n - 1) * to_owners * (INDEX_BYTES + value),
                     "reduced_counts": (n - 1) * 8, "from_owners": (n - 1) * from_owners}


def test_wire_bytes_match_the_meter_and_the_formulas(worlds):
    world, results = worlds
    for name in CASES:
        for rank, r in enumerate(results):
            for scheme in SCHEMES:
                _, result, metered = r[name][scheme]
                assert result.wire_bytes == metered == sum(result.phases.values())
                expected = _expected_phases(name, world, scheme, result.scheme)
                assert result.phases == expected, (name, scheme, rank)
    # every format ran: dense slices when the union is all of out, bitmaps at ~30% density,
    # pairs at 0.05%
    formats = {name: results[0][name]["balanced"][1].owner_formats for name in CASES}
    assert formats["complete"] == ("dense",) * world
    assert formats["overlapping"] == ("bitmap",) * world
    assert formats["scattered"] == ("pairs",) * world


def test_auto_picks_the_rules_scheme_from_the_exchanged_counts(worlds):
    world, results = worlds
    for name in CASES:
        inputs = [_case(name, r, world) for r in range(world)]
        numel, ks = inputs[0][0], [idx.numel() for _, idx, _ in inputs]
        size, union = sketch_size(numel), None
        if size:
            union = estimate_union(torch.stack([bottom_hashes(idx, size) for _, idx, _ in inputs]),
                                   size)
            union = min(max(union, max(ks)), numel)
        value = inputs[0][2].element_size()
        filled = max(gap_encode(idx.sort().values, v)[0].numel() for _, idx, v in inputs)
        narrow = filled * (2 + value) < max(ks) * (INDEX_BYTES + value)
        expected = choose_scheme(math.ceil(sum(ks) / world), numel, world, max_nnz=max(ks),
                                 union=union, value_bytes=value,
                                 gap_bytes=2 if narrow else None)
        assert {r[name]["auto"][1].scheme for r in results} == {expected}, name
    if world == 4:  # the sketch-informed path to balanced ran
        assert results[0]["hot"]["auto"][1].scheme == "balanced"


# --- pure ----------------------------------------------------------------------------------------


def _zipf_indices(seed: int, count: int, hot: int) -> torch.Tensor:
    """`count` distinct indices of [0, hot), drawn with probability ~ 1 / (i + 1)^1.2."""
    weights = 1.0 / torch.arange(1, hot + 1, dtype=torch.float64) ** 1.2
    return torch.multinomial(weights, count, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [4, 8])
def test_hash_partition_balances_a_skewed_hot_range_and_ranges_do_not(n):
    numel = 1_000_000
    pairs = torch.cat([_zipf_indices(seed, 5_000, 50_000) for seed in range(n)])
    hashed, ranged = (partition_loads(pairs, n, numel, how) for how in ("hash", "range"))
    assert sum(hashed) == sum(ranged) == pairs.numel()
    mean = pairs.numel() / n
    assert max(hashed) / mean <= 1.5, hashed
    assert max(ranged) / mean > 1.5, ranged  # the hot range is inside the first range


def test_owner_is_a_pure_function_of_index_and_n():
    indices = torch.tensor([0, 1, 2, 12345, 2**31 - 1, 2**31, 2**40 + 7, 2**62])
    for n in (1, 2, 3, 4, 7, 1024):
        owners = owner_of(indices, n)
        assert torch.equal(owners, owner_of(indices.clone(), n))
        assert 0 <= owners.min() and owners.max() < n
        key = [(i ^ (i >> 31)) & (2**31 - 1) for i in indices.tolist()]
        assert owners.tolist() == [(k * 2654435769 % 2**32) * n >> 32 for k in key]
    # a contiguous range lands evenly: the golden-ratio sequence
    assert max(partition_loads(torch.arange(1000), 4, 1000)) - 250 <= 2
    with pytest.raises(ValueError, match="how='modulo'"):
        partition_loads(indices, 4, 2**63 - 1, "modulo")


def test_scheme_rule_follows_its_documented_behaviour():
    numel = 1 << 22
    for n in (2, 4, 8, 16):  # very low density: allgather
        assert choose_scheme(numel // 1000, numel, n) == "allgather"
    assert [choose_scheme(numel // 100, numel, n) for n in (2, 4, 8)] == [
        "allgather", "allgather", "balanced"]  # 1%: grows with N
    k = numel // 10
    assert [choose_scheme(k, numel, n) for n in (2, 4)] == ["allgather", "balanced"]  # 10%
    # the documented crossover at N = 4 (independent sets), moved down by overlap
    assert choose_scheme(int(0.023 * numel), numel, 4) == "allgather"
    assert choose_scheme(int(0.025 * numel), numel, 4) == "balanced"
    assert choose_scheme(int(0.015 * numel), numel, 4, union=int(0.015 * numel)) == "balanced"
    assert choose_scheme(100, 10**6, 4, union=100) == "allgather"  # the latencies decide
    assert choose_scheme(k, numel, 1) == "allgather"
    # the docstring's figures at 10%, N = 4: 10.1 MB against 7.2 MB
    assert estimated_wire_bytes("allgather", k, numel, 4) == 16 * 3 + 3 * k * 8
    assert estimated_wire_bytes("allgather", k, numel, 4, gap_bytes=2) == 16 * 3 + 3 * k * 6
    assert estimated_wire_bytes("balanced", k, numel, 4) == pytest.approx(7.237e6, rel=1e-3)


@pytest.mark.parametrize("count, fmt", [(3, "pairs"), (40, "bitmap"), (100, "dense")])
def test_each_chunk_format_round_trips_and_is_the_cheapest(count, fmt):
    size = 100
    positions = torch.sort(torch.randperm(size, generator=torch.Generator().manual_seed(count))
                           [:count]).values
    values = torch.randn(count, dtype=torch.float64)
    enc = Encoding(torch.int32, torch.float64)
    assert enc.best(count, size, FORMATS) == fmt == best_format(count, size, 4, 8)
    where = torch.zeros(size, dtype=torch.bool).index_fill_(0, positions, True)
    chunk = enc.encode(fmt, where if fmt == "bitmap" else positions, values, size)
    assert chunk.numel() == enc.bytes(fmt, count, size)
    got_where, got_values = enc.decode(fmt, chunk, count, size)
    assert torch.equal(got_values, values)
    if fmt == "dense":
        assert got_where is None
    elif fmt == "bitmap":
        assert torch.equal(got_where, where)
    else:
        assert got_where.tolist() == positions.tolist()


@pytest.mark.parametrize("size", [1, 7, 8, 9, 64, 1001])
def test_bit_codecs_match_the_bit_by_bit_definition(size):
    mask = torch.rand(size, generator=torch.Generator().manual_seed(size)) < 0.3
    padded = torch.zeros(8 * math.ceil(size / 8), dtype=torch.uint8)
    padded[:size] = mask
    expected = (padded.view(-1, 8).long() << torch.arange(8)).sum(1).to(torch.uint8)
    assert torch.equal(pack_bits(mask), expected)
    assert torch.equal(pack_bits(torch.cat([mask[:1], mask])[1:]), expected)  # unaligned start
    assert torch.equal(unpack_bits(expected, size), mask)
    assert torch.equal(true_positions(mask), mask.nonzero().view(-1))


def test_partition_layout_orders_each_owners_indices_and_inverts():
    numel, n = 1000, 4
    layout = partition_layout(numel, n, torch.device("cpu"))
    owners = owner_of(torch.arange(numel), n)
    assert list(layout.sizes) == partition_loads(torch.arange(numel), n, numel)
    for p in range(n):
        assert torch.equal(layout.members(p).long(), (owners == p).nonzero().view(-1))
    assert torch.equal(layout.by_owner.long()[layout.slot.long()], torch.arange(numel))


def test_gap_encoding_bridges_long_gaps_with_zero_fillers_and_round_trips():
    indices = torch.tensor([0, 3, 4, 10, 70_000, 70_001])
    values = torch.arange(1.0, 7.0)
    gaps, padded = gap_encode(indices, values)
    # 69,990 = 2 x 32,767 + 4,456: two fillers of value 0 before 70,000
    assert gaps.tolist() == [0, 3, 1, 6, 32_767, 32_767, 4_456, 1]
    assert padded.tolist() == [1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 5.0, 6.0]
    assert int(gaps.max()) <= 2**15 - 1
    positions = gap_decode(gaps.to(torch.int16))
    dense = torch.zeros(70_002).index_add_(0, positions, padded)
    assert torch.equal(dense, torch.zeros(70_002).index_put_((indices,), values))
    empty = torch.tensor([], dtype=torch.int64)
    assert gap_encode(empty, empty.float())[0].numel() == 0


def test_sketch_size_grows_with_out_and_vanishes_when_small():
    assert [sketch_size(n) for n in (1000, 65_535, 65_536, 1 << 20, 1 << 22)] == [0, 0, 16, 256, 256]
    assert sketch_size(1 << 18) == 64


def test_union_sketch_is_exact_when_small_and_close_when_large():
    small = [torch.arange(r, 100 + r) for r in range(4)]
    assert estimate_union(torch.stack([bottom_hashes(s) for s in small])) == 103
    g = torch.Generator().manual_seed(0)
    sets = [torch.randperm(400_000, generator=g)[:100_000] for _ in range(4)]
    true = torch.unique(torch.cat(sets)).numel()
    estimate = estimate_union(torch.stack([bottom_hashes(s) for s in sets]))
    assert abs(estimate / true - 1) < 0.15, (estimate, true)  # 2.5 sigma at k = 256
    hot = estimate_union(bottom_hashes(torch.arange(50_000))[None])
    assert abs(hot / 50_000 - 1) < 0.05, hot  # the hash spreads a range evenly


class _Pair:
    """A mesh axis of `n` ranks that fails if a collective is reached."""

    def __init__(self, n: int):
        self.n = n

    def size(self, axis):
        return self.n


@pytest.mark.parametrize("indices, values, message", [
    (torch.tensor([0, 10]), torch.ones(2), r"lie in \[0, 10\)"),
    (torch.tensor([-1, 3]), torch.ones(2), r"lie in \[0, 10\)"),
    (torch.tensor([0, 1, 2]), torch.ones(2), "must match indices"),
    (torch.tensor([0, 1], dtype=torch.int32), torch.ones(2), "1-D int64"),
    (torch.tensor([[0, 1]]), torch.ones(1, 2), "1-D int64"),
    (torch.tensor([0, 1]), torch.ones(2, dtype=torch.float64), "one floating dtype"),
])
def test_bad_input_is_refused_before_any_collective(indices, values, message):
    with pytest.raises(ValueError, match=message):
        sparse_all_reduce(indices, values, torch.zeros(10), _Pair(2), "dp")


def test_unknown_scheme_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"scheme='ring' is not one of \('auto', 'allgather'"):
        sparse_all_reduce(torch.tensor([0]), torch.ones(1), torch.zeros(4), _Pair(2), "dp", "ring")


def test_a_group_of_one_scatters_and_sends_nothing():
    out = torch.full((6,), math.nan)
    result = sparse_all_reduce(torch.tensor([4, 1]), torch.tensor([2.0, 3.0]), out, _Pair(1), "dp")
    assert out.tolist() == [0, 3, 0, 0, 2, 0] and result.wire_bytes == 0
    assert result.scheme == "allgather"
    assert index_wire_dtype(2**31 - 1) == torch.int32 and index_wire_dtype(2**31) == torch.int64
