"""Zeroth-order core (src/loomtrain/zeroth/): the SPSA estimator's expectation on a quadratic,
bitwise restoration and the value of probed forwards on the three models, trainable subsets,
every optimizer's descent and invariants, resumption through state_dict, and peak memory."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from loomtrain.models import GPT, MLP, token_loss_sum
from loomtrain.zeroth import OPTIMIZERS, Perturber, build_zo_optimizer, hyper_keys
from loomtrain.zeroth.memory import measure_in_subprocess
from loomtrain.zeroth.perturb import magnitude_thresholds, mix_seed


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: a second intra-op thread only adds OpenMP barriers, which a
    loaded machine makes ruinous (measured with the 2 cores shared: 300 ZO-momentum steps on the
    least-squares problem 0.23 s on one thread, 13-15 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Quadratic(nn.Module):
    """f(x) = 0.5 x^T A x - b^T x, gradient A x - b."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, x: torch.Tensor):
        super().__init__()
        self.register_buffer("a", a)
        self.register_buffer("b", b)
        self.x = nn.Parameter(x.clone())

    def forward(self) -> torch.Tensor:
        return 0.5 * self.x @ self.a @ self.x - self.b @ self.x


def test_spsa_estimate_is_unbiased_on_a_quadratic():
    """For a quadratic the central difference is exact: g = grad.z, so the estimator g z has
    mean grad and, z ~ N(0, I), per-coordinate variance E[(grad.z)^2 z_i^2] - grad_i^2 =
    |grad|^2 + grad_i^2. The mean of N estimates is within 5 standard errors
    sqrt((|grad|^2 + grad_i^2) / N) of grad in every coordinate (a false alarm has probability
    < 8 x 6e-7 under the CLT); the same bound rejects a flipped sign, a doubled and a halved
    estimator, so the test could fail. Float64 keeps rounding (1e-16 relative) out of it."""
    torch.manual_seed(0)
    d, n = 8, 6000
    m = torch.randn(d, d, dtype=torch.float64)
    quad = Quadratic(m @ m.T / d + torch.eye(d, dtype=torch.float64),
                     torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64))
    grad = (quad.a @ quad.x - quad.b).detach()
    perturber = Perturber(quad)
    total = torch.zeros(d, dtype=torch.float64)
    for j in range(n):
        seed = mix_seed(7, j)
        g, _, _ = perturber.projected_gradient(quad, seed, eps=1e-2)
        total += g * perturber.direction(0, seed)
    mean = total / n
    bound = 5 * torch.sqrt((grad.square().sum() + grad.square()) / n)
    assert ((mean - grad).abs() <= bound).all(), (mean, grad, bound)
    for wrong in (-grad, 2 * grad, 0.5 * grad):
        assert ((mean - wrong).abs() > bound).any()


