"""Zeroth-order optimizers split in two: local probes -> (seed, projected gradient) pairs, and
a deterministic update from the pairs alone (`probe`, `apply`; `step` does both).

MeZO (Malladi et al., arXiv 2305.17333, Algorithm 1), ZO-momentum, ZO-Adam (Kingma & Ba, arXiv
1412.6980) and sparse MeZO (Liu et al., arXiv 2402.15751); MeZO-SVRG is svrg.py, HELENE
helene.py. Updates, state and memory: docs/zeroth.md, "The methods" and "Memory".
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch

from loomtrain.zeroth.perturb import Perturber, step_seed
from loomtrain.zeroth.split import pieces_of, whole_thresholds


class Pair(NamedTuple):
    """One probe's result: the seed of its z and the projected gradient (a float32 value)."""
    seed: int
    grad: float


class Probe(NamedTuple):
    pairs: list[Pair]
    loss: float  # mean over the probes of (L+ + L-) / 2: this rank's batch loss near theta


class LocalExchange:
    """The exchange of a single process: rank 0 of a world of one, the pairs unchanged."""
    rank, world = 0, 1

    def __call__(self, pairs: Sequence[Pair]) -> list[Pair]:
        return list(pairs)


class ZOOptimizer:
    """MeZO, and the base of every method: subclasses change `_update` and their state.

    `perturber`: the model and its trainable parameters (perturb.py). `lr`: the default of
    `apply`'s lr. `eps`: the perturbation scale. `seed`: the base of every step's seeds.
    """

    name = "mezo"
    state_kinds: tuple[str, ...] = ()  # per-parameter state tensors, each P elements

    def __init__(self, perturber: Perturber, lr: float, eps: float = 1e-3,
                 n_perturbations: int = 1, seed: int = 0):
        if not lr > 0 or not eps > 0:
            raise ValueError(f"{self.name}: lr={lr} and eps={eps} must be positive")
        if n_perturbations < 1:
            raise ValueError(f"{self.name}: n_perturbations={n_perturbations} must be >= 1")
        self.perturber, self.lr, self.eps = perturber, lr, eps
        self.n_perturbations, self.seed = n_perturbations, seed
        self.step_count = 0      # optimizer steps taken (each seeds its probes)
        self.forward_passes = 0  # forwards run by this rank's probes
        self.skipped_steps = 0   # steps whose pairs held a non-finite scalar
        self.state = {kind: [torch.zeros_like(p) for p in perturber.params]
                      for kind in self.state_kinds}

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.perturber.params

    def needs_refresh(self) -> bool:
        """True when this step must be `refresh(...)` instead of `step(...)` (MeZO-SVRG)."""
        return False

    def probe(self, loss_fn: Callable[[], torch.Tensor], rank: int = 0) -> Probe:
        """(a): this rank's K probes at the current step."""
        pairs, total = [], 0.0
        for k in range(self.n_perturbations):
            seed = step_seed(self.seed, self.step_count, rank, k)
            g, loss_plus, loss_minus = self.perturber.projected_gradient(loss_fn, seed, self.eps)
            self.forward_passes += 2
            pairs.append(Pair(seed, g))
            total += loss_plus + loss_minus
        return Probe(pairs, total / (2 * self.n_perturbations))

    def expected_seeds(self, world: int) -> list[int]:
        """The seeds of every rank's probes at this step, in (rank, k) order."""
        return [step_seed(self.seed, self.step_count, r, k)
                for r in range(world) for k in range(self.n_perturbations)]

    def apply(self, pairs: Sequence[Pair], lr: float | None = None) -> None:
        """(b): the update from the pairs (every rank's, in (rank, k) order); the step ends."""
        if all(math.isfinite(p.grad) for p in pairs):
            self._update(list(pairs), self.lr if lr is None else lr)
        else:
            self.skipped_steps += 1
        self.step_count += 1
        self._after_step()

    def step(self, loss_fn: Callable[[], torch.Tensor], exchange=None,
             lr: float | None = None) -> float:
        """Probe, exchange, check that the pairs are this step's, apply. Returns this rank's
        probed loss (`Probe.loss`)."""
        if self.needs_refresh():
            raise RuntimeError(f"{self.name} step {self.step_count} is a refresh step: call "
                               "refresh(loss_fns) (needs_refresh() says when)")
        exchange = exchange or LocalExchange()
        probe = self.probe(loss_fn, exchange.rank)
        pairs = exchange(probe.pairs)
        check_seeds(pairs, self.expected_seeds(exchange.world), self.step_count)
        self.apply(pairs, lr)
        return probe.loss

    def refresh(self, loss_fns, exchange=None, lr: float | None = None) -> float:
        raise RuntimeError(f"{self.name} has no refresh step")

    def estimate(self, pos: int, pairs: Sequence[Pair]) -> torch.Tensor:
        """g_hat's slice for parameter position `pos`: (1/n) sum_j g_j z_j."""
        n = len(pairs)
        return self.perturber.direction_sum(pos, [(p.seed, p.grad / n) for p in pairs])

    @torch.no_grad()
    def _update(self, pairs: list[Pair], lr: float) -> None:
        n = len(pairs)
        self.perturber.add_pairs([(p.seed, -lr * p.grad / n) for p in pairs])

    def _after_step(self) -> None:
        pass

    # --- checkpoints: plain dicts, tensors under "tensors" keyed "<kind>.<parameter name>" ---

    def state_dict(self) -> dict:
        tensors = {f"{kind}.{name}": t for kind, ts in self.state.items()
                   for name, t in zip(self.perturber.names, ts)}
        return {"name": self.name, "step": self.step_count, "forward_passes": self.forward_passes,
                "skipped_steps": self.skipped_steps, "seed": self.seed, "tensors": tensors,
                **self._extra_state()}

    def load_state_dict(self, state: dict) -> None:
        if state["name"] != self.name:
            raise ValueError(f"a {state['name']!r} optimizer state cannot load into {self.name!r}")
        mine = self.state_dict()["tensors"]
        if set(state["tensors"]) != set(mine):
            raise ValueError(f"{self.name} state keys differ: missing "
                             f"{sorted(set(mine) - set(state['tensors']))}, unexpected "
                             f"{sorted(set(state['tensors']) - set(mine))}")
        with torch.no_grad():
            for key, t in mine.items():
                t.copy_(state["tensors"][key])
        self.step_count, self.forward_passes = state["step"], state["forward_passes"]
        self.skipped_steps, self.seed = state["skipped_steps"], state["seed"]
        self._load_extra_state(state)

    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, state: dict) -> None:
        pass


