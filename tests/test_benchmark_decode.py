"""Smoke test of benchmarks/decode.py: the smallest run prints one JSON line with every
figure, and the variants that must decode the exact tokens do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "decode.py"
VARIANTS = {"exact", "compressed", "overlap", "compressed_overlap", "torch"}


def test_benchmark_decode_smallest_run():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--small", "--rounds", "1", "--new-tokens", "6"],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["ms_per_token"]) == VARIANTS and all(v > 0 for v in out["ms_per_token"].values())
    # torch's DTensor split and loomtrain's overlap decode the same greedy tokens as exact
    assert out["greedy_match_torch"] == 1.0 and out["greedy_match_overlap"] == 1.0
    assert 0 < out["max_logit_diff_compressed"] and 0 <= out["greedy_match_compressed"] <= 1
    wire = out["wire_bytes_per_token"]
    assert wire["compressed"] < wire["exact"] / 3 and wire["overlap"] == wire["exact"]
    assert set(out["all_reduce_ms"]) == {"4096", "65536", "1048576"}
