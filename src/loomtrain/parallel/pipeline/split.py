"""The model cut into pipeline stages: a sequence of layers, split into contiguous runs that
minimize the largest stage cost (the linear-partition problem, solved exactly by dynamic
programming). How a model is seen as layers, and where tied parameters live:
docs/pipeline.md, "The model as layers, cut into stages".
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn as nn

from loomtrain import comm
from loomtrain.models import GPT, MLP, Llama
from loomtrain.parallel.pipeline.hf_layers import hf_layers
from loomtrain.parallel.pipeline.layer import Layer


def layers_of(model: nn.Module) -> list[Layer]:
    """The model as a sequence of layers (docs/pipeline.md)."""
    if isinstance(model, (GPT, MLP, Llama)):
        embed = (Layer("embed", ("tok_emb", "pos_emb", "drop"), lambda m, x: m.embed(x))
                 if isinstance(model, GPT) else Layer("embed", ("tok_emb",), lambda m, x: m.tok_emb(x)))
        blocks = [Layer(f"blocks.{i}", (f"blocks.{i}",), _block(i)) for i in range(len(model.blocks))]
        head = Layer("head", ("ln_f", "head"), lambda m, x: m.head(m.ln_f(x)))
        return [embed, *blocks, head]
    if isinstance(model, nn.Sequential):
        return [Layer(name, (name,), lambda m, x, name=name: m._modules[name](x))
                for name in model._modules]
    if hasattr(model, "pipeline_layers"):
        return list(model.pipeline_layers())
    found = hf_layers(model)
    if found is not None:
        return found
    raise TypeError(f"cannot split a {type(model).__name__} into pipeline stages: give an "
                    "nn.Sequential, a Hugging Face decoder (Llama-style or GPT-2), or define "
                    "pipeline_layers() returning its Layer sequence")


def _block(i: int):
    """Block i as a layer; the llama's rotation takes the model's `position_ids` (the global
    positions of this rank's tokens under context parallelism; None: 0..t-1)."""
    def run(m, x):
        if isinstance(m, Llama):
            return m.blocks[i](x, None, m.position_ids)
        return m.blocks[i](x)
    return run


def balance(costs: list[float], k: int) -> list[int]:
    """Start indices of `k` contiguous, non-empty groups of `costs` with the smallest largest
    group sum (ties: the earliest cut). Returns k + 1 bounds, the last being len(costs)."""
    n = len(costs)
    if not 1 <= k <= n:
        raise ValueError(f"cannot cut {n} layers into {k} non-empty pipeline stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[j][i]: smallest largest sum cutting the first i layers into j groups
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for c in range(j - 1, i):
                value = max(best[j - 1][c], prefix[i] - prefix[c])
                if value < best[j][i] - 1e-12:
                    best[j][i], cut[j][i] = value, c
    bounds, i = [n], n
    for j in range(k, 0, -1):
        i = cut[j][i]
        bounds.append(i)
    return bounds[::-1]


def parameter_costs(model: nn.Module, layers: list[Layer]) -> list[float]:
    """Parameters each layer computes with (a tied one counts in every layer using it: each
    stage holding it stores it)."""
    modules = dict(model.named_modules())
    costs = []
    for layer in layers:
        params = {id(p): p.numel() for path in layer.owns for p in modules[path].parameters()}
        costs.append(float(sum(params.values())))
    return costs


def measured_costs(model: nn.Module, layers: list[Layer], sample: torch.Tensor,
                   repeats: int = 3) -> list[float]:
    """Each layer's forward plus backward seconds on `sample` (the first layer's input), the
    median of `repeats` after one warm-up. The caller averages them over ranks, so that every
    rank cuts the model at the same points."""
    inputs, x = [], sample
    with torch.no_grad():
        for layer in layers:
            inputs.append(x)
            x = layer.run(model, x)
    costs = []
    for layer, x in zip(layers, inputs):
        times = []
        for _ in range(repeats + 1):
            x_in = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            y = layer.run(model, x_in)
            y.float().square().mean().backward()
            times.append(time.perf_counter() - t0)
        costs.append(sorted(times[1:])[len(times[1:]) // 2])
    model.zero_grad(set_to_none=True)
    return costs


def stage_shapes(model: nn.Module, layers: list[Layer], bounds: list[int],
                 sample: torch.Tensor) -> list[tuple[torch.Size, torch.dtype]]:
    """(shape, dtype) of every stage's output for an input like `sample`, found on the meta
    device (no compute, no memory). A layer the meta device cannot run (one reading values:
    `.item()`, `torch.nonzero`, as a Hugging Face mixture of experts' routing does) raises
    there; the shapes then come from running the layers on `sample` itself (`_real_shapes`)."""
    try:
        return _shapes(copy.deepcopy(model).to("meta"), layers, bounds, sample.to("meta"))
    except (NotImplementedError, RuntimeError):
        return _real_shapes(model, layers, bounds, sample)


def _shapes(model: nn.Module, layers: list[Layer], bounds: list[int],
            x: torch.Tensor) -> list[tuple[torch.Size, torch.dtype]]:
    out = []
    with torch.no_grad(), comm.shapes_only():
        for i, layer in enumerate(layers):
            x = layer.run(model, x)
            if i + 1 in bounds[1:]:
                out.append((x.shape, x.dtype))
    return out


def _real_shapes(model: nn.Module, layers: list[Layer], bounds: list[int],
                 sample: torch.Tensor) -> list[tuple[torch.Size, torch.dtype]]:
    """The stage shapes from one real forward of `sample` on the model's device. A model still
    on the meta device runs as an uninitialized copy on the CPU (the values are garbage, the
    shapes are not; it costs the whole model's memory once, on every rank)."""
    if any(p.is_meta for p in model.parameters()):
        model = copy.deepcopy(model).to_empty(device="cpu")
    device = next(model.parameters(), sample).device
    return _shapes(model, layers, bounds, sample.to(device))


def shared_parameters(model: nn.Module, layers: list[Layer], bounds: list[int],
                      pp: int) -> dict[str, list[int]]:
    """{parameter name: the pp ranks holding it} for parameters that layers on more than one
    rank use (the GPT's tied embedding and head), under the parameter's first name."""
    modules = dict(model.named_modules())
    names = {id(p): n for n, p in model.named_parameters()}
    ranks: dict[str, set[int]] = {}
    for s in range(len(bounds) - 1):
        for layer in layers[bounds[s]:bounds[s + 1]]:
            for path in layer.owns:
                for p in modules[path].parameters():
                    ranks.setdefault(names[id(p)], set()).add(s % pp)
    return {n: sorted(r) for n, r in ranks.items() if len(r) > 1}


class PipelineModule(nn.Module):
    """This rank's stages of `model`: `forward(x, stage)` runs stage `stage` (one of
    `self.stages`). The model's children are registered here under their own names, less the
    modules of layers on other ranks, so parameter names are the single-process ones.
    `stage_modules()` gives the runtime its stage modules."""

    def __init__(self, model: nn.Module, layers: list[Layer], bounds: list[int], stages: list[int]):
        super().__init__()
        self.layers, self.bounds, self.stages = layers, bounds, list(stages)
        kept = {path for s in stages for layer in layers[bounds[s]:bounds[s + 1]] for path in layer.owns}
        dropped = {path for layer in layers for path in layer.owns} - kept
        for path in sorted(dropped, key=lambda p: -p.count(".")):  # inner modules first
            parent, _, name = path.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            owner._modules[name] = None  # named_children, state_dict, parameters skip it
        for name, child in model._modules.items():
            self._modules[name] = child
        for name, p in model._parameters.items():
            self._parameters[name] = p
        # layers run on it; not registered (no "whole." names), and not named "model", the
        # name of a Hugging Face decoder's inner model, a child registered here
        self.__dict__["whole"] = model

    def forward(self, x: torch.Tensor, stage: int) -> torch.Tensor:
        for layer in self.layers[self.bounds[stage]:self.bounds[stage + 1]]:
            x = layer.run(self.whole, x)
        return x

    def stage_modules(self) -> dict[int, "PipelineStage"]:
        """{stage: a module whose forward(x) runs it} for this rank's stages: the pipeline
        runtime's input (runtime.py)."""
        return {s: PipelineStage(self, s) for s in self.stages}


class PipelineStage(nn.Module):
    """One stage of a PipelineModule as a module of its own. Its forward runs the stage
    through the PipelineModule, so hooks a dp engine put on that one (ZeRO's) fire as they do
    for the PipelineModule's own calls; its parameters are the stage's layers', under their
    single-process names (`blocks.3.attn.qkv.weight`): the modules themselves, shared with
    the PipelineModule (mounted on empty containers, so another stage's blocks stay out)."""

    def __init__(self, owner: PipelineModule, stage: int):
        super().__init__()
        self.__dict__["owner"] = owner  # not registered: its other stages are not this one's
        self.stage = stage
        layers = owner.layers[owner.bounds[stage]:owner.bounds[stage + 1]]
        mounted: set[str] = set()
        for path in sorted({p for layer in layers for p in layer.owns}, key=lambda p: p.count(".")):
            *parents, leaf = path.split(".")
            if any(".".join(parents[:i]) in mounted for i in range(1, len(parents) + 1)):
                continue  # an enclosing module is mounted already and holds this one
            container = self
            for name in parents:
                container = container._modules.setdefault(name, nn.Module())
            container._modules[leaf] = owner.get_submodule(path)
            mounted.add(path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.owner(x, self.stage)
