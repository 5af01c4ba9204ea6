"""Non-finite losses: the step is skipped on every rank (parameters and optimizer state
untouched) with a warning, and too many in a row abort the run with exit code 3."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import run_world
from loomtrain.train import checkpoint, run, trainer
from loomtrain.train.metrics import read_metrics


def _poisoned_run(rank: int, cfg, run_dir: str, nan_steps: set[int], nan_rank: int) -> dict:
    """Runs `cfg` with the loss of rank `nan_rank` multiplied by NaN on the 1-based steps
    `nan_steps` (a test-side patch of the loss the trainer passes to its step), recording for every step whether
    the parameters and the optimizer's step counts changed."""
    steps: list[dict] = []
    real_step = trainer.step

    def step(built, batches, global_tokens, grad_clip):
        real_loss = built.loss_sum

        def loss(logits, targets):
            value = real_loss(logits, targets)
            return value * math.nan if rank == nan_rank and len(steps) + 1 in nan_steps else value

        model, optimizer = built.model, built.optimizer
        before = [p.detach().clone() for p in model.parameters()]
        counts = [float(s["step"]) for s in optimizer.state.values()]
        built.loss_sum = loss
        try:
            result = real_step(built, batches, global_tokens, grad_clip)
        finally:
            built.loss_sum = real_loss
        steps.append({
            "stepped": result[2],
            "params_changed": any(not torch.equal(a, p) for a, p in zip(before, model.parameters())),
            "adam_steps_changed": counts != [float(s["step"]) for s in optimizer.state.values()],
        })
        return result

    trainer.step = step
    stderr, error = io.StringIO(), None
    try:
        with contextlib.redirect_stderr(stderr):
            run.run(cfg, Path(run_dir), None)
    except trainer.NonFiniteError as err:
        error = str(err)
    finally:
        trainer.step = real_step
    return {"steps": steps, "stderr": stderr.getvalue(), "error": error,
            "metrics": read_metrics(run_dir) if rank == 0 else None}


def _two_scenarios(rank, world, skip_cfg, abort_cfg, root):
    # two runs share the harness's process group: re-creating it on the same port can race
    run.shutdown = lambda mesh: None
    # NaN on rank 1 only: the all-reduced gradient norm makes every rank skip together
    skipped = _poisoned_run(rank, skip_cfg, f"{root}/skip", {3, 5}, nan_rank=1)
    aborted = _poisoned_run(rank, abort_cfg, f"{root}/abort", {3, 4}, nan_rank=1)
    return skipped, aborted


def test_nonfinite_steps_are_skipped_then_abort(tiny, tmp_path):
    # limit 2: steps 3 and 5 are isolated (the run completes), steps 3 and 4 abort at step 4
    skip_cfg = tiny(train={"steps": 6}, parallel={"nproc": 2}, run={"max_nonfinite_steps": 2})
    abort_cfg = tiny(train={"steps": 6}, parallel={"nproc": 2}, run={"max_nonfinite_steps": 2})
    results = run_world(_two_scenarios, 2, skip_cfg, abort_cfg, str(tmp_path), timeout_s=240)

    for skipped, _ in results:
        assert skipped["error"] is None
        assert [s["stepped"] for s in skipped["steps"]] == [True, True, False, True, False, True]
        for i, s in enumerate(skipped["steps"], start=1):
            # a skipped step leaves parameters and AdamW's state bitwise as they were
            assert s["params_changed"] == s["adam_steps_changed"] == (i not in (3, 5)), (i, s)
    skipped = results[0][0]
    assert "warning: step 3 skipped: non-finite loss or gradient (1 in a row, limit 2)" in skipped["stderr"]
    assert "warning: step 5 skipped" in skipped["stderr"]
    by_step = {r["step"]: r for r in skipped["metrics"]}
    assert sorted(by_step) == [1, 2, 3, 4, 5, 6]
    assert by_step[3]["skipped"] and math.isnan(by_step[3]["loss"])
    assert "skipped" not in by_step[4] and math.isfinite(by_step[4]["loss"])

    for _, aborted in results:
        assert [s["stepped"] for s in aborted["steps"]] == [True, True, False, False]
        assert "run.max_nonfinite_steps=2" in aborted["error"]
    assert [r["step"] for r in results[0][1]["metrics"]] == [1, 2, 3]  # step 4 raised first


