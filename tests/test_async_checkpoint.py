"""Checkpoints of the parameter server and resuming them (asyncsgd/state.py), and non-finite
gradients at the server (server.py).

- pure: every policy's state, through the checkpoint's serialization (torch.save, read back
  with weights_only=True), continues exactly as the policy it was taken from;
- `loom train` with one worker, 12 updates, a checkpoint every 6: resumed from update 6, the
  run ends with the uninterrupted run's parameters and optimizer state, bitwise, and logs the
  same losses (one worker makes asynchronous SGD deterministic: nothing is in flight at a save);
- a resume that does not fit the checkpoint (workers, policy, model, sync <-> async) exits 2
  at the CLI with one paragraph, before anything is spawned, and changes no file;
- the protocol: a NaN gradient is discarded and the run matches SGD without that step,
  non-finite gradients in a row end the run, and a resumed server starts its worker at the
  saved step."""

from __future__ import annotations

import io
import math
import os
import re
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_tree
from harness import run_world
from test_async_runtime import LeastSquares

from loomtrain import cli
from loomtrain.asyncsgd import build_policy, run_worker, serve
from loomtrain.asyncsgd.state import SERVER_STATE
from loomtrain.asyncsgd.train import ServerMode
from loomtrain.mesh import build_mesh
from loomtrain.train import checkpoint, run, trainer
from loomtrain.train.config import config_from_dict
from loomtrain.train.metrics import read_metrics

POLICIES = ["plain", "bounded", "drop_stale", "staleness_scaled", "ringleader"]


def _through_checkpoint(state: dict) -> dict:
    """What state.save and state.restore do to a state: torch.save, then weights_only load."""
    blob = io.BytesIO()
    torch.save(state, blob)
    return torch.load(io.BytesIO(blob.getvalue()), weights_only=True)


def _feed(policy, script, version: int) -> tuple[list, int]:
    """Arrivals (worker, gradient, staleness) at the server's version; returns per arrival
    the policy's answers: may the worker start again, the outcome, the update; and the
    version after them."""
    out = []
    for worker, grad, staleness in script:
        pulled = max(0, version - staleness)
        update = policy.on_gradient(worker, grad, pulled, version)
        may_start = policy.may_start((worker + 1) % 3, version, {worker: pulled})
        out.append((may_start, policy.last_outcome, update))
        version += update is not None
    return out, version


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_state_continues_identically(name):
    gen = torch.Generator().manual_seed(3)
    workers = [0, 0, 1, 2, 0, 2, 2, 1, 0, 0, 1, 2, 1, 0, 2, 2, 0, 1]
    script = [(w, torch.randn(5, generator=gen), s)
              for w, s in zip(workers, [0, 1, 2, 0, 3, 1, 0, 2, 4, 0, 1, 1, 3, 0, 2, 0, 1, 5])]
    first = build_policy(name, 3, 1)
    _, version = _feed(first, script[:6], 0)
    if name == "ringleader":  # mid-round (Phase 2, a gradient held), a worker out of the table
        first.on_lost(0)
        assert first.table.phase == 2 and first.table.buffer.counts == [0, 0, 1]
    second = build_policy(name, 3, 1)
    second.load_state_dict(_through_checkpoint(first.state_dict()))
    a, end_a = _feed(first, script[6:], version)
    b, end_b = _feed(second, script[6:], version)
    assert end_a == end_b
    for (start_a, outcome_a, update_a), (start_b, outcome_b, update_b) in zip(a, b):
        assert (start_a, outcome_a) == (start_b, outcome_b)
        assert (update_a is None) == (update_b is None)
        if update_a is not None:
            assert torch.equal(update_a[0], update_b[0]) and update_a[1] == update_b[1]
    outcomes = {outcome for _, outcome, _ in a}  # the continuation exercises the policy
    expected = {"ringleader": {"held", "discarded"}, "drop_stale": {"discarded"}}
    assert expected.get(name, {"applied"}) <= outcomes, outcomes
    if name == "bounded":
        assert {start for start, _, _ in a} == {True, False}


# `loom train` (in-process ranks, as test_async_training.py runs it): one worker, plain policy

SECTIONS = {"parallel": {"nproc": 2}, "train": {"steps": 12}, "checkpoint": {"every": 6},
            "async": {"mode": "ps"}}


