"""SPSA perturbations regenerated from seeds, applied in place during the forward, module by
module, and restored bitwise.

MeZO (Malladi et al., arXiv 2305.17333, Algorithm 1); sparse MeZO's masks (Liu et al., arXiv
2402.15751). Seeds, why whole-model perturbation is not exact, the hooks and their
requirement on models: docs/zeroth.md, "Exact restoration"; a model split by tensor or
pipeline parallelism: "Split replicas".
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
import torch.nn as nn

from loomtrain.parallel.placement import placement_of

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One splitmix64 output for state x (64-bit arithmetic)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*words: int) -> int:
    """A 63-bit seed from integer words (each taken mod 2^64), order-sensitive."""
    h = 0
    for w in words:
        h = splitmix64(h ^ (w & _MASK64))
    return h >> 1


def step_seed(base_seed: int, step: int, rank: int, k: int, stream: int = 0) -> int:
    """The seed of perturbation k of data-parallel rank `rank` at optimizer step `step`.
    `stream` separates uses within a step (0: minibatch probes, 1: MeZO-SVRG's large batch)."""
    return mix_seed(base_seed, stream, step, rank, k)


def as_float32(x: float) -> float:
    """x rounded to the nearest float32 (what a pair's scalar is when sent); overflow: inf."""
    return float(torch.tensor(x, dtype=torch.float32))


def magnitude_thresholds(params: Iterable[torch.Tensor], sparsity: float) -> list[float]:
    """Per tensor, the threshold t such that the entries with |theta| <= t are the
    (1 - sparsity) fraction of smallest magnitude: the round(sparsity * n) largest-magnitude
    entries are left unperturbed (ties at t are perturbed). inf: everything perturbed;
    -1.0: nothing. Costs one |theta| copy of the tensor at a time."""
    out = []
    for p in params:
        n = p.numel()
        small = n - round(sparsity * n)
        if small >= n:
            out.append(float("inf"))
        elif small <= 0:
            out.append(-1.0)
        else:
            out.append(float(p.detach().abs().flatten().kthvalue(small).values))
    return out


@dataclass
class _Probe:
    """One perturbed forward in progress: what each hook saved, and who saw what."""
    seed: int
    scale: float
    depth: dict[int, int] = field(default_factory=dict)
    saved: dict[int, torch.Tensor] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)


def parameter_indices(model: nn.Module) -> dict[str, int]:
    """Every name of `model`'s parameters (a tied parameter's each) -> the parameter's index
    in `model.parameters()`: the model-wide index that seeds its z."""
    first: dict[int, int] = {}
    return {name: first.setdefault(id(p), len(first))
            for name, p in model.named_parameters(remove_duplicate=False)}


