"""Automatic sequence parallelism (parallel/sequence/auto.py, cp_method = "auto"): the traced
attention calls and positions of loomtrain's GPT and of a user's own model, the refusals, the
checkpointing decision, parity of the rewritten models with the unmodified single-process model
at cp = 2 and 4 (Ulysses, and ring attention where the heads do not split), and the trainer's
loss curve against the single-process one."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_world
from loomtrain import comm
from loomtrain.mesh import build_mesh
from loomtrain.models import GPT
from loomtrain.parallel.sequence.auto import (auto_sequence, choose_method, find_attention,
                                              plan_checkpointing, plan_sequence)

# the spawned ranks import this module: the trainer and config modules are imported where used

VOCAB, T, B = 64, 32, 2


# -- a user's model, written as a user would: nothing in it knows about loomtrain ------------

class UserAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class UserBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = UserAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class UserLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, max_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(UserBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens):
        positions = torch.arange(tokens.size(1), device=tokens.device)
        h = self.embed(tokens) + self.pos(positions)
        for layer in self.layers:
            h = layer(h)
        return self.out(self.norm(h))


class MaskedAttention(UserAttention):
    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        i = torch.arange(t, device=x.device)
        mask = i[None, :] <= i[:, None]
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                        .transpose(1, 2).reshape(b, t, c))


class BidirectionalAttention(UserAttention):
    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c))


class PositionTable(nn.Module):
    """Positions sliced from a buffer by the length: what SP cannot see through."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.register_buffer("table", torch.randn(T, 16))
        self.attention = UserAttention(16, 2)

    def forward(self, tokens):
        return self.attention(self.embed(tokens) + self.table[:tokens.shape[1]])


MODELS = {  # name -> (constructor, heads)
    "gpt": (lambda: GPT(VOCAB, T, 32, 2, 2), 2),
    "user3": (lambda: UserLM(VOCAB, 24, 3, 2, T), 3),
    "user4": (lambda: UserLM(VOCAB, 32, 4, 2, T), 4),
}


# -- single process: finding, refusing, planning ----------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_finds_every_attention_call_and_the_positions(name):
    make, heads = MODELS[name]
    report = find_attention(make())
    layers = "blocks" if name == "gpt" else "layers"
    inner = "attn" if name == "gpt" else "attention"
    assert [s.path for s in report.attention] == [f"{layers}.{i}.{inner}" for i in range(2)]
    assert [s.graph for s in report.attention] == [f"{layers}.{i}" for i in range(2)]
    assert len(report.positions) == 1 and report.positions[0].graph == ""  # in the model's forward
    assert all(s.problem is None for s in report.attention + report.positions)
    assert plan_sequence(report, 2, T).heads == (heads, heads)


@pytest.mark.parametrize("attention,expected", [
    (MaskedAttention, "an explicit attn_mask"),
    (BidirectionalAttention, "non-causal attention (is_causal=False)")])
def test_unsupported_attention_is_refused(attention, expected):
    model = UserLM(VOCAB, 16, 2, 2, T)
    for layer in model.layers:
        layer.attention = attention(16, 2)
    report = find_attention(model)
    assert len(report.attention) == 2 and all(expected in s.problem for s in report.attention)
    with pytest.raises(ValueError, match="layers.0.attention"):
        plan_sequence(report, 2, T)


def test_attention_dropout_and_position_tables_are_refused():
    with pytest.raises(ValueError, match=r"attention dropout \(dropout_p=0.1\)"):
        plan_sequence(find_attention(GPT(VOCAB, T, 32, 2, 2, dropout=0.1)), 2, T)
    with pytest.raises(ValueError, match="table is indexed by the sequence length"):
        plan_sequence(find_attention(PositionTable()), 2, T)
    with pytest.raises(ValueError, match="no F.scaled_dot_product_attention"):
        plan_sequence(find_attention(nn.Sequential(nn.Embedding(VOCAB, 8))), 2, T)


def test_kernel_rule():
    assert choose_method([4, 4], 2) == choose_method([4], 4) == "ulysses"
    assert choose_method([4, 6], 4) == choose_method([3], 2) == "ring"


def test_checkpointing_follows_the_budget_and_the_estimate_the_local_length():
    report = find_attention(GPT(VOCAB, 256, 32, 2, 2))
    plans = {(cp, n): plan_sequence(report, cp, n) for cp, n in ((2, 64), (4, 128), (2, 128), (2, 256))}
    # the estimate depends on the local length sample_len / cp only, and linearly (every
    # intermediate is per token: the attention's scores live inside the SDPA node)
    assert plans[(2, 64)].estimate_bytes == plans[(4, 128)].estimate_bytes
    for short, long in (((2, 64), (2, 128)), ((2, 128), (2, 256))):
        ratio = plans[long].estimate_bytes / plans[short].estimate_bytes
        assert 1.95 < ratio < 2.05, ratio
    plan = plans[(2, 128)]
    assert plan.checkpointed_bytes < plan.estimate_bytes and not plan.checkpointed
    decisions = [plan_sequence(report, 2, 128, budget).checkpointed
                 for budget in (None, 2 * plan.estimate_bytes, plan.estimate_bytes,
                                plan.estimate_bytes - 1, 1)]
    assert decisions == [False, False, False, True, True]
    assert plan_checkpointing(10, [5, 7], [1, 1], 21) == (22, 19, True)


