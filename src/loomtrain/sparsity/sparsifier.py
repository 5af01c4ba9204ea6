"""`Sparsifier`: the masks of a model's sparse layers (every nn.Linear weight but a tied one),
kept in step with training: applied to the weights, applied to the gradients, updated on the
method's schedule.

Scope, methods, the loop it is used in and its costs: docs/sparsity.md, "What is sparse",
"Using it in your own loop", "Methods" and "Composition and limits".
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from loomtrain.sparsity.dst import cosine_fraction, rigl_update, set_update, swap_count
from loomtrain.sparsity.masks import (active_count, cubic_density, erk_densities, magnitude_mask,
                                      nm_mask, pack_mask, random_mask, uniform_densities,
                                      unpack_mask)
from loomtrain.sparsity.sharded import ShardedSlices
from loomtrain.sparsity.split import Pieces, whole_counts
from loomtrain.zeroth.perturb import mix_seed

_INIT_STREAM, _SET_STREAM = 0x5EED, 0x5E7  # seed streams: initial masks, SET's regrowth
KEY = "sparsity.mask."  # checkpoint keys: KEY + parameter name -> packed bits


def sparse_layers(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, weight) of every trainable nn.Linear weight registered under one name only, and
    held by one pipeline stage only (a stage's copy of the tied head is the embedding too)."""
    uses: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    names = {id(p): n for n, p in module.named_parameters()}
    return [(names[id(m.weight)], m.weight) for m in module.modules()
            if isinstance(m, nn.Linear) and m.weight.requires_grad and uses[id(m.weight)] == 1
            and getattr(m.weight, "pp_copies", 1) == 1]


