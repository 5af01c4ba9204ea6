"""The optimizer and the learning-rate schedule the trainer builds from [train]. A module of
its own below parallel/: the asynchronous pipeline (parallel/pipeline/nesterov.py) builds the
same optimizer, and parallel/ imports nothing from train/ (tests/test_imports.py)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def lr_at(step: int, cfg) -> float:
    """Linear warmup to `cfg.lr` over `warmup_steps`, then cosine decay to `min_lr_ratio * lr`
    at `steps` (the schedule of GPT-3, Brown et al. 2020, and nanoGPT). `step` counts from 0."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, cfg, parameters=None) -> torch.optim.Optimizer:
    """AdamW (or SGD with momentum); weight decay only on matrices and embeddings, not on
    biases and LayerNorm gains (as in GPT-2/nanoGPT). `parameters`: only these of the model's
    (a sharded parameter server's, asyncsgd/shard.py); default all."""
    chosen = model.parameters() if parameters is None else parameters
    params = list(dict.fromkeys(p for p in chosen if p.requires_grad))
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=True)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.beta1, foreach=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
