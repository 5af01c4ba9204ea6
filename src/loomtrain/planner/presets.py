"""Model shapes by name, for `loom plan --model NAME`: the GPT-3 family (Brown et al. 2020,
arXiv 2005.14165, Table 2.1: layers, d_model, heads; context 2048, the GPT-2 BPE vocabulary
of 50257), the 1T configuration of Narayanan et al. 2021 (arXiv 2104.04473, Table 1: 128
layers, hidden 25600, 160 heads), and loomtrain's own default model (train/config.py). Two shapes differ from the table as
printed: 1.3B has 16 heads of 128 (the table's 24 heads of 128 do not make d_model 2048) and
13B has d_model 5120 = 40 heads of 128 (the table prints 5140). The llama family's presets
(models/presets.py) come as LlamaShapes (llama_shape.py).

ModelShape below is the GPT's shape, LlamaShape the llama's: what the cost model reads of
either is listed in shape.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from loomtrain.activations import FP32_BYTES, gpt_layer_bytes
from loomtrain.planner.llama_shape import LlamaShape, llama_presets, llama_shape
from loomtrain.planner.shape import Shape


@dataclass(frozen=True)
class ModelShape(Shape):
    """A GPT as loomtrain builds it (models/gpt.py): token and position embeddings, blocks of
    (layer norm, attention with qkv and proj, layer norm, MLP fc and proj, all with biases), a
    final layer norm and a head tied to the token embedding."""
    mlp_ratio: int = 4

    @property
    def block_params(self) -> int:
        """One block: qkv 3h^2+3h, proj h^2+h, fc r h^2 + r h, fc proj r h^2 + h, 2 norms 4h."""
        h, r = self.d_model, self.mlp_ratio
        return (4 + 2 * r) * h * h + (3 + 1 + r + 1 + 4) * h

    @property
    def embedding_params(self) -> int:
        """Token embedding (tied with the head) and learned positions."""
        return (self.vocab_size + self.seq_len) * self.d_model

    @property
    def params(self) -> int:
        return self.embedding_params + self.n_layers * self.block_params + 2 * self.d_model

    tied_head = True  # a class attribute, not a field: the GPT's head is always tied

    @property
    def block_matmul_params(self) -> int:
        """The weights a token multiplies in a block: qkv, proj, fc and fc proj."""
        return (4 + 2 * self.mlp_ratio) * self.d_model ** 2

    @property
    def head_params(self) -> int:
        """ln_f and the head (the token embedding's: counted once in `params`)."""
        return 2 * self.d_model + self.vocab_size * self.d_model

    @property
    def traffic_h(self) -> dict[str, float]:
        """Memory-bound elements per token in one forward, in units of d_model (models/gpt.py):
        "replicated" (not split by tp): a block's two layer norms (read + write 2h each) and
        two residual adds (3h each); "split": the head merge copy (2h), the attention
        kernel's q, k, v in and output out (4h) and GELU (2rh); "embed": the gather and the
        position add (4h); "head": its norm (2h)."""
        return {"split": 6 + 2 * self.mlp_ratio, "replicated": 10, "embed": 4, "head": 2}

    # operator launches per forward (models/gpt.py): block: ln, qkv, view/permute/unbind, sdpa,
    # transpose/reshape, proj, add, ln, fc, gelu, proj, add; embed: 2 lookups, arange, add;
    # head: ln, matmul, log-softmax, nll
    ops = {"embed": 4, "block": 14, "head": 4}

    def stash_bytes(self, kind: str, b: int, t: int, c: int, tp: int, sp: bool) -> int:
        """A layer's saved activations on one tp rank: activations.py's, with a block's
        tp-split parts (qkv 3h, attention out h, fc+gelu 2rh, the log-sum-exp) divided by tp
        and the rest (both norms' inputs and outputs, 4h + 4) too under sequence parallelism;
        the head keeps V/tp of the log-softmax."""
        h, r, V = self.d_model, self.mlp_ratio, self.vocab_size
        stash = gpt_layer_bytes(kind, b, t, h, self.n_heads, r, V, c)
        if tp > 1 and kind == "block":
            kept = (4 + 2 * r) * h / tp + (4 * h + 4) / (tp if sp else 1)
            return int(b * t * (c * kept + FP32_BYTES * self.n_heads / tp))
        if tp > 1 and kind == "head":
            return int(stash - b * t * FP32_BYTES * V * (1 - 1 / tp))
        return stash

    def tp_params(self, kind: str, tp: int) -> float:
        """The parameters one of `tp` ranks holds of a layer, counted as split throughout (the
        layer norms, positions and row biases each rank holds whole count 1/tp: slightly
        under)."""
        return {"embed": self.embedding_params, "block": self.block_params,
                "head": self.head_params}[kind] / tp

    def kv_width(self, tp: int) -> float:
        """The k and v elements per token one of `tp` ranks holds (the cp ring passes them)."""
        return 2 * self.d_model / tp

    def core_bytes(self, b: int, t: int, c: int, tp: int) -> int:
        """What selective recomputation frees: the attention output and log-sum-exp."""
        return int(b * t * (c * self.d_model + FP32_BYTES * self.n_heads) / tp)

    def tp_calls(self, kind: str, tp: int, sp: bool, ep: int = 1) -> tuple[list, list]:
        """(forward, backward) tp collectives of a layer per microbatch as parallel/tensor.py
        runs them, each (op, payload, count) as LlamaShape.tp_calls (no experts: ep unused): a
        block all-reduces one activation after attention and after the MLP forward, and two
        input gradients backward; the embedding one forward, the head one backward plus the
        vocabulary-parallel cross-entropy's three of one number per token forward. Sequence
        parallel turns each all-reduce into an all-gather and a reduce-scatter and sums the
        gradients of the norms' weights and biases and of the row layers' biases backward
        (a block's 6, the head's final norm 2)."""
        h = self.d_model
        if kind == "block":
            return ([("half", "act", 4)], [("half", "act", 4), ("ar", h, 6)]) if sp \
                else ([("ar", "act", 2)], [("ar", "act", 2)])
        if kind == "embed":
            return [("ar", "act", 1)], [("half", "act", 1)] if sp else []
        return ([("ar", "tokens", 3)] + ([("half", "act", 1)] if sp else []),
                [("half", "act", 1), ("ar", h, 2)] if sp else [("ar", "act", 1)])

    def model_keys(self) -> dict:
        """The [model] table of a config that builds this shape."""
        return {"name": "gpt", "n_layers": self.n_layers, "d_model": self.d_model,
                "n_heads": self.n_heads, "seq_len": self.seq_len, "vocab_size": self.vocab_size,
                "mlp_ratio": self.mlp_ratio}


_GPT3 = {  # name: (layers, d_model, heads)
    "gpt3-125m": (12, 768, 12), "gpt3-350m": (24, 1024, 16), "gpt3-760m": (24, 1536, 16),
    "gpt3-1.3b": (24, 2048, 16), "gpt3-2.7b": (32, 2560, 32), "gpt3-6.7b": (32, 4096, 32),
    "gpt3-13b": (40, 5120, 40), "gpt3-175b": (96, 12288, 96),
}
PRESETS: dict[str, ModelShape | LlamaShape] = {
    **{name: ModelShape(name, layers, h, heads, 2048, 50257) for name, (layers, h, heads) in _GPT3.items()},
    "gpt-1t": ModelShape("gpt-1t", 128, 25600, 160, 2048, 50257),
    "default": ModelShape("default", 4, 256, 4, 128, 256),
    **llama_presets(),
}


def preset(name: str) -> ModelShape | LlamaShape:
    """The shape called `name`; ValueError naming the choices if there is none."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)} "
                         "or give a loomtrain config file (its [model] section)")
    return PRESETS[name]


def from_model_config(m, name: str = "config") -> ModelShape | LlamaShape:
    """The shape of a config's [model] section (train/config.py ModelConfig): the GPT's or the
    llama's."""
    if m.name == "llama":
        return llama_shape(m, name)
    if m.name != "gpt":
        raise ValueError(f"the planner models the GPT and the llama; model.name={m.name!r} has "
                         'no transformer blocks to place: use model.name="gpt" or "llama"')
    return ModelShape(name, m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size, m.mlp_ratio)
