"""The planner's shape of a Llama-family model (models/llama.py): what the cost model
(cost.py) needs of it, as presets.py's ModelShape gives it for the GPT. Its fields are the
[model] keys' resolved values under the names ModelConfig gives them (`kv_heads`,
`ffn_width`), so that activations.py's llama formulas take either. Formulas and sources:
docs/planner.md, "The llama family".
"""

from __future__ import annotations

from dataclasses import dataclass

from loomtrain.activations import (llama_core_bytes, llama_heads, llama_layer_bytes,
                                   moe_block_extra_bytes)
from loomtrain.models.moe import is_moe_layer
from loomtrain.planner.shape import Shape

# Llama 3's pre-training sequence length (arXiv 2407.21783, sec. 3.4.1: 8,192 tokens after
# the first 252M), the planner's seq_len for the llama presets; llama-debug keeps the run's
# default, 128 (train/config.py). `loom plan --seq` overrides either.
PRESET_SEQ_LEN = 8192
DEBUG_SEQ_LEN = 128
# the mixture of experts' [model] keys the shape keeps (the cost reads them; aux_loss_coef and
# router_bias_rate change no cost and stay the config's own)
MOE_KEYS = ("n_experts", "experts_per_token", "n_shared_experts", "shared_expert_gate",
            "moe_every", "moe_hidden", "router", "router_norm_topk")


