"""Dynamic hybrid data x context parallelism, the running part (`data.balance = true`): this
rank keeps the tokens of its shares as one row, attends whole documents locally and split
ones by ring attention, all of a layer's rings in one order on every rank. Details:
docs/sequence.md, "Dynamic hybrid dp x cp" and "Dealing documents".
"""

from __future__ import annotations

import torch

from loomtrain.models import IGNORE_INDEX
from loomtrain.parallel.sequence.context import Ring, SeqContext, SharedRows
from loomtrain.parallel.sequence.hybrid import dp_imbalance, plan_shares, zigzag_split
from loomtrain.parallel.sequence.ring import _backward, _forward
from loomtrain.parallel.sequence.runtime import attention_modules, local_attention


class _Rings(torch.autograd.Function):
    """Ring attention of every split piece of one layer, pieces in segment order."""

    @staticmethod
    def forward(fctx, q, k, v, pieces):
        outs, lses = [], []
        for part, seq in pieces:
            out, lse = _forward(q[..., part, :], k[..., part, :], v[..., part, :], seq)
            outs.append(out)  # fp32, for backward
            lses.append(lse)
        fctx.pieces = pieces
        fctx.save_for_backward(q, k, v, *outs, *lses)
        return tuple(out.to(q.dtype) for out in outs)

    @staticmethod
    def backward(fctx, *douts):
        q, k, v, *rest = fctx.saved_tensors
        n = len(fctx.pieces)
        outs, lses = rest[:n], rest[n:]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (part, seq), dout, out, lse in zip(fctx.pieces, douts, outs, lses):
            g = _backward(dout, q[..., part, :], k[..., part, :], v[..., part, :], out, lse, seq)
            dq[..., part, :], dk[..., part, :], dv[..., part, :] = g
        return dq, dk, dv, None


class HybridRuntime:
    """The pool's shares of each micro-step, and the attention core that runs them."""

    def __init__(self, model, mesh, attention: str):
        if attention != "softmax":
            raise ValueError("data.balance splits long documents with ring attention: softmax only")
        # the model whose embedding reads `position_ids`: the whole model under a pipeline
        self.model, self.mesh = getattr(model, "whole", model), mesh
        self.pool, self.me = mesh.size("dpcp"), mesh.local_rank("dpcp")
        self.imbalance = self.dp_imbalance = 0.0
        self.whole: list[slice] = []  # local token ranges of whole documents
        self.split: list[tuple[slice, SeqContext]] = []  # and of split ones, with their ring
        self.rows: SharedRows | None = None  # the pool's rows, which the deal spreads
        modules = attention_modules(model)
        self.window = max((getattr(m, "window", 0) for m in modules), default=0)  # runtime.py
        for module in modules:
            module.core = self.attend

    def shard(self, x: torch.Tensor, y: torch.Tensor, docs: torch.Tensor):
        """This rank's tokens of the pool's rows `x`, `y`, `docs` (rows, T), as one row."""
        segs, shares, plan = plan_shares(docs.cpu(), self.pool)
        self.imbalance = plan.imbalance
        self.dp_imbalance = dp_imbalance(docs.cpu(), self.pool)
        rows, cols, valid = [], [], []
        self.whole, self.split = [], []
        for share in shares[self.me]:
            seg, start = segs[share.segment], len(rows)
            pad = share.padded - len(share.positions)
            rows += [seg.row] * share.padded
            cols += [seg.start + p for p in share.positions] + [seg.start] * pad
            valid += [True] * len(share.positions) + [False] * pad
            span = slice(start, len(rows))
            if len(share.members) == 1:
                self.whole.append(span)
                continue
            n = len(share.members)
            positions = []  # pads sit beyond the document: no real query sees them
            for m in range(n):
                own = zigzag_split(seg.length, n, m)
                positions.append(torch.tensor(own + list(range(seg.length, seg.length + share.padded - len(own)))))
            ring = Ring(self.mesh, "dpcp", list(share.members))
            self.split.append((span, SeqContext(positions, ring.me, None, ring, self.window)))
        index = (torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long))
        keep = torch.tensor(valid, dtype=torch.bool)
        real = keep.nonzero().view(-1)  # the local tokens that are not padding
        self.rows = SharedRows(self.mesh, "dpcp", x.shape[0], x.shape[1], real.to(x.device),
                               index[0][real].to(x.device))
        self.model.position_ids = index[1].to(x.device)
        local_y = torch.where(keep.to(y.device), y[index], torch.full_like(y[index], IGNORE_INDEX))
        return x[index][None], local_y[None]

    def context_state(self) -> tuple:
        """What the last `shard` set: its documents' local ranges, rings, rows and positions."""
        return self.whole, self.split, self.rows, self.model.position_ids

    def restore(self, state: tuple) -> None:
        """Back to a `context_state()`: a pipeline runs micro-batches sharded earlier, each
        stage with the same deal (every stage of a pool rank deals the same rows alike)."""
        self.whole, self.split, self.rows, self.model.position_ids = state

    def shared_rows(self) -> SharedRows:
        """How the last deal spread the pool's rows: their real tokens, in one local row."""
        return self.rows

    def attend(self, q, k, v):
        """Whole documents by SDPA, split ones by the layer's rings; outputs in local order."""
        outs = {}
        for span in self.whole:
            whole = SeqContext.local(span.stop - span.start, window=self.window)
            outs[span.start] = local_attention(q[..., span, :], k[..., span, :], v[..., span, :],
                                               whole)
        if self.split:
            for (span, _), out in zip(self.split, _Rings.apply(q, k, v, self.split)):
                outs[span.start] = out
        return torch.cat([outs[start] for start in sorted(outs)], dim=-2)
