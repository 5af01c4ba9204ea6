"""Measured costs of every pipeline stage, for the memory-budgeted schedule (`schedule =
"optimal"`): each rank times its own stages on one micro-batch of random input, and the
figures are gathered over pp so that every rank plans with the same numbers. What is
measured: docs/pipeline.md, "Memory-budgeted schedule".
"""

from __future__ import annotations

import statistics
import time

import torch

from loomtrain import comm
from loomtrain.parallel.pipeline.offload import ActivationStash
from loomtrain.parallel.pipeline.runtime import DeferredWeightGrads

FIELDS = ("f", "b", "i", "w", "offload", "reload", "act", "input")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _measure_stage(module, x: torch.Tensor, repeats: int, store: DeferredWeightGrads,
                   device: torch.device, loss=None) -> list[float]:
    stash = ActivationStash(module.parameters(), device)
    times: dict[str, list[float]] = {k: [] for k in FIELDS[:6]}
    act = 0
    for r in range(repeats + 1):
        x_in = x.detach().requires_grad_(x.is_floating_point())
        for kind in ("b", "i"):
            key = (r, kind)
            t0 = time.perf_counter()
            with stash.saving(key):
                out = module(x_in)
                if loss is not None:  # the last stage: the loss is part of its forward
                    out = loss(out)
            times["f"].append(time.perf_counter() - t0)
            act = stash.live_bytes
            grad = torch.ones_like(out) / out.numel()
            if kind == "b":
                times["b"].append(_timed(lambda: torch.autograd.backward(out, grad)))
            else:
                def backward_input():
                    with store.deferring(key):
                        torch.autograd.backward(out, grad)
                times["i"].append(_timed(backward_input))
                times["w"].append(_timed(lambda: store.run(key)))
            times["offload"].append(_timed(lambda: (stash.offload(key), stash.wait(key))))
            times["reload"].append(_timed(lambda: (stash.reload(key), stash.wait(key))))
            stash.release(key)
    stash.close()
    module.zero_grad(set_to_none=True)
    median = {k: statistics.median(v[2:]) for k, v in times.items()}  # two per repeat
    input_bytes = x.numel() * x.element_size() if x.is_floating_point() else 0
    return [median[k] for k in FIELDS[:6]] + [float(act), float(input_bytes)]


def profile_stages(runtime, sample: torch.Tensor, loss=None, repeats: int = 3) -> list[dict[str, float]]:
    """[{field: value}] for every stage (all pp ranks' stages, in stage order); `loss(output)`
    ends the last stage's forward, as in training. Collective over pp; needs the runtime's
    stage modules to defer their linear weight gradients (zero-bubble's split), which
    `PipelineRuntime` sets up for every schedule that profiling serves."""
    mesh, stages = runtime.mesh, runtime.schedule.stages
    table = torch.zeros((stages, len(FIELDS)), dtype=torch.float64)
    for s, module in runtime.stages.items():
        if s == 0:
            x = sample
        else:
            shape, dtype = runtime.shapes[s - 1]
            x = torch.randn(shape, dtype=dtype, device=mesh.device)
        last = loss if s == stages - 1 else None
        table[s] = torch.tensor(_measure_stage(module, x, repeats, runtime.deferred, mesh.device, last))
    comm.all_reduce(table, mesh, "pp")  # each stage's row is filled on its own rank only
    return [dict(zip(FIELDS, row)) for row in table.tolist()]
