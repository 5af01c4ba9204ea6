"""`loom bench calibrate` (planner/calibrate.py): the alpha-beta fit against known links, the
spec built from raw figures, the TOML round trip through load_device("cpu-here"), and one real
quick calibration through the CLI whose figures the cost model then uses."""

import math
import os

import pytest

from loomtrain.planner import comm_cost as C
from loomtrain.planner.calibrate import QUICK, fit_alpha_beta, save, spec_from, usable_memory_bytes
from loomtrain.planner.cost import estimate
from loomtrain.planner.plan import Plan
from loomtrain.planner.presets import preset
from loomtrain.planner.specs import ClusterSpec, DeviceSpec, load_device

SIZES = [4, 64, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 16 << 20]


def _device(alpha: float, beta: float, n: int) -> DeviceSpec:
    return DeviceSpec("t", 1e9, 1e9, 1, 1e9, 1e9, 1e-6, 1e9, 1e-6, 1e9, collective_fit=((n, alpha, beta),))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fit_recovers_the_link_comm_cost_predicts_with(n):
    """Times made by comm_cost.all_reduce_s itself give back its alpha and beta exactly."""
    alpha, beta = 300e-6, 1.5e9
    cluster = ClusterSpec(_device(alpha, beta, n), n, n)
    times = [C.all_reduce_s(cluster, s, n, False) for s in SIZES]
    got = fit_alpha_beta(SIZES, times, n)
    assert got == pytest.approx((alpha, beta), rel=1e-9)
    fitted = ClusterSpec(_device(*got, n), n, n)
    assert [C.all_reduce_s(fitted, s, n, False) for s in SIZES] == pytest.approx(times, rel=1e-9)


def test_fit_of_sends_and_under_noise():
    """A send is alpha + S / beta. With 5-10% noise on every time the fit stays within 5%: the
    relative weighting lets the 4-byte messages set alpha although the 16 MiB ones take 1000x
    longer; an ordinary least-squares line through the same points misses alpha by 15%."""
    alpha, beta = 50e-6, 3e9
    noise = [1.1, 0.9, 1.05, 0.95, 1.1, 0.9, 1.05]
    times = [(alpha + s / beta) * e for s, e in zip(SIZES, noise)]
    got_alpha, got_beta = fit_alpha_beta(SIZES, times)
    assert got_alpha == pytest.approx(alpha, rel=0.05) and got_beta == pytest.approx(beta, rel=0.05)
    mean_s, mean_t = sum(SIZES) / len(SIZES), sum(times) / len(times)
    slope = (sum((s - mean_s) * (t - mean_t) for s, t in zip(SIZES, times))
             / sum((s - mean_s) ** 2 for s in SIZES))
    assert abs((mean_t - slope * mean_s) / alpha - 1) > 0.1  # the unweighted intercept


def test_fit_refuses_what_has_no_line_and_clips_a_negative_alpha():
    with pytest.raises(ValueError, match="two message sizes"):
        fit_alpha_beta([1024, 1024], [1e-3, 1e-3])
    with pytest.raises(ValueError, match="do not grow"):
        fit_alpha_beta([4, 1 << 20], [2e-3, 1e-3])
    alpha, beta = fit_alpha_beta([1 << 20, 2 << 20, 4 << 20], [0.9e-3, 2e-3, 4.1e-3])  # intercept < 0
    assert alpha == 0.0 and 1e9 < beta < 1.1e9


def _found(bf16: float) -> dict:
    """Raw figures as measure() returns them, made from known links (2: 200 us, 2 GB/s; 4:
    300 us, 1 GB/s; sends 60 us, 4 GB/s)."""
    sizes = SIZES
    ar = {n: [C.all_reduce_s(ClusterSpec(_device(a, b, n), n, n), s, n, False) for s in sizes]
          for n, a, b in ((2, 200e-6, 2e9), (4, 300e-6, 1e9))}
    return {"message_bytes": sizes, "large_fp32_flops": 80e9, "large_bf16_flops": bf16,
            "stream_bytes_per_s": 20e9, "op_overhead_s": 8e-6,
            "flops_by_procs": [[1, 90e9], [2, 50e9], [4, 26e9]],
            "all_reduce_s_2": ar[2], "all_reduce_s_4": ar[4],
            "send_s": [60e-6 + s / 4e9 for s in sizes], "load_average": 0.5,
            "attention_efficiency": 0.4, "sync_penalty": [[2, 2, 8e-4], [4, 2, 9e-4], [4, 4, 1.5e-3]],
            # exposed shift times: the send (60 us + S / 4 GB/s) plus 3 and 4 ms
            "shift_exposed_s": [[2, [3.06e-3 + s / 4e9 for s in (4, 65536, 1 << 20)]],
                                [4, [4.06e-3 + s / 4e9 for s in (4, 65536, 1 << 20)]]]}


