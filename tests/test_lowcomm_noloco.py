"""NoLoCo (lowcomm/noloco.py): its outer step on hand-computed tensors and what it reduces to
with two replicas; then in the trainer, one spawn per world size: at world 2 the equality with
DiLoCo where the algebra gives one; at world 4 the bytes and the simulated link time against
DiLoCo, convergence, the spread between partners, and a bitwise resume. Config rules last."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_tree
from harness import run_world
from loomtrain.errors import ConfigError
from loomtrain.lowcomm.noloco import outer_update, pair_message
from loomtrain.models import build_model
from loomtrain.train.config import config_from_dict
from test_lowcomm import _losses, _rel, _runs

GBPS = 0.05  # the simulated inter-node link of the world-4 runs: 50 Mbit/s, no latency


def _step(momentum, outer, fast, partner_outer, partner_fast, alpha, beta, gamma):
    """One replica's outer step through the module's functions (the message it would get)."""
    own = pair_message(fast, outer, beta, gamma)
    received = pair_message(partner_fast, partner_outer, beta, gamma)
    outer_update(momentum, outer, own, received, alpha, gamma)


def test_outer_step_on_hand_computed_tensors():
    # the paper's form, by hand, with binary fractions so that fp32 is exact:
    # alpha = 1/2, beta = 1/2, gamma = 1/4; replica i: phi = (1, 2), theta = (0, 2), delta = (1/2, -1);
    # its partner j: phi = (3, 2), theta = (2, 0), delta = 0. Pair means: Delta_bar =
    # ((1, 0) + (1, 2)) / 2 = (1, 1), phi_bar = (2, 2).
    # i: delta = (1/4, -1/2) - (1/2, 1/2) - 1/4 (-1, 0) = (0, -1);         phi = (1, 1)
    # j: delta = 0           - (1/2, 1/2) - 1/4 (1, 0)  = (-3/4, -1/2);    phi = (9/4, 3/2)
    phi_i, theta_i, delta_i = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 2.0]), torch.tensor([0.5, -1.0])
    phi_j, theta_j, delta_j = torch.tensor([3.0, 2.0]), torch.tensor([2.0, 0.0]), torch.zeros(2)
    new_i, new_j = phi_i.clone(), phi_j.clone()
    _step(delta_i, new_i, theta_i, phi_j, theta_j, 0.5, 0.5, 0.25)
    _step(delta_j, new_j, theta_j, phi_i, theta_i, 0.5, 0.5, 0.25)
    assert delta_i.tolist() == [0.0, -1.0] and new_i.tolist() == [1.0, 1.0]
    assert delta_j.tolist() == [-0.75, -0.5] and new_j.tolist() == [2.25, 1.5]
    # a replica without a partner: its own pseudo-gradient, no pull: delta = -beta (phi - theta)
    alone, momentum = phi_i.clone(), torch.zeros(2)
    _step(momentum, alone, theta_i, phi_i, theta_i, 0.5, 0.5, 0.25)
    assert momentum.tolist() == [-0.5, 0.0] and alone.tolist() == [0.5, 2.0]
    # with gamma = beta the message is beta x the weights: the partner's theta, for the spread
    assert pair_message(theta_j, phi_j, 0.7, 0.7).tolist() == (0.7 * theta_j).tolist()


def test_two_replicas_make_heavy_ball_diloco_not_nesterov_diloco():
    """With two replicas that start identical the pair means are over both, phi_0 = phi_1 at
    every outer step, and the pull vanishes: the update is SGD with heavy-ball momentum on the
    averaged pseudo-gradient. It is not torch's Nesterov (DiLoCo's), whose first step is
    already beta (1 + alpha) Delta_bar."""
    alpha, beta = 0.9, 0.7
    results = {}
    for gamma in (0.0, 0.7):
        torch.manual_seed(0)
        start = torch.randn(64)
        outer, momentum = [start.clone(), start.clone()], [torch.zeros(64), torch.zeros(64)]
        torch.manual_seed(1)
        for _ in range(6):
            fast = [outer[r] - 0.1 * torch.randn(64) for r in range(2)]  # each its own inner steps
            new = [outer[r].clone() for r in range(2)]
            for r in range(2):
                _step(momentum[r], new[r], fast[r], outer[1 - r], fast[1 - r], alpha, beta, gamma)
            assert torch.equal(new[0], new[1])  # both ends make the same step, bitwise
            outer = new
        results[gamma] = outer[0]
    # the pull term is gamma (phi_i - phi_bar) = 0: gamma changes only the rounding (of
    # weights of magnitude 0.01-3, whose ulp is up to 2.4e-7): measured 1.1e-6 after 6 steps
    assert (results[0.0] - results[0.7]).abs().max() < 1e-5

    def diloco(nesterov: bool) -> torch.Tensor:
        torch.manual_seed(0)
        theta = torch.randn(64)
        sgd = torch.optim.SGD([theta], lr=beta, momentum=alpha, nesterov=nesterov)
        torch.manual_seed(1)
        for _ in range(6):
            fast = [theta - 0.1 * torch.randn(64) for _ in range(2)]
            theta.grad = ((theta - fast[0]) + (theta - fast[1])) / 2
            sgd.step()
        return theta.detach()
    # measured: 8e-7 from heavy ball (rounding), 0.20 from Nesterov
    assert (results[0.7] - diloco(nesterov=False)).abs().max() < 1e-5
    assert (results[0.7] - diloco(nesterov=True)).abs().max() > 0.05


def test_world2_noloco_without_momentum_is_diloco_with_outer_sgd(tmp_path, corpus):
    """In the trainer: with (almost) no momentum NoLoCo's outer step at world 2 is
    phi - beta Delta_bar, DiLoCo's with outer SGD; the pull vanishes (identical replicas), so
    outer_pull=0 and the default 0.7 give the same run. The config refuses a momentum of 0:
    1e-9 it is, which moves the parameters by ~1e-9 of an outer step."""
    def tree(lowcomm):
        return tiny_tree(tmp_path, corpus, parallel={"nproc": 2}, lowcomm=lowcomm, train={"steps": 12})

    h2 = {"inner_steps": 2, "outer_lr": 0.7}
    noloco = {"algorithm": "noloco", "outer_momentum": 1e-9, **h2}
    jobs = [("diloco", tree({"algorithm": "diloco", "outer_optimizer": "sgd", **h2}), None, False),
            ("pull0", tree({**noloco, "outer_pull": 0.0}), None, False),
            ("pull", tree(noloco), None, False)]
    out = run_world(_runs, 2, jobs, str(tmp_path / "w2"), timeout_s=300)[0]
    diloco = _losses(out["diloco"][0])
    assert diloco[-1] < diloco[0] - 0.3  # it learns
    # pair means against all-reduced means: fp32 rounding apart, measured 2.5e-8 for both
    for name in ("pull0", "pull"):
        assert _rel(_losses(out[name][0]), diloco) < 1e-6, name
    for r in out["pull"][0][:-1]:  # no all-reduce of the model before the final average
        assert r["comm_bytes"]["all_reduce"] < 100, r  # 36 wire bytes: control and loss
    spreads = [r["param_spread"] for r in out["pull"][0] if r["step"] % 2 == 0]
    # measured 0.054, 0.049, 0.032, 0.018, 0.009, 0.003: the inner steps' drift, shrinking with
    # the learning rate's decay
    assert len(spreads) == 6 and min(spreads) > 0  # the replicas' weights differ at each exchange
    assert all(r["partner"] == 1 for r in out["pull"][0][1:])  # rank 0's partner: always 1


def test_world4_pairs_instead_of_an_all_reduce(tmp_path, corpus):
    link = dict(parallel={"nproc": 4, "ranks_per_node": 2}, comm={"inter_node_gbps": GBPS})
    runs = {name: tiny_tree(tmp_path, corpus, lowcomm={"algorithm": name, "inner_steps": 4},
                            train={"steps": 16}, **link)
            for name in ("noloco", "diloco")}
    # resume: H=2, checkpoints every 4 steps, dropout on (the per-rank RNG state matters)
    h2 = tiny_tree(tmp_path, corpus, parallel={"nproc": 4}, model={"dropout": 0.1},
                   lowcomm={"algorithm": "noloco", "inner_steps": 2},
                   train={"steps": 8}, checkpoint={"every": 4})
    jobs = [(name, t, None, False) for name, t in runs.items()]
    jobs += [("h2", h2, None, False), ("h2_stopped", h2, 4, False), ("h2_stopped", h2, None, True),
             ("h2_mid", h2, 3, False), ("h2_mid", h2, None, True)]
    out = run_world(_runs, 4, jobs, str(tmp_path / "w4"), timeout_s=300)[0]
    noloco, diloco = out["noloco"][0], out["diloco"][0]
    cfg = config_from_dict(runs["noloco"])
    model_bytes = 4 * sum(p.numel() for p in build_model(cfg.model).parameters())

    # bytes: at each outer step one send of the model (P) and no all-reduce of it, until the
    # final average; DiLoCo all-reduces 2(N-1)/N x P = 1.5 P per outer step
    outer = [r for r in noloco if r["step"] % 4 == 0]
    assert [r["comm_bytes"].get("send", 0) for r in noloco] == [
        model_bytes if r["step"] % 4 == 0 else 0 for r in noloco]
    assert all(r["comm_bytes"]["all_reduce"] < 100 for r in noloco[:-1])
    assert noloco[-1]["comm_bytes"]["all_reduce"] >= 1.5 * model_bytes  # the final average
    synced = [r["comm_bytes"]["all_reduce"] for r in diloco if r["step"] % 4 == 0]
    assert all(1.5 * model_bytes <= b < 1.5 * model_bytes + 100 for b in synced)

    # simulated link time per outer step (steps 4-12: the 16th adds NoLoCo's final average).
    # An exchange takes one message's time across nodes, 0 inside a node; DiLoCo's all-reduce
    # 1.5 messages' time, always across nodes. run.seed=1 draws cross-node pairs at outer
    # steps 1-3, so this is NoLoCo's worst case: 2/3. comm_simulated_s also counts the
    # receive, which runs during the send: summed, NoLoCo's steps count 2 P, 4/3 of DiLoCo's
    steady = slice(0, 12)
    exchange_s = sum(r["exchange_simulated_s"] for r in noloco[steady])
    noloco_s = sum(r["comm_simulated_s"] for r in noloco[steady])
    diloco_s = sum(r["comm_simulated_s"] for r in diloco[steady])
    assert exchange_s / diloco_s == pytest.approx(2 / 3, rel=1e-3)  # control ops: 1e-4 of it
    assert noloco_s / diloco_s == pytest.approx(4 / 3, rel=1e-3)

    # it learns, near DiLoCo: measured 5.48 -> 4.25 in 16 steps, DiLoCo 3.91 (heavy-ball
    # momentum 0.9 against DiLoCo's Nesterov 0.9, and pairs instead of all four replicas)
    losses = _losses(noloco)
    assert losses[-1] < losses[0] - 0.5 and losses[-1] < _losses(diloco)[-1] * 1.2, losses
    # the spread between partners at each exchange (rank 0's pair): > 0, and it does not grow
    # beyond twice the first (measured 0.107, 0.065, 0.124, 0.093)
    spreads = [r["param_spread"] for r in outer]
    assert len(spreads) == 4 and min(spreads) > 0 and max(spreads) < 2 * spreads[0], spreads

    # resume at an outer step: each replica's momentum and AdamW state, the RNG: bitwise
    reference = _losses(out["h2"][0])
    records, saved = out["h2_stopped"]
    assert saved == ["step_00000004", "step_00000008"]
    assert _losses(records) == reference  # == on floats
    # a stop between outer steps takes the pending one (and the average) first, then saves
    losses = _losses(out["h2_mid"][0])
    assert losses[:3] == reference[:3] and losses[3:] != reference[3:]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("lowcomm,why", [
    ({"algorithm": "noloco", "outer_pull": 3.0, "outer_momentum": 0.4}, "below 2 x (1 + lowcomm"),
    ({"algorithm": "diloco", "outer_pull": 0.5}, "it is a setting of 'noloco'"),
    ({"algorithm": "noloco", "outer_optimizer": "sgd"}, "is not read by lowcomm.algorithm='noloco'"),
])
def test_config_refuses(tmp_path, corpus, lowcomm, why):
    with pytest.raises(ConfigError, match="lowcomm") as err:
        config_from_dict(tiny_tree(tmp_path, corpus, lowcomm=lowcomm))
    assert why in str(err.value), str(err.value)


def test_config_accepts_noloco(tmp_path, corpus):
    lowcomm = {"algorithm": "noloco", "inner_steps": 4, "outer_lr": 0.5, "outer_momentum": 0.5,
               "outer_pull": 0.0}
    cfg = config_from_dict(tiny_tree(tmp_path, corpus, lowcomm=lowcomm, checkpoint={"every": 8},
                                     parallel={"nproc": 4}))
    assert cfg.lowcomm.model_dump() | lowcomm == cfg.lowcomm.model_dump()
    assert config_from_dict({}).lowcomm.outer_pull == 0.7
