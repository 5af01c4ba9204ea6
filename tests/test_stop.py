"""A stop signal behaves the same in every training mode (train/loop.py): backprop, zeroth-order
and the parameter server each act on it at the step boundary before the next step, save the
state after the last step done (marked with the signal), return 0, and resume from that
checkpoint to the end with each step logged once."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_tree
from harness import StopBefore, run_world

from loomtrain import comm
from loomtrain.train import checkpoint
from loomtrain.train.config import config_from_dict
from loomtrain.train.launch import init_distributed
from loomtrain.train.metrics import read_metrics
from loomtrain.train.run import train_loop
from loomtrain.train.trainer import StopFlag

STOP_BEFORE = 3  # the signal arrives once steps 1..3 are done
STEPS = 6
MODES = {"backprop": {}, "zeroth": {"optim": {"name": "mezo"}},
         "server": {"async": {"mode": "ps", "worker_timeout_s": 30}}}


def _stop_then_resume(rank, world, trees, root):
    out = {}
    for name, tree in trees.items():
        cfg = config_from_dict(tree)
        run_dir = Path(root) / name
        mesh = init_distributed(cfg)
        stopped = train_loop(cfg, run_dir, None, mesh, StopBefore(STOP_BEFORE))
        comm.barrier(mesh)  # the stop's checkpoint is published
        saved = checkpoint.list_checkpoints(run_dir)
        before = read_metrics(run_dir)
        resumed = train_loop(cfg, run_dir, saved[-1], mesh, StopFlag())
        comm.barrier(mesh)
        if rank == 0:
            out[name] = {"returned": (stopped, resumed), "before": [r["step"] for r in before],
                         "saved": [(p.name, checkpoint.read_meta(p).get("stopped_by"))
                                   for p in saved],
                         "after": [r["step"] for r in read_metrics(run_dir)],
                         "final": [p.name for p in checkpoint.list_checkpoints(run_dir)]}
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("stop")
    trees = {name: tiny_tree(root, corpus, parallel={"nproc": 2}, train={"steps": STEPS},
                             checkpoint={"keep": 5}, **sections)
             for name, sections in MODES.items()}
    return run_world(_stop_then_resume, 2, trees, str(root), timeout_s=240)[0]


@pytest.mark.parametrize("mode", MODES)
def test_a_stop_acts_before_the_next_step_and_resumes_in_every_mode(stopped, mode):
    run = stopped[mode]
    assert run["returned"] == (0, 0)
    # steps 1..3 done and logged, step 4 never started; step 3 saved, marked by the signal
    assert run["before"] == [1, 2, 3]
    assert run["saved"] == [("step_00000003", "SIGTERM")]
    # the resume continues at step 4: each step logged once, the last step saved
    assert run["after"] == list(range(1, STEPS + 1))
    assert run["final"] == ["step_00000003", f"step_{STEPS:08d}"]


def test_every_mode_stopped_alike(stopped):
    assert len({repr(run) for run in stopped.values()}) == 1
