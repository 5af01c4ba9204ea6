"""The mixture-of-experts feed-forward of the Llama family (docs/moe.md): a router picks
`experts_per_token` of `n_experts` SwiGLU experts for every token, the experts run grouped, and
optional shared experts see every token (DeepSeekMoE, arXiv 2401.06066), their output scaled by
a sigmoid gate in Qwen-MoE (`shared_expert_gate`).

Routing is dropless: every token reaches every expert it chose, whatever the load, so a parallel
run computes exactly what one process does (no capacity factor, no token dropped by a full
expert). The experts' weights are stacked ([experts, in, out]) and each matrix product runs over
all experts at once with `torch.nn.functional.grouped_mm` on the tokens sorted by expert (one
kernel, not a loop over tokens); where the kernel refuses the shapes (rows that are not
16-byte aligned) it loops over the experts instead.

Balancing, both optional:
- the auxiliary loss `aux_loss_coef * E * sum_i f_i * P_i` (Switch Transformer, arXiv
  2101.03961, eq. 4), f_i the share of the token's picks that went to expert i and P_i its mean
  router probability. It is taken per sequence, as DeepSeek-V3's sequence-wise balance loss
  (arXiv 2412.19437, eq. 17-20), and averaged over the sequences by token: a batch-wise loss
  would change with how rows are grouped into micro-batches and ranks, a sequence-wise one
  does not, so every layout reproduces the single-process loss;
- DeepSeek-V3's auxiliary-loss-free bias (section 2.1.2): a per-expert bias added to the scores
  for choosing the experts only (the weights stay the unbiased scores), moved by
  `router_bias_rate` towards the mean load after each step (parallel/expert/balance.py).

The auxiliary loss reaches the gradient through `_AuxLoss`, which passes the hidden state through
unchanged and hands the loss its gradient in the backward, as Megatron-Core's
MoEAuxLossAutoScaler does: a pipeline stage's routers then learn from their loss without the
loss having to travel to the last stage. The same backward counts the tokens each expert
received (once per micro-batch even under recomputation: only the graph that is run backward
counts), for the metrics and the bias update.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from loomtrain.models.swiglu import SwiGLU


def row_offsets(counts: torch.Tensor) -> torch.Tensor:
    """The grouped kernel's `offs`: where each expert's rows end (int32 cumulative counts)."""
    return counts.cumsum(0).to(torch.int32)


# eager inside a compiled block (train.compile): torch 2.13's fake-tensor rule for _grouped_mm
# accepts bf16 inputs only, though the CPU kernel multiplies fp32, so dynamo cannot trace it
# (torch.compiler.disable's lazy form, which leaves dynamo unimported until it is called)
@torch._disable_dynamo
def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
               offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of `x` sorted by expert (`counts[e]` rows for expert e) times their expert's matrix
    (`weight[e]`, [in, out]): one grouped kernel, or a loop over the experts where the kernel
    needs 16-byte aligned rows (widths not a multiple of 4 in fp32, of 8 in bf16). `offsets`:
    `row_offsets(counts)`, where the caller shares them between products (autograd then saves
    one tensor for all of them)."""
    if all(s * x.element_size() % 16 == 0 for s in (x.shape[-1], weight.shape[-1])):
        return F.grouped_mm(x, weight, offs=row_offsets(counts) if offsets is None else offsets)
    pieces = x.split(counts.tolist())
    return torch.cat([p @ w for p, w in zip(pieces, weight)])


