"""Cutting a model into pipeline stages: the balance, the layers of each model kind, what a
rank keeps, and a user's nn.Sequential trained through the runtime on two ranks."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn as nn

from harness import run_world
from loomtrain.mesh import build_mesh
from loomtrain.models import GPT, MLP
from loomtrain.parallel.data import DataParallel
from loomtrain.parallel.pipeline import pipeline, schedules
from loomtrain.parallel.pipeline.split import (
    Layer,
    PipelineModule,
    balance,
    layers_of,
    measured_costs,
    parameter_costs,
    shared_parameters,
    stage_shapes,
)


def _brute_force(costs, k):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), k - 1):
        bounds = [0, *cuts, len(costs)]
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balance_minimizes_the_largest_stage(seed):
    rng = random.Random(seed)
    costs = [rng.choice([1, 2, 3, 10, 0.5]) for _ in range(rng.randint(2, 9))]
    k = rng.randint(1, len(costs))
    bounds = balance(costs, k)
    assert bounds[0] == 0 and bounds[-1] == len(costs) and len(bounds) == k + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:]))  # no empty stage
    worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert worst == pytest.approx(_brute_force(costs, k))


def test_balance_refuses_more_stages_than_layers():
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4"):
        balance([1, 1, 1], 4)


def test_layers_of_each_model_kind():
    gpt = GPT(64, 16, 32, 3, 2)
    assert [layer.name for layer in layers_of(gpt)] == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    mlp = MLP(64, 16, 2)
    assert [layer.name for layer in layers_of(mlp)] == ["embed", "blocks.0", "blocks.1", "head"]
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert [layer.owns for layer in layers_of(seq)] == [("0",), ("1",), ("2",)]

    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def pipeline_layers(self):
            return [Layer("a", ("a",), lambda m, x: m.a(x)), Layer("b", ("b",), lambda m, x: m.b(x))]

    assert len(layers_of(Custom())) == 2
    with pytest.raises(TypeError, match="pipeline_layers"):
        layers_of(nn.Linear(2, 2))


def test_the_layers_in_sequence_compute_the_model():
    torch.manual_seed(0)
    gpt = GPT(64, 16, 32, 3, 2)
    x = torch.randint(0, 64, (2, 16))
    y = x
    for layer in layers_of(gpt):
        y = layer.run(gpt, y)
    torch.testing.assert_close(y, gpt(x), rtol=0, atol=0)


def test_a_rank_keeps_its_stages_under_their_own_names():
    torch.manual_seed(0)
    gpt = GPT(64, 16, 32, 4, 2)
    names = dict(gpt.state_dict())
    layers = layers_of(gpt)
    bounds = balance(parameter_costs(gpt, layers), 4)
    shared = shared_parameters(gpt, layers, bounds, 2)
    assert shared == {"tok_emb.weight": [0, 1]}  # the embedding and the tied head
    stage_out = stage_shapes(gpt, layers, bounds, torch.zeros(2, 16, dtype=torch.long))
    assert stage_out[:3] == [(torch.Size([2, 16, 32]), torch.float32)] * 3
    assert stage_out[3] == (torch.Size([2, 16, 64]), torch.float32)
    last = PipelineModule(gpt, layers, bounds, [1, 3])  # rank 1 of pp=2, two virtual stages
    kept = set(last.state_dict())
    assert kept < set(names) and "head.weight" in kept and "tok_emb.weight" not in kept
    owned = {p for s in (1, 3) for layer in layers[bounds[s]:bounds[s + 1]] for p in layer.owns}
    assert all(any(k.startswith(o + ".") for o in owned) for k in kept)
    for k in kept:
        assert last.state_dict()[k] is not None and torch.equal(last.state_dict()[k], names[k])


def test_measured_costs_time_every_layer():
    gpt = GPT(64, 16, 32, 2, 2)
    costs = measured_costs(gpt, layers_of(gpt), torch.zeros(2, 16, dtype=torch.long), repeats=1)
    assert len(costs) == 4 and all(c > 0 for c in costs)
    assert all(p.grad is None for p in gpt.parameters())


def _sequential(rank, world, schedule_name, balance_by):
    """A user's nn.Sequential trained for 3 steps on pp=2; returns the last stage's losses
    and every rank's parameters (to compare with one process)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3))
    mesh = build_mesh({"pp": world})
    sample = torch.zeros(4, 6)
    schedule = schedules.build(schedule_name, world, 4)
    module = pipeline(model, mesh, schedule, sample, balance=balance_by)
    wrapped = DataParallel(module, mesh, gradient_reduce="sum")
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        batches = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(4)]
        loss = module.runtime.train_step(wrapped, batches, 48.0, lambda out, y: ((out - y) ** 2).sum())
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        losses.append(float(loss))
    return losses, {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("schedule_name,balance_by", [("1f1b", "params"), ("zb-h1", [3])])
def test_a_users_sequential_trains_as_on_one_process(schedule_name, balance_by):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        total = 0.0
        for _ in range(4):
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
            loss = ((model(x) - y) ** 2).sum()
            (loss / 48.0).backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        expected.append(total)
    results = run_world(_sequential, 2, schedule_name, balance_by, timeout_s=60)
    assert results[0][0] == [0.0, 0.0, 0.0]  # the first stage computes no loss
    assert results[1][0] == pytest.approx(expected, rel=1e-6)
    merged = {**results[0][1], **results[1][1]}
    assert set(merged) == set(model.state_dict())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(merged[name], value, rtol=1e-6, atol=1e-6)