_ABORT_CLI = """
import math, sys
import loomtrain.train.apply as apply
real = apply.token_loss_sum  # the loss `build` hands the trainer without tp
apply.token_loss_sum = lambda logits, targets: real(logits, targets) * math.nan
from loomtrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_nonfinite_abort_exits_3(tmp_path, corpus):
    """The CLI path: an in-process worker (nproc 1, so the test's patch applies) whose every
    loss is NaN stops after run.max_nonfinite_steps steps with exit code 3."""
    from conftest import tiny_tree
    from loomtrain.train.config import config_from_dict, config_to_toml

    config = tmp_path / "nan.toml"
    config.write_text(config_to_toml(config_from_dict(tiny_tree(tmp_path, corpus))))
    proc = subprocess.run([sys.executable, "-c", _ABORT_CLI, "train", str(config), "--set",
                           "run.max_nonfinite_steps=3"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})  # see test_checkpoint.py
    assert proc.returncode == 3, proc.stderr
    assert "warning: step 3 skipped: non-finite loss or gradient (3 in a row, limit 3)" in proc.stderr
    assert "error: 3 consecutive steps had a non-finite loss" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "runs" / "t").glob("checkpoints/step_*"))  # nothing to save


def _streak_then_resume(rank, world, cfg, root):
    run.shutdown = lambda mesh: None
    aborted = _poisoned_run(rank, cfg, f"{root}/nf", {4, 5, 6}, nan_rank=0)
    saved = [p.name for p in checkpoint.list_checkpoints(Path(root) / "nf")]
    return aborted, saved


def test_no_checkpoint_is_written_during_a_nonfinite_streak(tiny, tmp_path):
    # checkpoints every 2 steps; steps 4, 5, 6 non-finite with limit 3: step 4's checkpoint
    # falls in the streak and is skipped, the abort at step 6 writes none: the newest is step
    # 2's, taken before the streak, which a resume then starts from
    cfg = tiny(train={"steps": 8}, checkpoint={"every": 2, "keep": 5},
               run={"max_nonfinite_steps": 3})
    [(aborted, saved)] = run_world(_streak_then_resume, 1, cfg, str(tmp_path), timeout_s=120)
    assert [s["stepped"] for s in aborted["steps"]] == [True] * 3 + [False] * 3
    assert "run.max_nonfinite_steps=3" in aborted["error"]
    assert saved == ["step_00000002"]
    assert ("warning: no checkpoint at step 4: a non-finite streak is in progress (checkpoint "
            "step 2 stays the newest)") in aborted["stderr"]


def _replica_streak(rank, world, cfg, root):
    run.shutdown = lambda mesh: None
    return _poisoned_run(rank, cfg, f"{root}/ls", {3, 4}, nan_rank=1)


def test_under_local_sgd_one_replicas_streak_skips_the_checkpoint_on_every_replica(tiny, tmp_path):
    # local SGD's replicas step on their own gradients: only replica 1 skips steps 3 and 4.
    # The step-4 checkpoint (collective) is skipped by both, as the streak is agreed; before,
    # replica 0 began a save that replica 1 never joined
    cfg = tiny(train={"steps": 6}, parallel={"nproc": 2}, checkpoint={"every": 2, "keep": 5},
               lowcomm={"algorithm": "local_sgd", "inner_steps": 2})
    zero, one = run_world(_replica_streak, 2, cfg, str(tmp_path), timeout_s=180)
    assert [s["stepped"] for s in zero["steps"]] == [True] * 6
    assert [s["stepped"] for s in one["steps"]] == [True, True, False, False, True, True]
    assert zero["error"] is one["error"] is None
    saved = [p.name for p in checkpoint.list_checkpoints(tmp_path / "ls")]  # once both ended
    assert saved == ["step_00000002", "step_00000006"]
    assert ("warning: no checkpoint at step 4: a non-finite streak is in progress (checkpoint "
            "step 2 stays the newest)") in zero["stderr"]


def test_a_torn_last_metrics_line_is_repaired_by_the_resume(tiny, tmp_path):
    """A crash while a record was written leaves half a line: a resume drops it and goes on;
    a damaged line before the last is refused, naming it."""
    from loomtrain.train.metrics import MetricsError, truncate_metrics

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    whole = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in whole) + '{"step": 4, "lo')
    assert read_metrics(run_dir) == whole
    truncate_metrics(run_dir, 2)
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in whole[:2])
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(MetricsError, match=r"metrics.jsonl: line 2 is not a metrics record"):
        read_metrics(run_dir)
