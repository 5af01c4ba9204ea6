"""MeZO-SVRG: a periodic large-batch ZO estimate at a snapshot as the control variate of the
minibatch estimates.

Gautam et al., arXiv 2404.08080, Algorithm 1. The update, how the large batch is split over
ranks, memory and cost: docs/zeroth.md, "The methods".
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Sequence

import torch

from loomtrain.zeroth.optimizers import LocalExchange, Pair, Probe, ZOOptimizer, check_seeds
from loomtrain.zeroth.perturb import Perturber, as_float32, rng_state, set_rng_state, step_seed


class MeZOSVRG(ZOOptimizer):
    name = "mezo-svrg"
    state_kinds = ("snapshot", "full")

    def __init__(self, perturber: Perturber, lr: float, svrg_every: int = 10,
                 svrg_batches: int = 4, svrg_lr_ratio: float = 1.0, **base):
        super().__init__(perturber, lr, **base)
        if svrg_every < 1 or svrg_batches < 1 or not svrg_lr_ratio >= 0:
            raise ValueError(f"mezo-svrg: svrg_every={svrg_every} and svrg_batches="
                             f"{svrg_batches} must be >= 1, svrg_lr_ratio={svrg_lr_ratio} >= 0")
        self.svrg_every, self.svrg_batches = svrg_every, svrg_batches
        self.svrg_lr_ratio = svrg_lr_ratio

    def needs_refresh(self) -> bool:
        return self.step_count % self.svrg_every == 0

    def refresh_seeds(self) -> list[int]:
        """The large batch's K seeds at this step, the same on every rank."""
        return [step_seed(self.seed, self.step_count, 0, k, stream=1)
                for k in range(self.n_perturbations)]

    @contextmanager
    def at_snapshot(self):
        """Inside: the parameters hold the snapshot (storage swapped, swapped back on exit)."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _swap(self) -> None:
        snapshot = self.state["snapshot"]
        for pos, p in enumerate(self.params):
            p.data, snapshot[pos] = snapshot[pos], p.data

    def probe(self, loss_fn: Callable[[], torch.Tensor], rank: int = 0) -> Probe:
        """A minibatch step's probes: per seed, proj(theta) - proj(snapshot) on the same batch,
        the snapshot's forwards replaying the same torch RNG state (dropout)."""
        pairs, total = [], 0.0
        for k in range(self.n_perturbations):
            seed = step_seed(self.seed, self.step_count, rank, k)
            rng = rng_state(self.params)
            g, loss_plus, loss_minus = self.perturber.projected_gradient(loss_fn, seed, self.eps)
            set_rng_state(rng)
            with self.at_snapshot():
                g_snapshot, _, _ = self.perturber.projected_gradient(loss_fn, seed, self.eps)
            self.forward_passes += 4
            pairs.append(Pair(seed, as_float32(g - g_snapshot)))
            total += loss_plus + loss_minus
        return Probe(pairs, total / (2 * self.n_perturbations))

    @torch.no_grad()
    def _update(self, pairs: list[Pair], lr: float) -> None:
        for pos, p in enumerate(self.params):
            p.add_(self.estimate(pos, pairs).add_(self.state["full"][pos]), alpha=-lr)

    def probe_full(self, loss_fns: Sequence[Callable[[], torch.Tensor]]) -> Probe:
        """(a) of a refresh: per refresh seed, the mean over this rank's batches of g."""
        pairs, total = [], 0.0
        for seed in self.refresh_seeds():
            grads = []
            for loss_fn in loss_fns:
                g, loss_plus, loss_minus = self.perturber.projected_gradient(loss_fn, seed, self.eps)
                grads.append(g)
                total += loss_plus + loss_minus
            self.forward_passes += 2 * len(loss_fns)
            pairs.append(Pair(seed, as_float32(sum(grads) / len(grads))))
        return Probe(pairs, total / (2 * self.n_perturbations * len(loss_fns)))

    @torch.no_grad()
    def apply_full(self, pairs: Sequence[Pair], lr: float | None = None) -> None:
        """(b) of a refresh, from every rank's refresh pairs (rank order): g_full, the
        snapshot, and theta -= svrg_lr_ratio x lr x g_full; the step ends."""
        seeds = self.refresh_seeds()
        merged = []
        for seed in seeds:
            grads = [p.grad for p in pairs if p.seed == seed]
            merged.append((seed, as_float32(sum(grads) / len(grads)) / len(seeds)))
        if all(math.isfinite(c) for _, c in merged):
            step = self.svrg_lr_ratio * (self.lr if lr is None else lr)
            for pos, p in enumerate(self.params):
                full = self.state["full"][pos]
                full.copy_(self.perturber.direction_sum(pos, merged))
                self.state["snapshot"][pos].copy_(p)
                p.add_(full, alpha=-step)
        else:
            self.skipped_steps += 1
        self.step_count += 1

    def refresh(self, loss_fns: Sequence[Callable[[], torch.Tensor]], exchange=None,
                lr: float | None = None) -> float:
        """A refresh step: probe the large batch, exchange, apply. Returns this rank's mean
        probed loss over its batches."""
        if not self.needs_refresh():
            raise RuntimeError(f"mezo-svrg step {self.step_count} is not a refresh step")
        exchange = exchange or LocalExchange()
        probe = self.probe_full(loss_fns)
        pairs = exchange(probe.pairs)
        check_seeds(pairs, self.refresh_seeds() * exchange.world, self.step_count)
        self.apply_full(pairs, lr)
        return probe.loss
