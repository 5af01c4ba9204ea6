"""schedule="async" (parallel/pipeline/asynchronous.py, nesterov.py): the stream's order and
delays (pure), the delay-corrected Nesterov update, config rules, weight stashing and the
fixed delay on 2 ranks, and convergence against the synchronous 1F1B on the tiny default
task. The method changes the maths on purpose: convergence is checked, not the oracle."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.func import functional_call

from conftest import tiny_tree
from harness import run_world
from loomtrain.errors import ConfigError
from loomtrain.parallel.pipeline.asynchronous import delays, drain_actions, step_actions
from loomtrain.parallel.pipeline.nesterov import DelayedNesterov
from loomtrain.train.config import config_from_dict
from loomtrain.train.metrics import read_metrics

# --- pure: the stream ------------------------------------------------------------------------


def _stream(stage, pp, microbatches, steps, drain_after=()):
    """One rank's actions over `steps` trainer steps, draining after the steps listed."""
    actions, cold = [], 0
    for t in range(steps):
        actions += step_actions(stage, pp, t * microbatches, microbatches, cold)
        if t in drain_after:
            actions += drain_actions(stage, pp, (t + 1) * microbatches, cold)
            cold = (t + 1) * microbatches
    return actions + drain_actions(stage, pp, steps * microbatches, cold), cold


@pytest.mark.parametrize("pp,microbatches", [(2, 4), (3, 2), (4, 1), (4, 6)])
def test_every_microbatch_runs_once_with_the_fixed_delay_of_its_stage(pp, microbatches):
    steps = 5
    for stage in range(pp):
        actions, cold = _stream(stage, pp, microbatches, steps, drain_after=(2,))
        total = steps * microbatches
        assert sorted(a.microbatch for a in actions if a.kind == "F") == list(range(total))
        assert sorted(a.microbatch for a in actions if a.kind == "B") == list(range(total))
        # tau_s = pp-1-s updates between F(g) and B(g), fewer for the first ones after a cold
        # start (g = 0, and the step after the drain)
        start = [0 if g < 3 * microbatches else 3 * microbatches for g in range(total)]
        assert delays(actions) == {g: min(g - start[g], pp - 1 - stage) for g in range(total)}
        assert _peak_versions(actions) <= pp - stage
        # without the drain the stream reaches pp - s weight versions in flight
        assert _peak_versions(_stream(stage, pp, microbatches, steps)[0]) == pp - stage


def _peak_versions(actions) -> int:
    """The most stashed weight versions alive at once (a forward's, until its backward)."""
    in_flight = peak = 0
    for a in actions:
        in_flight += 1 if a.kind == "F" else -1
        peak = max(peak, in_flight)
    return peak


def test_no_flush_within_the_stream():
    # rank 0 of pp=3 runs step 1 as F B F B ...: the backwards of step 0's tail (4, 5) come
    # in step 1, so no step begins with more than the first step's warm-up
    acts = step_actions(0, 3, 6, 6, cold=0)
    assert [str(a) for a in acts] == ["F6.0", "B4.0", "F7.0", "B5.0", "F8.0", "B6.0", "F9.0", "B7.0",
                                      "F10.0", "B8.0", "F11.0", "B9.0"]
    assert [str(a) for a in step_actions(0, 3, 0, 2, cold=0)] == ["F0.0", "F1.0"]
    assert [str(a) for a in drain_actions(0, 3, 12, cold=0)] == ["B10.0", "B11.0"]
    assert drain_actions(2, 3, 12, cold=0) == []  # the last stage holds nothing in flight


# --- pure: the update ------------------------------------------------------------------------


