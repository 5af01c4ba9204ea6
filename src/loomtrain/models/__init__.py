"""Models loomtrain trains, built from the [model] section, and the loss they share."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from loomtrain.models.gpt import GPT
from loomtrain.models.llama import Llama
from loomtrain.models.mlp import MLP, MLPClassifier

IGNORE_INDEX = -100


def build_model(cfg) -> nn.Module:
    """`cfg` is a ModelConfig. Parameters are initialized from torch's current RNG state."""
    if cfg.name == "gpt":
        return GPT(cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.n_layers, cfg.n_heads,
                   cfg.mlp_ratio, cfg.dropout, cfg.attention, cfg.linear_decay, cfg.activation)
    if cfg.name == "llama":
        return Llama(cfg)
    if cfg.name == "mlp":
        return MLP(cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.mlp_ratio)
    raise AssertionError(f"unvalidated model name {cfg.name!r}")


def build_classifier(cfg, features: int, classes: int) -> nn.Module:
    """The classifier of `features`-long inputs into `classes` that `cfg` (a ModelConfig, with
    name "mlp": config validation) describes; initialized from torch's current RNG state."""
    assert cfg.name == "mlp", f"unvalidated classifier model {cfg.name!r}"
    return MLPClassifier(features, classes, cfg.d_model, cfg.n_layers, cfg.mlp_ratio)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over target tokens (IGNORE_INDEX skipped); for a classifier's
    logits [n, classes] and labels [n], summed over the examples.

    The caller divides by the global number of target tokens in the optimizer step, across
    micro-batches and data-parallel ranks, so the gradient equals the single-process one.
    """
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )


__all__ = ["GPT", "Llama", "MLP", "MLPClassifier", "IGNORE_INDEX", "build_classifier", "build_model",
           "token_loss_sum"]
