"""What a run learns, decided by `data.source`: next-token prediction on text, or
classification of scikit-learn's digits (`"digits"`, data/digits.py). The model and the data
of each; the loss is the same for both. docs/finetune.md, "For code: the pieces another
training loop reuses".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from loomtrain.data import (PartitionedSampler, WindowSampler, load_data, require_documents,
                            require_windows)
from loomtrain.models import build_classifier, build_model

DIGITS = "digits"


def is_classification(cfg) -> bool:
    return cfg.data.source == DIGITS


def build_task_model(cfg) -> nn.Module:
    """The model `cfg` (the whole Config) trains, initialized from torch's current RNG state."""
    if is_classification(cfg):
        from loomtrain.data.digits import CLASSES, FEATURES

        return build_classifier(cfg.model, FEATURES, CLASSES)
    return build_model(cfg.model)


@dataclass(frozen=True)
class TaskData:
    train: object  # WindowSampler, PartitionedSampler or ExampleSampler
    val: object
    description: str
    targets_per_row: int  # seq_len tokens, or 1 example


def load_task_data(cfg, dp: int) -> TaskData:
    """The samplers of a run with `dp` data-parallel ranks (data.partition="by_file" gives
    rank r its own group of files; validation is never partitioned)."""
    d, seed = cfg.data, cfg.run.seed
    if is_classification(cfg):
        from loomtrain.data.digits import ExampleSampler, load_digits

        train, val, desc = load_digits(d.val_fraction, d.classes)
        return TaskData(ExampleSampler(train, seed), ExampleSampler(val, seed + 1), desc, 1)
    corpus = load_data(d, cfg.model.vocab_size)
    if d.packing:
        require_documents(corpus, d.source)
    seq_len = cfg.model.seq_len
    train = WindowSampler(corpus.train, seq_len, seed, corpus.train_doc_starts)
    if d.partition == "by_file":
        train = PartitionedSampler(corpus, seq_len, seed, dp, cfg.train.global_batch // dp)
    val = WindowSampler(corpus.val, seq_len, seed + 1, corpus.val_doc_starts)
    return TaskData(train, val, corpus.description, seq_len)


def check_task_data(cfg) -> str:
    """Before any process starts: the source loads and both splits hold a row (DataError
    otherwise). Returns its description."""
    if is_classification(cfg):
        from loomtrain.data.digits import load_digits

        return load_digits(cfg.data.val_fraction, cfg.data.classes)[2]
    corpus = load_data(cfg.data, cfg.model.vocab_size)
    require_windows(corpus, cfg.model.seq_len, cfg.data.source)
    if cfg.data.packing:
        require_documents(corpus, cfg.data.source)
    return corpus.description