def test_naive_in_place_round_trip_is_not_exact():
    """The motivation of the per-module hook engine (docs/zeroth.md): p + eps z - 2 eps z +
    eps z in fp32 leaves ~46% of the elements an ulp away (p ~ N(0, 0.02), eps 1e-3)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(200_000, generator=gen) * 0.02
    z = torch.randn(200_000, generator=gen)
    q = p.clone().add_(z, alpha=1e-3).add_(z, alpha=-2e-3).add_(z, alpha=1e-3)
    assert 0.3 < (q != p).double().mean() < 0.6


def _gpt(attention="softmax"):
    torch.manual_seed(0)
    return GPT(64, 16, 32, 2, 2, attention=attention, linear_decay=attention == "linear")


def _mlp():
    torch.manual_seed(0)
    return MLP(64, 32, 2)


MODELS = {"gpt": _gpt, "linear-gpt": lambda: _gpt("linear"), "mlp": _mlp}


def _batch(vocab=64, rows=4, t=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (rows, t), generator=gen),
            torch.randint(0, vocab, (rows, t), generator=gen))


def _loss_fn(model, batch):
    x, y = batch
    return lambda: token_loss_sum(model(x), y) / y.numel()


@pytest.mark.parametrize("name", MODELS)
def test_probe_restores_bitwise_and_sees_the_perturbed_model(name):
    """After a probe every parameter (the GPT's tied head included) is bitwise what it was,
    and the two probed losses are those of explicit copies theta + eps z and theta - eps z:
    the same fp32 values through the same CPU kernels, so equal exactly (a head perturbed twice,
    or with its own z, would change the loss)."""
    model, batch = MODELS[name](), _batch()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    perturber = Perturber(model)
    seed, eps = 12345, 1e-2
    g, loss_plus, loss_minus = perturber.projected_gradient(_loss_fn(model, batch), seed, eps)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    if name == "gpt":
        assert model.head.weight is model.tok_emb.weight
    for scale, probed in ((eps, loss_plus), (-eps, loss_minus)):
        twin = copy.deepcopy(model)  # deepcopy keeps the tie: one tensor, perturbed once
        with torch.no_grad():
            for pos, p in enumerate(Perturber(twin).params):
                p.add_(perturber.direction(pos, seed), alpha=scale)
            explicit = float(_loss_fn(twin, batch)())
        assert probed == explicit
    assert loss_plus != loss_minus and g == pytest.approx((loss_plus - loss_minus) / (2 * eps),
                                                          rel=1e-6)


def test_add_moves_along_the_regenerated_direction():
    """add(seed, c) is theta + c z(seed), z regenerated identically (bitwise), per parameter
    a different z (seeded by its index)."""
    model = _mlp()
    perturber = Perturber(model)
    before = [p.detach().clone() for p in perturber.params]
    perturber.add(99, 0.25)
    for pos, (p, b) in enumerate(zip(perturber.params, before)):
        assert torch.equal(p, b.add(perturber.direction(pos, 99), alpha=0.25))
    first, second = perturber.direction(0, 99), perturber.direction(1, 99)
    assert not torch.equal(first.flatten()[:8], second.flatten()[:8])
    assert not torch.equal(first, perturber.direction(0, 100))


class UsesWeightOutside(nn.Module):
    """The parent reads its child's weight with F.linear: no hook of the child sees that use."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        return self.out(F.linear(x, self.inner.weight, self.inner.bias)).sum()


def test_a_parameter_used_outside_its_module_is_refused():
    model = UsesWeightOutside()
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"inner\.weight.*never perturbed"):
        Perturber(model).projected_gradient(lambda: model(x), seed=1, eps=1e-3)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    # a module whose forward raises (wrong width) after its pre-hook perturbed it: restored
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        Perturber(model).projected_gradient(lambda: model.out(torch.randn(3, 5)), seed=1, eps=1e-3)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    # trained without the refused ones (frozen), it works
    opt = build_zo_optimizer("mezo", model, list(model.out.parameters()), lr=1e-3)
    opt.step(lambda: model(x))
    assert not torch.equal(model.out.weight, before[2])


def test_trainable_subset_leaves_the_rest_bitwise_untouched():
    model, batch = _gpt(), _batch()
    subset = list(model.blocks[1].parameters())
    chosen = {id(p) for p in subset}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_zo_optimizer("zo-adam", model, subset, lr=1e-3)
    for _ in range(3):
        opt.step(_loss_fn(model, batch))
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != (id(p) in chosen), n


def _least_squares(init_seed=0):
    """A 16 -> 4 linear least-squares problem with an exact solution (loss 0 reachable); the
    data are always the same, the model's initial values come from `init_seed`."""
    torch.manual_seed(0)
    target = nn.Linear(16, 4)
    x = torch.randn(64, 16)
    y = target(x).detach()
    torch.manual_seed(init_seed + 1)
    model = nn.Linear(16, 4)
    return model, lambda: F.mse_loss(model(x), y)


