"""The one exchange LASP needs: every ring member's d x (d_v + 1) chunk states, to everyone.

Forward is an all-gather of the states over the ring's mesh axis (LASP-2, Sun et al., arXiv
2502.07563, section 3: one collective instead of LASP-1's N-1 sequential hops); its backward
is the adjoint, a reduce-scatter: member m's state was read by every later member, so its
gradient is the sum over members of their gradient for chunk m. Both move state-sized
tensors only, whatever the sequence length.
"""

from __future__ import annotations

import torch

from loomtrain import comm


class _GatherStates(torch.autograd.Function):
    """(*shape) on each member of `axis` -> (members, *shape) in the axis's group order."""

    @staticmethod
    def forward(ctx, state: torch.Tensor, mesh, axis: str) -> torch.Tensor:
        ctx.mesh, ctx.axis = mesh, axis
        state = state.contiguous()
        gathered = state.new_empty((mesh.size(axis), *state.shape))
        comm.all_gather(gathered, state, mesh, axis)
        return gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mine = grad.new_empty(grad.shape[1:])
        comm.reduce_scatter(mine, grad.contiguous(), ctx.mesh, ctx.axis)
        return mine, None, None


def gather_states(state: torch.Tensor, ring) -> torch.Tensor:
    """Every member's `state`, stacked in ring member order: (ring.size, *state.shape).

    The all-gather runs on the axis's process group, so the ring must span its axis (in any
    order); a ring over part of an axis would need a group of its own.
    """
    axis_size = ring.mesh.size(ring.axis)
    assert sorted(ring.members) == list(range(axis_size)), (
        f"LASP gathers over the whole {ring.axis!r} axis ({axis_size} ranks); ring members "
        f"{ring.members}")
    gathered = _GatherStates.apply(state, ring.mesh, ring.axis)
    return gathered[ring.members]  # group order -> member order (a gather: autograd scatters)
