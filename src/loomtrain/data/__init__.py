"""Corpora (text through a tokenizer, token files), the deterministic distributed sampler and the non-IID split
of the files between workers."""

from loomtrain.data.corpus import (
    Corpus,
    load_corpus,
    load_data,
    require_documents,
    require_windows,
)
from loomtrain.data.partition import (
    PartitionedSampler,
    file_groups,
    part_sampler,
    partition_windows,
)
from loomtrain.data.sampler import WindowSampler, eval_samples, rank_samples

__all__ = ["Corpus", "PartitionedSampler", "WindowSampler", "eval_samples", "file_groups",
           "load_corpus", "load_data", "part_sampler", "partition_windows", "rank_samples",
           "require_documents", "require_windows"]