# per method, for the least-squares problem (68 parameters, a deterministic loss): lr about a
# third of the smallest that diverged or stalled in a sweep (x1, x3, x10); sparse MeZO leaves
# its large entries still between threshold updates, so a low sparsity; MeZO-SVRG's g_full is
# one K-direction estimate reused until the next refresh, so frequent refreshes
LSQ_HYPER = {
    "mezo": dict(lr=0.03), "zo-momentum": dict(lr=0.003), "zo-adam": dict(lr=0.01),
    "sparse-mezo": dict(lr=0.05, sparsity=0.25, mask_every=5),
    "mezo-svrg": dict(lr=0.01, svrg_every=2), "helene": dict(lr=0.003, anneal_steps=50),
}


def _run(opt, loss_fn, steps):
    losses = []
    for _ in range(steps):
        losses.append(opt.refresh([loss_fn]) if opt.needs_refresh() else opt.step(loss_fn))
    return losses


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_decreases_a_least_squares_loss(name):
    model, loss_fn = _least_squares()
    opt = build_zo_optimizer(name, model, eps=1e-3, n_perturbations=2, **LSQ_HYPER[name])
    with torch.no_grad():
        start = float(loss_fn())
    _run(opt, loss_fn, 300)
    with torch.no_grad():
        end = float(loss_fn())
    assert end < 0.2 * start, (start, end)
    # K = 2 probes of 2 forwards; MeZO-SVRG: refreshes (every other step) 2 K on one batch,
    # minibatch steps 4 K
    assert opt.forward_passes == (150 * 4 + 150 * 8 if name == "mezo-svrg" else 300 * 4)


def test_mezo_decreases_a_tiny_gpt_loss():
    model, batch = _gpt(), _batch()
    loss_fn = _loss_fn(model, batch)
    opt = build_zo_optimizer("mezo", model, lr=3e-3, eps=1e-3)
    with torch.no_grad():
        start = float(loss_fn())
    _run(opt, loss_fn, 40)
    with torch.no_grad():
        assert float(loss_fn()) < start - 0.05


def test_n_perturbations_are_averaged():
    """One step with K = 3 moves theta by -lr/3 sum_k g_k z_k (computed densely in float64)."""
    model, loss_fn = _least_squares()
    opt = build_zo_optimizer("mezo", model, lr=0.1, n_perturbations=3)
    before = [p.detach().double().clone() for p in opt.params]
    probe = opt.probe(loss_fn)
    assert len({p.seed for p in probe.pairs}) == 3 and opt.forward_passes == 6
    opt.apply(probe.pairs)
    for pos, p in enumerate(opt.params):
        step = sum(pair.grad * opt.perturber.direction(pos, pair.seed).double()
                   for pair in probe.pairs)
        assert torch.allclose(p.double(), before[pos] - 0.1 / 3 * step, rtol=0, atol=1e-6)


def test_sparse_mezo_never_changes_large_entries_within_a_step():
    model, batch = _gpt(), _batch()
    opt = build_zo_optimizer("sparse-mezo", model, lr=1e-2, sparsity=0.75, mask_every=1)
    for _ in range(3):
        thresholds = list(opt.perturber.thresholds)
        assert thresholds == magnitude_thresholds(opt.params, 0.75)
        before = [p.detach().clone() for p in opt.params]
        opt.step(_loss_fn(model, batch))
        for p, b, t in zip(opt.params, before, thresholds):
            if p.dim() < 2:
                continue  # LayerNorm's ones and the zero biases: all tied at the threshold
            large = b.abs() > t
            assert 0.74 < large.double().mean() < 0.76
            assert torch.equal(p[large], b[large])
            assert (p[~large] != b[~large]).double().mean() > 0.9


def test_sparse_mezo_loads_thresholds_saved_by_name_or_as_the_old_list():
    model = _gpt()
    opt = build_zo_optimizer("sparse-mezo", model, lr=1e-2, sparsity=0.75, mask_every=1)
    opt.step(_loss_fn(model, _batch()))
    state = opt.state_dict()
    assert sorted(state["thresholds"]) == sorted(opt.perturber.names)  # by name
    for saved in (state, {**state, "thresholds": list(opt.perturber.thresholds)}):
        fresh = build_zo_optimizer("sparse-mezo", _gpt(), lr=1e-2, sparsity=0.75, mask_every=1)
        fresh.load_state_dict(saved)
        assert fresh.perturber.thresholds == opt.perturber.thresholds


