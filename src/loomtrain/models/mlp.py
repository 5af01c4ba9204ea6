"""Residual MLPs: a per-position language model, and a classifier of feature vectors.

`MLP`: each token predicts the next from itself alone. It has no attention, so it learns
bigram statistics; its use is as a second, very different architecture for tests and
benchmarks (no sequence mixing, only Linear and LayerNorm).

`MLPClassifier`: the same residual blocks between a linear input layer and a linear head;
model.name = "mlp" builds it for a classification source (data.source = "digits").
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ResidualMLP(nn.Module):
    def __init__(self, d_model: int, ratio: int):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, ratio * d_model)
        self.proj = nn.Linear(ratio * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class MLP(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, n_layers: int, mlp_ratio: int = 4):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(ResidualMLP(d_model, mlp_ratio) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class MLPClassifier(nn.Module):
    """features -> d_model (Linear) -> n_layers ResidualMLP blocks -> LayerNorm -> classes
    logits. Inputs are cast to the weights' dtype (a bf16 engine gets float32 features)."""

    def __init__(self, features: int, classes: int, d_model: int, n_layers: int,
                 mlp_ratio: int = 4):
        super().__init__()
        self.embed = nn.Linear(features, d_model)
        self.blocks = nn.ModuleList(ResidualMLP(d_model, mlp_ratio) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x.to(self.embed.weight.dtype))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