def test_spec_from_raw_figures():
    spec = spec_from(_found(bf16=300e9), "test")
    assert spec.name == "cpu-here" and spec.matmul_efficiency == 1.0
    assert spec.peak_fp32_flops == 90e9  # the best single-process rate: the model's GEMMs here
    assert spec.peak_bf16_flops == 300e9
    assert spec.flops_by_procs == ((1, 90e9), (2, 50e9), (4, 26e9))
    assert [n for n, _, _ in spec.collective_fit] == [2, 4]
    assert spec.collective_fit[0][1:] == pytest.approx((200e-6, 2e9))
    assert spec.collective_fit[1][1:] == pytest.approx((300e-6, 1e9))
    assert (spec.intra_node_latency_s, spec.intra_node_bytes_per_s) == pytest.approx((60e-6, 4e9))
    assert spec.inter_node_bytes_per_s == spec.intra_node_bytes_per_s  # one machine
    assert spec.host_link_bytes_per_s == spec.mem_bandwidth_bytes_per_s == 20e9
    assert spec.cores == os.cpu_count()
    assert spec.mem_bytes == usable_memory_bytes() > 0  # shared by the processes of a plan
    assert ClusterSpec(spec, 4, 4).mem_per_device == spec.mem_bytes // 4
    # the all-reduce times are kept as measured, by group size, for comm_cost to interpolate
    assert spec.collective_table[:len(SIZES)] == tuple((2, s, t) for s, t in
                                                       zip(SIZES, _found(1)["all_reduce_s_2"]))
    assert spec.sync_penalty == ((2, 2, 8e-4), (4, 2, 9e-4), (4, 4, 1.5e-3))
    assert spec.attention_efficiency == 0.4
    assert [p for p, _ in spec.shift_penalty] == [2, 4]
    assert [t for _, t in spec.shift_penalty] == pytest.approx([3e-3, 4e-3], rel=1e-6)
    slow = spec_from(_found(bf16=10e9), "test")  # bf16 slower than fp32 on this CPU
    assert slow.peak_bf16_flops == slow.peak_fp32_flops and "slower than fp32" in slow.source


def test_save_writes_where_load_device_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="loom bench calibrate"):
        load_device("cpu-here")
    spec = spec_from(_found(bf16=300e9), "test")
    path = save(spec)
    assert path == tmp_path / "loomtrain" / "cpu-here.toml"
    assert load_device("cpu-here") == spec  # every field, tuples included
    assert load_device(str(save(spec, tmp_path / "elsewhere.toml"))) == spec


@pytest.fixture(scope="module")
def calibrated(calibration) -> DeviceSpec:
    """The session's quick calibration (conftest.py `calibration`), as the planner loads it."""
    cache, stdout = calibration
    out = cache / "loomtrain" / "cpu-here.toml"
    assert f"saved {out}" in stdout and "gloo all-reduce over 2" in stdout
    return load_device(str(out))


@pytest.mark.timeout(150)
def test_quick_calibration_is_plausible(calibrated):
    d = calibrated
    assert d.source.startswith("measured by loom bench calibrate (quick)")
    assert [n for n, _ in d.flops_by_procs] == [1, 2, 4]
    assert all(rate > 1e8 for _, rate in d.flops_by_procs)  # far below any CPU of this decade
    assert d.peak_fp32_flops >= d.flops_by_procs[0][1] and d.peak_bf16_flops >= d.peak_fp32_flops
    for n, alpha, beta in d.collective_fit:  # loopback gloo: DESIGN.md measured ~1 ms per op
        assert 1e-6 < alpha < 50e-3, (n, alpha)
        assert 1e6 < beta < 1e12, (n, beta)
    assert 1e-6 < d.intra_node_latency_s < 50e-3 and d.intra_node_bytes_per_s > 1e6
    assert 1e8 < d.mem_bandwidth_bytes_per_s < 1e13
    assert 1e-7 < d.op_overhead_s < 1e-2
    assert d.cores == os.cpu_count() and d.mem_bytes > 1e8
    assert 0.01 < d.attention_efficiency < 10
    assert {(p, n) for p, n, _ in d.sync_penalty} == {(2, 2), (4, 2), (4, 4)}
    assert all(0 <= t < 0.1 for _, _, t in d.sync_penalty)
    assert [p for p, _ in d.shift_penalty] == [2, 4] and all(0 <= t < 0.1 for _, t in d.shift_penalty)
    assert {n for n, _, _ in d.collective_table} == {2, 4} and all(t > 0 for *_, t in d.collective_table)
    assert QUICK.message_bytes[0] == 4 and QUICK.message_bytes[-1] == 16 << 20


@pytest.mark.timeout(150)
def test_the_cost_model_runs_on_the_calibrated_machine(calibrated):
    model = preset("default")
    cluster = ClusterSpec(calibrated, 2, 2)
    e = estimate(model, cluster, Plan(dp=2, precision="fp32", micro_batch=8, microbatches=2))
    assert math.isfinite(e.step_time_s) and e.step_time_s > 0 and e.fits
    # the gradient all-reduce is the measured link's: between the two measured sizes around
    # it, not a datasheet's
    grads = model.params * 4
    below = max((s, t) for n, s, t in calibrated.collective_table if n == 2 and s <= grads)
    above = min((s, t) for n, s, t in calibrated.collective_table if n == 2 and s >= grads)
    got = C.all_reduce_s(cluster, grads, 2, False)
    assert min(below[1], above[1]) <= got <= max(below[1], above[1])


def test_bad_out_exits_2(tmp_path):
    from loomtrain.cli import main
    assert main(["bench", "calibrate", "--out", str(tmp_path)]) == 2  # a folder, before measuring
    with pytest.raises(SystemExit) as exit_:
        main(["bench"])
    assert exit_.value.code == 2
