"""Token files: raw little-endian ids, their width named by the suffix, and the sidecars
`loom tokenize` writes beside them. Format: docs/data.md, "Token files".

- `*.bin`, `*.u16`: uint16 ids (vocabularies up to 65,536), as before this module;
- `*.u32`: uint32 ids (any larger vocabulary);
- `FILE.docs` (optional): uint64 offsets of the documents' first tokens, ascending from 0;
  with it the file is made of documents, for data.packing and data.partition="by_file".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loomtrain.errors import DataError

WIDTHS = {".bin": np.uint16, ".u16": np.uint16, ".u32": np.uint32}
TOKEN_FILE_SUFFIXES = tuple(WIDTHS)
DOCS_SUFFIX = ".docs"


def is_token_file(path: Path) -> bool:
    return path.suffix in WIDTHS


def id_dtype(vocab_size: int) -> type:
    """The narrowest unsigned type that holds every id below `vocab_size`."""
    return np.uint8 if vocab_size <= 1 << 8 else np.uint16 if vocab_size <= 1 << 16 else np.uint32


def docs_path(path: Path) -> Path:
    return path.with_name(path.name + DOCS_SUFFIX)


def _largest(tokens: np.ndarray) -> int:
    """The largest id, read in 16M-token chunks (a memory map is never loaded whole)."""
    return max(int(tokens[i:i + (1 << 24)].max()) for i in range(0, len(tokens), 1 << 24))


def read_token_file(path: Path, vocab_size: int) -> np.ndarray:
    """The ids of token file `path`, memory-mapped; DataError if its size is not whole ids or
    an id is not below `vocab_size`."""
    dtype = np.dtype(WIDTHS[path.suffix])
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise DataError(
            f"data.source={str(path)!r} is a token file ({path.suffix}: raw {dtype.name} ids) but "
            f"its size ({size} bytes) is not a positive multiple of {dtype.itemsize}")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    top = _largest(tokens)
    if top >= vocab_size:
        raise DataError(
            f"data.source={str(path)!r} holds token id {top}, but model.vocab_size={vocab_size}; "
            f"set model.vocab_size to at least {top + 1}")
    return tokens


def read_doc_starts(path: Path, n_tokens: int) -> np.ndarray | None:
    """The document starts of token file `path` (None without a FILE.docs); DataError if they
    do not start at 0, do not ascend or pass the end of the file."""
    sidecar = docs_path(path)
    if not sidecar.is_file():
        return None
    starts = np.fromfile(sidecar, dtype="<u8").astype(np.int64)
    if len(starts) == 0 or starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= n_tokens:
        raise DataError(
            f"{str(sidecar)!r} does not hold the document starts of {str(path)!r} (uint64 "
            f"offsets ascending from 0, each below its {n_tokens} tokens); remake both with "
            "`loom tokenize`, or delete it to read the file as one stream")
    return starts


def split_doc_starts(starts: np.ndarray, cut: int) -> tuple[np.ndarray, np.ndarray]:
    """The starts of the documents of tokens [0, cut) and of [cut, end) (offset to the cut),
    where the cut may fall inside a document: its tail starts the second part."""
    train, val = starts[starts < cut], starts[starts >= cut] - cut
    if len(val) == 0 or val[0] != 0:
        val = np.concatenate([[0], val])
    return train, val
