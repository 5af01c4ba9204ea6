"""Tensor parallelism over the mesh's `tp` axis, Megatron-style (Shoeybi et al., arXiv
1909.08053): a column-parallel linear layer keeps a slice of the output features, a
row-parallel one a slice of the input features, and a pair of them (attention's qkv and proj,
the MLP's fc and proj) costs one all-reduce in forward and one in backward.

    x ─ copy ─ column(W1[rows_r]) ─ act ─ row(W2[:, cols_r]) ─ reduce ─ + b2
        (identity forward, all-reduce of the input gradient backward)   (all-reduce forward)

Everything outside the pairs (layer norms, embeddings, the biases added after a reduce) is
replicated on the tp ranks; their inputs and the gradients reaching them are the same on
every tp rank (the all-reduces make them so), so their gradients agree without any sync.

Status (issue 4, first increment): the linear layers, the GPT's attention and MLP, and
user plans that name column/row submodules. Not yet: vocab-parallel embedding and
cross-entropy, sequence parallelism, the trainer's `parallel.tp`, decoding.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn as nn
import torch.nn.functional as F

from loomtrain import comm


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (Megatron's `f`)."""

    @staticmethod
    def forward(ctx, x, mesh, axis):
        ctx.mesh, ctx.axis = mesh, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, ctx.mesh, ctx.axis)
        return grad, None, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward (Megatron's `g`)."""

    @staticmethod
    def forward(ctx, x, mesh, axis):
        out = x.contiguous().clone()
        comm.all_reduce(out, mesh, axis)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _split(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what} = {n} is not divisible by the tensor-parallel size {parts}; "
                         f"choose parallel.tp among the divisors of {n}")
    return n // parts


class ColumnParallelLinear(nn.Module):
    """The rows `rows` (output features) of `linear`; the input is replicated."""

    def __init__(self, linear: nn.Linear, rows: torch.Tensor, mesh, axis: str = "tp"):
        super().__init__()
        self.mesh, self.axis = mesh, axis
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[rows].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToTP.apply(x, self.mesh, self.axis), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """The columns `cols` (input features) of `linear`; the partial outputs are all-reduced,
    then the (replicated) bias is added once."""

    def __init__(self, linear: nn.Linear, cols: torch.Tensor, mesh, axis: str = "tp"):
        super().__init__()
        self.mesh, self.axis = mesh, axis
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromTP.apply(F.linear(x, self.weight), self.mesh, self.axis)
        return y if self.bias is None else y + self.bias


def _contiguous(n: int, rank: int, parts: int, what: str) -> torch.Tensor:
    size = _split(n, parts, what)
    return torch.arange(rank * size, (rank + 1) * size)


def _qkv_rows(d_model: int, n_heads: int, rank: int, parts: int) -> torch.Tensor:
    """My heads' rows of a fused [q; k; v] projection: the same head range in each third."""
    _split(n_heads, parts, "the number of attention heads")
    mine = _contiguous(d_model, rank, parts, "d_model")
    return torch.cat([mine + j * d_model for j in range(3)])


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def parallelize_tensor(model: nn.Module, mesh, plan: dict[str, str] | None = None,
                       axis: str = "tp") -> nn.Module:
    """Split `model` over the `axis` ranks in place and return it.

    Without `plan` the model must be loomtrain's GPT: every block's attention (heads split)
    and MLP become column/row pairs. A `plan` maps module-name patterns (fnmatch) to
    "column" or "row" for any model whose nn.Linear layers pair up that way (a column layer's
    output features, a row layer's input features split in contiguous ranges); the model's
    own code must work on the local widths.
    """
    parts, rank = mesh.size(axis), mesh.local_rank(axis)
    if parts == 1:
        return model
    if plan is None:
        from loomtrain.models.gpt import GPT
        if not isinstance(model, GPT):
            raise ValueError(f"parallelize_tensor needs a plan for {type(model).__name__} "
                             "(names of its column- and row-parallel nn.Linear layers)")
        for block in model.blocks:
            attn, mlp = block.attn, block.mlp
            d = attn.proj.in_features
            attn.qkv = ColumnParallelLinear(attn.qkv, _qkv_rows(d, attn.n_heads, rank, parts),
                                            mesh, axis)
            attn.proj = RowParallelLinear(attn.proj, _contiguous(d, rank, parts, "d_model"),
                                          mesh, axis)
            attn.n_heads //= parts
            hidden = mlp.fc.out_features
            mine = _contiguous(hidden, rank, parts, "the MLP's hidden width")
            mlp.fc = ColumnParallelLinear(mlp.fc, mine, mesh, axis)
            mlp.proj = RowParallelLinear(mlp.proj, mine, mesh, axis)
        return model
    for kind in plan.values():
        if kind not in ("column", "row"):
            raise ValueError(f"tensor-parallel plan: {kind!r} is not 'column' or 'row'")
    for name, module in list(model.named_modules()):
        kind = next((k for pattern, k in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if kind is None:
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(f"tensor-parallel plan: {name} is a {type(module).__name__}, "
                             "not an nn.Linear")
        if kind == "column":
            rows = _contiguous(module.out_features, rank, parts, f"{name}.out_features")
            _set(model, name, ColumnParallelLinear(module, rows, mesh, axis))
        else:
            cols = _contiguous(module.in_features, rank, parts, f"{name}.in_features")
            _set(model, name, RowParallelLinear(module, cols, mesh, axis))
    return model


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "parallelize_tensor"]
