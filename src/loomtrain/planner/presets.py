"""Model shapes by name, for `loom plan --model NAME`: the GPT-3 family (Brown et al. 2020,
arXiv 2005.14165, Table 2.1: layers, d_model, heads; context 2048, the GPT-2 BPE vocabulary
of 50257), the 1T configuration of Narayanan et al. 2021 (arXiv 2104.04473, Table 1: 128
layers, hidden 25600, 160 heads), and loomtrain's own default model (train/config.py). Two shapes differ from the table as
printed: 1.3B has 16 heads of 128 (the table's 24 heads of 128 do not make d_model 2048) and
13B has d_model 5120 = 40 heads of 128 (the table prints 5140)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """A GPT as loomtrain builds it (models/gpt.py): token and position embeddings, blocks of
    (layer norm, attention with qkv and proj, layer norm, MLP fc and proj, all with biases), a
    final layer norm and a head tied to the token embedding."""
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int
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


_GPT3 = {  # name: (layers, d_model, heads)
    "gpt3-125m": (12, 768, 12), "gpt3-350m": (24, 1024, 16), "gpt3-760m": (24, 1536, 16),
    "gpt3-1.3b": (24, 2048, 16), "gpt3-2.7b": (32, 2560, 32), "gpt3-6.7b": (32, 4096, 32),
    "gpt3-13b": (40, 5120, 40), "gpt3-175b": (96, 12288, 96),
}
PRESETS: dict[str, ModelShape] = {
    **{name: ModelShape(name, layers, h, heads, 2048, 50257) for name, (layers, h, heads) in _GPT3.items()},
    "gpt-1t": ModelShape("gpt-1t", 128, 25600, 160, 2048, 50257),
    "default": ModelShape("default", 4, 256, 4, 128, 256),
}


def preset(name: str) -> ModelShape:
    """The shape called `name`; ValueError naming the choices if there is none."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)} "
                         "or give a loomtrain config file (its [model] section)")
    return PRESETS[name]


def from_model_config(m, name: str = "config") -> ModelShape:
    """The shape of a config's [model] section (train/config.py ModelConfig; GPT only)."""
    if m.name != "gpt":
        raise ValueError(f"the planner models the GPT; model.name={m.name!r} has no transformer "
                         'blocks to place: use model.name="gpt"')
    return ModelShape(name, m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size, m.mlp_ratio)
