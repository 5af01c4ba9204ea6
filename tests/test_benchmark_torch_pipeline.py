"""benchmarks/torch_pipeline.py, the torch peer of the pipeline benchmark: it runs, and it
trains the same model (its first step's loss is the single-process loss)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from harness import run_world

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # scripts, no package
import torch_pipeline as tp  # noqa: E402

TINY = {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2}
RUN = {"microbatches": 4, "virtual_stages": 1, "model_cfg": TINY, "micro_batch": 2,
       "steps": 2, "warmup": 1}
SCHEDULES = ("gpipe", "1f1b")


def _measure_both(rank: int, world: int) -> dict:
    return {s: tp.measure_torch(rank, world, schedule=s, **RUN) for s in SCHEDULES}


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_world(_measure_both, 2, timeout_s=120)


def test_torch_schedules_report_throughput(measured):
    for rank_result in measured:
        for s in SCHEDULES:
            r = rank_result[s]
            assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0, (s, r)
            assert r["step_s"] > 0 and len(r["losses"]) == RUN["warmup"] + RUN["steps"]
    # the slowest rank's time, and the last stage's losses, are shared by every rank
    assert measured[0] == measured[1]


def test_torch_peer_computes_the_single_process_loss(measured):
    torch.manual_seed(tp.MODEL_SEED)
    model = tp.GPT(**TINY)
    x, y = tp.token_batch(TINY, RUN["microbatches"] * RUN["micro_batch"], 0)
    with torch.no_grad():
        h = x
        for stage in tp.gpt_stage_modules(model, tp.even_bounds(TINY["n_layers"], 2)):
            h = stage(h)
        untied = float(tp.token_loss_sum(h, y)) / y.numel()
        tied = float(tp.token_loss_sum(model(x), y)) / y.numel()
    assert untied == tied  # the stages are copies: the same operations on the same numbers
    for s in SCHEDULES:
        # the pipeline sums the microbatches' losses in another order than one cross entropy
        # over the whole batch: fp32 rounding (~1e-7 relative), far below 1e-5
        assert abs(measured[0][s]["losses"][0] - untied) <= 1e-5 * untied, (s, untied)
