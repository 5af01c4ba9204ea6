"""The dynamic data x context parallel dealer (parallel/sequence/balance.py): every token
dealt once, split sequences on distinct ranks, and the work balanced on heavy-tailed lengths."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from loomtrain.parallel.sequence.balance import deal, work_of


def _heavy_tailed(seed: int, n: int = 256) -> list[int]:
    """Document lengths from a Pareto distribution (shape 1.2, minimum 64 tokens, capped at
    32k): most documents short, a few very long, as in pre-training corpora."""
    rng = random.Random(seed)
    return [min(32768, int(64 * rng.paretovariate(1.2))) for _ in range(n)]


def _check_complete(plan, lengths):
    parts = defaultdict(list)
    for r, pieces in enumerate(plan.ranks):
        for p in pieces:
            parts[p.sequence].append((p.part, p.parts, r))
    assert sorted(parts) == list(range(len(lengths)))
    for seq, got in parts.items():
        k = got[0][1]
        assert sorted(part for part, _, _ in got) == list(range(k))  # each piece once
        assert len({r for _, _, r in got}) == k  # on k different ranks


@pytest.mark.parametrize("attention", ["softmax", "linear"])
@pytest.mark.parametrize("ranks", [2, 4, 8, 16])
@pytest.mark.parametrize("seed", range(5))
def test_heavy_tailed_lengths_balance_within_10_percent(attention, ranks, seed):
    lengths = _heavy_tailed(seed)
    plan = deal(lengths, ranks, attention)
    _check_complete(plan, lengths)
    assert sum(plan.work) == pytest.approx(sum(work_of(n, attention) for n in lengths))
    assert plan.imbalance < 0.10, (attention, ranks, seed, plan.imbalance)


def test_only_sequences_heavier_than_a_share_are_split():
    plan = deal([1000, 100, 100, 100, 100], 4)  # 1000^2 is far more than a quarter
    split = {p.sequence for r in plan.ranks for p in r if p.parts > 1}
    assert split == {0}
    assert plan.imbalance < 0.05
    even = deal([100] * 8, 4)
    assert all(p.parts == 1 for r in even.ranks for p in r) and even.imbalance == 0


def test_softmax_and_linear_differ_where_quadratic_work_matters():
    lengths = [4096, 512, 512, 512, 512, 512, 512, 512, 512]
    soft, lin = deal(lengths, 2, "softmax"), deal(lengths, 2, "linear")
    assert max(p.parts for r in soft.ranks for p in r) == 2  # 4096^2 > half of the total
    assert max(p.parts for r in lin.ranks for p in r) == 1  # 4096 = half of 8192: fits whole


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least one rank"):
        deal([10], 0)
    with pytest.raises(ValueError, match="length of at least 1"):
        deal([10, 0], 2)
    with pytest.raises(ValueError, match="softmax"):
        deal([10], 2, "sparse")


def _packed_docs(seed: int, rows: int, seq_len: int):
    """Rows of `seq_len` tokens packed with documents of Pareto(1.2) lengths (minimum 16),
    numbered in stream order as the sampler does."""
    import torch

    rng = random.Random(seed)
    ids, doc = [], 0
    while len(ids) < rows * seq_len:
        ids.extend([doc] * int(16 * rng.paretovariate(1.2)))
        doc += 1
    return torch.tensor(ids[:rows * seq_len]).view(rows, seq_len)


@pytest.mark.parametrize("pool", [2, 4, 8])
@pytest.mark.parametrize("seed", range(3))
def test_hybrid_shares_hold_every_token_once_and_balance(pool, seed):
    from loomtrain.parallel.sequence.hybrid import dp_imbalance, plan_shares, segments

    docs = _packed_docs(seed, rows=16, seq_len=512)
    segs, shares, plan = plan_shares(docs, pool)
    assert sum(s.length for s in segs) == docs.numel()
    assert all(bool((docs[s.row, s.start:s.end] == docs[s.row, s.start]).all()) for s in segs)
    held = defaultdict(list)
    for rank, mine in enumerate(shares):
        assert [s.segment for s in mine] == sorted(s.segment for s in mine)  # ring order
        for share in mine:
            assert rank in share.members and len(share.positions) <= share.padded
            held[share.segment].append((rank, share))
    for seg, got in held.items():
        members = got[0][1].members
        assert sorted(r for r, _ in got) == sorted(members)
        assert all(s.members == members for _, s in got)
        positions = sorted(p for _, s in got for p in s.positions)
        assert positions == list(range(segs[seg].length))  # each token once
        assert got[0][1].padded == max(len(s.positions) for _, s in got)
    assert plan.imbalance < 0.10
    # whole rows to ranks (plain dp) on the same batch is far less even
    assert dp_imbalance(docs, pool) > plan.imbalance
    assert len(segments(docs[:1, :0])) == 0


def test_zigzag_split_of_uneven_lengths():
    from loomtrain.parallel.sequence.hybrid import zigzag_split

    assert zigzag_split(8, 2, 0) == [0, 1, 6, 7] and zigzag_split(8, 2, 1) == [2, 3, 4, 5]
    for length in range(1, 40):
        for n in (2, 3, 4):
            parts = [zigzag_split(length, n, m) for m in range(n)]
            assert sorted(p for part in parts for p in part) == list(range(length))
            assert max(map(len, parts)) - min(map(len, parts)) <= 2
