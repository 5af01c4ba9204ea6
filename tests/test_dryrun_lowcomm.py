"""The dry run of the low-communication replicas (lowcomm/estimate.py): the synchronization
every H steps against the meter of real 2-rank runs, record by record, and DiLoCo's outer
state against the wrapper's own tensors; the algorithms not modelled are refused by name."""

from __future__ import annotations

import pytest
import torch

from harness import run_world
from loomtrain.errors import ConfigError
from loomtrain.lowcomm.estimate import outer_state_bytes, sync_collectives
from loomtrain.models import build_model
from loomtrain.train import dryrun
from loomtrain.train.dryrun_text import dry_run
from test_dryrun import _train

CASES = [{"algorithm": "local_sgd", "inner_steps": 2},
         {"algorithm": "diloco", "inner_steps": 3},  # 5 steps: syncs at 3, and 5 (the last)
         {"algorithm": "diloco", "inner_steps": 2, "outer_optimizer": "sgd", "outer_lr": 1.0}]


def lowcomm_cfg(tiny, case, world=2):
    return tiny(lowcomm=case, train={"steps": 5, "global_batch": 4 * world},
                parallel={"nproc": world}, run={"eval_every": 1000},
                checkpoint={"every": 0})


def test_sync_collectives_and_outer_state_by_hand():
    assert sync_collectives("diloco", 1000, dp=1, inner_steps=4) == []
    (sync,) = sync_collectives("local_sgd", 1000, dp=4, inner_steps=4)
    # one fp32 all-reduce of the flat parameters: 4P payload, 2(N-1)/N x 4P on the wire
    assert (sync.op, sync.axis, sync.payload_bytes, sync.wire_bytes, sync.every_steps) == \
        ("all_reduce", "dp", 4000, 6000, 4)
    assert outer_state_bytes("local_sgd", 1000, "nesterov") == 0
    assert outer_state_bytes("diloco", 1000, "nesterov") == 8000  # theta and the momentum
    assert outer_state_bytes("diloco", 1000, "sgd") == 4000  # theta only


def test_diloco_dry_run_adds_the_outer_state_and_sends_every_h_steps(tiny):
    cfg = lowcomm_cfg(tiny, {"algorithm": "diloco", "inner_steps": 4}, world=4)
    est = dryrun.estimate(cfg)
    params = est.parameters
    assert est.bucket_bytes == [] and est.zero is None
    (sync,) = est.engine
    assert (sync.payload_bytes, sync.wire_bytes, sync.every_steps) == (4 * params, 6 * params, 4)
    (row,) = est.memory.rows
    assert row.nbytes == 8 * params
    assert est.memory.total_bytes == 4 * params * (1 + 1 + 2 + 2) + est.memory.activation_bytes
    assert est.broadcast_wire_bytes == 2 * 4 * params  # as DataParallel: log2(4) children
    text = dry_run(cfg)
    for words in ("outer optimizer", "pseudo-gradient (DiLoCo's outer step", "every 4 steps",
                  "(nothing is sharded)", "one fp32 gradient per parameter (.grad)"):
        assert words in text, words


def test_algorithms_not_modelled_are_refused(tiny):
    with pytest.raises(ConfigError, match="does not model lowcomm.algorithm='noloco' yet"):
        dryrun.estimate(lowcomm_cfg(tiny, {"algorithm": "noloco"}))
    compressed = lowcomm_cfg(tiny, {"algorithm": "diloco"})
    compressed = compressed.model_copy(update={"compression": compressed.compression.model_copy(
        update={"method": "int8", "applies_to": "pseudo_gradients"})})
    with pytest.raises(ConfigError, match="does not model compressed pseudo-gradients"):
        dryrun.estimate(compressed)


def _train_and_measure(rank, world, cfgs, run_dirs):
    """The runs' records, and the bytes of a DiLoCo wrapper's outer state after one outer step
    (theta and the momentum buffer the outer SGD creates at its first step)."""
    from loomtrain.lowcomm import DiLoCo
    from loomtrain.train.launch import init_distributed

    records = _train(rank, world, cfgs, run_dirs)
    cfg = cfgs[1]
    wrapper = DiLoCo(build_model(cfg.model), init_distributed(cfg), cfg.lowcomm.inner_steps)
    wrapper.synchronize()
    state = [wrapper.global_params, *wrapper.outer.state[wrapper.global_params].values()]
    return records, sum(t.numel() * t.element_size() for t in state if isinstance(t, torch.Tensor))


def test_lowcomm_collectives_and_outer_state_match_a_real_run(tiny, tmp_path):
    """Every record of a 5-step run (log_every 1) holds the control and logged-loss
    all-reduces, and on the steps that synchronize (multiples of H, and the last) the
    predicted sync, to the byte."""
    cfgs = [lowcomm_cfg(tiny, case) for case in CASES]
    dirs = [str(tmp_path / f"run{i}") for i in range(len(cfgs))]
    records, outer = run_world(_train_and_measure, 2, cfgs, dirs, timeout_s=180)[0]
    for case, cfg, run in zip(CASES, cfgs, records):
        est = dryrun.estimate(cfg)
        every = sum(c.wire_bytes * c.calls for c in est.collectives
                    if c.every_steps == 1 and not c.purpose.startswith("validation"))
        (sync,) = est.engine
        steps, h = cfg.train.steps, cfg.lowcomm.inner_steps
        expected = [every + (sync.wire_bytes if k % h == 0 or k == steps else 0)
                    for k in range(1, steps + 1)]
        assert [r["comm_bytes"]["total"] for r in run] == expected, case
        assert all(set(r["comm_bytes"]) == {"all_reduce", "total"} for r in run), case
    assert outer == dryrun.estimate(cfgs[1]).memory.rows[0].nbytes > 0
