"""The oracle: data parallel on 2 and 4 ranks reproduces the single-process loss curve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conftest import tiny_tree
from harness import run_world
from loomtrain.mesh import build_mesh
from loomtrain.parallel.data import DataParallel, apply_data_parallel, build_buckets
from loomtrain.train.config import ParallelConfig
from loomtrain.train.metrics import read_metrics
from test_zero import Blocks, _mean_loss_against_ddp, _train_many
from loomtrain.train.run import run


def _train(rank, world, cfg, run_dir):
    run(cfg, Path(run_dir), None)
    return [r["loss"] for r in read_metrics(run_dir)] if rank == 0 else None


def _losses(cfg, world, run_dir):
    return run_world(_train, world, cfg, str(run_dir), timeout_s=240)[0]


def test_oracle_dp_matches_single_process(tmp_path, corpus):
    """The GPT and the MLP model, each world running both (one spawn per world)."""
    # global batch 8 = micro 2 x accumulation 4 (1 rank) = 2 x 2 x 2 ranks = 2 x 1 x 4 ranks
    def curves(world):
        trees = [tiny_tree(tmp_path, corpus, model={"name": m}, parallel={"nproc": world})
                 for m in ("gpt", "mlp")]
        return run_world(_train_many, world, trees, str(tmp_path / f"r{world}"), timeout_s=240)[0]
    references = curves(1)
    for reference in references:
        assert len(reference) == 20 and reference[-1] < reference[0] - 0.3  # it learns
    for world in (2, 4):
        for model, losses, reference in zip(("gpt", "mlp"), curves(world), references):
            # fp32 sums in a different order (per-rank partial sums, then all-reduce) differ in
            # the last bits; over 20 AdamW steps that stays below 1e-6 relative here, 1e-4 is
            # the bound
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
            assert rel < 1e-4, (model, world, rel, losses, reference)


def _uneven_token_step(rank, world):
    """One trainer step with different numbers of target tokens per micro-batch and per rank
    (IGNORE_INDEX padding): the update must equal the single-process one, i.e. the gradient of
    the token loss summed over the global batch divided by its global token count."""
    import loomtrain.train.trainer as trainer
    from loomtrain.models import GPT, IGNORE_INDEX, token_loss_sum

    mesh = build_mesh({"dp": world})
    torch.manual_seed(0)
    make = lambda: GPT(vocab_size=50, seq_len=8, d_model=16, n_layers=1, n_heads=2)  # noqa: E731
    model, reference = make(), make()
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 50, (world * 4, 8), generator=g)
    y = torch.randint(0, 50, (world * 4, 8), generator=g)
    y[0, :7] = IGNORE_INDEX  # rank 0's first micro-batch has far fewer tokens than the rest
    y[-1, 2:] = IGNORE_INDEX  # and the last rank's last one
    mine = [(x[rank * 4 + 2 * m: rank * 4 + 2 * m + 2], y[rank * 4 + 2 * m: rank * 4 + 2 * m + 2])
            for m in range(2)]
    global_tokens, _ = trainer._control(mine, trainer.StopFlag(), mesh)
    dp = apply_data_parallel(model, mesh, ParallelConfig(nproc=world, bucket_mb=0.01))
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train_step(dp, sgd, mine, global_tokens, grad_clip=0.0)
    (token_loss_sum(reference(x), y) / (y != IGNORE_INDEX).sum()).backward()
    for p0, p1, ref in zip(before, model.parameters(), reference.parameters()):
        torch.testing.assert_close(p0 - p1, ref.grad, rtol=1e-5, atol=1e-7)
    # a per-micro-batch mean would weight rank 0's 9-token micro-batch like a 16-token one
    return global_tokens == float((y != IGNORE_INDEX).sum())


@pytest.mark.parametrize("world", [1, 2])
def test_loss_normalized_by_global_tokens(world):
    assert all(run_world(_uneven_token_step, world, timeout_s=120))


def _payload_per_step(rank, world):
    mesh = build_mesh({"dp": world})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10))
    dp = DataParallel(model, mesh, bucket_mb=0.01)
    mesh.meter.counts.clear()
    for _ in range(3):
        with dp.no_sync():  # accumulation micro-steps send nothing
            dp(torch.randn(4, 64)).sum().backward()
    assert mesh.meter.total("payload_bytes") == 0
    dp(torch.randn(4, 64)).sum().backward()
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    return (mesh.meter.total("payload_bytes", op="all_reduce", axis="dp"),
            mesh.meter.total("wire_bytes", op="all_reduce", axis="dp"), grad_bytes,
            len(dp.buckets), [p.grad.clone() for p in model.parameters()])


@pytest.mark.parametrize("world", [2, 4])
def test_allreduce_payload_equals_gradient_bytes(world):
    results = run_world(_payload_per_step, world, timeout_s=120)
    payload, wire, grad_bytes, buckets, grads = results[0]
    assert buckets > 1  # 0.01 MiB buckets split this model: several all-reduces
    assert payload == grad_bytes
    assert wire == 2 * (world - 1) * grad_bytes // world  # ring all-reduce formula, per bucket
    for other in results[1:]:  # mean-reduced gradients are identical on every rank
        for g0, g in zip(grads, other[4]):
            torch.testing.assert_close(g0, g, rtol=0, atol=0)


def _unused_param(rank, world):
    mesh = build_mesh({"dp": world})
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(4, 4), "unused": nn.Linear(4, 4)})
    _engine = DataParallel(model, mesh)
    model["used"](torch.full((2, 4), float(rank + 1))).sum().backward()
    return model["used"].weight.grad.clone(), model["unused"].weight.grad.abs().sum().item()


def test_unused_parameters_do_not_hang_and_average():
    (g0, unused0), (g1, _) = run_world(_unused_param, 2, timeout_s=90)
    torch.testing.assert_close(g0, g1)
    assert unused0 == 0.0
    # rank inputs are 1 and 2 everywhere: the mean gradient of sum(Wx+b) wrt W is 1.5 * 2 rows
    torch.testing.assert_close(g0, torch.full((4, 4), 3.0))


def _copied_and_in_place(rank, world):
    mesh = build_mesh({"dp": world})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    DataParallel(model, mesh)  # one bucket: the mean is taken as the gradients come in
    x = torch.full((2, 4), float(rank + 1))
    model(x).sum().backward()
    first = [p.grad.clone() for p in model.parameters()]
    model[0].weight.grad = None  # a fresh gradient, copied into the bucket; the rest in place
    model(x).sum().backward()
    return first, [p.grad.clone() for p in model.parameters()]


def test_copied_and_in_place_gradients_both_get_the_mean():
    """A gradient the user set to None arrives as a new tensor and is divided as it is copied
    into its bucket (DDP's fused copy); the others, bucket views, are divided in place: the
    second backward adds the same mean to the in-place ones and replaces the copied one."""
    for first, second in run_world(_copied_and_in_place, 2, timeout_s=90):
        torch.testing.assert_close(second[0], first[0], rtol=0, atol=0)
        for a, b in zip(first[1:], second[1:]):
            torch.testing.assert_close(b, 2 * a, rtol=0, atol=0)


def test_buckets_respect_size_and_order():
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 10, 30, 5, 100)]
    buckets = build_buckets(params, bucket_bytes=25 * 4)
    assert [[p.numel() for p in b.params] for b in buckets] == [[10, 10], [30], [5], [100]]
    assert all(v.data_ptr() >= b.buffer.data_ptr() for b in buckets for v in b.views)


def test_last_gradients_get_a_small_bucket_of_their_own():
    """The engine change the benchmark measured (docs/benchmarks.md): the parameters at the end
    of the ready order that fit in `last_bucket_bytes` are bucketed apart."""
    params = [nn.Parameter(torch.zeros(n)) for n in (100, 30, 5, 3)]
    sizes = lambda buckets: [[p.numel() for p in b.params] for b in buckets]  # noqa: E731
    assert sizes(build_buckets(params, 40 * 4)) == [[100], [30, 5, 3]]
    assert sizes(build_buckets(params, 40 * 4, last_bucket_bytes=10 * 4)) == [[100], [30], [5, 3]]
    # a last parameter larger than the limit: nothing is split off
    assert sizes(build_buckets(params[:2], 40 * 4, last_bucket_bytes=10 * 4)) == [[100], [30]]


def test_default_mean_gives_torch_ddp_gradients_and_sum_gives_dp_times_them():
    """A DDP user's loop (a mean loss per rank, no_sync accumulation, clip, step): the default
    gradient_reduce="mean" gives torch DDP's gradient, norm and step; "sum" (the trainer's)
    gives dp x that gradient. The tolerances and their reasons: test_zero's
    `_mean_loss_against_ddp`, which runs it (measured: the same bits as DDP here)."""
    run_world(_mean_loss_against_ddp, 2, [{"engine": "dp"}], timeout_s=90)


def test_gradient_reduce_is_validated_before_anything_is_sent():
    with pytest.raises(ValueError, match="gradient_reduce='avg' is not one of 'mean', 'sum'"):
        DataParallel(Blocks(), None, gradient_reduce="avg")
