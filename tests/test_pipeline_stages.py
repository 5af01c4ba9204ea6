"""The pipeline runtime over stage modules it did not cut itself (issue 25, point 5): hand-built
stages of a GPT (an embedding and blocks, blocks and a head: nn.Sequential, no PipelineModule),
alone, with a dp engine, and with tensor-parallel blocks (pp 2 x tp 2), each against the
single-process model on the same batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from harness import run_world
from loomtrain.mesh import build_mesh
from loomtrain.models import GPT, token_loss_sum
from loomtrain.parallel.data import DataParallel
from loomtrain.parallel.pipeline import schedules
from loomtrain.parallel.pipeline.runtime import PipelineRuntime, output_shape
from loomtrain.parallel.tensor import ColumnParallelLinear, parallelize_tensor

VOCAB, SEQ, D_MODEL, HEADS, BLOCKS = 64, 16, 32, 4, 4
MICRO, MICROBATCHES, STEPS, LR = 2, 4, 3, 0.1
# fp32, the same sums in another order (micro-batch gradients accumulated stage by stage, the
# tied embedding and head summed over pp, zero-bubble's deferred weight matmuls, tp's split
# matmuls): the bound of tests/test_pipeline_training.py's oracle, on the losses and on each
# parameter's largest difference over its largest entry (measured: 6e-8 and 6e-7, the
# parameters having moved by up to 0.05 in the 3 steps). SGD, not Adam: Adam divides
# by the root of the second moment, so a gradient that is zero in exact arithmetic (the
# attention's key bias: softmax ignores a shift shared by every key) steps by its rounding
# noise's sign, a whole learning rate, differently in every summation order
TOLERANCE = 1e-4


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


class Embedding(nn.Module):
    """Token plus position embeddings (the GPT's own tables, without its `embed`)."""

    def __init__(self, tokens: nn.Embedding, positions: nn.Embedding):
        super().__init__()
        self.tokens, self.positions = tokens, positions

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    def __init__(self, norm: nn.LayerNorm, out: nn.Linear):
        super().__init__()
        self.norm, self.out = norm, out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, SEQ, D_MODEL, BLOCKS, HEADS)


def _stage_modules(gpt: GPT, stages: int, mine: list[int]) -> dict[int, nn.Module]:
    """Stage s of `stages`: its share of the blocks, the embedding before the first, the head
    after the last; built by hand for the stages in `mine`."""
    per = BLOCKS // stages
    out = {}
    for s in mine:
        parts = list(gpt.blocks[s * per:(s + 1) * per])
        if s == 0:
            parts.insert(0, Embedding(gpt.tok_emb, gpt.pos_emb))
        if s == stages - 1:
            parts.append(Head(gpt.ln_f, gpt.head))
        out[s] = nn.Sequential(*parts)
    return out


