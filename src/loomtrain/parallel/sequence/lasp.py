"""LASP: causal linear attention over a sequence split in contiguous chunks across a ring
(Sun et al., "Linear Attention Sequence Parallelism", arXiv 2404.02882; the states travel by
one all-gather as in LASP-2, arXiv 2502.07563).

Linear attention (models/linear_attention.py) sums everything before a token into a
d x (d_v + 1) state per head, so a member needs only the states of the members before it,
never their keys and values:

    member m holds tokens [s_m, e_m); L_m = its state: its last document's tokens,
        decayed to e_m - 1 (`chunk_state`)
    every L_m is all-gathered (lasp_comm.py; backward: reduce-scatter of their gradients)
    incoming_r = sum_{m<r} w_rm L_m,   w_rm = lambda^(s_r - e_m) if no member strictly
        between m and r holds a document start, else 0 (`carry_weights`)
    member r: its chunked attention with `incoming_r` carried into the tokens before its own
        first document start (`chunked_sums`), then numerator / denominator.

Communication per layer: (N-1) states out in forward and the reduce-scatter of N state
gradients in backward, b * heads * d * (d_v + 1) numbers each: independent of the sequence
length (LASP, section 3.3). Document starts are read from the full rows in `ctx.docs`, which
every member holds, so no flags travel.

Every member multiplies all N gathered states (the weights of later members are zero), so
the gathered tensor is in every member's graph and every member joins the backward
reduce-scatter, including member 0, which reads none of them.
"""

from __future__ import annotations

import torch

from loomtrain.models.linear_attention import (causal_linear_attention, chunk_state, chunked_sums,
                                               document_starts, log_decay_of, normalize,
                                               with_ones)
from loomtrain.parallel.sequence.context import SeqContext
from loomtrain.parallel.sequence.lasp_comm import gather_states


def carry_weights(lengths: list[int], resets: torch.Tensor, log_decay: torch.Tensor,
                  me: int) -> torch.Tensor:
    """(b, heads, members) weights of the members' states in what reaches member `me`.

    `lengths`: tokens per member; `resets` (b, members): whether a member's chunk holds a
    document start. Member m < me counts with lambda^(tokens strictly between m and me)
    unless a document starts in a member strictly between (m's own starts are already in
    L_m; me's own starts are applied to its tokens); members m >= me count 0.
    """
    b, members = resets.shape
    weights = torch.zeros(b, log_decay.shape[0], members, dtype=log_decay.dtype)
    for m in range(me):
        gap = sum(lengths[m + 1:me])
        alive = ~resets[:, m + 1:me].any(dim=1)
        weights[:, :, m] = torch.exp(gap * log_decay)[None, :] * alive[:, None]
    return weights


def _check_contiguous(ctx: SeqContext) -> None:
    whole = torch.cat(ctx.positions)
    assert torch.equal(whole, torch.arange(len(whole))), (
        "LASP needs the contiguous layout: member m holds positions [m T/n, (m+1) T/n)")


def lasp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: SeqContext,
                   decay: torch.Tensor | None = None, chunk: int = 64) -> torch.Tensor:
    """Causal linear attention of this member's (b, heads, t_local, d) feature-mapped queries
    and keys (phi already applied) and values, over the whole rows of `ctx`.

    `decay`: (heads,) lambda_h in (0, 1], or None. Without a ring, the local chunked kernel.
    """
    mine = ctx.local_positions
    assert q.shape[2] == len(mine), f"{q.shape[2]} local tokens, the context says {len(mine)}"
    docs = None if ctx.docs is None else ctx.docs.to(q.device)
    if ctx.ring is None:
        assert ctx.members == 1, "a context without a ring holds whole rows"
        local_docs = None if docs is None else docs[:, mine]
        return causal_linear_attention(q, k, v, decay, local_docs, chunk)
    _check_contiguous(ctx)
    assert ctx.me == ctx.ring.me, f"context member {ctx.me}, ring member {ctx.ring.me}"
    b = q.shape[0]
    log_decay = log_decay_of(decay, q.shape[1], q.device)
    v_ones = with_ones(v)
    if docs is None:
        starts, resets = None, torch.zeros(b, ctx.members, dtype=torch.bool)
    else:
        every_start = document_starts(docs)
        starts = every_start[:, mine.to(q.device)]
        resets = torch.stack([every_start[:, p.to(q.device)].any(dim=1) for p in ctx.positions], 1)
    states = gather_states(chunk_state(k, v_ones, log_decay, starts), ctx.ring)
    weights = carry_weights([len(p) for p in ctx.positions], resets.cpu(), log_decay.cpu(), ctx.me)
    incoming = torch.einsum("bhm,mbhde->bhde", weights.to(q.device, q.dtype), states)
    return normalize(chunked_sums(q, k, v_ones, log_decay, starts, chunk, incoming))
