"""benchmarks/gpu_check.py on a machine without CUDA: exit 2 with its one line; and its runner
(each check timed, a failure recorded and the next run, the budget skipping the rest)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_check_exits_2_without_cuda():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py")], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == gpu_check.NO_CUDA and proc.stdout == ""


def test_runner_records_each_check_and_keeps_to_the_budget():
    def refused():
        raise gpu_check.NotAvailable("train.compile: unknown key")

    def broken():
        raise RuntimeError("exit 1: boom")

    found = {"ok": lambda: {"loss": 1.0}, "refused": refused, "broken": broken,
             "after": lambda: {"loss": 2.0}}
    results = gpu_check.run_all(found, budget_s=60, min_left_s=1)
    assert {k: r["status"] for k, r in results.items()} == {
        "ok": "pass", "refused": "not available", "broken": "fail", "after": "pass"}
    assert results["broken"]["error"] == "RuntimeError: exit 1: boom"
    assert results["ok"]["loss"] == 1.0 and all(r["s"] >= 0 for r in results.values())
    skipped = gpu_check.run_all(found, budget_s=0.5, min_left_s=1)
    assert {r["status"] for r in skipped.values()} == {"skipped (budget)"}


def test_oracles_compare_losses_step_by_step_and_share_their_reference():
    want = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}]
    assert gpu_check.max_rel_diff(want, want, 1e-4, "same") == 0.0
    off = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.001}]
    assert gpu_check.max_rel_diff(off, want, 1e-3, "close") == pytest.approx(2.5e-4)
    with pytest.raises(RuntimeError, match="0.00025 relative"):
        gpu_check.max_rel_diff(off, want, 1e-4, "over")
    with pytest.raises(RuntimeError, match="relative"):  # a NaN loss is never within the bound
        gpu_check.max_rel_diff([{"step": 1, "loss": float("nan")}, want[1]], want, 1e-4, "nan")
    with pytest.raises(RuntimeError, match="steps"):
        gpu_check.max_rel_diff(want[:1], want, 1e-4, "short")
    runs = []
    reference = gpu_check.memoized(lambda: runs.append("run") or want)
    assert reference() is want and reference() is want and runs == ["run"]