class Router(nn.Module):
    """Scores each token against the experts (softmax or sigmoid of a linear gate) and picks the
    top k; `norm_topk` renormalizes the k weights to sum to one (Mixtral, DeepSeek-V3; Qwen-MoE
    leaves them). `expert_bias` (a persistent buffer, zeros) shifts the choice, not the weights."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, score: str, norm_topk: bool):
        super().__init__()
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.top_k, self.score, self.norm_topk = top_k, score, norm_topk
        self.register_buffer("expert_bias", torch.zeros(n_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, d] -> (weights [tokens, k] in x's dtype, experts [tokens, k], the fp32
        probabilities [tokens, E] the auxiliary loss uses)."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        experts = (scores + self.expert_bias).topk(self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(-1, experts)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts, probs


class GroupedExperts(nn.Module):
    """`n_experts` SwiGLU feed-forwards, their weights stacked: gate and up [E, d, h], down
    [E, h, d]. `first` is the global index of this module's first expert (expert parallelism
    holds a slice of them). `weight_entry`: None, or a function each weight passes through
    where the forward reads it (Megatron's `f` under sequence parallelism, where each rank
    sees part of the tokens: parallel/tensor_llama.py `SequenceParallelMoE`)."""

    def __init__(self, n_experts: int, d_model: int, hidden: int, first: int = 0):
        super().__init__()
        self.first = first
        self.gate_proj = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.up_proj = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.weight_entry: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def n_experts(self) -> int:
        return self.gate_proj.shape[0]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: rows sorted by expert, `counts[e]` of them for expert e; the three products
        share one tensor of row offsets."""
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        if self.weight_entry is not None:
            gate, up, down = (self.weight_entry(w) for w in (gate, up, down))
        offsets = row_offsets(counts)
        hidden = F.silu(grouped_mm(x, gate, counts, offsets)) * grouped_mm(x, up, counts, offsets)
        return grouped_mm(hidden, down, counts, offsets)


class _AuxLoss(torch.autograd.Function):
    """Identity on the hidden state; its backward gives the layer's auxiliary loss (a sum over
    sequences of `tokens` tokens each: t, or the whole sequence's length where the rank holds
    a piece of it) the gradient `moe.aux_grad * tokens`, each sequence's loss weighing as its
    tokens do in the step's objective, and adds to the layer's `counted` the picks `experts`
    of this rank's tokens, and the loss and its `sequences` (0: another rank counts the
    sequences, which context parallelism shares)."""

    @staticmethod
    def forward(ctx, hidden, aux, experts, moe, tokens, sequences):
        ctx.moe, ctx.experts, ctx.tokens, ctx.sequences = moe, experts, tokens, sequences
        ctx.aux = aux.detach()  # no host sync in the forward
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        moe = ctx.moe
        picks = torch.bincount(ctx.experts.reshape(-1), minlength=moe.n_experts).double()
        aux = ctx.aux.double().view(1) if ctx.sequences else picks.new_zeros(1)
        seen = torch.cat([picks, aux, picks.new_tensor([ctx.sequences])])
        moe.counted = seen if moe.counted is None else moe.counted + seen
        aux_grad = grad.new_full((), moe.aux_grad * ctx.tokens, dtype=torch.float32)
        return grad, aux_grad, None, None, None, None