# -- several processes: parity with the unmodified single-process model ------------------------

CASES = [  # (model, activation budget in bytes: 1 checkpoints every block)
    ("gpt", 1), ("user3", None), ("user4", None)]


def _inputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (B, T), generator=gen)
    return x, torch.roll(x, -1, 1), torch.randn(B, T, VOCAB, generator=gen)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _parity(mesh, name: str, budget):
    torch.manual_seed(0)
    model = MODELS[name][0]()
    x, y, upstream = _inputs()
    reference = model(x)
    (reference * upstream).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    auto = auto_sequence(model, mesh, T, budget_bytes=budget, micro_batch=B)  # shares parameters
    x_local, _ = auto.sequence.shard(x, y)
    mine = auto.sequence.context.local_positions
    logits = auto(x_local)
    (logits * upstream[:, mine]).sum().backward()
    errors = {"logits": _relative(logits.detach(), reference.detach()[:, mine])}
    for n, p in model.named_parameters():  # the full gradient: summed over the cp ranks
        grad = p.grad.clone()
        comm.all_reduce(grad, mesh, "cp")
        errors[n] = _relative(grad, want[n])
    same_keys = list(auto.state_dict()) == list(model.state_dict()) or \
        set(auto.state_dict()) == set(model.state_dict())
    return auto.plan, errors, same_keys


def _world(rank, world):
    out = {}
    for cp in (4, 2):  # cp = 4, then dp = 2 x cp = 2 (two rings: local-to-global ranks)
        mesh = build_mesh({"dp": world // cp, "cp": cp})
        out[cp] = [_parity(mesh, name, budget) for name, budget in CASES]
    return out


def test_rewritten_models_match_the_single_process_model():
    for result in run_world(_world, 4, timeout_s=90):
        for cp in (4, 2):
            for (name, budget), (plan, errors, same_keys) in zip(CASES, result[cp]):
                heads = MODELS[name][1]
                assert plan.method == ("ulysses" if heads % cp == 0 else "ring"), (cp, name)
                assert plan.checkpointed == (budget is not None), (cp, name)
                # fp32 throughout; the kernels sum the same products in another order (tiles
                # merged through their log-sum-exp, all-to-alls, gradients summed over the cp
                # ranks): measured at most 6e-7 of the largest value. 1e-4 leaves a wide margin
                # while a wrong position, mask or lost block moves results by 1e-2 and more.
                worst = max(errors, key=errors.get)
                assert errors[worst] < 1e-4, (cp, name, budget, worst, errors[worst])
                assert same_keys, (cp, name)


class _Axis:
    """A stand-in mesh of one cp rank among `cp`: what a plan and a Ring read at set-up (no
    communication happens before the first batch)."""

    def __init__(self, cp: int):
        self.cp = cp

    def size(self, axis: str) -> int:
        return self.cp if axis == "cp" else 1

    def local_rank(self, axis: str) -> int:
        return 0


def test_the_config_reaches_the_plan(tmp_path, doc_corpus):
    from conftest import tiny_tree
    from loomtrain.parallel.sequence import apply_sequence
    from loomtrain.train.config import config_from_dict

    cfg = config_from_dict(tiny_tree(tmp_path, doc_corpus, parallel={
        "nproc": 4, "cp": 2, "cp_method": "auto", "activation_budget_mb": 0.01}))
    model = GPT(256, 32, 32, 2, 2)
    auto = apply_sequence(model, _Axis(2), cfg)
    assert auto.sequence.plan is auto.plan and auto is not model
    plan = auto.plan  # micro_batch 2 x 16 tokens: the logits alone are 32 KiB > 0.01 MiB
    assert plan.budget_bytes == int(0.01 * 2**20) and plan.checkpointed
    assert plan.method == "ulysses" and plan.local_len == 16 and plan.heads == (2, 2)
    assert "checkpoint" in auto.code  # the model's forward calls its blocks through it
    # the rewritten blocks sit in a ModuleList again, under their names: ZeRO's units and
    # activation offload find them there (before, fx's plain container hid them: no units)
    from loomtrain.parallel.zero import find_units

    assert isinstance(auto.blocks, nn.ModuleList)
    assert [name for name, _ in find_units(auto)] == ["blocks.0", "blocks.1"]
    assert sorted(auto.state_dict()) == sorted(model.state_dict())


# The trainer with cp_method = "auto" (Ulysses; ring with packing and checkpointed blocks)
# follows the single-process curve: cases of tests/test_sequence_training.py's oracle.