def check_seeds(pairs: Sequence[Pair], expected: Sequence[int], step: int) -> None:
    """Every rank's pairs must be this step's: a rank at another step (a desynchronized resume)
    would otherwise be replayed silently."""
    got = [p.seed for p in pairs]
    if got != list(expected):
        raise RuntimeError(f"step {step}: the exchanged pairs carry seeds {got[:4]}... instead of "
                           f"this step's {list(expected)[:4]}...: the ranks are not at the same "
                           f"step or do not share the optimizer's seed")


class MeZO(ZOOptimizer):
    """ZO-SGD with SPSA (the base class's update)."""


class ZOMomentum(ZOOptimizer):
    """m = momentum * m + g_hat; theta -= lr m (heavy ball, torch.optim.SGD's form)."""

    name = "zo-momentum"
    state_kinds = ("m",)

    def __init__(self, perturber: Perturber, lr: float, momentum: float = 0.9, **base):
        super().__init__(perturber, lr, **base)
        if not 0 <= momentum < 1:
            raise ValueError(f"zo-momentum: momentum={momentum} must be in [0, 1)")
        self.momentum = momentum

    @torch.no_grad()
    def _update(self, pairs: list[Pair], lr: float) -> None:
        for pos, p in enumerate(self.params):
            m = self.state["m"][pos]
            m.mul_(self.momentum).add_(self.estimate(pos, pairs))
            p.add_(m, alpha=-lr)


class ZOAdam(ZOOptimizer):
    """Adam on g_hat: m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
    theta -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + adam_eps), t = step + 1."""

    name = "zo-adam"
    state_kinds = ("m", "v")

    def __init__(self, perturber: Perturber, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 adam_eps: float = 1e-8, **base):
        super().__init__(perturber, lr, **base)
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"zo-adam: betas={betas} must be in [0, 1)")
        self.betas, self.adam_eps = tuple(betas), adam_eps

    @torch.no_grad()
    def _update(self, pairs: list[Pair], lr: float) -> None:
        b1, b2 = self.betas
        t = self.step_count + 1
        for pos, p in enumerate(self.params):
            g = self.estimate(pos, pairs)
            m, v = self.state["m"][pos], self.state["v"][pos]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v / (1 - b2 ** t)).sqrt_().add_(self.adam_eps)
            p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))


class SparseMeZO(ZOOptimizer):
    """MeZO with z masked to the small-magnitude entries (docs/zeroth.md). The thresholds are
    the whole tensors' (split.py), kept by parameter name: a pipeline's stages each save
    their own."""

    name = "sparse-mezo"

    def __init__(self, perturber: Perturber, lr: float, sparsity: float = 0.75,
                 mask_every: int = 50, **base):
        super().__init__(perturber, lr, **base)
        if not 0 <= sparsity < 1:
            raise ValueError(f"sparse-mezo: sparsity={sparsity} (the fraction left unperturbed) "
                             "must be in [0, 1)")
        if mask_every < 1:
            raise ValueError(f"sparse-mezo: mask_every={mask_every} must be >= 1")
        self.sparsity, self.mask_every = sparsity, mask_every
        self.pieces = pieces_of(perturber)
        self.perturber.thresholds = whole_thresholds(perturber, self.pieces, sparsity)

    def _after_step(self) -> None:
        if self.step_count % self.mask_every == 0:
            self.perturber.thresholds = whole_thresholds(self.perturber, self.pieces,
                                                         self.sparsity)

    def _extra_state(self) -> dict:
        return {"thresholds": dict(zip(self.perturber.names, self.perturber.thresholds))}

    def _load_extra_state(self, state: dict) -> None:
        saved = state["thresholds"]
        if isinstance(saved, list):  # before 2026-12-06: one list in the model's order
            saved = dict(zip(self.perturber.names, saved))
        self.perturber.thresholds = [saved[name] for name in self.perturber.names]
