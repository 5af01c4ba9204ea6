"""The planner's shape of a Llama-family model (models/llama.py): what the cost model
(cost.py) needs of it, as presets.py's ModelShape gives it for the GPT. Its fields are the
[model] keys' resolved values under the names ModelConfig gives them (`kv_heads`,
`ffn_width`), so that activations.py's llama formulas take either. Formulas and sources:
docs/planner.md, "The llama family".
"""

from __future__ import annotations

from dataclasses import dataclass

from loomtrain.activations import llama_core_bytes, llama_layer_bytes
from loomtrain.planner.shape import Shape

# Llama 3's pre-training sequence length (arXiv 2407.21783, sec. 3.4.1: 8,192 tokens after
# the first 252M), the planner's seq_len for the llama presets; llama-debug keeps the run's
# default, 128 (train/config.py). `loom plan --seq` overrides either.
PRESET_SEQ_LEN = 8192
DEBUG_SEQ_LEN = 128


@dataclass(frozen=True)
class LlamaShape(Shape):
    """Token embedding, blocks of (RMSNorm, attention with q, k, v and o projections, RMSNorm,
    SwiGLU), a final RMSNorm and a head, tied to the embedding or not. `preset`: the
    models/presets.py name it came from, written into a planned config so that the keys the
    cost does not read (rope_theta, rope_scaling, norm_eps) come with it."""

    kv_heads: int
    ffn_width: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = 0
    preset: str | None = None
    head_dim: int = 0  # the [model] key: Qwen3's wider heads; 0: d_model / n_heads

    @property
    def head_width(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def attention_width(self) -> float:
        """The query heads' width over d_model: 1 but where head_dim widens the heads."""
        return self.n_heads * self.head_width / self.d_model

    @property
    def tied_head(self) -> bool:
        return self.tie_embeddings

    @property
    def block_matmul_params(self) -> int:
        """The weights a token multiplies in a block: q and o d x heads head_dim each (d^2 but
        where head_dim widens the heads), k and v d x kv_heads head_dim each (grouped-query
        attention), the three SwiGLU matrices d f each."""
        d, q, kv = self.d_model, self.n_heads * self.head_width, self.kv_heads * self.head_width
        return 2 * d * q + 2 * d * kv + 3 * d * self.ffn_width

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

    @property
    def params(self) -> int:
        untied = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return self.embedding_params + self.n_layers * self.block_params + self.d_model + untied

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
        (`attention_width`)."""
        kv = self.kv_heads / self.n_heads
        attention = 9 * (1 + kv) + 4
        if kv < 1:
            attention += 2 * (1 + kv)
        if self.qk_norm:
            attention += 7 * (1 + kv) + 2
        split = attention * self.attention_width + 5 * self.ffn_width / self.d_model
        return {"split": split, "replicated": 20, "embed": 2, "head": 7}

    @property
    def ops(self) -> dict[str, int]:
        """Operator launches per forward: a block's two RMSNorms (6 each), q, k, v (3) and
        their views (1), the two rotations (11 each: angles, cos, sin, the tables' repeats,
        the half swap, two products, the sum, the cast), the kv expansion (2), attention, its
        reshape, o_proj, the SwiGLU (5), two adds; qk_norm's two norms (12); the embedding's
        lookup and positions; the head's ln_f, matmul, log-softmax and loss."""
        return {"embed": 2, "block": 50 + 12 * self.qk_norm, "head": 9}

    def stash_bytes(self, kind: str, b: int, t: int, c: int, tp: int, sp: bool) -> int:
        """A layer's saved activations on one tp rank (activations.py, held to the tensors
        autograd saves by tests/test_dryrun.py)."""
        return llama_layer_bytes(kind, b, t, self, c, tp, sp)

    def core_bytes(self, b: int, t: int, c: int, tp: int) -> int:
        """What selective recomputation of a block's attention core frees."""
        return llama_core_bytes(b, t, self, c, tp)

    def tp_calls(self, kind: str, tp: int, sp: bool) -> tuple[list, list]:
        """(forward, backward) tp collectives of a layer per microbatch, each (op, payload,
        count): op "ar" (all-reduce) or "half" (all-gather or reduce-scatter); payload "act"
        (b s d), "tokens" (one fp32 per token) or a number of weight elements. As
        parallel/tensor_llama.py runs them (tensor_estimate.py `_llama_collectives`): a
        block as the GPT's, the weight gradients of ln1 and ln2 (sequence parallel), q_norm
        and k_norm, and of replicated k_proj and v_proj summed backward; the embedding
        reduce-scatters under sequence parallelism."""
        if kind == "embed":
            return ([("half", "act", 1)], [("half", "act", 1)]) if sp else ([("ar", "act", 1)], [])
        d = self.d_model
        if kind == "head":
            if sp:
                return [("ar", "tokens", 3), ("half", "act", 1)], [("half", "act", 1), ("ar", d, 1)]
            return [("ar", "tokens", 3)], [("ar", "act", 1)]
        if sp:
            forward, backward = [("half", "act", 4)], [("half", "act", 4), ("ar", d, 2)]
        else:
            forward, backward = [("ar", "act", 2)], [("ar", "act", 2)]
        if self.qk_norm:
            backward.append(("ar", self.head_width, 2))
        if self.kv_heads % tp:  # replicated: each rank sums the whole k and v gradients
            width = self.kv_heads * self.head_width
            backward.append(("ar", width * d, 2))
            if self.qkv_bias:
                backward.append(("ar", width, 2))
        return forward, backward

    def model_keys(self) -> dict:
        """The [model] table of a config that builds this shape."""
        keys = {"name": "llama", "n_layers": self.n_layers, "d_model": self.d_model,
                "n_heads": self.n_heads, "seq_len": self.seq_len, "vocab_size": self.vocab_size,
                "n_kv_heads": self.kv_heads, "ffn_hidden": self.ffn_width,
                "tie_embeddings": self.tie_embeddings, "qkv_bias": self.qkv_bias,
                "qk_norm": self.qk_norm, "sliding_window": self.sliding_window}
        if self.head_dim:
            keys["head_dim"] = self.head_dim
        return keys if self.preset is None else {"preset": self.preset, **keys}


def llama_shape(m, name: str) -> LlamaShape:
    """The shape of a ModelConfig with name "llama"."""
    return LlamaShape(name, m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size,
                      m.kv_heads, m.ffn_width, m.tie_embeddings, m.qkv_bias, m.qk_norm,
                      m.sliding_window, m.preset, m.head_dim)


def llama_presets() -> dict[str, LlamaShape]:
    """models/presets.py's shapes by name, at PRESET_SEQ_LEN (llama-debug: DEBUG_SEQ_LEN)."""
    from loomtrain.models.config import ModelConfig
    from loomtrain.models.presets import PRESETS

    def seq_len(name: str) -> int:
        return DEBUG_SEQ_LEN if name == "llama-debug" else PRESET_SEQ_LEN

    return {name: llama_shape(ModelConfig(preset=name, seq_len=seq_len(name)), name)
            for name in PRESETS}


__all__ = ["LlamaShape", "llama_presets", "llama_shape"]
