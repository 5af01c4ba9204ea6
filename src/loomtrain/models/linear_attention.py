"""Causal linear attention (Katharopoulos et al., "Transformers are RNNs", arXiv 2006.16236),
with an optional per-head decay (RetNet, Sun et al., arXiv 2307.08621) and packed documents.

Computed in chunks (RetNet's chunkwise form) with a d x (d_v + 1) state carried between them;
`chunk_state` and `chunked_sums` are what LASP composes across ranks. The formulas:
docs/sequence.md, "Linear attention, chunkwise".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1 > 0 (Katharopoulos et al., eq. 7): every weight, and so every
    denominator, is positive."""
    return F.elu(x) + 1


def default_decay(n_heads: int) -> torch.Tensor:
    """RetNet's per-head decays lambda_h = 1 - 2^(-5-h) (Sun et al., section 2.2): head 0
    forgets fastest (~1/32 per token), later heads keep longer context."""
    return 1 - 2.0 ** (-5 - torch.arange(n_heads, dtype=torch.float32))


def with_ones(v: torch.Tensor) -> torch.Tensor:
    """[v, 1]: the last column of any weighted sum of these rows is the sum of the weights."""
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


def normalize(sums: torch.Tensor) -> torch.Tensor:
    """The numerator columns over the denominator (the last column)."""
    return sums[..., :-1] / sums[..., -1:]


def log_decay_of(decay: torch.Tensor | None, heads: int, device) -> torch.Tensor:
    """log lambda_h in fp64 (powers are taken as exp(n log lambda), in fp32 or better: a bf16
    lambda^n would be off by percents); zeros for no decay, so every factor is exactly 1."""
    if decay is None:
        return torch.zeros(heads, dtype=torch.float64, device=device)
    assert decay.shape == (heads,), f"decay of shape {tuple(decay.shape)} for {heads} heads"
    return decay.detach().double().log()


def _powers(log_decay: torch.Tensor, exponents: torch.Tensor, dtype) -> torch.Tensor:
    """lambda_h^n as (heads, *exponents.shape); exponents must be >= 0 where used."""
    shape = (-1,) + (1,) * exponents.dim()
    work = torch.promote_types(dtype, torch.float32)
    return torch.exp(log_decay.to(work).view(shape) * exponents.to(work)).to(dtype)


def document_starts(docs: torch.Tensor) -> torch.Tensor:
    """(b, t) bool, True where a document begins (position 0, and wherever the id changes)."""
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    # the recurrent state forgets a document at its end; an id that returned later would be
    # "the same document" to the quadratic form but not to the state
    runs = starts.sum(dim=1)
    distinct = torch.tensor([row.unique().numel() for row in docs], device=docs.device)
    assert bool((runs == distinct).all()), "a document id appears in two separate runs of a row"
    return starts


def naive_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           decay: torch.Tensor | None = None,
                           docs: torch.Tensor | None = None) -> torch.Tensor:
    """The quadratic form, the reference: the explicit t x t weight matrix
    W_ij = (q_i.k_j) lambda^(i-j) for j <= i in the same document, 0 elsewhere."""
    t = q.shape[2]
    pos = torch.arange(t, device=q.device)
    visible = pos[None, :] <= pos[:, None]
    if docs is not None:
        visible = visible[None] & (docs[:, :, None] == docs[:, None, :])  # (b, t, t)
    distance = (pos[:, None] - pos[None, :]).clamp(min=0)
    decay_matrix = _powers(log_decay_of(decay, q.shape[1], q.device), distance, q.dtype)
    weights = (q @ k.transpose(-2, -1)) * decay_matrix * visible.unsqueeze(-3)
    return normalize(weights @ with_ones(v))


def chunk_state(k: torch.Tensor, v_ones: torch.Tensor, log_decay: torch.Tensor,
                starts: torch.Tensor | None = None) -> torch.Tensor:
    """S = sum_j lambda^(t-1-j) k_j v_ones_j^T over the tokens of the last document of these
    t tokens (those after its last start), decayed to the last token: (b, heads, d, d_v + 1)."""
    t = k.shape[2]
    to_end = torch.arange(t - 1, -1, -1, device=k.device)
    weights = _powers(log_decay, to_end, k.dtype)[None]  # (1, heads, t)
    if starts is not None:
        # starts at or after j, minus j's own: 0 exactly for the last document's tokens
        later = starts.flip(1).cumsum(1).flip(1) - starts.long()
        weights = weights * (later == 0)[:, None, :]
    return (k * weights[..., None]).transpose(-2, -1) @ v_ones


def chunked_sums(q: torch.Tensor, k: torch.Tensor, v_ones: torch.Tensor,
                 log_decay: torch.Tensor, starts: torch.Tensor | None = None, chunk: int = 64,
                 state: torch.Tensor | None = None) -> torch.Tensor:
    """Unnormalized [numerator, denominator] sums (b, heads, t, d_v + 1), chunk by chunk.

    `state` (b, heads, d, d_v + 1): what earlier tokens (of the document that the first of
    these tokens continues) contribute, decayed to the token before the first; it reaches the
    tokens before the first document start in `starts`. None: nothing before.
    """
    b, heads, t, d = q.shape
    if state is None:
        state = q.new_zeros(b, heads, d, v_ones.shape[-1])
    # offsets inside a chunk are the same in every chunk: decays for a full one, sliced for
    # the last, shorter one
    pos = torch.arange(min(chunk, t), device=q.device)
    causal = pos[None, :] <= pos[:, None]
    intra_decay = _powers(log_decay, (pos[:, None] - pos[None, :]).clamp(min=0), q.dtype)
    carry_decay = _powers(log_decay, pos + 1, q.dtype)[None, :, :, None]  # lambda^(i-s+1)
    out = []
    for s in range(0, t, chunk):
        e = min(s + chunk, t)
        n = e - s
        qc, kc, vc = q[:, :, s:e], k[:, :, s:e], v_ones[:, :, s:e]
        sc = None if starts is None else starts[:, s:e]
        visible = causal[:n, :n]
        # the carried state reaches the chunk's tokens before its first document start
        continues = torch.ones(1, n, dtype=torch.bool, device=q.device)
        if sc is not None:
            segment = sc.cumsum(1)  # document index inside the chunk (0: the carried one)
            visible = visible[None] & (segment[:, :, None] == segment[:, None, :])
            continues = segment == 0
        intra = ((qc @ kc.transpose(-2, -1)) * intra_decay[:, :n, :n] * visible.unsqueeze(-3)) @ vc
        carried = (qc @ state) * (carry_decay[:, :, :n] * continues[:, None, :, None])
        out.append(intra + carried)
        if e < t:
            keep = _powers(log_decay, torch.tensor(n, device=q.device), q.dtype).view(1, -1, 1, 1)
            if sc is not None:
                keep = keep * (~sc.any(1)).view(-1, 1, 1, 1)  # a start in the chunk: forget
            state = chunk_state(kc, vc, log_decay, sc) + keep * state
    return torch.cat(out, dim=2)


def causal_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            decay: torch.Tensor | None = None, docs: torch.Tensor | None = None,
                            chunk: int = 64) -> torch.Tensor:
    """The chunked form used for training; equal to `naive_linear_attention` up to rounding."""
    assert chunk >= 1, f"chunk={chunk}"
    starts = None if docs is None else document_starts(docs)
    log_decay = log_decay_of(decay, q.shape[1], q.device)
    return normalize(chunked_sums(q, k, with_ones(v), log_decay, starts, chunk))