def _batches(step: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random tokens, each to be followed by the next token id (a task the model learns: the
    oracle's loss falls over the steps)."""
    g = torch.Generator().manual_seed(step)
    xs = [torch.randint(0, VOCAB, (rows, SEQ), generator=g) for _ in range(MICROBATCHES)]
    return [(x, (x + 1) % VOCAB) for x in xs]


def _oracle(rows: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process run: per-step token-summed losses, the final parameters."""
    gpt = _gpt()
    optimizer = _optimizer(gpt.parameters())
    tokens, losses = MICROBATCHES * rows * SEQ, []
    for step in range(STEPS):
        total = 0.0
        for x, y in _batches(step, rows):
            loss = token_loss_sum(gpt(x), y)
            (loss / tokens).backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in gpt.named_parameters()}


def _train(mesh, gpt: GPT, run: dict) -> tuple[list[float], list]:
    """`STEPS` steps of the runtime over hand-built stages of `gpt` on `mesh`; this rank's
    losses and its parameters as (single-process name, value, tp placement or None)."""
    pp, dp = mesh.size("pp"), mesh.size("dp")
    virtual = run.get("virtual_stages", 1)
    schedule = schedules.build(run["schedule"], pp, MICROBATCHES, virtual)
    if run.get("offload"):
        schedule = schedules.with_offload(schedule, run["offload"])
    rank, stages = mesh.local_rank("pp"), pp * virtual
    modules = _stage_modules(gpt, stages, [s for s in range(stages) if s % pp == rank])
    shapes = [(torch.Size([MICRO, SEQ, D_MODEL]), torch.float32)] * (stages - 1)
    tied = gpt.tok_emb.weight  # the head's too: on the first and the last stage's ranks
    holds = any(tied is p for m in modules.values() for p in m.parameters())
    shared = [(tied if holds else None, tied.shape)]
    runtime = PipelineRuntime(modules, mesh, schedule, shapes, shared, run.get("recompute", "none"))
    runtime.stash.synchronous = True
    params = list(runtime.module.parameters())
    engine = DataParallel(runtime.module, mesh, gradient_reduce="sum") if dp > 1 else None
    optimizer = _optimizer(params)
    mine = slice(mesh.local_rank("dp") * MICRO, (mesh.local_rank("dp") + 1) * MICRO)
    losses = []
    for step in range(STEPS):
        batches = [(x[mine], y[mine]) for x, y in _batches(step, dp * MICRO)]
        loss = runtime.train_step(engine, batches, MICROBATCHES * dp * MICRO * SEQ, token_loss_sum)
        optimizer.step()
        optimizer.zero_grad(set_to_none=engine is None)  # DataParallel's grads are its buckets
        losses.append(float(loss))
    runtime.stash.close()
    names = {id(p): n for n, p in gpt.named_parameters()}
    return losses, [(names[id(p)], p.detach().clone(), getattr(p, "tp_placement", None))
                    for p in params]


def _world(rank, world, sizes, runs, tensor_parallel):
    mesh = build_mesh(sizes)
    out = []
    for run in runs:
        gpt = _gpt()
        if tensor_parallel:
            parallelize_tensor(gpt, mesh)
            assert isinstance(gpt.blocks[0].attn.qkv, ColumnParallelLinear)
        out.append(_train(mesh, gpt, run))
    return out


def _wrong_stages(rank, world):
    mesh = build_mesh({"pp": world})
    gpt = _gpt()
    try:  # every stage on every rank: the schedule puts stage s on rank s % pp only
        PipelineRuntime(_stage_modules(gpt, 2, [0, 1]), mesh, schedules.build("1f1b", 2, 4),
                        [(torch.Size([MICRO, SEQ, D_MODEL]), torch.float32)], [])
    except ValueError as err:
        return str(err)
    return None


def _full(value: torch.Tensor, placement) -> torch.Tensor:
    """The entries of the full `value` that a tensor-parallel piece at `placement` holds."""
    if placement is None:
        return value
    runs = sorted(placement.runs, key=lambda r: r[1])
    return torch.cat([value.narrow(placement.dim, start, n) for start, _, n in runs], placement.dim)


def _check(results: list, runs: list, reference: tuple, loss_ranks: list[list[int]]) -> None:
    """Each run's losses (of every group of `loss_ranks`: the last stage's dp ranks, summed)
    and every rank's parameters against the oracle's."""
    want_losses, want_params = reference
    for i, run in enumerate(runs):
        for group in loss_ranks:
            losses = [sum(results[r][i][0][step] for r in group) for step in range(STEPS)]
            for got, want in zip(losses, want_losses):
                assert abs(got - want) / want < TOLERANCE, (run, group, losses, want_losses)
        seen = set()
        for rank_result in results:
            for name, value, placement in rank_result[i][1]:
                want = _full(want_params[name], placement)
                scale = float(want.abs().max())
                assert float((value - want).abs().max()) < TOLERANCE * scale, (run, name)
                seen.add(name)
        assert seen == set(want_params), (run, set(want_params) - seen)


def test_the_runtime_refuses_stage_modules_of_other_ranks():
    messages = run_world(_wrong_stages, 2, timeout_s=60)
    assert all(m is not None and "runs stages" in m for m in messages), messages


PP_RUNS = [{"schedule": "1f1b", "recompute": "full"}, {"schedule": "zb-h1"},
           {"schedule": "interleaved", "virtual_stages": 2}, {"schedule": "gpipe", "offload": 0.5}]


def test_hand_built_stages_train_as_on_one_process():
    """pp 2: stage 0 an embedding and two blocks, stage 1 two blocks and the head (interleaved:
    four stages of one block), the tied embedding and head listed as shared."""
    results = run_world(_world, 2, {"pp": 2}, PP_RUNS, False, timeout_s=180)
    assert all(loss == 0.0 for run in results[0] for loss in run[0])  # no loss off the last stage
    reference = _oracle(MICRO)
    assert reference[0][-1] < reference[0][0]  # a run that moves, compared step by step
    _check(results, PP_RUNS, reference, loss_ranks=[[1]])


@pytest.mark.parametrize("sizes,runs,tensor_parallel,loss_ranks", [
    # ranks 0, 1: stage 0 split over tp; 2, 3: stage 1 (tp innermost), each with the whole
    # loss; no dp: no gradient engine
    ({"pp": 2, "tp": 2}, [{"schedule": "zb-h1"}, {"schedule": "1f1b", "recompute": "full"}], True,
     [[2], [3]]),
    # ranks 0, 1: stage 0 of dp replicas 0 and 1, each with half the batch; the engine is
    # DataParallel over the rank's stage modules
    ({"pp": 2, "dp": 2}, [{"schedule": "1f1b"}], False, [[2, 3]]),
])
def test_tensor_parallel_or_data_parallel_stages_train_as_on_one_process(
        sizes, runs, tensor_parallel, loss_ranks):
    results = run_world(_world, 4, sizes, runs, tensor_parallel, timeout_s=240)
    _check(results, runs, _oracle(sizes.get("dp", 1) * MICRO), loss_ranks)


def test_a_stage_output_shape_follows_its_micro_batch_input():
    # found for (2, 32) tokens: (2, 32, 8), or 1/tp of the tokens under sequence parallelism
    assert output_shape((2, 32, 8), (2, 32), (3, 32)) == (3, 32, 8)  # evaluation's rows
    assert output_shape((2, 32, 8), (2, 32), (1, 57)) == (1, 57, 8)  # data.balance's deal
    assert output_shape((2, 16, 8), (2, 32), (1, 40)) == (1, 20, 8)  # tp2 with SP
    assert output_shape((2, 10), (2, 64), (5, 64)) == (5, 10)  # the MLP: rows only
    assert output_shape((2, 16, 8), None, (1, 40)) == (1, 16, 8)  # no sample: rows only
    assert output_shape((2, 16, 8), (2, 32), None) == (2, 16, 8)  # the async stream
    with pytest.raises(ValueError, match="does not divide"):
        output_shape((2, 16, 8), (2, 32), (1, 41))
