"""The [model] section: the model family and its sizes (models/)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from loomtrain.component import Section
from loomtrain.models.presets import PRESETS, with_preset


class RopeScaling(Section):
    """Rotary frequency scaling (models/llama.py `rope_frequencies`): Llama 3's, whose defaults
    are Llama 3.1's published ones, or "linear" (position interpolation: every frequency
    divided by `factor`, which alone it reads)."""

    rope_type: Literal["llama3", "linear"] = "llama3"
    factor: float = Field(8.0, ge=1.0)
    low_freq_factor: float = Field(1.0, gt=0.0)
    high_freq_factor: float = Field(4.0, gt=0.0)
    original_max_position: int = Field(8192, ge=1)

    @model_validator(mode="after")
    def _keys_fit_the_type(self) -> "RopeScaling":
        if self.rope_type == "linear":
            # compared with the defaults, not "given": the resolved config.toml writes them all
            band = [k for k in ("low_freq_factor", "high_freq_factor", "original_max_position")
                    if getattr(self, k) != type(self).model_fields[k].default]
            if band:
                raise ValueError(f"model.rope_scaling.{band[0]} is a key of Llama 3's scaling; "
                                 "rope_type=\"linear\" reads only factor: leave it out")
            return self
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must "
                             f"exceed low_freq_factor={self.low_freq_factor} (the band between "
                             "them is interpolated)")
        return self


# the llama keys and their defaults: any other value is refused for model.name "gpt"/"mlp"
LLAMA_DEFAULTS = {"preset": None, "n_kv_heads": 0, "head_dim": 0, "ffn_hidden": 0,
                  "rope_theta": 10000.0, "rope_scaling": None, "norm_eps": 1e-5,
                  "tie_embeddings": False, "qkv_bias": False, "qk_norm": False,
                  "sliding_window": 0, "n_experts": 0, "experts_per_token": 2,
                  "n_shared_experts": 0, "moe_every": 1, "moe_hidden": 0, "router": "softmax",
                  "router_norm_topk": True, "aux_loss_coef": 0.0, "router_bias_rate": 0.0,
                  "shared_expert_gate": False}


class ModelConfig(Section):
    name: Literal["gpt", "mlp", "llama"] = "gpt"
    d_model: int = Field(256, ge=8)
    n_layers: int = Field(4, ge=1)
    n_heads: int = Field(4, ge=1)
    seq_len: int = Field(128, ge=2)
    vocab_size: int = Field(256, ge=2)
    mlp_ratio: int = Field(4, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # gpt: "linear" is causal linear attention (models/linear_attention.py), with RetNet's
    # per-head decay when linear_decay is set
    attention: Literal["softmax", "linear"] = "softmax"
    linear_decay: bool = False
    # gpt: the MLP's GELU, exact or tanh-approximated (GPT-2's "gelu_new")
    activation: Literal["gelu", "gelu_tanh"] = "gelu"
    # llama (models/llama.py, docs/models.md). preset: a published shape (models/presets.py)
    preset: str | None = None
    n_kv_heads: int = Field(0, ge=0)  # grouped-query attention; 0: n_heads (multi-head)
    head_dim: int = Field(0, ge=0)  # Qwen3: wider than d_model/n_heads; 0: d_model/n_heads
    ffn_hidden: int = Field(0, ge=0)  # SwiGLU width; 0: `ffn_width(d_model)`
    rope_theta: float = Field(10000.0, gt=0.0)
    rope_scaling: RopeScaling | None = None
    norm_eps: float = Field(1e-5, gt=0.0)
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm of every q and k head
    sliding_window: int = Field(0, ge=0)  # Mistral: attend to the last N tokens; 0: all
    # mixture of experts (models/moe.py, docs/moe.md); n_experts 0: dense feed-forwards
    n_experts: int = Field(0, ge=0)
    experts_per_token: int = Field(2, ge=1)  # top k
    n_shared_experts: int = Field(0, ge=0)  # DeepSeekMoE's experts every token goes through
    shared_expert_gate: bool = False  # Qwen-MoE: sigmoid(linear(x)) scales the shared output
    moe_every: int = Field(1, ge=1)  # every n-th block is MoE (from the n-th), the rest dense
    moe_hidden: int = Field(0, ge=0)  # an expert's SwiGLU width; 0: ffn_width
    router: Literal["softmax", "sigmoid"] = "softmax"  # sigmoid: DeepSeek-V3's scores
    router_norm_topk: bool = True  # the k weights renormalized to sum to 1
    aux_loss_coef: float = Field(0.0, ge=0.0)  # Switch's balance loss, sequence-wise; 0: off
    router_bias_rate: float = Field(0.0, ge=0.0)  # DeepSeek-V3's loss-free bias speed; 0: off

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data):
        return with_preset(data) if isinstance(data, dict) else data

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_width(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def ffn_width(self) -> int:
        return self.ffn_hidden or ffn_width(self.d_model)

    @property
    def expert_width(self) -> int:
        return self.moe_hidden or self.ffn_width

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "ModelConfig":
        if self.name in ("gpt", "llama") and self.d_model % self.n_heads and not self.head_dim:
            raise ValueError(
                f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}"
            )
        return self

    @model_validator(mode="after")
    def _attention_keys(self) -> "ModelConfig":
        if self.attention != "softmax" and self.name != "gpt":
            raise ValueError(f"model.attention={self.attention!r} is the GPT's attention; "
                             f"model.name={self.name!r} has none: leave it \"softmax\"")
        if self.linear_decay and self.attention != "linear":
            raise ValueError(f"model.linear_decay=true decays linear attention; it needs "
                             f"model.attention=\"linear\" (got {self.attention!r})")
        if self.activation != "gelu" and self.name != "gpt":
            raise ValueError(f"model.activation={self.activation!r} picks the GPT's GELU; "
                             f"model.name={self.name!r} does not read it: leave it \"gelu\"")
        return self

    @model_validator(mode="after")
    def _llama_keys(self) -> "ModelConfig":
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"model.preset={self.preset!r} is not a known shape; choose among "
                             f"{', '.join(PRESETS)}")
        if self.name != "llama":
            given = [k for k, v in LLAMA_DEFAULTS.items() if getattr(self, k) != v]
            if given:
                raise ValueError(f"model.{given[0]}={getattr(self, given[0])!r} is a key of the "
                                 f"llama model; model.name={self.name!r} has none: set "
                                 "model.name=\"llama\" or leave it out")
            return self
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads="
                             f"{self.n_heads} (each kv head serves a group of query heads)")
        if self.head_width % 2:
            what = "model.head_dim" if self.head_dim else "model.d_model/model.n_heads"
            raise ValueError(f"{what} = {self.head_width} must be even: rotary embeddings "
                             "rotate pairs of a head's dimensions")
        _experts_fit(self)
        for key, default in (("mlp_ratio", 4), ("dropout", 0.0)):
            if getattr(self, key) != default:
                raise ValueError(f"model.{key}={getattr(self, key)} is a GPT key; the llama model "
                                 "has no dropout and sizes its MLP by model.ffn_hidden")
        return self


def _experts_fit(cfg: ModelConfig) -> None:
    """The mixture-of-experts keys agree with each other (they are refused outside llama)."""
    moe_keys = [k for k in ("experts_per_token", "n_shared_experts", "moe_every", "moe_hidden",
                            "router", "router_norm_topk", "aux_loss_coef", "router_bias_rate",
                            "shared_expert_gate")
                if getattr(cfg, k) != LLAMA_DEFAULTS[k]]
    if not cfg.n_experts and moe_keys:
        raise ValueError(f"model.{moe_keys[0]}={getattr(cfg, moe_keys[0])!r} is a key of the "
                         "mixture of experts; set model.n_experts (the routed experts per MoE "
                         "block) or leave it out")
    if cfg.n_experts and cfg.experts_per_token > cfg.n_experts:
        raise ValueError(f"model.experts_per_token={cfg.experts_per_token} exceeds "
                         f"model.n_experts={cfg.n_experts}: a token picks k distinct experts")
    if cfg.shared_expert_gate and not cfg.n_shared_experts:
        raise ValueError("model.shared_expert_gate=true gates the shared experts' output; set "
                         "model.n_shared_experts or leave it out")
    if cfg.n_experts and cfg.moe_every > cfg.n_layers:
        raise ValueError(f"model.moe_every={cfg.moe_every} exceeds model.n_layers="
                         f"{cfg.n_layers}: no block would be a mixture of experts")


def ffn_width(d_model: int) -> int:
    """Llama's SwiGLU width for ffn_hidden = 0: 2/3 of 4 * d_model (the parameters of a 4x GELU
    MLP, in three matrices), rounded up to a multiple of 256 (Llama's `multiple_of`); below
    d_model 256, to a multiple of 8, so a tiny model's width stays near 8/3 * d_model."""
    multiple = 256 if d_model >= 256 else 8
    return multiple * math.ceil(8 * d_model / 3 / multiple)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary the tp ranks split: `vocab_size` rounded up to a multiple of tp, each
    rank holding padded_vocab / tp rows of the embedding and head, the last rows zeros whose
    logits are -inf (parallel/tensor_layers.py). Megatron-LM pads the same way, to a multiple
    of make-vocab-size-divisible-by (128) x tp (megatron/training/tokenizer/tokenizer.py
    `_vocab_size_with_padding`); loomtrain pads only as far as tp needs: checkpoints, exports
    and the loss never see the padding, so no key chooses it (docs/tensor.md)."""
    return -(-vocab_size // tp) * tp