class MoE(nn.Module):
    """The mixture-of-experts feed-forward (see the module's docstring). `aux_grad`: the
    auxiliary loss's gradient per token of a sequence, set per step by the Experts component
    (parallel/expert/config.py) to the coefficient over the step's loss tokens (the objective is
    (cross-entropy sum + coef * sum of sequence losses * their tokens) / loss tokens);
    `counted` (fp64, None until a backward): what the backwards saw since the component read it, the
    picks of each expert, then the auxiliary loss summed over the sequences and their number.
    `split_rows`: None, or a function giving how the micro-batch's rows lie over the ranks that
    share them (parallel/sequence/context.py `SharedRows`), set where context parallelism
    splits the rows (parallel/expert/config.py)."""

    def __init__(self, cfg):
        super().__init__()
        self.n_experts = cfg.n_experts
        self.router = Router(cfg.d_model, cfg.n_experts, cfg.experts_per_token, cfg.router,
                             cfg.router_norm_topk)
        self.experts = GroupedExperts(cfg.n_experts, cfg.d_model, cfg.expert_width)
        self.shared = self.shared_gate = None
        if cfg.n_shared_experts:
            self.shared = SwiGLU(cfg.d_model, cfg.n_shared_experts * cfg.expert_width)
        if cfg.shared_expert_gate:  # Qwen-MoE's sigmoid gate on the shared output
            self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False)
        self.aux_grad = 0.0
        self.counted: torch.Tensor | None = None  # not a buffer: bf16 casts would round it
        self.split_rows = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:  # no values to route by: the pipeline's split asks for the shape alone
            return torch.empty_like(x)
        b, t, d = x.shape
        tokens = x.reshape(-1, d)
        weights, experts, probs = self.router(tokens)
        routed = self.route(tokens, weights, experts)
        out = routed if self.shared is None else routed + self._shared(tokens)
        out = out.view(b, t, d)
        if torch.is_grad_enabled():
            rows = None if self.split_rows is None else self.split_rows()
            probs, experts = probs.view(b, t, -1), experts.view(b, t, -1)
            counts, length = balance_counts(probs, experts, rows)
            counts, length = self.whole_sequences(counts, length)
            aux = balance_loss_of(counts, length, experts.shape[-1])
            if rows is None:
                out = _AuxLoss.apply(out, aux, experts, self, length, b)
            else:
                out = _AuxLoss.apply(out, aux, rows.own(experts), self, length, rows.counted)
        return out

    def whole_sequences(self, counts: torch.Tensor, t: int) -> tuple[torch.Tensor, int]:
        """The balance loss's per-sequence counts (`balance_counts`) and length of the whole
        sequences this layer saw `t` tokens of each of: its own here; under sequence
        parallelism, where each rank sees a piece of every sequence, their sums over the
        ranks (parallel/tensor_llama.py `SequenceParallelMoE`)."""
        return counts, t

    def _shared(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.shared(tokens)
        return out if self.shared_gate is None else torch.sigmoid(self.shared_gate(tokens)) * out

    def route(self, tokens: torch.Tensor, weights: torch.Tensor,
              experts: torch.Tensor) -> torch.Tensor:
        """Each token's k picks sorted by expert, run grouped, weighted and summed back."""
        k = experts.shape[-1]
        order = experts.reshape(-1).argsort(stable=True)
        counts = torch.bincount(experts.reshape(-1), minlength=self.n_experts)
        source = order // k
        y = self.experts(tokens[source], counts) * weights.reshape(-1, 1)[order]
        return torch.zeros_like(tokens).index_add_(0, source, y)


def balance_loss(probs: torch.Tensor, experts: torch.Tensor, rows=None) -> torch.Tensor:
    """Switch Transformer's load-balancing loss E * sum_i f_i * P_i per sequence, summed over
    the sequences (probs [b, t, E], experts [b, t, k]): f_i, the share of the sequence's picks
    that chose expert i; P_i, its mean probability over the sequence's tokens. Minimal (1) when
    both are uniform. `rows`: as `balance_counts`."""
    counts, length = balance_counts(probs, experts, rows)
    return balance_loss_of(counts, length, experts.shape[-1])


def balance_counts(probs: torch.Tensor, experts: torch.Tensor,
                   rows=None) -> tuple[torch.Tensor, int]:
    """([sequences, 2E], their length): each sequence's picks of each expert, then each
    expert's probabilities summed over the sequence's tokens: sums, so the pieces of a sequence
    held by several ranks add up to the whole sequence's (picks are exact in fp32 up to 2^24).
    `rows` (parallel/sequence/context.py `SharedRows`): the sequences are whole rows that other
    ranks hold tokens of, summed over those ranks in one all-reduce."""
    t, k = experts.shape[1:]
    picks = torch.zeros_like(probs).scatter_add_(2, experts, torch.ones_like(probs[..., :k]))
    sums = torch.cat([picks, probs], -1)  # [b, t, 2E]
    if rows is None:
        return sums.sum(1), t
    return rows.sums(sums), rows.length


def balance_loss_of(counts: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """`balance_loss` from the `balance_counts` of sequences of `t` tokens with `k` picks each.
    The picks are counts, not differentiable: the gradient reaches the probabilities only."""
    n_experts = counts.shape[1] // 2
    share = counts[:, :n_experts].detach() / (t * k)
    return n_experts * (share * (counts[:, n_experts:] / t)).sum()


def is_moe_layer(cfg, layer: int) -> bool:
    """Whether block `layer` (from 0) has the mixture-of-experts feed-forward: every
    `moe_every`-th block, counted from 1 (Qwen-MoE's decoder_sparse_step)."""
    return cfg.n_experts > 0 and (layer + 1) % cfg.moe_every == 0


def moe_blocks(cfg) -> list[int]:
    """The blocks (from 0) with the mixture-of-experts feed-forward, in order."""
    return [i for i in range(cfg.n_layers) if is_moe_layer(cfg, i)]


__all__ = ["GroupedExperts", "MoE", "Router", "balance_counts", "balance_loss", "balance_loss_of",
           "grouped_mm", "is_moe_layer", "moe_blocks", "row_offsets"]
