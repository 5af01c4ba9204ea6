"""Distributed zeroth-order training (zeroth/distributed.py): ranks that exchange only
(seed, scalar) pairs stay bitwise identical, equal the single-process run that probes every
rank's seeds on every rank's batch, and send exactly world x K x 12 bytes per step."""

from __future__ import annotations

import torch

from harness import run_world
from loomtrain.mesh import build_mesh
from loomtrain.models import GPT, token_loss_sum
from loomtrain.zeroth import SeedScalarExchange, build_zo_optimizer, pair_exchange_bytes
from loomtrain.zeroth.optimizers import check_seeds

STEPS = 6


def _model():
    torch.manual_seed(0)
    return GPT(64, 16, 32, 2, 2)


def _loss_fn(model, rank: int, step: int, part: int = 0):
    """Rank `rank`'s batch at `step` (part > 0: the other batches of a large batch)."""
    gen = torch.Generator().manual_seed(10_000 * part + 100 * step + rank)
    x, y = torch.randint(0, 64, (2, 16), generator=gen), torch.randint(0, 64, (2, 16), generator=gen)
    return lambda: token_loss_sum(model(x), y) / y.numel()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _distributed(model, opt, rank: int, mesh, exchange) -> list[dict]:
    """STEPS steps on this rank's batches; the meter's wire bytes per op of every step."""
    per_step = []
    for step in range(STEPS):
        if opt.needs_refresh():
            opt.refresh([_loss_fn(model, rank, step, b) for b in range(2)], exchange)
        else:
            opt.step(_loss_fn(model, rank, step), exchange)
        per_step.append(mesh.meter.take())
    return per_step


def _single_process(model, opt, world: int) -> None:
    """The oracle: one process probes every rank's seeds on that rank's batch, then applies
    all the pairs in (rank, k) order."""
    for step in range(STEPS):
        if opt.needs_refresh():
            pairs = [p for r in range(world)
                     for p in opt.probe_full([_loss_fn(model, r, step, b) for b in range(2)]).pairs]
            opt.apply_full(pairs)
        else:
            pairs = [p for r in range(world) for p in opt.probe(_loss_fn(model, r, step), r).pairs]
            check_seeds(pairs, opt.expected_seeds(world), step)
            opt.apply(pairs)


def _zo_world(rank, world, runs, build=_model):
    """`build`: the model, the same on every call (a module-level function: it is pickled)."""
    mesh = build_mesh({"dp": world})
    exchange = SeedScalarExchange(mesh)
    out = []
    for name, k, hyper in runs:
        model = build()
        start = _flat(model)
        opt = build_zo_optimizer(name, model, n_perturbations=k, seed=11, **hyper)
        mesh.meter.take()
        mesh.meter.counts.clear()
        per_step = _distributed(model, opt, rank, mesh, exchange)
        count = mesh.meter.counts[("dp", "all_gather")]
        result = {"params": _flat(model), "moved": not torch.equal(_flat(model), start),
                  "per_step": per_step, "payload": count.payload_bytes, "calls": count.calls}
        if rank == 0:
            oracle = build()
            _single_process(oracle, build_zo_optimizer(name, oracle, n_perturbations=k, seed=11,
                                                        **hyper), world)
            result["oracle"] = _flat(oracle)
        out.append(result)
    # a rank one step ahead (a desynchronized resume) is refused on every rank, not replayed
    model = build()
    opt = build_zo_optimizer("mezo", model, lr=1e-3, seed=11)
    opt.step_count = rank
    try:
        opt.step(_loss_fn(model, rank, 0), exchange)
    except RuntimeError as err:
        out.append(str(err))
    return out


def check_results(results: list, world: int, runs) -> None:
    """The ranks' `_zo_world` results: bitwise one model, the oracle's, on pairs' bytes only."""
    for i, (name, k, _) in enumerate(runs):
        per_rank = [r[i] for r in results]
        for r in per_rank:
            assert r["moved"], name
            assert torch.equal(r["params"], per_rank[0]["params"]), (name, "ranks differ")
        assert torch.equal(per_rank[0]["oracle"], per_rank[0]["params"]), (name, "oracle")
        # one all-gather of world x K pairs of 12 bytes per step, nothing else on the wire
        expected = pair_exchange_bytes(world, k)
        assert expected == {"payload": world * k * 12, "wire": (world - 1) * k * 12}
        for r in per_rank:
            assert r["per_step"] == [{"all_gather": expected["wire"], "total": expected["wire"]}] * STEPS
            assert r["calls"] == STEPS and r["payload"] == STEPS * expected["payload"]
    for r in results:
        assert "not at the same step" in r[-1]


WORLD_2_RUNS = [("mezo", 2, dict(lr=1e-3)), ("helene", 1, dict(lr=1e-3, anneal_steps=10)),
                ("mezo-svrg", 2, dict(lr=1e-3, svrg_every=3))]


def test_world_2_mezo_helene_svrg_bitwise_identical_seed_scalar_bytes():
    check_results(run_world(_zo_world, 2, WORLD_2_RUNS, timeout_s=120), 2, WORLD_2_RUNS)


def test_world_4_mezo_zo_adam_bitwise_identical_seed_scalar_bytes():
    runs = [("mezo", 1, dict(lr=1e-3)), ("zo-adam", 2, dict(lr=1e-3))]
    check_results(run_world(_zo_world, 4, runs, timeout_s=120), 4, runs)
