"""The communication expert parallelism needs (parallel/expert/dispatch.py), over the mesh's
"ep" axis: the row counts each member sends to each other, and the rows themselves in uneven
chunks, through autograd (the backward of an all-to-all is the all-to-all with the splits
swapped, as Megatron-Core's `all_to_all` autograd function does)."""

from __future__ import annotations

import torch

from loomtrain import comm


def exchange_counts(sent: torch.Tensor, mesh) -> torch.Tensor:
    """`sent` [ep, n]: the rows this rank sends to member j for each of its n experts ->
    [ep, n]: the rows member j sends this rank for each of this rank's experts."""
    received = torch.empty_like(sent)
    comm.all_to_all(received, sent.contiguous(), mesh, "ep")
    return received


def exchange_rows(rows: torch.Tensor, sent: list[int], received: list[int], mesh) -> torch.Tensor:
    """`sent[j]` rows of `rows` to member j, `received[j]` rows from it, with autograd."""
    return _AllToAll.apply(rows, sent, received, mesh)


def _all_to_all(rows: torch.Tensor, sent: list[int], received: list[int], mesh) -> torch.Tensor:
    out = rows.new_empty((sum(received), *rows.shape[1:]))
    comm.all_to_all_uneven(out, rows.contiguous(), received, sent, mesh, "ep")
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, sent, received, mesh):
        ctx.sent, ctx.received, ctx.mesh = sent, received, mesh
        return _all_to_all(rows, sent, received, mesh)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.received, ctx.sent, ctx.mesh), None, None, None


__all__ = ["exchange_counts", "exchange_rows"]
