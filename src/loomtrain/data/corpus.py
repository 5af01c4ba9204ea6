"""Corpora: a source's documents through a tokenizer, or a token file, split into train and
validation token arrays.

Sources (data/documents.py): the standard library ("stdlib", and its "stdlib-code" and
"stdlib-tests" halves), a text file or folder, a JSON Lines or Parquet file, or a token file
(data/tokenfile.py). Documents (files, records) decide the split: validation holds out whole
ones, by a CRC32 of their name. Details: docs/data.md and docs/finetune.md.
"""

from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass

import numpy as np

from loomtrain.data import documents as docs
from loomtrain.data.documents import STDLIB_DOMAINS
from loomtrain.data.tokenfile import id_dtype, read_doc_starts, read_token_file, split_doc_starts
from loomtrain.data.tokenizer import ByteTokenizer, data_tokenizer
from loomtrain.errors import DataError


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # 1-D token ids (uint8 for bytes, uint16 or uint32 for larger vocabularies)
    val: np.ndarray
    description: str
    # offsets of the documents' first tokens in `train` / `val` (None: not made of documents)
    train_doc_starts: np.ndarray | None = None
    val_doc_starts: np.ndarray | None = None


def _is_val(name: str, val_fraction: float) -> bool:
    return zlib.crc32(name.encode()) < val_fraction * 2**32


def _concatenate(parts: list[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
    """(the ids of `parts` end to end, the offset of each part's first id)."""
    starts = np.cumsum([0] + [len(p) for p in parts[:-1]])
    return np.concatenate([np.zeros(0, dtype), *parts]).astype(dtype, copy=False), starts


def _read_documents(source: str, val_fraction: float, tokenizer, fields) -> tuple[np.ndarray, ...]:
    """Train and validation ids of a source made of documents, and their document starts."""
    found = list(docs.documents(source, *fields))
    if not found:
        raise DataError(f"data.source={source!r} holds no documents")
    names, texts = zip(*found)
    held = [_is_val(n, val_fraction) for n in names]
    if not any(held):  # too few documents for the hash to pick one: hold out the last
        held[-1] = True
    ids = tokenizer.encode_many(list(texts))
    dtype = id_dtype(tokenizer.vocab_size)
    train, train_starts = _concatenate([i for i, h in zip(ids, held) if not h], dtype)
    val, val_starts = _concatenate([i for i, h in zip(ids, held) if h], dtype)
    return train, val, train_starts, val_starts


def _tail_split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = len(tokens) - max(1, int(len(tokens) * val_fraction))
    return tokens[:cut], tokens[cut:]


def _read_token_source(source: str, val_fraction: float, vocab_size: int) -> tuple:
    """A token file's two splits (its tail is validation) and, with its FILE.docs sidecar,
    their document starts."""
    path = docs.source_path(source)
    tokens = read_token_file(path, vocab_size)
    train, val = _tail_split(tokens, val_fraction)
    starts = read_doc_starts(path, len(tokens))
    split = (None, None) if starts is None else split_doc_starts(starts, len(train))
    made = "" if starts is None else f", {len(starts)} documents"
    return train, val, *split, f"{source}: {tokens.dtype.name} tokens{made}"


def load_data(data, vocab_size: int) -> Corpus:
    """The corpus of a [data] section, through the tokenizer it names."""
    return load_corpus(data.source, data.val_fraction, vocab_size, data_tokenizer(data),
                       (data.text_field, data.text_column))


def load_corpus(source: str, val_fraction: float, vocab_size: int, tokenizer=None,
                fields: tuple[str, str] = ("text", "text")) -> Corpus:
    """The train and validation tokens of `source` through `tokenizer` (default: bytes);
    `fields`: the JSON Lines field and the Parquet column of the text. DataError names what
    cannot be used."""
    tokenizer = tokenizer or ByteTokenizer()
    try:
        return _load_corpus(source, val_fraction, vocab_size, tokenizer, fields)
    except OSError as err:  # a file without read permission, a device that fails to read
        raise DataError(f"data.source={source!r}: cannot read {str(err.filename or source)!r} "
                        f"({err.strerror or err})") from None


def _describe(source: str, kind: str, count: int) -> str:
    if source in STDLIB_DOMAINS:
        part = {"stdlib-code": " without its test modules", "stdlib-tests": " test modules"}
        return f"Python {'.'.join(map(str, sys.version_info[:2]))} stdlib{part.get(source, '')}, {count} files"
    return f"{source}: {count} {'files' if kind == 'files' else 'records'}"


def _load_corpus(source: str, val_fraction: float, vocab_size: int, tokenizer, fields) -> Corpus:
    starts = [None, None]
    kind = docs.kind_of(source)
    if kind == "tokens":
        train, val, *starts, desc = _read_token_source(source, val_fraction, vocab_size)
    elif kind == "text":
        tokens = tokenizer.encode(docs.source_path(source).read_bytes())
        train, val = _tail_split(tokens.astype(id_dtype(tokenizer.vocab_size), copy=False), val_fraction)
        desc = f"{source}: {'bytes' if isinstance(tokenizer, ByteTokenizer) else 'tokens'}"
    else:
        train, val, *starts = _read_documents(source, val_fraction, tokenizer, fields)
        desc = _describe(source, kind, len(starts[0]) + len(starts[1]))
    if train.dtype == np.uint8 and vocab_size < 256:  # the stdlib too: its bytes reach 255
        top = max(int(split.max()) for split in (train, val) if len(split))
        raise DataError(
            f"data.source={source!r} is read as bytes (ids 0-255; its largest is {top}), but "
            f"model.vocab_size={vocab_size}; set model.vocab_size = 256"
        )
    if kind != "tokens" and tokenizer.vocab_size > vocab_size:
        raise DataError(f"data.tokenizer has {tokenizer.vocab_size} tokens, but model.vocab_size="
                        f"{vocab_size}; set model.vocab_size = {tokenizer.vocab_size}")
    return Corpus(train=train, val=val, description=f"{desc} ({len(train)} train / {len(val)} val tokens)",
                  train_doc_starts=starts[0], val_doc_starts=starts[1])


def require_windows(corpus: Corpus, seq_len: int, source: str) -> None:
    """Both splits must hold at least one window of seq_len + 1 tokens."""
    for split, tokens in (("train", corpus.train), ("validation", corpus.val)):
        if len(tokens) < seq_len + 1:
            raise DataError(
                f"data.source={source!r}: the {split} split has {len(tokens)} tokens, too few for "
                f"one window of model.seq_len+1 = {seq_len + 1}; lower model.seq_len, raise "
                f"data.val_fraction, or give more data")


def require_documents(corpus: Corpus, source: str) -> None:
    """data.packing needs documents: a source made of files or records."""
    if corpus.train_doc_starts is None:
        raise DataError(
            f"data.packing=true masks attention at document boundaries, and the documents are "
            f"the source's files or records, but data.source={source!r} is a single text file "
            f"(or a token file without its FILE.docs); give \"stdlib\", a folder of text files, "
            f"a JSON Lines or Parquet file or a token file made by `loom tokenize`, or set "
            f"data.packing=false")
