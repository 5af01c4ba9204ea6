"""benchmarks/lowcomm.py against its peer, torchft: without torchft it says so and exits 2; with
it (the peers extra), a smoke run of the bare-loop runs beside the trainer's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "lowcomm.py"
PEERS = ["local_sgd_bare", "torchft_local_sgd", "diloco_bare", "torchft_diloco"]


def test_lowcomm_benchmark_without_torchft_exits_2():
    # torchft made unimportable (sys.modules[name] = None), whether or not it is installed
    code = (f"import runpy, sys; sys.modules['torchft'] = None; "
            f"sys.path.insert(0, {str(SCRIPT.parent)!r}); sys.argv = [{str(SCRIPT)!r}, '--small']; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    assert "torchft" in line and 'pip install -e ".[peers]"' in line, line


def test_lowcomm_benchmark_against_torchft_smallest_run():
    pytest.importorskip("torchft")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--only", ",".join(["local_sgd", "diloco_h50",
                                                                      *PEERS])],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = out["runs"]
    assert set(PEERS) | {"local_sgd", "diloco_h50", "dp"} == runs.keys()
    for name in PEERS:
        r = runs[name]
        assert r["one_model"] and r["wall_s"] > 0 and r["socket_bytes_per_rank"] > 0, (name, r)
        assert r["lowcomm"]["inner_steps"] == runs["diloco_h50"]["lowcomm"]["inner_steps"]
    for method, trainer_run in (("local_sgd", "local_sgd"), ("diloco", "diloco_h50")):
        # the bare loop is the trainer's maths: the same final model up to the order of sums
        bare = runs[f"{method}_bare"]
        assert abs(bare["val_loss"] - runs[trainer_run]["val_loss"]) <= 1e-4, (method, runs)
        # torchft's run is the same algorithm: 40 steps leave it within fp32 rounding
        assert abs(out["vs_torchft"][method]["val_loss_vs_torchft"]) <= 1e-4, out["vs_torchft"]
        # what the meter counts is what the sockets carry, give or take gloo's framing
        assert 0.5 < bare["socket_bytes_per_rank"] / bare["bytes_per_rank"] < 2, bare
    assert {"diloco_socket_bytes_at_most_torchft",
            "diloco_val_loss_no_worse_than_torchft"} <= out["targets"].keys()