def _keep_group(mesh) -> None:
    """Stands in for run.shutdown: consecutive runs share the harness's process group
    (test_resume.py says why)."""


def _start(rank, cfg) -> Path:
    run_dir = Path(cfg.run.dir) / cfg.run.name
    if rank == 0:  # what `loom train` writes before it spawns the ranks
        run_dir.mkdir(parents=True)
        trainer.write_config(run_dir, cfg)
    dist.barrier()  # as there, no rank starts before the folder is written (a worker writes in it)
    run.run(cfg, run_dir, None)
    return run_dir


def _sigterm_after_update_4(mode, step, work):
    result = real_run(mode, step, work)
    if mode.server.version == 4:  # seen at the step boundary: update 4 is the last
        os.kill(os.getpid(), signal.SIGTERM)
    return result


real_run = ServerMode.run


def _runs(rank, world, cfg, stopped_cfg, sync_cfg, aside):
    run.shutdown = _keep_group
    run_dir = _start(rank, cfg)
    full = stopped = None
    if rank == 0:  # the uninterrupted run's end, moved out: the resume starts from update 6
        full = read_metrics(run_dir)
        shutil.move(checkpoint.step_dir(run_dir, 12), aside)
    run.run(cfg, run_dir, checkpoint.step_dir(run_dir, 6))
    if rank == 0:  # the server gets a SIGTERM
        ServerMode.run = _sigterm_after_update_4
    stopped_dir = _start(rank, stopped_cfg)
    ServerMode.run = real_run
    if rank == 0:  # before the resume's checkpoints replace it (checkpoint.keep = 2)
        stopped = [checkpoint.read_meta(p) for p in checkpoint.list_checkpoints(stopped_dir)]
    run.run(stopped_cfg, stopped_dir, checkpoint.list_checkpoints(stopped_dir)[-1])
    _start(rank, sync_cfg)  # a synchronous checkpoint, for the refusals below
    return full, stopped


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("ps")
    trees = {name: tiny_tree(root, corpus, **SECTIONS) for name in ("ps", "stopped")}
    trees["sync"] = tiny_tree(root, corpus, parallel={"nproc": 2}, train={"steps": 2})
    for name, tree in trees.items():
        tree["run"]["name"] = name
    aside = root / "uninterrupted_step_12"
    full, stopped = run_world(_runs, 2, *(config_from_dict(t) for t in trees.values()), aside,
                              timeout_s=120)[0]
    runs = root / "runs"
    return runs / "ps", runs / "sync", aside, full, runs / "stopped", stopped


