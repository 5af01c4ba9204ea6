"""Non-IID data (data.partition = "by_file"): each worker trains on its own group of files, the
heterogeneous setting of Ringleader ASGD (Maranjyan & Richtárik, arXiv 2509.22860).

The cut, a part's windows, and how data parallelism and asynchronous SGD read the parts:
docs/training.md, "Non-IID partition".
"""

from __future__ import annotations

import numpy as np
import torch

from loomtrain.data.corpus import Corpus
from loomtrain.data.sampler import WindowSampler
from loomtrain.errors import DataError


def file_groups(doc_starts: np.ndarray, n_tokens: int, parts: int) -> np.ndarray:
    """parts + 1 ascending token offsets: part k is tokens [bounds[k], bounds[k+1]), whole files.

    Cut k (1 <= k < parts) is the file boundary nearest to k * n_tokens / parts, moved where
    needed so that every part holds at least one file."""
    files = len(doc_starts)
    if files < parts:
        raise DataError(
            f"data.partition=\"by_file\" gives each of {parts} workers its own files, but the "
            f"training split has only {files}; use fewer workers, give more files, or set "
            f"data.partition=\"iid\"")
    boundaries = np.append(np.asarray(doc_starts, dtype=np.int64), n_tokens)  # files + 1
    cuts = [0]
    for k in range(1, parts):
        target = k * n_tokens / parts
        after = int(np.searchsorted(boundaries, target))  # first boundary at or past target
        nearest = after - 1 if target - boundaries[after - 1] < boundaries[after] - target else after
        cuts.append(min(max(nearest, cuts[-1] + 1), files - (parts - k)))
    cuts.append(files)
    return boundaries[cuts]


def partition_windows(corpus: Corpus, seq_len: int, part: int, parts: int) -> np.ndarray:
    """The token offsets in `corpus.train` of the windows (seq_len + 1 tokens) of `part`."""
    assert corpus.train_doc_starts is not None, "data.partition=\"by_file\" needs documents"
    assert 0 <= part < parts, (part, parts)
    bounds = file_groups(corpus.train_doc_starts, len(corpus.train), parts)
    first, end = int(bounds[part]), int(bounds[part + 1])
    windows = (end - first - 1) // seq_len
    if windows < 1:
        raise DataError(
            f"data.partition=\"by_file\": worker {part} of {parts} gets {end - first} tokens of "
            f"files, too few for one window of model.seq_len+1 = {seq_len + 1}; use fewer "
            f"workers, lower model.seq_len, or give more data")
    return first + seq_len * np.arange(windows, dtype=np.int64)


def part_sampler(corpus: Corpus, seq_len: int, seed: int, part: int, parts: int
                 ) -> WindowSampler:
    """Worker `part`'s sampler: only its own files' windows, samples numbered within the part."""
    return WindowSampler(corpus.train, seq_len, seed, corpus.train_doc_starts,
                         starts=partition_windows(corpus, seq_len, part, parts))


class PartitionedSampler:
    """The WindowSampler interface over `parts` parts: the global samples are dealt in blocks of
    `rows_per_part` to the parts in turn (the layout of `rank_samples` with rows_per_part =
    global_batch / dp), and sample g is row (g // (rows_per_part * parts)) * rows_per_part +
    g % rows_per_part of part (g // rows_per_part) % parts."""

    def __init__(self, corpus: Corpus, seq_len: int, seed: int, parts: int, rows_per_part: int):
        assert rows_per_part >= 1, rows_per_part
        self.rows_per_part, self.seq_len = rows_per_part, seq_len
        self.parts = [part_sampler(corpus, seq_len, seed, p, parts) for p in range(parts)]

    def locate(self, sample: int) -> tuple[int, int]:
        """(part, sample number within the part) of global sample `sample`."""
        block, row = divmod(sample, self.rows_per_part)
        rounds, part = divmod(block, len(self.parts))
        return part, rounds * self.rows_per_part + row

    def batch(self, samples) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.parts[p].batch([g]) for p, g in map(self.locate, samples)]
        return torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])

    def documents(self, samples) -> torch.Tensor:
        return torch.cat([self.parts[p].documents([g]) for p, g in map(self.locate, samples)])
