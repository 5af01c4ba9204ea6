"""The [model] section: the model family and its sizes (models/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loomtrain.component import Section


class ModelConfig(Section):
    name: Literal["gpt", "mlp"] = "gpt"
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

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "ModelConfig":
        if self.name == "gpt" and self.d_model % self.n_heads:
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
        return self
