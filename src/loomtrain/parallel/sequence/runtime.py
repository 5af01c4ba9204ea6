"""The sequence runtime: what `apply_sequence` leaves on the model. `shard` keeps this rank's
positions of each micro-batch's full rows under the method's layout and records the batch's
SeqContext for the attention kernels; everything outside attention runs per token. The
methods and their layouts: docs/sequence.md, "The context a kernel sees".
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from loomtrain.parallel.sequence.context import Ring, SeqContext, SharedRows, grouped_kv

LAYOUT = {"ring": "zigzag", "ulysses": "contiguous", "lasp": "contiguous", "local": "contiguous"}


def local_attention(q, k, v, ctx: SeqContext, linear: bool = False, decay=None) -> torch.Tensor:
    """The whole row on this rank: causal attention within each document (and the window);
    k and v may hold fewer (grouped) heads than q."""
    if linear:
        from loomtrain.models.linear_attention import causal_linear_attention

        return causal_linear_attention(q, k, v, decay=decay, docs=ctx.docs)
    k, v = grouped_kv(k, q.shape[1]), grouped_kv(v, q.shape[1])
    if ctx.dense:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = ctx.visible(0, 0, device=q.device)[:, None]  # (b, 1, t, t)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _linear_over(decay):
    """Linear attention over Ulysses' gathered sequence (contiguous: positions 0..T-1)."""
    def attend(q, k, v, positions, docs, window=0):
        from loomtrain.models.linear_attention import causal_linear_attention

        assert torch.equal(positions, torch.arange(len(positions))), "linear attention runs in order"
        return causal_linear_attention(q, k, v, decay=decay, docs=docs)
    return attend


class SequenceRuntime:
    def __init__(self, model, mesh, method: str, attention: str):
        # the model whose embedding and rotation read `position_ids`: the whole model under a
        # pipeline, whose layers run on it (PipelineModule.whole)
        self.model, self.mesh, self.method = getattr(model, "whole", model), mesh, method
        self.linear = attention == "linear"
        self.ring = Ring(mesh, "cp") if method != "local" else None
        self.context: SeqContext | None = None
        self.rows: SharedRows | None = None  # how the last batch's rows lie over cp
        modules = attention_modules(model)
        # the llama's sliding window (models/llama.py), one for every layer; the GPT has none
        self.window = max((getattr(m, "window", 0) for m in modules), default=0)
        for module in modules:
            module.core = self._core_for(module)

    @property
    def layout(self) -> str:
        return LAYOUT[self.method]

    def shard(self, x: torch.Tensor, y: torch.Tensor, docs: torch.Tensor | None = None):
        """This rank's tokens of the full rows `x`, `y` (b, T); `docs` (b, T) their documents."""
        seq_len = x.shape[1]
        if docs is not None:
            docs = docs.to(x.device)
        if self.ring is None:
            self.context = SeqContext.local(seq_len, docs, self.window)
            return x, y
        self.context = SeqContext.of_ring(self.ring, seq_len, self.layout, docs, self.window)
        self.rows = SharedRows(self.mesh, self.ring.axis, x.shape[0], seq_len)
        positions = self.context.local_positions.to(x.device)
        self.model.position_ids = positions
        return x[:, positions], y[:, positions]

    def context_state(self) -> tuple:
        """What the last `shard` set: the kernels' context, the rows' split, the model's
        positions."""
        return self.context, self.rows, self.model.position_ids

    def restore(self, state: tuple) -> None:
        """Back to a `context_state()`: a pipeline runs micro-batches sharded earlier."""
        self.context, self.rows, self.model.position_ids = state

    def shared_rows(self) -> SharedRows | None:
        """How the last batch's rows lie over the ranks (None: each rank holds whole rows)."""
        return self.rows

    def _core_for(self, module):
        """The kernel for `module`, chosen once; the core reads the batch's context per call."""
        decay = getattr(module, "decay", None)
        if self.method == "local":
            kernel = partial(local_attention, linear=self.linear, decay=decay)
        elif self.method == "ring":
            from loomtrain.parallel.sequence.ring import ring_attention as kernel
        elif self.method == "ulysses":
            from loomtrain.parallel.sequence.ulysses import ulysses_attention

            kernel = (partial(ulysses_attention, attend=_linear_over(decay)) if self.linear
                      else ulysses_attention)
        else:
            from loomtrain.parallel.sequence.lasp import lasp_attention

            kernel = partial(lasp_attention, decay=decay)

        # eager inside a compiled block (train.compile): the kernel reads this micro-batch's
        # context, and the ring's loop exchanges blocks between its steps; dynamo would guard
        # on every context and break inside the loop, so the core is one graph break instead
        # (torch.compiler.disable's lazy form: comm/collectives.py)
        @torch._disable_dynamo
        def core(q, k, v):
            assert self.context is not None, "SequenceRuntime.shard must run before the forward"
            return kernel(q, k, v, self.context)
        return core


def attention_modules(model):
    """The model's attention modules that take a kernel in their `core` (the GPT's
    CausalSelfAttention, the llama's Attention: core(q, k, v) on (b, heads, t, head_dim), k
    and v with the model's kv heads)."""
    return [m for m in model.modules() if hasattr(m, "core") and hasattr(m, "n_heads")]


def sequence_of(model) -> SequenceRuntime | None:
    """The sequence runtime of a (possibly dp-wrapped) model, or None."""
    return getattr(getattr(model, "module", model), "sequence", None)
