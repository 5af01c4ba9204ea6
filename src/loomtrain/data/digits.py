"""scikit-learn's handwritten digits as a classification task (`data.source = "digits"`).

The examples, the fixed stratified split, `data.classes` and `ExampleSampler` (the
WindowSampler interface over examples): docs/finetune.md, "Digits: a classification task".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loomtrain.data.sampler import EpochOrder

FEATURES, CLASSES = 64, 10  # pixels per image, digits
_MAX_INTENSITY = 16.0  # load_digits' pixels are counts of set bits in 4x4 blocks: 0..16


@dataclass(frozen=True)
class Examples:
    inputs: torch.Tensor  # [n, FEATURES] float32 in [0, 1]
    targets: torch.Tensor  # [n] int64 digits


def split_indices(labels: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) example indices, ascending: per digit, the first round(val_fraction x
    count) of a permutation seeded by 0 (at least one) are held out."""
    order = np.random.default_rng(0).permutation(len(labels))
    val = []
    for digit in np.unique(labels):
        mine = order[labels[order] == digit]
        val.extend(mine[:max(1, round(val_fraction * len(mine)))])
    held = np.zeros(len(labels), dtype=bool)
    held[val] = True
    return np.flatnonzero(~held), np.flatnonzero(held)


def load_digits(val_fraction: float, classes: list[int] | tuple[int, ...] = ()) -> tuple[Examples, Examples, str]:
    """(train, val, description) of the digits in `classes` (empty: all ten)."""
    from sklearn.datasets import load_digits as sklearn_digits  # ~1 s to import: only here

    bunch = sklearn_digits()
    inputs = torch.from_numpy((bunch.data / _MAX_INTENSITY).astype(np.float32))
    labels = bunch.target.astype(np.int64)
    train, val = split_indices(labels, val_fraction)
    kept = sorted(classes) if classes else list(range(CLASSES))
    pick = lambda idx: idx[np.isin(labels[idx], kept)]  # noqa: E731
    train, val = pick(train), pick(val)
    as_examples = lambda idx: Examples(inputs[idx], torch.from_numpy(labels[idx]))  # noqa: E731
    which = "all ten digits" if not classes else f"digits {', '.join(map(str, kept))}"
    desc = (f"scikit-learn digits (8x8 images, {which}): {len(train)} train / {len(val)} val "
            "examples")
    return as_examples(train), as_examples(val), desc


class ExampleSampler:
    """The WindowSampler interface over a fixed set of examples."""

    def __init__(self, examples: Examples, seed: int):
        self.examples = examples
        self.example_of = EpochOrder(len(examples.targets), seed)

    def batch(self, samples: range) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [len(samples), FEATURES] float32, targets [len(samples)] int64)."""
        idx = torch.tensor([self.example_of(g) for g in samples], dtype=torch.int64)
        return self.examples.inputs[idx], self.examples.targets[idx]