def test_svrg_control_variate_cancels_at_the_snapshot():
    """With svrg_lr_ratio = 0 the refresh leaves theta at the snapshot, so the next minibatch
    pairs are proj(theta) - proj(snapshot) = 0 exactly and the step is -lr g_full alone."""
    model, loss_fn = _least_squares()
    opt = build_zo_optimizer("mezo-svrg", model, lr=0.1, svrg_every=5, svrg_lr_ratio=0.0)
    opt.refresh([loss_fn, loss_fn])
    assert opt.forward_passes == 4
    before = [p.detach().clone() for p in opt.params]
    assert all(torch.equal(p, s) for p, s in zip(before, opt.state["snapshot"]))
    probe = opt.probe(loss_fn)
    assert [p.grad for p in probe.pairs] == [0.0]
    opt.apply(probe.pairs)
    for p, b, full in zip(opt.params, before, opt.state["full"]):
        assert full.abs().sum() > 0 and torch.equal(p, b.add(full, alpha=-0.1))


@pytest.mark.parametrize("name", ["zo-momentum", "zo-adam", "sparse-mezo", "mezo-svrg", "helene"])
def test_state_dict_resume_is_bitwise(name):
    """N steps, save (through torch.save), a fresh model and optimizer load, N more steps:
    bitwise the 2N uninterrupted steps."""
    hyper = dict(LSQ_HYPER[name], n_perturbations=2, seed=3)
    if name == "mezo-svrg":
        hyper["svrg_every"] = 4
    model, loss_fn = _least_squares()
    opt = build_zo_optimizer(name, model, **hyper)
    _run(opt, loss_fn, 10)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    _run(opt, loss_fn, 10)

    resumed, resumed_loss = _least_squares(init_seed=5)  # other values, overwritten
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed.load_state_dict(saved["model"])
    again = build_zo_optimizer(name, resumed, **dict(hyper, seed=0))
    again.load_state_dict(saved["optim"])
    _run(again, resumed_loss, 10)
    assert again.step_count == opt.step_count == 20
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_build_refuses_unknown_names_and_keys():
    assert hyper_keys("mezo") == ("eps", "lr", "n_perturbations", "seed")
    assert set(hyper_keys("zo-adam")) - set(hyper_keys("mezo")) == {"betas", "adam_eps"}
    model, _ = _least_squares()
    with pytest.raises(ValueError, match="not one of"):
        build_zo_optimizer("sgd", model, lr=1.0)
    with pytest.raises(ValueError, match="momentum"):
        build_zo_optimizer("mezo", model, lr=1.0, momentum=0.9)
    with pytest.raises(ValueError, match="sparsity"):
        build_zo_optimizer("sparse-mezo", model, lr=1.0, sparsity=1.0)


def test_mezo_peak_memory_is_inference_memory():
    """A MeZO step's peak (a fresh process, VmHWM above the RSS before the model; zeroth/
    memory.py) on a 3.3M-parameter GPT is at most 1.1x the inference forward's; backprop +
    AdamW's, measured the same way, is far above (so the measurement sees allocations)."""
    model = dict(name="gpt", d_model=256, n_layers=4, n_heads=4, seq_len=128, vocab_size=256)
    peaks = measure_in_subprocess(model, batch=8, phases=("inference", "mezo", "backprop_adamw"))
    assert peaks["params"] > 3_000_000
    assert peaks["inference"] > peaks["param_bytes"]
    assert peaks["mezo"] <= 1.1 * peaks["inference"], peaks
    assert peaks["backprop_adamw"] > 3 * peaks["inference"], peaks
