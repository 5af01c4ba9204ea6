"""Byte-level corpora, token files and the deterministic distributed sampler."""

from loomtrain.data.corpus import Corpus, load_corpus, require_documents, require_windows
from loomtrain.data.sampler import WindowSampler, eval_samples, rank_samples

__all__ = ["Corpus", "WindowSampler", "eval_samples", "load_corpus", "rank_samples",
           "require_documents", "require_windows"]