@dataclass(frozen=True)
class LlamaShape(Shape):
    """Token embedding, blocks of (RMSNorm, attention with q, k, v and o projections, RMSNorm,
    SwiGLU), a final RMSNorm and a head, tied to the embedding or not. `preset`: the
    models/presets.py name it came from, written into a planned config so that the keys the
    cost does not read (rope_theta, rope_scaling, norm_eps) come with it. With `n_experts`,
    every `moe_every`-th block's SwiGLU is a mixture of experts (models/moe.py): a router,
    `n_experts` SwiGLUs of `expert_width` of which each token runs `experts_per_token`, and
    `n_shared_experts` every token runs (the "moe" kind of layer; docs/moe.md)."""

    kv_heads: int
    ffn_width: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = 0
    preset: str | None = None
    head_dim: int = 0  # the [model] key: Qwen3's wider heads; 0: d_model / n_heads
    n_experts: int = 0  # the mixture of experts' [model] keys (models/config.py), 0: dense
    experts_per_token: int = 2
    n_shared_experts: int = 0
    shared_expert_gate: bool = False
    moe_every: int = 1
    moe_hidden: int = 0
    router: str = "softmax"
    router_norm_topk: bool = True

    @property
    def head_width(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def attention_width(self) -> float:
        """The query heads' width over d_model: 1 but where head_dim widens the heads."""
        return self.n_heads * self.head_width / self.d_model

    @property
    def expert_width(self) -> int:
        return self.moe_hidden or self.ffn_width

    def is_moe(self, layer: int) -> bool:
        return is_moe_layer(self, layer)

    @property
    def tied_head(self) -> bool:
        return self.tie_embeddings

    @property
    def block_matmul_params(self) -> int:
        """The weights a token multiplies in a block: q and o d x heads head_dim each (d^2 but
        where head_dim widens the heads), k and v d x kv_heads head_dim each (grouped-query
        attention), the three SwiGLU matrices d f each."""
        return self._attention_matmul_params + 3 * self.d_model * self.ffn_width

    @property
    def _attention_matmul_params(self) -> int:
        d, q, kv = self.d_model, self.n_heads * self.head_width, self.kv_heads * self.head_width
        return 2 * d * q + 2 * d * kv

    @property
    def expert_params(self) -> int:
        """The routed experts' weights of one MoE block: gate, up [E, d, h] and down [E, h, d]."""
        return 3 * self.n_experts * self.d_model * self.expert_width

    @property
    def moe_matmul_params(self) -> int:
        """The weights a token multiplies in a MoE block: attention's and its feed-forward's
        (`moe_feed_forward_matmul_params`)."""
        return self._attention_matmul_params + self.moe_feed_forward_matmul_params

    @property
    def moe_feed_forward_matmul_params(self) -> int:
        """The weights a token multiplies in a MoE feed-forward: the router's d x E, its k
        experts' and the shared experts' SwiGLUs (3 d h each), Qwen's shared gate d: k of the
        E experts, not E (dropless top-k routing)."""
        d, h = self.d_model, self.expert_width
        swiglus = 3 * d * h * (self.experts_per_token + self.n_shared_experts)
        return d * self.n_experts + swiglus + d * self.shared_expert_gate

    @property
    def moe_feed_forward_params(self) -> int:
        """A MoE feed-forward: the router, the E experts, the shared experts (one SwiGLU
        n_shared h wide) and the shared gate."""
        d, h = self.d_model, self.expert_width
        return (d * self.n_experts + self.expert_params + 3 * d * h * self.n_shared_experts
                + d * self.shared_expert_gate)

    @property
    def moe_block_params(self) -> int:
        """A MoE block: a dense block's, its SwiGLU replaced by the MoE feed-forward."""
        return self.block_params - 3 * self.d_model * self.ffn_width + self.moe_feed_forward_params

    @property
    def moe_blocks(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layers))

    @property
    def block_params(self) -> int:
        """The matrices, q/k/v biases (qkv_bias), q_norm and k_norm (qk_norm, head_dim each),
        ln1 and ln2 (d each)."""
        bias = (self.n_heads + 2 * self.kv_heads) * self.head_width * self.qkv_bias
        return self.block_matmul_params + bias + 2 * self.head_width * self.qk_norm + 2 * self.d_model

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model

    @property
    def head_params(self) -> int:
        """ln_f and the head's matrix (the embedding's when tied: counted once in `params`)."""
        return self.d_model + self.vocab_size * self.d_model

    def tp_params(self, kind: str, tp: int) -> float:
        """The parameters one of `tp` ranks holds of a layer of this kind, all its experts
        included (parallel/tensor_llama.py): the vocabulary-parallel embedding's and head's
        rows (V / tp: `cost.padded` pads V to a multiple of tp), ln_f whole; a block's q and o
        (and q's bias) split, k and v (and their biases) split when tp divides the kv heads,
        whole when tp is a multiple of them (replicated), its SwiGLU split, its norms (ln1,
        ln2, q_norm, k_norm) whole; a MoE block's feed-forward whole on every tp rank."""
        d = self.d_model
        if kind == "embed":
            return self.embedding_params / tp
        if kind == "head":
            return d + self.vocab_size * d / tp
        q, kv = self.n_heads * self.head_width, self.kv_heads * self.head_width
        kv_split = tp if self.kv_heads % tp == 0 else 1
        attention = (q * (2 * d + self.qkv_bias) / tp
                     + 2 * kv * (d + self.qkv_bias) / kv_split)
        norms = 2 * d + 2 * self.head_width * self.qk_norm
        if kind == "moe":
            return attention + norms + self.moe_feed_forward_params
        return attention + norms + 3 * d * self.ffn_width / tp

    def kv_width(self, tp: int) -> int:
        """The k and v elements per token one of `tp` ranks holds, which the cp ring passes
        on: the rank's kv heads (`llama_heads`: grouped-query attention sends them
        unexpanded)."""
        _, kv, head_dim = llama_heads(self, tp)
        return 2 * kv * head_dim

    @property
    def params(self) -> int:
        untied = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        moe = self.moe_blocks
        blocks = (self.n_layers - moe) * self.block_params + moe * self.moe_block_params
        return self.embedding_params + blocks + self.d_model + untied

    @property
    def traffic_h(self) -> dict[str, float]:
        """Memory-bound elements per token in one forward, in units of d_model (cost.py
        charges them at the device's bandwidth), counted from models/llama.py's operators:
        "replicated" (not split by tp): two RMSNorms (torch's decomposition: square, mean,
        scale, weight: 7d each) and two residual adds (3d each); "split": the rotation of q
        and k (9 per element: two products with the tables, the half swap, the sum), the
        expansion of k and v to every head (read kv, write d, each), the attention kernel's
        q, k, v and output (4d), the SwiGLU's silu and product (5f), and with qk_norm the
        norms of q and k (7 per element) and o_proj's input copy (2d); "embed": the gather
        (2d); "head": ln_f (7d). The attention's terms scale with the heads' width
        (`attention_width`). A MoE block: "moe_split", the split part without the SwiGLU
        (attention's); "moe", its feed-forward (models/moe.py, E experts, k picks of width h, s
        shared), whole on every tp rank: the router's fp32 cast, softmax, bias and top-k over
        E (7E) and its k weights (6k), the copies' gather, weighting and index_add_ (7kd + d),
        their SwiGLUs (5kh) and the shared ones' (5sh, plus the sum 3d; Qwen's gate 3d), the
        balance loss's mean (E); "moe_ep": with expert parallelism, the received rows
        regrouped by expert and back (4kd)."""
        kv = self.kv_heads / self.n_heads
        attention = 9 * (1 + kv) + 4
        if kv < 1:
            attention += 2 * (1 + kv)
        if self.qk_norm:
            attention += 7 * (1 + kv) + 2
        d, f, k = self.d_model, self.ffn_width, self.experts_per_token
        split = attention * self.attention_width
        h, shared = self.expert_width, self.n_shared_experts
        moe = (8 * self.n_experts + 6 * k + 7 * k * d + d + 5 * k * h + 5 * shared * h
               + 3 * d * (shared > 0) + 3 * d * self.shared_expert_gate) / d
        return {"split": split + 5 * f / d, "replicated": 20, "embed": 2, "head": 7,
                "moe_split": split, "moe": moe, "moe_ep": 4 * k}

    @property
    def ops(self) -> dict[str, int]:
        """Operator launches per forward: a block's two RMSNorms (6 each), q, k, v (3) and
        their views (1), the two rotations (11 each: angles, cos, sin, the tables' repeats,
        the half swap, two products, the sum, the cast), the kv expansion (2), attention, its
        reshape, o_proj, the SwiGLU (5), two adds; qk_norm's two norms (12); the embedding's
        lookup and positions; the head's ln_f, matmul, log-softmax and loss. A MoE block
        (models/moe.py) runs, instead of the SwiGLU: the router (7; renormalized 2 more, the
        sigmoid's normalization 2), the route (19: sort, counts, gather, three grouped
        products with their offsets, silu, product, weighting, index_add_), the shared
        experts (5 and their sum; the gate 3), the balance loss and its autograd node (11);
        "moe_ep": expert parallelism's exchange (33: the counts' and rows' all-to-alls and
        buffers, the regrouping by expert and back, parallel/expert/dispatch.py)."""
        block = 50 + 12 * self.qk_norm
        moe = (block - 5 + 7 + 2 * self.router_norm_topk + 2 * (self.router == "sigmoid") + 19
               + 6 * (self.n_shared_experts > 0) + 3 * self.shared_expert_gate + 11)
        return {"embed": 2, "block": block, "head": 9, "moe": moe, "moe_ep": 33}

    def stash_bytes(self, kind: str, b: int, t: int, c: int, tp: int, sp: bool) -> int:
        """A layer's saved activations on one tp rank (activations.py, held to the tensors
        autograd saves by tests/test_dryrun.py); a MoE block's mixture in place of the
        SwiGLU (`moe_block_extra_bytes`: whole on every tp rank, over the rank's tokens, t / tp
        of each row under sequence parallelism; the experts split over ep, each rank's k
        copies per token stay)."""
        if kind != "moe":
            return llama_layer_bytes(kind, b, t, self, c, tp, sp)
        return (llama_layer_bytes("block", b, t, self, c, tp, sp)
                + moe_block_extra_bytes(b, t, self, c, tp, sp))

    def core_bytes(self, b: int, t: int, c: int, tp: int) -> int:
        """What selective recomputation of a block's attention core frees."""
        return llama_core_bytes(b, t, self, c, tp)

    def tp_calls(self, kind: str, tp: int, sp: bool, ep: int = 1) -> tuple[list, list]:
        """(forward, backward) tp collectives of a layer per microbatch, each (op, payload,
        count): op "ar" (all-reduce) or "half" (all-gather or reduce-scatter); payload "act"
        (b s d), "tokens" (one fp32 per token), "counts" (the balance loss's per-sequence
        counts, b 2E fp32) or a number of weight elements. As parallel/tensor_llama.py runs
        them (tensor_estimate.py `_llama_ops`): a block as the GPT's, the weight gradients of
        ln1 and ln2 (sequence parallel), q_norm and k_norm, and of replicated k_proj and
        v_proj summed backward; the embedding reduce-scatters under sequence parallelism. A
        MoE block: the attention half's, and its feed-forward's (`_moe_calls`, its experts
        split over `ep`)."""
        if kind == "embed":
            return ([("half", "act", 1)], [("half", "act", 1)]) if sp else ([("ar", "act", 1)], [])
        d = self.d_model
        if kind == "head":
            if sp:
                return [("ar", "tokens", 3), ("half", "act", 1)], [("half", "act", 1), ("ar", d, 1)]
            return [("ar", "tokens", 3)], [("ar", "act", 1)]
        halves = 1 if kind == "moe" else 2  # a MoE block enters tp's region for attention only
        if sp:
            forward = [("half", "act", 2 * halves)]
            backward = [("half", "act", 2 * halves), ("ar", d, 2)]
        else:
            forward, backward = [("ar", "act", halves)], [("ar", "act", halves)]
        if kind == "moe":
            moe = self._moe_calls(sp, ep)
            forward, backward = forward + moe[0], backward + moe[1]
        if self.qk_norm:
            backward.append(("ar", self.head_width, 2))
        if self.kv_heads % tp:  # replicated: each rank sums the whole k and v gradients
            width = self.kv_heads * self.head_width
            backward.append(("ar", width * d, 2))
            if self.qkv_bias:
                backward.append(("ar", width, 2))
        return forward, backward

    def _moe_calls(self, sp: bool, ep: int) -> tuple[list, list]:
        """A MoE feed-forward's own tp collectives (tensor_estimate.py `_moe_ops`): none
        without sequence parallelism (every tp rank runs the same tokens); with it the
        per-sequence counts summed forward, and every weight's gradient summed backward: the
        router's (E d), this rank's E / ep experts' three (E/ep d h each), the shared experts'
        three (s d, s = n_shared_experts h) and Qwen's shared gate (d)."""
        if not sp:
            return [], []
        d, h, shared = self.d_model, self.expert_width, self.n_shared_experts
        experts = [("ar", self.n_experts // ep * d * h, 3)]
        shared = [("ar", shared * h * d, 3)] if shared else []
        gate = [("ar", d, 1)] if self.shared_expert_gate else []
        return [("ar", "counts", 1)], [("ar", self.n_experts * d, 1), *experts, *shared, *gate]

    def model_keys(self) -> dict:
        """The [model] table of a config that builds this shape."""
        keys = {"name": "llama", "n_layers": self.n_layers, "d_model": self.d_model,
                "n_heads": self.n_heads, "seq_len": self.seq_len, "vocab_size": self.vocab_size,
                "n_kv_heads": self.kv_heads, "ffn_hidden": self.ffn_width,
                "tie_embeddings": self.tie_embeddings, "qkv_bias": self.qkv_bias,
                "qk_norm": self.qk_norm, "sliding_window": self.sliding_window}
        if self.head_dim:
            keys["head_dim"] = self.head_dim
        if self.n_experts:
            keys.update({k: getattr(self, k) for k in MOE_KEYS})
        return keys if self.preset is None else {"preset": self.preset, **keys}


def llama_shape(m, name: str) -> LlamaShape:
    """The shape of a ModelConfig with name "llama"."""
    return LlamaShape(name, m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size,
                      m.kv_heads, m.ffn_width, m.tie_embeddings, m.qkv_bias, m.qk_norm,
                      m.sliding_window, m.preset, m.head_dim,
                      **{k: getattr(m, k) for k in MOE_KEYS})


def llama_presets() -> dict[str, LlamaShape]:
    """models/presets.py's shapes by name, at PRESET_SEQ_LEN (llama-debug: DEBUG_SEQ_LEN)."""
    from loomtrain.models.config import ModelConfig
    from loomtrain.models.presets import PRESETS

    def seq_len(name: str) -> int:
        return DEBUG_SEQ_LEN if name == "llama-debug" else PRESET_SEQ_LEN

    return {name: llama_shape(ModelConfig(preset=name, seq_len=seq_len(name)), name)
            for name in PRESETS}


__all__ = ["LlamaShape", "llama_presets", "llama_shape"]