def _all_tensors(path: Path) -> dict:
    _, metadata = checkpoint.verify(path)
    state = {k: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
    state[SERVER_STATE] = b""
    checkpoint._dcp_load(path, state, metadata, no_dist=True)
    state[SERVER_STATE] = torch.load(io.BytesIO(state[SERVER_STATE]), weights_only=True)
    return state


def test_resumed_from_update_6_ends_as_the_uninterrupted_run_bitwise(runs):
    run_dir, _, aside, full, _, _ = runs
    assert [p.name for p in checkpoint.list_checkpoints(run_dir)] == ["step_00000006",
                                                                       "step_00000012"]
    uninterrupted, resumed = _all_tensors(aside), _all_tensors(checkpoint.step_dir(run_dir, 12))
    assert set(uninterrupted) == set(resumed)
    assert any(k.startswith("optim.state.") and k.endswith("exp_avg_sq") for k in resumed)
    for key, value in uninterrupted.items():
        if key != SERVER_STATE:  # parameters and AdamW's moments and step: == on floats
            assert torch.equal(value, resumed[key]), key
    server = resumed[SERVER_STATE]
    assert server == uninterrupted[SERVER_STATE]
    assert server["server"]["version"] == 12 and server["server"]["worker_steps"] == [12]
    assert server["metrics"] == {"staleness_histogram": {0: 12}, "applied_by_worker": [12]}
    # each update logged once; the worker continued on the rows of steps 6.. (the losses it
    # reported are those of the uninterrupted run, bitwise), and the run-wide counts of the
    # last record include the 6 updates before the resume
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [r["step"] for r in full] == list(range(1, 13))
    for before, after in zip(full, records):
        for key in ("loss", "lr", "grad_norm", "applied", "nonfinite", "staleness_max"):
            assert before[key] == after[key], (after["step"], key)
    assert records[-1]["val_loss"] == full[-1]["val_loss"]
    assert records[-1]["staleness_histogram"] == {"0": 12}
    assert records[-1]["applied_by_worker"] == [12]
    meta = checkpoint.read_meta(checkpoint.step_dir(run_dir, 6))
    assert meta["async"] == "plain" and meta["workers"] == 1 and meta["step"] == 6


def test_a_stop_saves_the_server_and_the_resume_ends_as_the_uninterrupted_run(runs):
    _, _, aside, full, stopped_dir, stopped = runs
    # SIGTERM after update 4: the run stops before update 5, as every mode does at a stop
    # (test_stop.py), and saves update 4 (checkpoint.every = 6 saved nothing)
    assert [(m["step"], m["stopped_by"]) for m in stopped] == [(4, "SIGTERM")]
    uninterrupted = _all_tensors(aside)
    resumed = _all_tensors(checkpoint.step_dir(stopped_dir, 12))
    for key, value in uninterrupted.items():
        if key != SERVER_STATE:
            assert torch.equal(value, resumed[key]), key
    assert [r["loss"] for r in read_metrics(stopped_dir)] == [r["loss"] for r in full]


def _snapshot(run_dir: Path) -> dict:
    return {p.relative_to(run_dir): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("which, overrides, message", [
    ("ps", ["--nproc", "3"], r"with async.policy='plain' and 1 workers, and this run has 2 "
                             r"workers \(parallel.nproc=3\)"),
    ("ps", ["--set", 'async.policy="bounded"'], r"this run has async.policy='bounded'"),
    ("ps", ["--set", "model.d_model=64"],
     r"the model differs \(the \[model\] section\): tensor '.*' is \[.*32.*\] in the "
     r"checkpoint and \[.*64.*\] in this run"),
    ("ps", ["--set", 'async.mode="none"'],
     r"written by the parameter server .* and this run has async.mode=\"none\""),
    ("sync", ["--set", 'async.mode="ps"'],
     r"written by synchronous training \(async.mode=\"none\"\), and this run has "
     r"async.mode=\"ps\""),
])
def test_a_resume_that_does_not_fit_exits_2_and_changes_nothing(runs, capsys, which,
                                                                 overrides, message):
    run_dir = runs[0] if which == "ps" else runs[1]
    before = _snapshot(run_dir)
    assert cli.main(["train", "--resume", str(run_dir), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --resume: checkpoint") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert "nothing in the run folder was changed" in err
    assert _snapshot(run_dir) == before


def test_a_fitting_resume_is_accepted_by_the_cli(runs):
    run_dir = runs[0]
    args = cli._parser().parse_args(["train", "--resume", str(run_dir), "--set",
                                     "train.steps=18"])
    cfg, resolved, latest = cli._resolve_train(args)
    assert resolved == run_dir and latest.name == "step_00000012" and cfg.train.steps == 18


# the protocol: least squares, one worker (server.py, worker.py)

D, LR = 16, 0.05


class Broken(LeastSquares):
    """LeastSquares, with a NaN gradient at the steps in `nan_at` (all from `nan_from` on),
    and the steps it was called with."""

    def __init__(self, nan_at=(), nan_from=None):
        super().__init__(0)
        self.nan_at, self.nan_from, self.steps = set(nan_at), nan_from, []

    def __call__(self, params, step):
        self.steps.append(step)
        grad = super().__call__(params, step)
        if step in self.nan_at or (self.nan_from is not None and step >= self.nan_from):
            grad[1] = math.nan if step % 2 else math.inf
        return grad


def _sgd(steps, skip=()) -> torch.Tensor:
    """The single-process reference: SGD over the gradients of `steps`, less those skipped."""
    params, grad_fn = torch.zeros(D), LeastSquares(0)
    for step in steps:
        if step not in skip:
            params.add_(grad_fn(params, step), alpha=-LR)
    return params


def _protocol(rank, world):
    mesh = build_mesh({"dp": world})
    scenarios = [(Broken(nan_at=[3]), {"total_updates": 10, "max_nonfinite": 3}),
                 (Broken(nan_from=2), {"total_updates": 10, "max_nonfinite": 3}),
                 (Broken(), {"total_updates": 10, "params": _sgd(range(4)),
                             "state": {"version": 4, "worker_steps": [4],
                                       "policy": build_policy("plain", 1, 0).state_dict()}})]
    out = []
    for grad_fn, kwargs in scenarios:
        if rank == 1:
            result = run_worker(mesh, grad_fn, D)
            out.append((grad_fn.steps, result.steps))
            continue
        params = kwargs.pop("params", torch.zeros(D))
        out.append(serve(mesh, params, build_policy("plain", 1, 0), lr=LR, **kwargs))
    return out


def test_nonfinite_gradients_and_a_resumed_worker():
    server, worker = run_world(_protocol, 2, timeout_s=60)
    # a NaN at step 3: discarded, the worker pulls again; SGD over steps 0..10 less step 3
    one = server[0]
    assert one.version == 10 and one.aborted is None
    assert [outcome for _, outcome in one.reports].count("nonfinite") == 1
    assert one.reports[3][1] == "nonfinite" and not one.staleness.arrivals[3].applied
    assert torch.isfinite(one.params).all()
    assert torch.equal(one.params, _sgd(range(11), skip={3}))
    # from step 2 on every gradient is non-finite: 3 in a row end the run at version 2
    two = server[1]
    assert two.version == 2 and "3 gradients in a row were non-finite" in two.aborted
    assert [o for _, o in two.reports] == ["applied", "applied"] + ["nonfinite"] * 3
    assert torch.isfinite(two.params).all() and worker[1] == (list(range(5)), 5)
    # resumed at version 4 with the worker's step 4: it computes steps 4..9, and the run is
    # the 10-step SGD, bitwise
    three = server[2]
    assert worker[2] == (list(range(4, 10)), 6)
    assert three.version == 10 and torch.equal(three.params, _sgd(range(10)))


def test_ringleader_mid_round_through_a_checkpoint_file(tmp_path, corpus):
    """state.save and state.restore, one process: the model, AdamW and Ringleader's tables
    (tensors stored as DCP entries of their own) come back and continue identically."""
    from loomtrain.asyncsgd import state
    from loomtrain.asyncsgd.train import alone, flatten_parameters
    from loomtrain.models import build_model
    from loomtrain.optim import build_optimizer

    cfg = config_from_dict(tiny_tree(tmp_path, corpus))  # its [model] and [train]

    def fresh():
        torch.manual_seed(0)
        model = build_model(cfg.model)
        flat = flatten_parameters(model)
        return model, flat, build_optimizer(model, cfg.train), build_policy("ringleader", 3, 0)

    model, flat, optimizer, policy = fresh()
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(flat.numel(), generator=gen) for _ in range(9)]
    for worker, grad in zip([0, 1, 2, 0, 0], grads):  # Phase 2: worker 0 served, then held
        update = policy.on_gradient(worker, grad, 0, 0)
        if update is not None:
            flat.grad.copy_(update[0])
            optimizer.step()
    assert policy.table.phase == 2 and policy.table.buffer.counts == [1, 0, 0]
    server = {"version": 2, "worker_steps": [3, 1, 1], "policy": policy.state_dict()}
    path = state.save(tmp_path / "run", 2, model, optimizer, {"server": server, "metrics": {}},
                      keep=2, extra={"async": "ringleader", "workers": 3})

    model2, flat2, optimizer2, policy2 = fresh()
    saved = state.restore(path, model2, optimizer2, policy2,
                          alone(SimpleNamespace(device=torch.device("cpu"))))
    assert saved["server"]["worker_steps"] == [3, 1, 1] and torch.equal(flat, flat2)
    for (w, grad) in zip([1, 0, 2], grads[5:]):  # the same continuation, both sides
        a, b = policy.on_gradient(w, grad, 1, 2), policy2.on_gradient(w, grad, 1, 2)
        assert policy.last_outcome == policy2.last_outcome and (a is None) == (b is None)
        for opt, f, update in ((optimizer, flat, a), (optimizer2, flat2, b)):
            if update is not None:
                f.grad.copy_(update[0])
                opt.step()
    assert policy2.table.rounds == policy.table.rounds == 1
    assert torch.equal(flat, flat2)  # AdamW's moments and step came back too
