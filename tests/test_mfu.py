"""MFU (train/mfu.py): the model FLOPs per token against hand counts, the arithmetic, the peak
(a CUDA name matched to the planner's table, the CPU calibration or its absence), and a short
run writing `mfu` into metrics.jsonl."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from loomtrain.models.config import ModelConfig
from loomtrain.planner.calibrate import save
from loomtrain.planner.specs import BUILTIN, DeviceSpec
from loomtrain.train.metrics import read_metrics
from loomtrain.train.mfu import (NO_CALIBRATION, Utilization, cuda_kind, model_flops_per_token,
                                 peak_flops)

from test_checkpoint import _train

CPU = torch.device("cpu")


def test_flops_per_token_of_a_tiny_gpt_by_hand():
    # d 32, 2 layers, seq 32, vocab 256, mlp_ratio 4: a block's matrices q k v o (4 d^2) and
    # the MLP's two (2 x 4 d^2) are 12 d^2 = 12,288 weights, 2 FLOPs each per token = 24,576,
    # attention's QK^T and AV 4 s d = 4,096: 28,672 per block, 57,344 for two; the tied head
    # 2 d V = 16,384; forward 73,728 per token, forward and backward 3x: 221,184
    m = ModelConfig(name="gpt", d_model=32, n_layers=2, n_heads=2, seq_len=32, vocab_size=256)
    assert model_flops_per_token(m) == 221_184


def test_flops_per_token_of_a_tiny_llama_by_hand():
    # d 32, 4 heads of 8, 2 kv heads (grouped-query), SwiGLU 64 wide, 2 layers, seq 16, vocab
    # 128: q and o d x 32 (2,048 weights), k and v d x 16 (1,024), the SwiGLU 3 x 32 x 64
    # (6,144): 9,216 weights, 18,432 FLOPs, attention 4 x 16 x 32 = 2,048: 20,480 per block,
    # 40,960 for two; the head 2 x 32 x 128 = 8,192; 49,152 forward, 147,456 per token
    m = ModelConfig(name="llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                    seq_len=16, vocab_size=128)
    assert model_flops_per_token(m) == 147_456
    # MoE in every block: 4 experts 16 wide, 2 per token: the router d x E (128 weights) and
    # the two picked SwiGLUs (2 x 3 x 32 x 16 = 3,072) replace the SwiGLU's 6,144: a block
    # has 3,072 + 3,200 = 6,272 weights, 12,544 FLOPs + 2,048 = 14,592; two, and the head:
    # 37,376 forward, 112,128 per token (k of the E experts, not E)
    moe = m.model_copy(update={"n_experts": 4, "experts_per_token": 2, "moe_hidden": 16})
    assert model_flops_per_token(moe) == 112_128


def test_mfu_is_model_flops_over_the_devices_peak():
    # 1,000 tok/s x 221,184 FLOPs = 221.184 MFLOP/s over 2 devices of 1 GFLOP/s
    assert Utilization(221_184, 1e9, 2).mfu(1000) == pytest.approx(0.110592, rel=1e-12)
    unknown = Utilization(None, None, 1, NO_CALIBRATION)
    assert unknown.mfu(1000) is None
    assert unknown.describe(None) == f"mfu n/a ({NO_CALIBRATION})"
    assert Utilization(1, 1, 1).describe(0.1234) == "mfu 12.3%"


def test_cuda_names_match_the_planner_table():
    assert cuda_kind("NVIDIA H100 80GB HBM3") == "h100-80g"
    assert cuda_kind("NVIDIA H200") == "h200-141g"
    assert cuda_kind("NVIDIA A100-SXM4-40GB") == "a100-40g"
    assert cuda_kind("NVIDIA A100-SXM4-80GB") == "a100-80g"
    assert cuda_kind("NVIDIA H100 PCIe") is None  # a lower peak than the SXM datasheet's
    assert cuda_kind("NVIDIA GeForce RTX 4090") is None
    assert BUILTIN[cuda_kind("NVIDIA H100 80GB HBM3")].peak_flops("bf16") == 989e12


def _calibrate_here(cache: Path) -> float:
    """A minimal cpu-here calibration under `cache` whose peak is this machine's fp32 rate on
    a 512^3 GEMM, timed here (best of 5): a real peak, in milliseconds rather than the ~25 s
    of `loom bench calibrate --quick`."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    peak = 2 * 512 ** 3 / best
    save(DeviceSpec("cpu-here", peak_bf16_flops=peak, peak_fp32_flops=peak, mem_bytes=2 ** 30,
                    mem_bandwidth_bytes_per_s=1e10, intra_node_bytes_per_s=1e9,
                    intra_node_latency_s=1e-5, inter_node_bytes_per_s=1e9,
                    inter_node_latency_s=1e-5, host_link_bytes_per_s=1e10),
         cache / "loomtrain" / "cpu-here.toml")
    return peak


def test_cpu_peak_is_the_calibration_or_none(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert peak_flops(CPU, "fp32") == (None, NO_CALIBRATION)
    peak = _calibrate_here(tmp_path)
    assert peak_flops(CPU, "bf16") == (pytest.approx(peak), "")


def test_a_run_writes_mfu_with_a_calibration_and_null_without(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    without = read_metrics(_train(tiny(train={"steps": 2}, run={"name": "bare"})))
    assert [r["mfu"] for r in without] == [None, None]
    assert f"mfu n/a ({NO_CALIBRATION})" in capsys.readouterr().err
    peak = _calibrate_here(tmp_path / "cache")
    cfg = tiny(train={"steps": 2}, run={"name": "calibrated"})
    records = read_metrics(_train(cfg))
    per_token = model_flops_per_token(cfg.model)
    for r in records:
        assert 0 < r["mfu"] <= 1
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * per_token / peak, rel=1e-6)
    assert f"mfu {records[-1]['mfu']:.1%}" in capsys.readouterr().err
