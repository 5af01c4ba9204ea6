"""The mixture-of-experts feed-forward (issue 29; models/moe.py, parallel/expert/): the grouped
experts compute what a loop over tokens does, the router's options, the balance loss and its
gradient, the counts under recomputation, the config's rules, and the oracle: data parallelism,
ZeRO 1-3 and recomputation reproduce the single-process losses and expert loads (fp32, 1e-4),
bf16 within 2%, and the dry run predicts their collectives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import refused, tiny_tree
from harness import run_world
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint

from loomtrain.cli import main
from loomtrain.models import build_model, token_loss_sum
from loomtrain.models.config import ModelConfig
from loomtrain.models.moe import MoE, balance_loss, grouped_mm
from loomtrain.parallel.expert.balance import figures, update_bias
from loomtrain.parallel.expert.dispatch import by_expert
from loomtrain.train import dryrun, trainer
from loomtrain.train.checkpoint import step_dir
from loomtrain.train.config import config_from_dict
from loomtrain.train.metrics import read_metrics
from test_weave import _metered, _predicted

MOE = {"name": "llama", "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
       "n_experts": 4, "experts_per_token": 2}


def _cfg(**over) -> ModelConfig:
    return ModelConfig(**{**MOE, "seq_len": 16, "vocab_size": 64, **over})


def _by_token(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The routed experts one token at a time: what the grouped path must equal."""
    weights, experts, _ = moe.router(x)
    e = moe.experts
    rows = []
    for i in range(x.shape[0]):
        row = torch.zeros_like(x[i])
        for w, k in zip(weights[i], experts[i]):
            h = F.silu(x[i] @ e.gate_proj[k]) * (x[i] @ e.up_proj[k])
            row = row + w * (h @ e.down_proj[k])
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_the_grouped_experts_compute_what_a_loop_over_tokens_does(router):
    torch.manual_seed(0)
    moe = MoE(_cfg(router=router, n_shared_experts=1))
    torch.nn.init.normal_(moe.router.gate.weight, std=0.5)  # spread picks over the experts
    for p in moe.experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        got = moe(x).view(-1, 32)
        want = _by_token(moe, x.view(-1, 32)) + moe.shared(x.view(-1, 32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_expert_loop_fallback_equals_the_grouped_kernel():
    """Widths that are not 16-byte aligned take the loop over experts."""
    torch.manual_seed(0)
    x, w = torch.randn(9, 6), torch.randn(3, 6, 4)
    counts = torch.tensor([4, 0, 5])
    ref = torch.cat([x[:4] @ w[0], x[4:] @ w[2]])
    loop = grouped_mm(x.bfloat16(), w.bfloat16(), counts)  # 6 * 2 bytes: not aligned
    torch.testing.assert_close(loop.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grouped_mm(x, w, counts), ref)  # 24 bytes: the loop too
    wide = torch.randn(3, 6, 8)  # 32 bytes out, 24 in: still the loop; 8 in and out: the kernel
    torch.testing.assert_close(grouped_mm(torch.randn(9, 8), torch.randn(3, 8, 8), counts).shape,
                               torch.Size([9, 8]))
    torch.testing.assert_close(grouped_mm(x, wide, counts), torch.cat([x[:4] @ wide[0], x[4:] @ wide[2]]))


def test_the_bias_moves_the_choice_not_the_weights():
    torch.manual_seed(0)
    moe = MoE(_cfg(router="sigmoid", router_norm_topk=False))
    x = torch.randn(5, 32)
    w0, e0, _ = moe.router(x)
    moe.router.expert_bias[:] = torch.tensor([10.0, 10.0, 0.0, 0.0])  # 0 and 1 always chosen
    w1, e1, _ = moe.router(x)
    assert (e1.sort(-1).values == torch.tensor([0, 1])).all()
    scores = moe.router.gate(x).sigmoid()
    torch.testing.assert_close(w1, scores.gather(-1, e1))  # unbiased scores of the picked
    assert not torch.equal(e0.sort(-1).values, e1.sort(-1).values)


def test_the_bias_update_moves_towards_the_mean_load():
    moe = MoE(_cfg())
    seen = torch.tensor([[8.0, 2.0, 5.0, 5.0, 3.0, 2.0]], dtype=torch.float64)  # mean load 5
    update_bias([moe], seen, 0.01)
    torch.testing.assert_close(moe.router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    got = figures(seen)
    assert got["moe_tokens_per_expert"] == [[8, 2, 5, 5]]
    assert got["moe_load_imbalance"] == 1.6 and got["moe_aux_loss"] == 1.5


def test_the_balance_loss_is_one_when_uniform_and_larger_when_skewed():
    probs = torch.full((1, 4, 4), 0.25)
    uniform = torch.tensor([[[0, 1], [2, 3], [0, 1], [2, 3]]])
    assert balance_loss(probs, uniform).item() == pytest.approx(1.0)
    skewed_probs = torch.tensor([[[0.7, 0.1, 0.1, 0.1]] * 4])
    skewed = torch.tensor([[[0, 1]] * 4])
    assert balance_loss(skewed_probs, skewed).item() == pytest.approx(4 * (0.5 * 0.7 + 0.5 * 0.1))


def test_the_balance_loss_gradient_is_its_share_of_the_objective():
    """The router's gradient through `_AuxLoss` equals the gradient of the objective written
    out: (cross-entropy sum + coef * sum over layers and sequences of the loss * t) / tokens."""
    torch.manual_seed(0)
    coef, tokens = 0.05, 37.0
    model = build_model(_cfg(aux_loss_coef=coef))
    idx = torch.randint(0, 64, (3, 9))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for m in moes:
        m.aux_grad = coef / tokens
    (token_loss_sum(model(idx[:, :-1]), idx[:, 1:]) / tokens).backward()
    got = [m.router.gate.weight.grad.clone() for m in moes]
    model.zero_grad()
    auxes = []

    def keep_aux(module, args, _out):  # the same loss, recomputed from the router's outputs
        x = args[0]
        _, experts, probs = module.router(x.reshape(-1, x.shape[-1]))
        auxes.append(balance_loss(probs.view(*x.shape[:2], -1), experts.view(*x.shape[:2], -1)))
    for m in moes:
        m.register_forward_hook(keep_aux)
        m.aux_grad = 0.0
    ce = token_loss_sum(model(idx[:, :-1]), idx[:, 1:])
    ((ce + coef * 8 * sum(auxes)) / tokens).backward()
    for g, m in zip(got, moes):
        torch.testing.assert_close(g, m.router.gate.weight.grad, rtol=1e-5, atol=1e-8)


def test_recomputation_counts_each_micro_batch_once():
    torch.manual_seed(0)
    moe = MoE(_cfg())
    x = torch.randn(2, 5, 32, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.counted[:4].sum().item() == 2 * 5 * 2 and moe.counted[-1].item() == 2


def test_received_rows_regroup_by_local_expert():
    # from member 0: 1 row for expert 0, 2 for expert 1; from member 1: 3 and 1
    assert by_expert(torch.tensor([[1, 2], [3, 1]])).tolist() == [0, 3, 4, 5, 1, 2, 6]
    assert by_expert(torch.tensor([[0, 2], [1, 0]])).tolist() == [2, 0, 1]


@pytest.mark.parametrize("argv, says", [
    (["--set", "model.name=gpt", "--set", "model.n_experts=4"], "key of the llama model"),
    (["--set", "model.name=llama", "--set", "parallel.ep=2", "--nproc", "2"],
     "parallel.ep=2 splits the experts of a mixture of experts"),
    (["--set", "model.name=llama", "--set", "model.n_experts=4", "--set", "parallel.ep=2",
      "--nproc", "1"], "must divide parallel.dp = 1"),
    (["--set", "model.name=llama", "--set", "model.n_experts=6", "--set", "parallel.ep=4",
      "--nproc", "4"], "must divide model.n_experts = 6"),
    (["--set", "model.name=llama", "--set", "model.aux_loss_coef=0.01"], "set model.n_experts"),
    (["--set", "model.name=llama", "--set", "model.n_experts=2", "--set",
      "model.experts_per_token=3"], "a token picks k distinct experts"),
    (["--set", "model.name=llama", "--set", "model.n_experts=4", "--set", "sparsity.method=nm"],
     "the stacked experts would stay dense"),
])
def test_bad_expert_settings_are_refused(capsys, argv, says):
    assert says in refused(capsys, ["train", "--dry-run", *argv])


STEPS = 12
# every option on, so each is checked against one process: the sigmoid router with
# DeepSeek-V3's bias, a shared expert, the balance loss
MODEL = {**MOE, "n_shared_experts": 1, "aux_loss_coef": 0.01, "router": "sigmoid",
         "router_bias_rate": 0.01}
LAYOUTS = [{}, {"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3, "recompute": "full"}]


def test_every_moe_every_th_block_is_a_mixture_of_experts():
    model = build_model(_cfg(n_layers=4, moe_every=2))
    assert [type(b.mlp).__name__ for b in model.blocks] == ["SwiGLU", "MoE", "SwiGLU", "MoE"]


EP2 = [{"ep": 2}, {"ep": 2, "zero_stage": 3}]  # world 2; the last saves at step SAVED
EP4 = [{"ep": 4}, {"ep": 2}]  # world 4: dp 4 as ep 4, and as ep 2 x edp 2
SAVED = 6
A2A = ("ep", "all_to_all")


def _check_dry_run(tree: dict, ranks: list[dict]) -> None:
    """The dry run against every rank's meter (calls, wire, payload per (axis, op)): rank 0's
    collectives call for call and byte for byte, except the rows of the experts' all-to-alls,
    which the routing spreads unevenly over the ep ranks: their calls on every rank, and
    their payloads summed over the world (the dispatches send every rank's T k rows, the
    combines return as many; the dry run counts balanced routing)."""
    cfg = config_from_dict(tree)
    want = _predicted(cfg)
    assert {k: v for k, v in want.items() if k != A2A} == \
        {k: v[:2] for k, v in ranks[0].items() if k != A2A}, tree["parallel"]
    if A2A in want:
        payload = sum(c.calls * c.payload_bytes for c in dryrun.estimate(cfg).collectives
                      if c.every_steps == 1 and (c.axis, c.op) == A2A)
        assert all(r[A2A][0] == want[A2A][0] for r in ranks)
        assert sum(r[A2A][2] for r in ranks) == len(ranks) * payload


def _rel_loss(got: list, want: list) -> float:
    by_step = {r["step"]: r["loss"] for r in want}
    return max(abs(r["loss"] - by_step[r["step"]]) / by_step[r["step"]] for r in got)


def _check_same_run(got: list, want: list, layout) -> None:
    """A layout's records against one process's: the losses at 1e-4, the same expert loads
    every step, the balance loss within 1e-5."""
    rel = _rel_loss(got, want)
    assert rel < 1e-4, (layout, rel)
    assert [r["moe_tokens_per_expert"] for r in got] == \
        [r["moe_tokens_per_expert"] for r in want], layout
    aux = max(abs(a["moe_aux_loss"] - b["moe_aux_loss"]) for a, b in zip(got, want))
    assert aux < 1e-5, (layout, aux)


def test_data_parallel_zero_and_expert_parallelism_reproduce_the_single_process_run(
        tmp_path, corpus):
    def trees(world, layouts, train=None, saves=False):
        return [tiny_tree(tmp_path, corpus, model=MODEL, train={"steps": STEPS, **(train or {})},
                          parallel={"nproc": world, **parallel},
                          checkpoint={"every": SAVED if saves else 0}) for parallel in layouts]
    run_world(_metered, 1, trees(1, [{}], saves=True), str(tmp_path / "one"), timeout_s=200)
    want = read_metrics(tmp_path / "one" / "run0")
    two = trees(2, LAYOUTS + EP2[:1]) + trees(2, [{"zero_stage": 3}], {"precision": "bf16"}) \
        + trees(2, EP2[1:], saves=True)
    metered = run_world(_metered, 2, two, str(tmp_path / "two"), True, timeout_s=400)
    saved = step_dir(tmp_path / "two" / f"run{len(two) - 1}", SAVED)
    four = trees(4, EP4 + [{"ep": 4}])  # the last resumes the ep 2 x ZeRO-3 checkpoint
    metered4 = run_world(_metered, 4, four, str(tmp_path / "four"), True,
                         [None] * len(EP4) + [str(saved)], timeout_s=400)
    run_world(_metered, 1, trees(1, [{}]), str(tmp_path / "resumed"), False, [str(saved)],
              timeout_s=200)
    for trees_, ranks in ((two, metered), (four, metered4)):
        for i, tree in enumerate(trees_):
            _check_dry_run(tree, [r[i] for r in ranks])
    runs = [(p, tmp_path / "two" / f"run{i}") for i, p in enumerate(LAYOUTS + EP2[:1])] + \
        [("bf16", tmp_path / "two" / "run5"), (EP2[1], tmp_path / "two" / "run6")] + \
        [(p, tmp_path / "four" / f"run{i}") for i, p in enumerate(EP4)]
    for parallel, run in runs:
        got = read_metrics(run)
        rel = _rel_loss(got, want)
        if parallel == "bf16":
            assert rel < 0.02, rel
            continue
        assert rel < 1e-4, (parallel, rel)
        assert [r["moe_tokens_per_expert"] for r in got] == \
            [r["moe_tokens_per_expert"] for r in want], parallel
        aux = max(abs(a["moe_aux_loss"] - b["moe_aux_loss"]) for a, b in zip(got, want))
        assert aux < 1e-5, (parallel, aux)
    for resumed in (tmp_path / "four" / "run2", tmp_path / "resumed" / "run0"):  # ep 4, one
        got = read_metrics(resumed)
        assert [r["step"] for r in got] == list(range(SAVED + 1, STEPS + 1))
        assert _rel_loss(got, want) < 1e-4, (resumed, _rel_loss(got, want))
    assert want[-1]["loss"] < want[0]["loss"] - 0.2  # it learns
    exports = []
    for run in (tmp_path / "one" / "run0", tmp_path / "two" / "run6"):  # one process, ep 2
        out = run / "model.safetensors"
        trainer.write_config(run, config_from_dict(trees(1, [{}])[0]))
        assert main(["export", str(run), "--out", str(out)]) == 0  # its last, step STEPS
        exports.append(load_file(str(out)))
    assert exports[0].keys() == exports[1].keys()
    for key in exports[0]:  # the same weights after STEPS steps, up to summation order
        torch.testing.assert_close(exports[1][key], exports[0][key], rtol=1e-4, atol=1e-6)
