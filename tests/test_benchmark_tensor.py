"""Smoke test of benchmarks/tensor.py (--quick: a tiny GPT, one round of one step)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tensor.py"
KEYS = {"loomtrain_tokens_per_s", "torch_tp_tokens_per_s", "ratio", "loomtrain_vocab_tokens_per_s",
        "loomtrain_sp_tokens_per_s", "engines", "tp_bytes", "first_step_losses",
        "unsplit_first_step_loss", "first_step_loss_max_rel_diff", "last_step_loss_max_rel_diff",
        "config", "date", "losses_agree", "decode_ms_per_token", "serving"}
ENGINES = {"loomtrain", "loomtrain_vocab", "loomtrain_sp", "torch_tp"}


def test_benchmark_tensor_quick():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert KEYS <= out.keys(), KEYS - out.keys()
    assert set(out["engines"]) == ENGINES and out["rounds"] == 1 and out["config"]["quick"]
    assert all(out["engines"][e]["tokens_per_s"] > 0 for e in ENGINES) and out["ratio"] > 0
    # every engine computes the unsplit model's loss: the splits only reorder fp32 sums
    # (all-reduces of partial products), so the losses agree to a few ulps, not exactly
    assert out["first_step_loss_max_rel_diff"] < 1e-5, out["first_step_losses"]
    assert out["last_step_loss_max_rel_diff"] < 1e-5, out["engines"]
    assert out["losses_agree"]
    assert all(out["decode_ms_per_token"][v] > 0 for v in ("exact", "compressed", "torch"))
    for policy in ("tp", "sp", "shift"):
        assert out["serving"][policy]["p50_latency_ms"] > 0 < out["serving"][policy]["tokens_per_s"]
    # loomtrain's meter counts what Megatron's scheme sends, op for op
    for engine in ("loomtrain", "loomtrain_vocab", "loomtrain_sp"):
        fig = out["tp_bytes"][engine]
        assert fig["measured"]["calls"] == fig["expected"]["calls"], (engine, fig)
        assert fig["measured"]["wire_bytes"] == fig["expected"]["wire_bytes"], (engine, fig)
    # torch's DTensor TP makes the same all-reduces: the same bytes reach the sockets
    sockets = {e: out["engines"][e]["socket_bytes_per_step"] for e in ("loomtrain", "torch_tp")}
    assert sockets["torch_tp"] > 0, sockets
    assert abs(sockets["loomtrain"] / sockets["torch_tp"] - 1) < 0.01, sockets