def _reference(steps, lr, gamma, beta2, wd, seed=0):
    """Eq. 10 in the NAdam form, written out tensor by tensor (the class runs foreach)."""
    torch.manual_seed(seed)
    w = torch.randn(7)
    p = w.clone().requires_grad_(True)
    opt = DelayedNesterov([{"params": [p], "weight_decay": wd}], lr=lr, momentum=gamma, beta2=beta2)
    m, v = torch.zeros(7), torch.zeros(7)
    for k in range(1, steps + 1):
        g = torch.randn(7)
        p.grad = g.clone()
        opt.step()
        m = gamma * m + (1 - gamma) * g
        denom = torch.ones(7)
        if beta2 is not None:
            v = beta2 * v + (1 - beta2) * g * g
            denom = (v / (1 - beta2 ** k)).sqrt() + 1e-8
        w = w * (1 - lr * wd) - lr * (gamma * m / (1 - gamma ** (k + 1))
                                      + (1 - gamma) * g / (1 - gamma ** k)) / denom
    return p.detach(), w


@pytest.mark.parametrize("beta2", [0.95, None])
def test_delayed_nesterov_is_eq_10_in_nadam_form(beta2):
    got, want = _reference(6, lr=0.01, gamma=0.9, beta2=beta2, wd=0.1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # fp32 rounding of 6 steps


def test_delayed_nesterov_without_momentum_is_sgd():
    p = torch.ones(3, requires_grad=True)
    opt = DelayedNesterov([{"params": [p], "weight_decay": 0.5}], lr=0.1, momentum=0.0, beta2=None)
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([0.85, 0.75, 0.65]))  # 1*(1-0.05) - 0.1 g


# --- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize("parallel,run,message", [
    ({"pp": 1, "schedule": "async"}, {}, "parallel.schedule is a pipeline setting"),
    ({"pp": 2, "async_optimizer": "stash"}, {}, 'parallel.async_optimizer is for parallel.schedule="async"'),
    ({"pp": 2, "schedule": "async", "recompute": "full"}, {}, "parallel.recompute='none'"),
    ({"pp": 2, "schedule": "async"}, {"timeline_step": 2}, "set run.timeline_step=0"),
])
def test_config_refuses_what_async_does_not_compose_with(tmp_path, corpus, parallel, run, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        config_from_dict(tiny_tree(tmp_path, corpus, run=run, parallel={"nproc": 2, **parallel}))


# --- 2 ranks: stashing and delays, traced ------------------------------------------------------


def _traced(rank, world, tree, steps):
    """Trains `steps` steps with the runtime's trace on; returns what the test checks."""
    from loomtrain.data import WindowSampler, load_corpus
    from loomtrain.models import build_model
    from loomtrain.optim import build_optimizer
    from loomtrain.parallel.pipeline import runtime_of
    from loomtrain.train import trainer
    from loomtrain.train.apply import build
    from loomtrain.train.batches import batches_of_step
    from loomtrain.train.launch import init_distributed

    cfg = config_from_dict(tree)
    mesh = init_distributed(cfg)
    torch.manual_seed(cfg.run.seed)
    corpus = load_corpus(cfg.data.source, cfg.data.val_fraction, cfg.model.vocab_size)
    sampler = WindowSampler(corpus.train, cfg.model.seq_len, cfg.run.seed)
    built = build(build_model(cfg.model), mesh, cfg, lambda m: build_optimizer(m, cfg.train))
    runtime = runtime_of(built.model)
    assert built.optimizer is runtime.optimizer  # the asynchronous schedule's own
    runtime.trace = []
    for step in range(steps):
        batches = batches_of_step(sampler, cfg, mesh, step, mesh.device)
        tokens, _ = trainer._control(batches, trainer.StopFlag(), mesh)
        trainer.step(built, batches, tokens, cfg.train.grad_clip)
    runtime.drain()
    forward = {e["microbatch"]: e for e in runtime.trace if e["kind"] == "F"}
    backward = {e["microbatch"]: e for e in runtime.trace if e["kind"] == "B"}
    out = {"delays": {g: b["version"] - forward[g]["version"] for g, b in backward.items()},
           "stash_kept": all(torch.equal(b["weights"], forward[g]["weights"]) for g, b in backward.items()),
           "moved": sum(not torch.equal(b["weights"], b["live"]) for b in backward.values()),
           "tied": [p.detach().clone() for p, _ in runtime.shared if p is not None]}
    if runtime.rank == runtime.last:
        return out
    # replay the last backward of this stage from its input and output gradient, at the
    # stashed weights and at the weights the stage held when it ran: it applied the first
    b = backward[max(backward)]
    names = list(b["stash"])
    sizes = [b["stash"][n].numel() for n in names]
    live = {n: t.view_as(b["stash"][n]) for n, t in zip(names, torch.split(b["live"], sizes))}
    out["replays"] = []
    for weights in (b["stash"], live):
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in weights.items()}
        torch.autograd.backward(functional_call(runtime.module, leaves, (b["input"], runtime.rank)),
                                b["grad_output"])
        out["replays"].append(all(torch.equal(leaves[n].grad, b["grads"][n]) for n in names))
    return out


