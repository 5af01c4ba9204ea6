"""Tensor parallelism (issue 4, first increment): the Megatron column/row split of the GPT's
attention and MLP and of a user's model through a plan, against the unsplit model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from harness import run_world
from loomtrain.mesh import build_mesh
from loomtrain.models import GPT, IGNORE_INDEX, token_loss_sum
from loomtrain.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, parallelize_tensor,
                                       vocab_parallel_loss_sum)

N_LAYERS = 2


def _gpt_case(rank, world):
    mesh = build_mesh({"tp": world})
    torch.manual_seed(0)
    reference = GPT(61, 16, 32, N_LAYERS, 4)
    model = GPT(61, 16, 32, N_LAYERS, 4)
    model.load_state_dict(reference.state_dict())
    parallelize_tensor(model, mesh)
    x = torch.randint(0, 60, (3, 16), generator=torch.Generator().manual_seed(1))
    ref_loss = token_loss_sum(reference(x), x)
    ref_loss.backward()
    mesh.meter.take()
    loss = token_loss_sum(model(x), x)
    forward_reduces = mesh.meter.counts[("tp", "all_reduce")].calls
    loss.backward()
    reduces = mesh.meter.counts[("tp", "all_reduce")].calls
    ref = dict(reference.named_parameters())
    d, hidden = 32, 128
    mine = torch.arange(rank * d // world, (rank + 1) * d // world)
    mine_hidden = torch.arange(rank * hidden // world, (rank + 1) * hidden // world)
    qkv_rows = torch.cat([mine + j * d for j in range(3)])
    worst = 0.0
    for name, p in model.named_parameters():
        want = ref[name].grad
        if "attn.qkv" in name:
            want = want[qkv_rows]
        elif name.endswith("attn.proj.weight"):
            want = want[:, mine]
        elif "mlp.fc" in name:
            want = want[mine_hidden]
        elif name.endswith("mlp.proj.weight"):
            want = want[:, mine_hidden]
        worst = max(worst, float((p.grad - want).abs().max() / want.abs().max()))
    return abs(float(loss) - float(ref_loss)) / float(ref_loss), worst, forward_reduces, reduces


@pytest.mark.parametrize("world", [2, 4])
def test_gpt_split_matches_the_unsplit_model_with_one_all_reduce_per_pair(world):
    for loss_diff, grad_diff, forward_reduces, reduces in run_world(_gpt_case, world, timeout_s=120):
        assert loss_diff < 1e-6 and grad_diff < 1e-5, (loss_diff, grad_diff)
        # one all-reduce per attention and per MLP in forward, and one each in backward
        assert forward_reduces == 2 * N_LAYERS and reduces == 4 * N_LAYERS


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 5)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _plan_case(rank, world):
    mesh = build_mesh({"tp": world})
    torch.manual_seed(0)
    reference = TwoLayer()
    model = parallelize_tensor(copy.deepcopy(reference), mesh, plan={"up": "column", "down": "row"})
    kinds = type(model.up), type(model.down)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    out, expected = model(x), reference(x)
    out.square().sum().backward()
    expected.square().sum().backward()
    cols = torch.arange(rank * 8 // world, (rank + 1) * 8 // world)
    return (kinds == (ColumnParallelLinear, RowParallelLinear),
            torch.allclose(out, expected, atol=1e-6),
            torch.allclose(model.up.weight.grad, reference.up.weight.grad[cols], atol=1e-6),
            torch.allclose(model.down.weight.grad, reference.down.weight.grad[:, cols], atol=1e-6),
            torch.allclose(model.down.bias.grad, reference.down.bias.grad, atol=1e-6))


def test_a_users_model_split_by_a_plan_matches():
    for checks in run_world(_plan_case, 2, timeout_s=120):
        assert all(checks), checks


def _refusals(rank, world):
    mesh = build_mesh({"tp": world})
    messages = []
    for make, plan in ((lambda: GPT(61, 16, 24, 1, 3), None),            # 3 heads over 2 ranks
                       (lambda: TwoLayer(), None),                        # no plan, not a GPT
                       (lambda: TwoLayer(), {"up": "diagonal"}),
                       (lambda: nn.Sequential(nn.ReLU()), {"0": "row"})):
        with pytest.raises(ValueError) as err:
            parallelize_tensor(make(), mesh, plan)
        messages.append(str(err.value))
    with pytest.raises(ValueError) as err:
        parallelize_tensor(TwoLayer(), mesh, {"up": "column"}, sequence_parallel=True)
    messages.append(str(err.value))
    return messages


def test_bad_splits_are_refused_with_the_reason():
    messages = run_world(_refusals, 2, timeout_s=60)[0]
    assert "heads = 3 is not divisible by the tensor-parallel size 2" in messages[0]
    assert "needs a plan" in messages[1]
    assert "'diagonal'" in messages[2]
    assert "not an nn.Linear" in messages[3]
    assert "GPT and Llama only" in messages[4]


def _vocab_case(rank, world):
    """A vocabulary tp divides (64) and two it does not, padded to a multiple of tp (61; 5,
    where at tp 4 the last rank holds padding only)."""
    mesh = build_mesh({"tp": world})
    return {vocab: _vocab_split(mesh, rank, world, vocab) for vocab in (64, 61, 5)}


def _vocab_split(mesh, rank, world, vocab):
    torch.manual_seed(0)
    reference = GPT(vocab, 16, 32, 1, 4)
    model = parallelize_tensor(copy.deepcopy(reference), mesh, vocab_parallel=True)
    x = torch.randint(0, vocab, (3, 16), generator=torch.Generator().manual_seed(1))
    y = x.roll(-1, dims=1)
    y[:, -1] = IGNORE_INDEX  # ignored targets count nothing
    rows = -(-vocab // world)  # padded_vocab(vocab, world) / world
    y[0, :world] = (torch.arange(world) * rows).clamp(max=vocab - 1)  # each range's first row
    ref_loss = token_loss_sum(reference(x), y)
    ref_loss.backward()
    mesh.meter.take()
    logits = model(x)
    loss = vocab_parallel_loss_sum(logits, y, model.head)
    loss.backward()
    real = max(0, min(rows, vocab - rank * rows))
    weight, emb_grad = model.tok_emb.weight, model.tok_emb.weight.grad
    ref_emb_grad = reference.tok_emb.weight.grad[rank * rows:rank * rows + real]
    return {"shape": tuple(logits.shape), "real": real,
            "loss": abs(loss.item() - ref_loss.item()) / ref_loss.item(),
            "emb": float((emb_grad[:real] - ref_emb_grad).abs().max() / ref_emb_grad.abs().max())
                   if real else 0.0,
            "ln_f": float((model.ln_f.weight.grad - reference.ln_f.weight.grad).abs().max()),
            # padding: zero rows with no gradient, -inf logits
            "padding": (bool(weight[real:].eq(0).all()) and bool(emb_grad[real:].eq(0).all())
                        and bool(logits[..., real:].eq(float("-inf")).all())),
            "tied": model.head.weight is model.tok_emb.weight}


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_embedding_head_and_loss_match_the_full_vocabulary(world):
    """Also when tp does not divide the vocabulary: padded rows are zeros, their logits -inf,
    and the loss and the real rows' gradients are the unpadded model's."""
    for cases in run_world(_vocab_case, world, timeout_s=120):
        assert cases[64]["shape"] == (3, 16, 64 // world)  # no rank ever holds the full logits
        for vocab, c in cases.items():
            assert c["shape"] == (3, 16, -(-vocab // world)), (vocab, c)
            assert c["loss"] < 1e-6 and c["emb"] < 1e-5 and c["ln_f"] < 1e-6, (vocab, c)
            assert c["padding"] and c["tied"], (vocab, c)
    if world == 4:  # the last rank of 5 over 4 (2 rows each) holds padding only
        assert cases[5]["real"] == 0 and cases[61]["real"] == 13


def _sequence_case(rank, world):
    mesh = build_mesh({"tp": world})
    torch.manual_seed(0)
    reference = GPT(64, 16, 32, N_LAYERS, 4)
    model = parallelize_tensor(copy.deepcopy(reference), mesh, vocab_parallel=True,
                               sequence_parallel=True)
    seen = []
    model.blocks[0].ln1.register_forward_hook(lambda _m, args, _out: seen.append(tuple(args[0].shape)))
    x = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    ref_loss = token_loss_sum(reference(x), x)
    ref_loss.backward()
    mesh.meter.take()
    loss = vocab_parallel_loss_sum(model(x), x, model.head)
    loss.backward()
    calls = {op: c.calls for (axis, op), c in mesh.meter.counts.items() if axis == "tp"}
    ref = dict(reference.named_parameters())
    mine = torch.arange(rank * 32 // world, (rank + 1) * 32 // world)
    checks = {
        "ln1": model.blocks[0].ln1.weight.grad - ref["blocks.0.ln1.weight"].grad,
        "ln_f": model.ln_f.bias.grad - ref["ln_f.bias"].grad,
        "proj.bias": model.blocks[1].attn.proj.bias.grad - ref["blocks.1.attn.proj.bias"].grad,
        "qkv": model.blocks[1].attn.qkv.weight.grad
               - ref["blocks.1.attn.qkv.weight"].grad[torch.cat([mine + j * 32 for j in range(3)])],
        "pos": model.pos_emb.weight.grad - ref["pos_emb.weight"].grad,
        "tok": model.tok_emb.weight.grad - ref["tok_emb.weight"].grad[rank * 64 // world:(rank + 1) * 64 // world],
    }
    worst = {k: float(v.abs().max()) for k, v in checks.items()}
    return seen[0], abs(loss.item() - ref_loss.item()) / ref_loss.item(), worst, calls


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_matches_and_trades_all_reduces_for_gathers_and_scatters(world):
    for ln_input, loss_diff, worst, calls in run_world(_sequence_case, world, timeout_s=120):
        assert ln_input == (3, 16 // world, 32)  # layer norms see 1/tp of the sequence
        assert loss_diff < 1e-6, loss_diff
        assert max(worst.values()) < 1e-5, worst
        # per block: 2 all-gathers and 2 reduce-scatters forward, the same backward, plus the
        # embedding's split/gather and the head's gather
        assert calls["reduce_scatter"] == 4 * N_LAYERS + 1
        assert calls["all_gather"] == 4 * N_LAYERS + 2
        # left as all-reduces: the embedding lookup, the loss's three, and the gradients of
        # the parameters that saw one sequence chunk (2 layer norms and 2 row biases per
        # block: 6 tensors; the final norm: 2)
        assert calls["all_reduce"] == 4 + 6 * N_LAYERS + 2, calls
