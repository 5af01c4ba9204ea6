"""LASP: causal linear attention over a sequence split in contiguous chunks across a ring (Sun
et al., "Linear Attention Sequence Parallelism", arXiv 2404.02882; the states travel by one
all-gather as in LASP-2, arXiv 2502.07563). Only each member's d x (d_v + 1) state travels,
whatever the sequence length. The formulas: docs/sequence.md, "LASP".
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
