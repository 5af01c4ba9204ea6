"""The gradient compressors (comm/compress/): each method's pure parts (top-k's choice,
error feedback's bookkeeping, PowerSGD's error against its rank, the int8 and sign codecs,
checkpoints of their state, the factory's errors) without processes, and every exchange on
2 and 4 gloo ranks against the sum of every rank's own contribution, the same bits on every
rank, its wire bytes as the meter counted them."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from harness import run_world

from loomtrain.comm.compress import METHODS, build_compressor, relative_error
from loomtrain.comm.compress.base import exchange_stats
from loomtrain.comm.compress.powersgd import (
    Layout,
    PowerSGD,
    PowerSGDPayload,
    back_project,
    orthonormalize_all,
    plan_layout,
    project,
    warm_start,
)
from loomtrain.comm.compress.sign import Sign
from loomtrain.comm.compress.topk import TopK, top_k_indices
from loomtrain.comm.meter import wire_bytes
from loomtrain.mesh import build_mesh

# a bucket as the data-parallel engine builds one: a matrix PowerSGD compresses at rank 2
# ((64 + 48) 2 < 3072), a bias, a matrix too small to compress ((3 + 4) 2 >= 12), a bias.
# Big enough that top-k's "auto" scheme, which sends a 2 KiB union sketch with its counts
# (comm/sparse.py), still sends fewer bytes than the dense all-reduce.
ROWS, COLS = 64, 48
MATRIX = ROWS * COLS
SHAPES = [(ROWS, COLS), (COLS,), (3, 4), (7,)]
NUMEL = sum(math.prod(s) for s in SHAPES)
EF_METHODS = ("topk", "randomk", "powersgd", "int8", "sign")
# where e + D(C(x)) == x holds bit for bit (base.py): the contribution is x or 0 per element
# (sparsifiers), or within a factor 2 of x (int8, Sterbenz); elsewhere to fp32 rounding
EXACT_EF = ("topk", "randomk", "int8")
FP32_EPS = torch.finfo(torch.float32).eps


def _make(method: str, error_feedback: bool = True):
    if method == "topk-balanced":
        return TopK(0.05, error_feedback, scheme="balanced")
    return build_compressor(method, ratio=0.05, rank=2, error_feedback=error_feedback, seed=7)


def _grad(rank: int, call: int, numel: int = NUMEL) -> torch.Tensor:
    """Rank `rank`'s bucket at call `call`: a pure function, so any process can rebuild it.
    Magnitudes spread over three decades, so chunks and top-k see different scales."""
    g = torch.Generator().manual_seed(1000 * rank + call)
    return torch.randn(numel, generator=g) * torch.logspace(-1, 2, numel)[torch.randperm(
        numel, generator=g)]


# --- pure parts ------------------------------------------------------------------------------


def test_top_k_keeps_exactly_the_k_largest_magnitudes():
    x = _grad(0, 0, 1000)
    for ratio in (0.0001, 0.01, 0.1, 0.5, 1.0):
        payload = TopK(ratio).compress("w", x, [(1000,)])
        k = max(1, math.ceil(ratio * 1000))
        by_sort = torch.sort(x.abs(), descending=True, stable=True).indices[:k].sort().values
        assert torch.equal(payload.indices, by_sort)
        assert torch.equal(payload.values, x[by_sort])


def test_top_k_breaks_ties_by_the_lowest_index():
    x = torch.tensor([1.0, -3.0, 3.0, 2.0, -3.0, 3.0, 0.5])
    assert top_k_indices(x, 1).tolist() == [1]
    assert top_k_indices(x, 3).tolist() == [1, 2, 4]
    assert top_k_indices(x, 5).tolist() == [1, 2, 3, 4, 5]
    assert top_k_indices(torch.zeros(6), 2).tolist() == [0, 1]


@pytest.mark.parametrize("method", EF_METHODS)
def test_error_feedback_keeps_what_was_not_sent(method):
    """e + D(C(x)) == x with x = g + the previous residual, over two calls."""
    comp = _make(method)
    residual = torch.zeros(NUMEL)
    for call in range(2):
        x = _grad(0, call) + residual if call else _grad(0, call)
        sent = comp.decompress(comp.compress("b", _grad(0, call), SHAPES), x)
        residual = comp.residual("b")
        assert residual.abs().max() > 0  # something was held back and is carried
        if method in EXACT_EF:
            assert torch.equal(residual + sent, x)
        else:  # two fp32 roundings (e = x - c, then e + c), each u = eps/2 of |x| + |c|
            assert ((residual + sent - x).abs() <= FP32_EPS * (x.abs() + sent.abs())).all()
    assert _make("int8", error_feedback=False).residual("b") is None


def _low_rank_plus_noise(n: int, m: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(n, 4, generator=g) @ torch.randn(4, m, generator=g)
            + 0.3 * torch.randn(n, m, generator=g))


def _power_error(comp, matrix: torch.Tensor) -> float:
    payload = comp.compress("w", matrix.view(-1), [matrix.shape])
    return relative_error(comp.decompress(payload, matrix.view(-1)), matrix.view(-1))


def test_powersgd_error_falls_with_rank_and_is_exact_at_full_rank():
    matrix = _low_rank_plus_noise(48, 40)
    errors = [_power_error(PowerSGD(r, error_feedback=False), matrix) for r in (1, 2, 4, 8)]
    assert all(a > b for a, b in itertools.pairwise(errors)), errors
    assert _power_error(PowerSGD(40), matrix) == 0.0  # (n + m) r >= n m: sent as it is
    # the low-rank maths itself at full rank: P^ spans M's columns, so P^ P^T M = M. fp32
    # QR and two matmuls of a well-conditioned 24 x 16 Gaussian: errors ~1e-6, 1e-5 is margin
    m = torch.randn(24, 16, generator=torch.Generator().manual_seed(4))
    layout = Layout(16, ((0, 24, 16),), ())
    p_hat = orthonormalize_all(layout, project(layout, m, warm_start(0, "w", 16 * 16)))
    payload = PowerSGDPayload(layout, p_hat, back_project(layout, m, p_hat), torch.zeros(0))
    assert torch.allclose(PowerSGD(16).decompress(payload, m.view(-1)).view(24, 16), m, atol=1e-5)


def test_powersgd_warm_start_changes_the_second_call():
    matrix = _low_rank_plus_noise(48, 40)
    comp = PowerSGD(2, error_feedback=False)
    first, second = _power_error(comp, matrix), _power_error(comp, matrix)
    assert second < first  # a second power-iteration step on the same matrix
    assert _power_error(PowerSGD(2, error_feedback=False), matrix) == first  # seeded start


def test_powersgd_sends_vectors_and_small_matrices_unchanged():
    layout = plan_layout(SHAPES, 2)
    assert layout.low_rank == ((0, ROWS, COLS),)
    assert layout.dense == ((MATRIX, COLS), (MATRIX + COLS, 12), (MATRIX + COLS + 12, 7))
    x = _grad(0, 0)
    out = PowerSGD(2).decompress(PowerSGD(2).compress("b", x, SHAPES), x)
    assert torch.equal(out[MATRIX:], x[MATRIX:])
    assert not torch.equal(out[:MATRIX], x[:MATRIX])


def test_powersgd_factors_each_expert_of_a_stack_on_its_own():
    """A mixture of experts' stacked weight (E, n, m) is E matrices: the same layout, the same
    factors and the same result as the E experts held as separate weights (not one rank-r
    approximation across the experts, which the (E, n m) view would give)."""
    experts, n, m = 4, 24, 20
    stacked, separate = [(experts, n, m), (5,)], [(n, m)] * experts + [(5,)]
    layout = plan_layout(stacked, 2)
    assert layout == plan_layout(separate, 2)
    assert layout.low_rank == tuple((e * n * m, n, m) for e in range(experts))
    x = torch.cat([_low_rank_plus_noise(n, m).reshape(-1) for _ in range(experts)]
                  + [torch.randn(5)])
    a, b = PowerSGD(2), PowerSGD(2)
    assert torch.equal(a.decompress(a.compress("b", x, stacked), x),
                       b.decompress(b.compress("b", x, separate), x))
    assert plan_layout([(experts, 3, 4)], 2).dense == ((0, experts * 12),)  # too small: whole


def test_int8_round_trip_is_within_half_a_step():
    x = _grad(0, 0, 300)  # not a whole number of 64-value chunks
    comp = build_compressor("int8", 1.0, 1, False, 0)
    back = comp.decompress(comp.compress("b", x, [(300,)]), x)
    padded = torch.nn.functional.pad(x, (0, 20)).view(-1, 64)
    bound = (padded.abs().amax(1) / 254).repeat_interleave(64)[:300]
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()


def test_sign_is_the_chunk_mean_magnitude_times_the_sign():
    x = _grad(0, 0, 1000)  # 3 chunks of 256 and a last one of 232
    x[5] = 0.0  # sign(0) counts as +1
    comp = Sign(chunk=256)
    packed, scales = comp.compress("b", x, [(1000,)])
    assert packed.dtype == torch.uint8 and packed.numel() == 4 * 256 // 8
    means = torch.stack([part.abs().mean() for part in x.split(256)])
    assert torch.allclose(scales, means, rtol=1e-6)
    signs = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(comp.decompress((packed, scales), x), scales.repeat_interleave(256)[:1000]
                       * signs)


def test_relative_error():
    assert relative_error(torch.ones(3), torch.zeros(3)) == 0.0
    assert relative_error(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 4.0])) == 0.75


@pytest.mark.parametrize("method", EF_METHODS)
def test_state_dict_round_trip_reproduces_the_next_call(method):
    comp = _make(method)
    for key in (0, "head"):
        comp.compress(key, _grad(1, 0), SHAPES)
    restored = _make(method)
    restored.load_state_dict(comp.state_dict())
    x = _grad(1, 1)
    a, b = comp.compress(0, x, SHAPES), restored.compress("0", x, SHAPES)
    assert torch.equal(comp.decompress(a, x), restored.decompress(b, x))
    assert torch.equal(comp.residual(0), restored.residual(0))
    with pytest.raises(ValueError, match="slot/key"):
        restored.load_state_dict({"momentum/0": x})


def test_build_compressor_names_bad_settings():
    assert build_compressor("none", 0.0, 0, True, 0) is None
    for method in METHODS[1:]:
        assert build_compressor(method, 0.1, 2, True, 0).name == method
    bad = [(("qsgd", 0.1, 1), "method 'qsgd' is not one of"),
           (("topk", 0.0, 1), r"ratio=0.0 for method 'topk' must be a number in \(0, 1\]"),
           (("randomk", 1.5, 1), "ratio=1.5"), (("topk", "1%", 1), "ratio='1%'"),
           (("powersgd", 0.1, 0), "rank=0 must be an integer >= 1"),
           (("powersgd", 0.1, 1.5), "rank=1.5")]
    for (method, ratio, rank), message in bad:
        with pytest.raises(ValueError, match=message):
            build_compressor(method, ratio, rank, True, 0)
    with pytest.raises(ValueError, match="scheme='dense'"):
        build_compressor("topk", 0.1, 1, True, 0, scheme="dense")


class _Alone:
    """What the exchanges read from a mesh whose axis has one rank."""

    def size(self, axis):
        return 1


@pytest.mark.parametrize("method", EF_METHODS)
def test_an_exchange_over_one_rank_is_the_own_contribution(method):
    comp, twin = _make(method), _make(method)
    for call in range(2):
        flat = _grad(2, call)
        payload = twin.compress("b", flat, SHAPES)
        expected = twin.decompress(payload, flat)
        stats = comp.start("b", flat, SHAPES, _Alone(), "dp").wait()
        assert torch.equal(flat, expected)
        assert torch.equal(comp.residual("b"), twin.residual("b"))
        assert stats == exchange_stats(flat, 1, 0, stats["local_error"])
        assert stats["ratio"] == 1.0 and 0 < stats["local_error"] < 1


# --- exchanges on 2 and 4 ranks ----------------------------------------------------------------

CASES = ("topk", "topk-balanced", "randomk", "powersgd", "int8", "sign")


def _exchange(rank, world):
    """Per case: two exchanges (the second with the first's residual), then the second again
    by a compressor restored from the state saved after the first."""
    mesh = build_mesh({"dp": world})
    out = {}
    for case in CASES:
        comp, calls = _make(case), []
        for call in range(2):
            flat = _grad(rank, call)
            before = mesh.meter.total(axis="dp")
            residual = comp.residual("b")
            x = flat + residual if residual is not None else flat.clone()
            stats = comp.start("b", flat, SHAPES, mesh, "dp").wait()
            calls.append({"sum": flat, "x": x, "residual": comp.residual("b").clone(),
                          "stats": stats, "meter": mesh.meter.total(axis="dp") - before})
            if call == 0:
                saved = comp.state_dict()
        restored = _make(case)
        restored.load_state_dict(saved)
        again = _grad(rank, 1)
        restored.start("b", again, SHAPES, mesh, "dp").wait()
        out[case] = {"calls": calls, "restored": again}
    return out


def _first_call_oracle(case: str, world: int) -> torch.Tensor:
    """The sum over ranks of each rank's contribution at the first call (no residual yet)."""
    if case != "powersgd":
        parts = []
        for r in range(world):
            comp = _make(case)
            parts.append(comp.decompress(comp.compress("b", _grad(r, 0), SHAPES), _grad(r, 0)))
        return torch.stack(parts).sum(0)
    # Vogels et al., Algorithm 1, written out: P = sum M_r Q; P^ = QR(P); Q = sum M_r^T P^
    grads = [_grad(r, 0) for r in range(world)]
    mats = [g[:MATRIX].view(ROWS, COLS) for g in grads]
    q0 = warm_start(7, "b", COLS * 2).view(COLS, 2)
    p_hat = torch.linalg.qr(sum(m @ q0 for m in mats)).Q
    total = torch.stack(grads).sum(0)
    total[:MATRIX] = (p_hat @ sum(m.T @ p_hat for m in mats).T).view(-1)
    return total


@pytest.mark.parametrize("world", [2, 4])
def test_every_exchange_sums_the_contributions_alike_on_every_rank(world):
    results = run_world(_exchange, world, timeout_s=120)
    for case in CASES:
        runs = [r[case] for r in results]
        first = runs[0]["calls"]
        # fp32 sums of N terms added in different orders (gloo's ring, index_add_, stack.sum)
        oracle = _first_call_oracle(case, world)
        assert torch.allclose(first[0]["sum"], oracle, rtol=1e-5, atol=1e-4), case
        # second call: each rank's contribution is x - e, its input less what it kept
        contributions = sum(run["calls"][1]["x"] - run["calls"][1]["residual"] for run in runs)
        assert torch.allclose(first[1]["sum"], contributions, rtol=1e-5, atol=1e-4), case
        for run in runs:
            for call, mine in zip(first, run["calls"]):
                assert torch.equal(mine["sum"], call["sum"]), case  # the same bits everywhere
                stats = mine["stats"]
                assert stats["wire_bytes"] == mine["meter"] > 0, case
                dense = wire_bytes("ring_all_reduce", 4 * NUMEL, world)
                assert stats["ratio"] == dense / stats["wire_bytes"] and stats["ratio"] > 1, case
                assert stats["dense_bytes"] == 4 * NUMEL and 0 < stats["local_error"] < 1, case
            assert torch.equal(run["restored"], first[1]["sum"]), case  # checkpoint resumes
    # random-k: k = 26 shared indices; the sum is nonzero exactly there, on every rank
    support = results[0]["randomk"]["calls"][0]["sum"].nonzero().view(-1)
    assert support.numel() == math.ceil(0.05 * NUMEL)
    comp = _make("randomk")
    assert torch.equal(comp.compress("b", _grad(0, 0), SHAPES).indices, support)
