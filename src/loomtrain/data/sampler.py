"""Deterministic distributed sampling of fixed-length windows.

Sample g of the run is a window of a permutation seeded by (seed, epoch); step s covers
samples [s*B, (s+1)*B), dp rank r takes the r-th slice, so the data-loader position is the
step number alone. Details: docs/training.md, "Data".
"""

from __future__ import annotations

import numpy as np
import numpy.random  # noqa: F401  numpy 2 loads it on first use: inside a timed step otherwise
import torch


class EpochOrder:
    """Sample g -> item perm_e[g mod n] of epoch e = g // n, perm_e a permutation of the n
    items seeded by (seed, e); the current epoch's permutation is cached."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._perm_epoch, self._perm = -1, None

    def __call__(self, sample: int) -> int:
        epoch, offset = divmod(sample, self.n)
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.n), epoch
        return int(self._perm[offset])


class WindowSampler:
    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int,
                 doc_starts: np.ndarray | None = None, starts: np.ndarray | None = None):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.doc_starts = doc_starts  # ascending offsets of documents' first tokens (packing)
        self.starts = starts  # token offsets of the windows (None: every seq_len-th from 0)
        self.windows = (len(tokens) - 1) // seq_len if starts is None else len(starts)
        if self.windows < 1:
            raise ValueError(f"{len(tokens)} tokens are too few for one window of {seq_len + 1}")
        self.window_of = EpochOrder(self.windows, seed)

    def start_of(self, sample: int) -> int:
        """The token offset of the window of `sample`."""
        window = self.window_of(sample)
        return window * self.seq_len if self.starts is None else int(self.starts[window])

    def batch(self, samples: range) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [len(samples), seq_len] int64."""
        rows = []
        for g in samples:
            start = self.start_of(g)
            rows.append(np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        block = torch.from_numpy(np.stack(rows))
        return block[:, :-1], block[:, 1:]

    def documents(self, samples: range) -> torch.Tensor:
        """[len(samples), seq_len] int64: the document of every input token (packing), as the
        number of its document in the stream; a window packs the documents it cuts through."""
        assert self.doc_starts is not None, "the sampler was built without document starts"
        offsets = np.arange(self.seq_len)
        positions = np.stack([self.start_of(g) + offsets for g in samples])
        return torch.from_numpy(np.searchsorted(self.doc_starts, positions, side="right") - 1)


def rank_samples(step: int, global_batch: int, dp_rank: int, dp_size: int, micro_batch: int,
                 micro: int) -> range:
    """Global sample numbers of micro-batch `micro` of data-parallel rank `dp_rank` at `step`."""
    per_rank = global_batch // dp_size
    start = step * global_batch + dp_rank * per_rank + micro * micro_batch
    return range(start, start + micro_batch)


def eval_samples(batches: int, micro_batch: int, dp_rank: int, dp_size: int) -> list[range]:
    """A fixed validation set of `batches` micro-batches, dealt round-robin to the dp ranks."""
    return [range(b * micro_batch, (b + 1) * micro_batch)
            for b in range(batches) if b % dp_size == dp_rank]
