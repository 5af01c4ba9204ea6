"""An error inside the ranks of a `loom train` run reaches the user once: one paragraph, the
exit code of its kind (2: bad input), no torch traceback, no note from torch's launcher or
its resource tracker (issue 26, point 7)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import tiny_tree

from loomtrain.train.config import config_from_dict, config_to_toml

LOOM = [sys.executable, "-m", "loomtrain"]
QUIET_OMP = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}  # see test_checkpoint.py


def test_a_resume_that_fails_in_every_rank_says_so_once(tmp_path, corpus):
    config = tmp_path / "two.toml"
    config.write_text(config_to_toml(config_from_dict(tiny_tree(
        tmp_path, corpus, train={"steps": 2}, parallel={"nproc": 2}))))
    first = subprocess.run([*LOOM, "train", str(config)], capture_output=True, text=True,
                           timeout=180, env=QUIET_OMP)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "runs" / "t"
    # both ranks fail to load the checkpoint into a wider model, each with the same message
    proc = subprocess.run([*LOOM, "train", "--resume", str(run_dir), "--set", "model.d_model=64",
                           "--set", "train.steps=4"], capture_output=True, text=True,
                          timeout=180, env=QUIET_OMP)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "could not be loaded" in errors[0], proc.stderr
    assert lines == [f"run folder: {run_dir}", errors[0]], proc.stderr


# a bug in one rank, put there by the interpreter's sitecustomize hook: every spawned rank
# imports it at start-up, and the launcher does too, which never steps
INJECTED = '''import os

if os.environ.get("LOOM_TEST_BUG"):
    import loomtrain.train.trainer as _trainer

    _real_step = _trainer.step

    def step(*args, **kwargs):
        if os.environ.get("RANK") == "1":
            raise RuntimeError("a bug injected into rank 1")
        return _real_step(*args, **kwargs)

    _trainer.step = step
'''


def test_a_rank_that_raises_has_its_traceback_printed_once(tmp_path, corpus):
    """A bug (not a person's error, which ends its rank with a message) at world 2: torch's
    worker wrapper takes the exception into its error file, where nobody saw it; the CLI
    prints that rank's traceback, once, marked with the rank, then says which rank ended."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(INJECTED)
    config = tmp_path / "two.toml"
    config.write_text(config_to_toml(config_from_dict(tiny_tree(
        tmp_path, corpus, train={"steps": 2}, parallel={"nproc": 2}))))
    env = {**QUIET_OMP, "LOOM_TEST_BUG": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([*LOOM, "train", str(config)], capture_output=True, text=True,
                          timeout=180, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert sum("Traceback" in line for line in lines) == 1, proc.stderr
    bug = lines.index("[rank 1] RuntimeError: a bug injected into rank 1")
    assert lines[bug - 1].startswith("[rank 1]") and "raise RuntimeError" in lines[bug - 1]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "rank 1" in errors[0] and lines.index(errors[0]) > bug, \
        proc.stderr