def test_backward_uses_the_forward_weights_and_the_fixed_delay(tmp_path, corpus):
    steps, pp = 3, 2
    tree = tiny_tree(tmp_path, corpus, run={"device": "cpu"}, train={"steps": steps},
                     parallel={"nproc": 2, "pp": pp, "schedule": "async"})
    results = run_world(_traced, 2, tree, steps, timeout_s=90)
    microbatches = 4  # global_batch 8 / micro_batch 2
    for stage, r in enumerate(results):
        assert r["delays"] == {g: min(g, pp - 1 - stage) for g in range(steps * microbatches)}
        assert r["stash_kept"]  # what B differentiated at is what F ran with
    # stage 0 (delay 1): the live weights moved under every backward but the first; the
    # gradient it applied is the one at the stashed weights, not at the live ones
    assert results[0]["moved"] == steps * microbatches - 1 and results[1]["moved"] == 0
    assert results[0]["replays"] == [True, False]
    # the tied embedding/head copies on the first and the last rank are still equal
    assert len(results[0]["tied"]) == 1 and torch.equal(results[0]["tied"][0], results[1]["tied"][0])


# --- 2 ranks: convergence on the default task --------------------------------------------------


def _train_all(rank, world, trees, root):
    from loomtrain.train import trainer
    from loomtrain.train.launch import init_distributed
    from loomtrain.train.run import train_loop

    for i, tree in enumerate(trees):
        cfg = config_from_dict(tree)
        train_loop(cfg, Path(root) / f"run{i}", None, init_distributed(cfg), trainer.StopFlag())


# async_momentum 0.9: the paper's 0.99 averages over ~100 updates, a quarter of these runs'
# 400 (100 steps x 4 micro-batches). Measured on this task (2026-12-03), final val loss:
# synchronous 1F1B 3.07; stash (AdamW) 3.02; nesterov 2.93 at 0.9, 3.07 at 0.95, 3.20 at 0.99
RUNS = {"sync": {"schedule": "1f1b"},
        "stash": {"schedule": "async", "async_optimizer": "stash"},
        "nesterov": {"schedule": "async", "async_optimizer": "nesterov", "async_momentum": 0.9}}


def test_async_converges_within_5_percent_of_synchronous(tmp_path, corpus):
    steps = 100
    trees = [tiny_tree(tmp_path, corpus, run={"device": "cpu", "log_every": 25}, train={"steps": steps},
                       parallel={"nproc": 2, "pp": 2, **p}) for p in RUNS.values()]
    run_world(_train_all, 2, trees, str(tmp_path), timeout_s=120)
    final = {}
    for i, name in enumerate(RUNS):
        records = read_metrics(tmp_path / f"run{i}")
        final[name] = next(r["val_loss"] for r in records if r["step"] == steps)
    print("final validation loss after the same tokens:", final)
    # same tokens (100 steps of 8 x 32): the Nesterov variant within 5% of the synchronous run
    assert final["nesterov"] <= 1.05 * final["sync"], final
    # weight stashing alone converges too: from ln(256) = 5.55 to well under 4
    assert final["stash"] < 0.7 * math.log(256), final