class Perturber:
    """The perturbation engine over `model` and its trainable parameters.

    `params`: the trainable subset (default: every parameter with requires_grad); everything
    else is never touched. Positions in `self.params` (model order) index per-parameter
    state; `self.indices` are the model-wide indices that seed z. `whole`: for a model that
    is this rank's part of a split one (tensor or pipeline parallel, names kept), the whole
    model's `parameter_indices`, so that a piece's z is the slice of the whole tensor's.
    `mesh`: that split model's mesh, whose tp ranks' pieces make the whole tensors that sparse
    MeZO and HELENE read (split.py); None in one process.
    """

    def __init__(self, model: nn.Module, params: Iterable[nn.Parameter] | None = None,
                 whole: dict[str, int] | None = None, mesh=None):
        named = list(model.named_parameters())
        index = {id(p): i for i, (_, p) in enumerate(named)}
        chosen = [p for _, p in named if p.requires_grad] if params is None else list(params)
        ids = [id(p) for p in chosen]
        if len(set(ids)) != len(ids):
            raise ValueError("the trainable parameters list one parameter twice")
        outside = [i for i, pid in enumerate(ids) if pid not in index]
        if outside:
            raise ValueError(f"trainable parameters at positions {outside} of the list given "
                             "are not parameters of the model")
        order = sorted(index[pid] for pid in ids)
        self.model, self.mesh = model, mesh
        self.params = [named[i][1] for i in order]
        self.names = [named[i][0] for i in order]
        self.indices = order if whole is None else [whole[name] for name in self.names]
        self._position = {id(p): pos for pos, p in enumerate(self.params)}
        self.thresholds: list[float] | None = None  # sparse MeZO's masks, per position
        self._owners = []
        for module in model.modules():
            mine = [self._position[id(p)] for p in module.parameters(recurse=False)
                    if id(p) in self._position]
            if mine:
                self._owners.append((module, mine))
        self._generators: dict[torch.device, torch.Generator] = {}

    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def mask(self, pos: int) -> torch.Tensor | None:
        """Sparse MeZO's mask of position `pos` from its current value (None: no mask)."""
        if self.thresholds is None or self.thresholds[pos] == float("inf"):
            return None
        return self.params[pos].detach().abs() <= self.thresholds[pos]

    def direction(self, pos: int, seed: int, mask: torch.Tensor | None = None,
                  shape: tuple[int, ...] | None = None,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
        """z of position `pos` under `seed` (times `mask` if given), freshly generated. A
        tensor-parallel piece's is its slice of the whole tensor's z (its placement,
        parallel/placement.py; zeros on a padded vocabulary's rows): the whole tensor's is
        drawn, then cut, so that every layout perturbs as one process does. `shape`: the
        parameter's (piece's) shape where it is empty between uses (ZeRO-3); `dtype`: z's
        where it is not the parameter's (fp32 master weights of bf16 parameters)."""
        p = self.params[pos]
        gen = self._generators.get(p.device)
        if gen is None:
            gen = self._generators[p.device] = torch.Generator(device=p.device)
        gen.manual_seed(mix_seed(seed, self.indices[pos]))
        placement = placement_of(p)
        local = p.shape if shape is None else shape
        z = torch.randn(local if placement is None else placement.shape, generator=gen,
                        device=p.device, dtype=p.dtype if dtype is None else dtype)
        if placement is not None:
            z = placement.take(z, local[placement.dim])
        return z if mask is None else z.mul_(mask)

    def direction_sum(self, pos: int, pairs: Sequence[tuple[int, float]]) -> torch.Tensor:
        """sum_j c_j z_j(pos) over (seed, c) pairs, in their order (a dense estimate's slice)."""
        mask = self.mask(pos)
        out = torch.zeros_like(self.params[pos], memory_format=torch.contiguous_format)
        for seed, coeff in pairs:
            out.add_(self.direction(pos, seed, mask), alpha=coeff)
        return out

    def add(self, seed: int, coeff: float) -> None:
        """theta += coeff * z(seed) on the trainable parameters (masked if sparse)."""
        self.add_pairs([(seed, coeff)])

    @torch.no_grad()
    def add_pairs(self, pairs: Sequence[tuple[int, float]]) -> None:
        """theta += sum_j c_j z_j for (seed, c) pairs, parameter by parameter, the pairs in
        their order (so every rank that applies the same list gets the same bits); sparse
        masks are taken once per parameter, before its first addition."""
        for pos, p in enumerate(self.params):
            mask = self.mask(pos)
            for seed, coeff in pairs:
                p.add_(self.direction(pos, seed, mask), alpha=coeff)

    @contextmanager
    def perturbed(self, seed: int, scale: float):
        """Inside: every forward of the model sees theta + scale * z(seed) on the trainable
        parameters (in place, module by module), and theta is bitwise itself again after each
        module's forward. On leaving, raises if a trainable parameter was never perturbed."""
        probe = _Probe(seed, scale)
        handles = []
        for module, positions in self._owners:
            handles.append(module.register_forward_pre_hook(
                lambda _m, _a, positions=positions: self._enter(probe, positions)))
            handles.append(module.register_forward_hook(
                lambda _m, _a, _o, positions=positions: self._leave(probe, positions),
                always_call=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            with torch.no_grad():
                for pos, saved in probe.saved.items():  # a forward that raised midway
                    self.params[pos].copy_(saved)
        unseen = [self.names[pos] for pos in range(len(self.params)) if pos not in probe.seen]
        if unseen:
            raise RuntimeError(
                f"trainable parameters {unseen} were never perturbed during the forward: a "
                "zeroth-order probe perturbs a parameter in the forward of a module that owns "
                "it, so it must be used only there (and be used at all). Leave it out of the "
                "trainable parameters, or call its module instead of using its tensor directly")

    @torch.no_grad()
    def _enter(self, probe: _Probe, positions: list[int]) -> None:
        for pos in positions:
            depth = probe.depth.get(pos, 0)
            probe.depth[pos] = depth + 1
            if depth:
                continue  # already perturbed by an enclosing use
            p = self.params[pos]
            probe.saved[pos] = p.detach().clone()
            p.add_(self.direction(pos, probe.seed, self.mask(pos)), alpha=probe.scale)
            probe.seen.add(pos)

    @torch.no_grad()
    def _leave(self, probe: _Probe, positions: list[int]) -> None:
        for pos in positions:
            probe.depth[pos] -= 1
            if probe.depth[pos] == 0:
                self.params[pos].copy_(probe.saved.pop(pos))

    def projected_gradient(self, loss_fn: Callable[[], torch.Tensor | float], seed: int,
                           eps: float) -> tuple[float, float, float]:
        """(g, L(theta + eps z), L(theta - eps z)) with g = (L+ - L-) / (2 eps), computed in
        float64 from the two losses and rounded to float32 (the scalar a pair carries).
        `loss_fn()` runs the forward on a fixed batch; both forwards start from the same torch
        RNG state (CPU and the parameters' CUDA devices), so dropout draws the same masks."""
        rng = rng_state(self.params)
        with torch.no_grad():
            with self.perturbed(seed, eps):
                loss_plus = float(loss_fn())
            set_rng_state(rng)
            with self.perturbed(seed, -eps):
                loss_minus = float(loss_fn())
        return as_float32((loss_plus - loss_minus) / (2 * eps)), loss_plus, loss_minus


def rng_state(params) -> tuple:
    """torch's RNG state on the CPU and on the CUDA devices of `params`."""
    cuda = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in cuda}


def set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for d, s in cuda.items():
        torch.cuda.set_rng_state(s, d)