def whole_layers(cfg) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the sparse layers of the model `cfg` trains, whole, in their order
    (the order that seeds each layer's random mask): built on the meta device, no memory."""
    from loomtrain.train.task import build_task_model

    with torch.device("meta"):
        return [(name, tuple(p.shape)) for name, p in sparse_layers(build_task_model(cfg))]


def layer_densities(shapes: list[tuple[int, ...]], density: float, distribution: str) -> list[float]:
    return (erk_densities if distribution == "erk" else uniform_densities)(shapes, density)


class Sparsifier:
    """Masks keyed by parameter name (of `model`, or of `model.module` for a wrapped one).

    `version` counts mask changes (an engine that sends only masked gradient entries rebuilds
    its index lists when it moves). `cfg` is the [sparsity] section; `total_steps` resolves
    its default `end_step` (75% of training).

    A split model (tensor or pipeline parallel) passes `whole`, the (name, shape) of the whole
    model's sparse layers (`whole_layers`), and the `mesh`: this rank masks the layers it
    holds (by name), each decision taken on the whole layer (its tp pieces gathered,
    split.Pieces) with the whole model's layer index and densities, then cut to its piece, so
    the masks are the single-process run's (docs/sparsity.md, "Split models").

    In the ZeRO engine (parallel/zero/) `sharded` is its `ShardedOptimizer`: the masks also
    cut along its shards of the master weights and of the reduced gradient
    (sparsity/sharded.py, docs/sparsity.md "ZeRO and bf16")."""

    def __init__(self, model: nn.Module, cfg, seed: int, total_steps: int,
                 whole: list[tuple[str, tuple[int, ...]]] | None = None, mesh=None,
                 sharded=None):
        module = getattr(model, "module", model)
        self.cfg, self.seed, self.mesh = cfg, seed, mesh
        if whole is None:
            whole = [(name, tuple(p.shape)) for name, p in sparse_layers(module)]
        if not whole:
            raise ValueError("the model has no nn.Linear weight to sparsify")
        self.whole = whole
        self.index = {name: i for i, (name, _) in enumerate(whole)}
        params = dict(module.named_parameters())
        self.layers = [(name, params[name]) for name, _ in whole if name in params]
        self.shards = (ShardedSlices(sharded, [name for name, _ in self.layers])
                       if sharded is not None else None)
        shapes = self.shards.shapes if self.shards is not None else {}
        self.pieces = {name: Pieces(p, mesh, shape=shapes.get(name)) for name, p in self.layers}
        self.end_step = cfg.end_step if cfg.end_step is not None else max(1, round(0.75 * total_steps))
        shapes = [shape for _, shape in whole]
        if cfg.method == "nm":
            self.densities = [cfg.n / cfg.m] * len(shapes)
        else:
            self.densities = layer_densities(shapes, cfg.density, cfg.distribution)
        weights = self._master_weights() if cfg.method == "nm" else None
        self.masks: dict[str, torch.Tensor] = {
            name: self.pieces[name].piece(self._initial(name, p, weights)) for name, p in self.layers}
        self.version = 0
        self.apply()

    def _master_weights(self) -> dict[str, torch.Tensor] | None:
        """The sparse layers' whole fp32 master weights, gathered from the sharded engine's
        shards where the parameters are not them (bf16 rounds them; ZeRO-3 leaves them empty
        between uses), so that every ranking reads the fp32 weights the optimizer steps, as
        over plain dp; None where the parameters are them."""
        if self.shards is None or self.shards.local_weights:
            return None
        return self.shards.whole("master")

    def _whole_weight(self, name: str, p: nn.Parameter, weights) -> torch.Tensor:
        return self.pieces[name].whole(weights[name] if weights is not None else p)

    def _initial(self, name: str, p: nn.Parameter, weights) -> torch.Tensor:
        """Layer `name`'s whole initial mask."""
        cfg, i, shape = self.cfg, self.index[name], self.whole[self.index[name]][1]
        if cfg.method == "nm":
            return nm_mask(self._whole_weight(name, p, weights), cfg.n, cfg.m)
        if cfg.method == "prune":  # dense until the schedule starts
            return torch.ones(shape, dtype=torch.bool, device=p.device)
        gen = torch.Generator(device=p.device).manual_seed(mix_seed(self.seed, _INIT_STREAM, i))
        return random_mask(shape, active_count(math.prod(shape), self.densities[i]), gen)

    # --- every step ---
    @torch.no_grad()
    def apply(self) -> None:
        """Masked weights set to exactly +0 (after each optimizer step); in the sharded
        engine its master slices too, where they are not the parameters' storage."""
        for name, p in self.layers:
            if p.numel():  # ZeRO-3 leaves the parameters empty between uses
                p.masked_fill_(~self.masks[name], 0.0)
        if self.shards is not None and not self.shards.local_weights:
            self.shards.zero_masters({name: ~m for name, m in self.masks.items()})

    @torch.no_grad()
    def mask_gradients(self) -> None:
        """Masked gradient entries set to 0 (after backward, before clipping and the step): in
        the sharded engine, the reduced gradient's slices."""
        if self.shards is not None:
            self.shards.zero_gradients({name: ~m for name, m in self.masks.items()})
            return
        for name, p in self.layers:
            if p.grad is not None:
                p.grad.masked_fill_(~self.masks[name], 0.0)

    def dense_gradients(self) -> dict[str, torch.Tensor]:
        """Copies of the sparse layers' gradients before masking (RigL's growth scores): in
        the sharded engine, gathered from the reduced gradient's shards."""
        if self.shards is not None:
            return self.shards.whole("grad")
        return {name: p.grad.detach().clone() for name, p in self.layers}

    # --- mask updates ---
    def update_due(self, t: int) -> bool:
        """Whether the mask changes after optimizer step t (counted from 1)."""
        c = self.cfg
        if c.method == "prune":
            return c.start_step <= t <= self.end_step and (
                (t - c.start_step) % c.update_every == 0 or t == self.end_step)
        if c.method in ("set", "rigl"):
            return t < self.end_step and t % c.update_every == 0
        return False

    def needs_dense_gradient(self, t: int) -> bool:
        """RigL at its update steps: the step's gradient is wanted before masking."""
        return self.cfg.method == "rigl" and self.update_due(t)

    def fraction(self, t: int) -> float:
        """SET/RigL: the fraction of each layer's active weights swapped at step t."""
        if self.cfg.schedule == "constant":
            return self.cfg.alpha
        return cosine_fraction(t, self.cfg.alpha, self.end_step)

    def target_density(self, i: int, t: int) -> float:
        """Gradual pruning: layer i's density after step t on the cubic schedule."""
        return cubic_density(t, self.densities[i], self.cfg.start_step, self.end_step)

    @torch.no_grad()
    def update(self, t: int, dense_grads: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The method's mask update after step t (call when `update_due(t)`). New connections'
        weights are 0 and dropped ones are zeroed. Returns {name: positions of this rank's
        piece whose mask changed} for the layers whose whole mask changed; `version` moves if
        any did (on every rank alike: the decisions are the whole layers')."""
        changed, weights = {}, self._master_weights()
        for name, p in self.layers:
            pieces, old = self.pieces[name], self.masks[name]
            whole_old = pieces.whole(old)
            whole_new = self._updated(name, p, whole_old, t, dense_grads, weights)
            if not torch.equal(whole_new, whole_old):
                new = pieces.piece(whole_new)
                changed[name] = new ^ old
                self.masks[name] = new
        if changed:
            self.version += 1
            self.apply()
            for name, p in self.layers:
                if name in changed and p.numel():
                    p.masked_fill_(changed[name] & self.masks[name], 0.0)  # new connections
            if self.shards is not None and not self.shards.local_weights:
                self.shards.zero_masters({name: where & self.masks[name]
                                          for name, where in changed.items()})
        return changed

    def _updated(self, name: str, p: torch.Tensor, old: torch.Tensor, t: int,
                 dense_grads, weights) -> torch.Tensor:
        """Layer `name`'s whole new mask from its whole old one."""
        i = self.index[name]
        method, active, numel = self.cfg.method, int(old.sum()), old.numel()
        if method == "prune":
            keep = active_count(numel, self.target_density(i, t))
            return old if keep >= active else magnitude_mask(self._whole_weight(name, p, weights),
                                                             keep, allowed=old)
        k, weight = swap_count(active, numel, self.fraction(t)), self._whole_weight(name, p, weights)
        if method == "set":
            gen = torch.Generator(device=p.device).manual_seed(mix_seed(self.seed, _SET_STREAM, t, i))
            return set_update(weight, old, k, gen)
        assert dense_grads is not None, "RigL's update needs the step's dense gradients"
        return rigl_update(weight, old, k, self.pieces[name].whole(dense_grads[name]))

    @torch.no_grad()
    def reset_optimizer_state(self, optimizer: torch.optim.Optimizer,
                              changed: dict[str, torch.Tensor]) -> None:
        """Zero the optimizer's per-weight state (Adam's moments, SGD's momentum) where masks
        changed: a new connection starts without a dropped one's history, and masked
        positions keep zero state, so the optimizer moves no masked weight. In the sharded
        engine the state is its inner optimizer's, slice by slice."""
        if self.shards is not None:
            self.shards.reset_state(changed)
            return
        params = dict(self.layers)
        for name, where in changed.items():
            for value in optimizer.state.get(params[name], {}).values():
                if torch.is_tensor(value) and value.shape == where.shape:
                    value.masked_fill_(where, 0.0)

    # --- what is reported and saved ---
    def masks_by_param(self) -> dict[nn.Parameter, torch.Tensor]:
        return {p: self.masks[name] for name, p in self.layers}

    def kept_per_layer(self) -> tuple[list[int], list[int]]:
        """(kept weights, weights) of every layer of the whole model, summed over the ranks
        that hold its parts (collective over tp and pp on a split model)."""
        counts = torch.zeros((2, len(self.whole)), dtype=torch.float64)
        for name, mask in self.masks.items():
            if self.pieces[name].counted():
                counts[0, self.index[name]] = int(mask.sum())
                counts[1, self.index[name]] = 1.0  # the layer is held
        counts = whole_counts(counts.to(self._device()), self.mesh).cpu()
        held = [math.prod(shape) if counts[1, i] else 0 for i, (_, shape) in enumerate(self.whole)]
        return [int(k) for k in counts[0]], held

    def _device(self):
        return self.mesh.device if self.mesh is not None else torch.device("cpu")

    def density_per_layer(self) -> dict[str, float]:
        kept, numel = self.kept_per_layer()
        return {name: k / n for (name, _), k, n in zip(self.whole, kept, numel) if n}

    def density(self) -> float:
        """Kept weights over all weights of the sparse layers."""
        kept, numel = self.kept_per_layer()
        return sum(kept) / sum(numel)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{KEY + name: packed bits of the whole mask}, plus the version: the same on every
        rank that holds the layer (collective over tp on a split model)."""
        state = {KEY + name: pack_mask(self.pieces[name].whole(m)) for name, m in self.masks.items()}
        state["sparsity.version"] = torch.tensor(self.version, dtype=torch.int64)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, p in self.layers:
            whole = unpack_mask(state[KEY + name], self.whole[self.index[name]][1])
            self.masks[name] = self.pieces[name].piece(whole.to(p.device))
        self.version = int(state["sparsity.version"])
        self.apply()
