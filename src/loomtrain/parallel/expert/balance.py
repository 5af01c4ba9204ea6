"""What the routers saw in a step, agreed over the ranks, and what follows from it: the
per-expert load, its imbalance, the balance loss (models/moe.py) and DeepSeek-V3's
auxiliary-loss-free bias update (arXiv 2412.19437, section 2.1.2: after each step every
expert's bias moves by `rate` towards the mean load, b_i += rate * sign(mean - load_i))."""

from __future__ import annotations

import re

import torch

from loomtrain import comm
from loomtrain.models.moe import MoE, moe_blocks


def token_axes(mesh, parallel) -> tuple[str, ...]:
    """The axes whose ranks route different tokens, so their counts add up to the step's
    (`parallel`: the [parallel] keys): dp, with cp, which splits every row (the "dpcp"
    group), and tp under sequence parallelism, where each tp rank routes its piece of every
    sequence (without it the tp ranks route the same tokens)."""
    tokens = ("dpcp" if mesh.size("cp") > 1 else "dp",)
    return (*tokens, "tp") if parallel.sequence_parallel and mesh.size("tp") > 1 else tokens


# the axes whose ranks hold different blocks (the pipeline's stages): each rank fills its own
# blocks' rows of the step's table and leaves the others' zero, so the sum holds every block
BLOCK_AXES = ("pp",)


def moe_layers(model: torch.nn.Module) -> list[MoE]:
    """The model's mixture-of-experts feed-forwards, in order (a pipeline stage's own)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_rows(model: torch.nn.Module, cfg) -> list[int]:
    """The row of each of `moe_layers(model)` among all the MoE blocks of the model `cfg`
    describes, in block order: a pipeline stage holds some of the blocks, under their names
    in the whole model (`blocks.3.mlp`, parallel/pipeline/split.py)."""
    blocks = moe_blocks(cfg)
    names = [name for name, m in model.named_modules() if isinstance(m, MoE)]
    return [blocks.index(int(re.search(r"blocks\.(\d+)\.mlp$", name)[1])) for name in names]


def set_aux_grad(layers: list[MoE], coef: float, loss_tokens: float) -> None:
    """The balance loss's gradient per token of a sequence this step: the loss enters the
    objective as coef * (sequence loss) * (its tokens), divided as the cross-entropy is."""
    for layer in layers:
        layer.aux_grad = coef / loss_tokens


def step_figures(layers: list[MoE], rows: list[int], cfg, mesh,
                 axes: tuple[str, ...]) -> torch.Tensor | None:
    """[MoE blocks of the model `cfg` describes, experts + 2]: each block's picks per expert,
    balance-loss sum and sequences over the step on every rank (one all-reduce per token axis
    of `axes`, `token_axes`, and per block axis); the counts of this rank's `layers` (the
    table's `rows`) reset. None without MoE blocks. Under sequence parallelism every tp rank
    counts each sequence and its loss once: the sums over tp hold both tp times, their ratio
    the mean."""
    blocks = len(moe_blocks(cfg))
    if not blocks:
        return None
    seen = torch.zeros(blocks, cfg.n_experts + 2, dtype=torch.float64, device=mesh.device)
    if layers:  # a pipeline stage may hold dense blocks only
        seen[rows] = torch.stack([_take(layer) for layer in layers])
    for axis in (*axes, *BLOCK_AXES):
        comm.all_reduce(seen, mesh, axis)
    return seen


def _take(layer: MoE) -> torch.Tensor:
    counted = layer.counted
    layer.counted = None
    if counted is None:  # no backward reached it (a step skipped in its forward): nothing seen
        return torch.zeros(layer.n_experts + 2, dtype=torch.float64,
                           device=layer.router.expert_bias.device)
    return counted


@torch.no_grad()
def update_bias(layers: list[MoE], seen: torch.Tensor, rate: float) -> None:
    """b_i += rate * sign(mean load - load_i), per layer, from the step's global counts."""
    for layer, row in zip(layers, seen):
        load = row[:layer.n_experts]
        step = rate * torch.sign(load.mean() - load)
        bias = layer.router.expert_bias
        bias += step.to(bias)


def figures(seen: torch.Tensor) -> dict:
    """The metrics of a step: tokens per expert (each layer's list), the load imbalance (the
    busiest expert's load over the mean, the worst layer's) and the balance loss (per
    sequence, averaged over the layers)."""
    loads = seen[:, :-2]
    imbalance = (loads.max(1).values / loads.mean(1).clamp_min(1e-12)).max()
    aux = (seen[:, -2] / seen[:, -1].clamp_min(1)).mean()
    return {"moe_tokens_per_expert": [[int(c) for c in row] for row in loads.tolist()],
            "moe_load_imbalance": round(float(imbalance), 6),
            "moe_aux_loss": round(float(aux), 6)}
