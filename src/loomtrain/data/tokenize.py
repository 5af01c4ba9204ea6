"""`loom tokenize SRC --tokenizer T --out FILE`: a text source into a token file, streamed.

Documents are read one at a time and their ids written a chunk at a time, so the corpus is
never held in memory (a single text file is one document, read whole). Beside FILE it writes
FILE.docs (the documents' starts, data/tokenfile.py) and, for a tokenizer other than bytes,
FILE.tokenizer.json. While it runs, FILE.progress records the documents and tokens written
and committed; a rerun of the same command after an interrupt truncates FILE and FILE.docs back
to it and continues, and gives the same bytes as a run never interrupted. docs/data.md.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from loomtrain.data import documents as docs
from loomtrain.data.tokenfile import WIDTHS, docs_path
from loomtrain.data.tokenizer import BYTES, load_tokenizer
from loomtrain.errors import ConfigError
from loomtrain.writes import write_atomic

# documents per chunk, and the bytes of text that end one early: what is encoded, written
# and committed at once
CHUNK_DOCUMENTS, CHUNK_BYTES = 512, 1 << 20


def progress_path(out: Path) -> Path:
    return out.with_name(out.name + ".progress")


def _check_out(out: Path, vocab_size: int) -> np.dtype:
    """The id type of `out`, by its suffix; ConfigError if it names none or is too narrow."""
    if out.suffix not in WIDTHS:
        raise ConfigError(f"--out {str(out)!r}: a token file ends in {', '.join(WIDTHS)} (uint16 "
                          "ids for .bin and .u16, uint32 for .u32)")
    dtype = np.dtype(WIDTHS[out.suffix])
    if vocab_size > np.iinfo(dtype).max + 1:
        raise ConfigError(f"--out {str(out)!r} holds {dtype.name} ids, below {np.iinfo(dtype).max + 1}, "
                          f"but the tokenizer has {vocab_size} tokens; name a .u32 file")
    return dtype


def _resume_point(out: Path, job: dict) -> tuple[int, int]:
    """(documents, tokens) already committed by an interrupted run of the same `job`, else
    (0, 0): a progress file of another source or tokenizer is not continued."""
    try:
        done = json.loads(progress_path(out).read_text())
    except (OSError, ValueError):
        return 0, 0
    if {k: done.get(k) for k in job} != job:
        print(f"loom tokenize: {progress_path(out)} is of another source or tokenizer; "
              "starting over", file=sys.stderr)
        return 0, 0
    return int(done["documents"]), int(done["tokens"])


def _chunks(stream):
    """Lists of (name, bytes) of at most CHUNK_DOCUMENTS documents or about CHUNK_BYTES."""
    chunk, size = [], 0
    for doc in stream:
        chunk.append(doc)
        size += len(doc[1])
        if len(chunk) == CHUNK_DOCUMENTS or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def tokenize(source: str, spec: str, out: Path, text_field: str = "text",
             text_column: str = "text", progress: bool = True,
             stop_after: int | None = None) -> tuple[int, int]:
    """Write the ids of `source` through tokenizer `spec` into token file `out`, continuing an
    interrupted run; `stop_after`: commit after that many documents and return (as an
    interrupt would). Returns (documents, tokens) in the file."""
    from tqdm import tqdm

    if docs.kind_of(source) == "tokens":
        raise ConfigError(f"loom tokenize {source!r}: it is a token file already; give a text source")
    tokenizer = load_tokenizer(spec, source, text_field, text_column)
    dtype = _check_out(out, tokenizer.vocab_size)
    job = {"source": source, "identity": docs.identity(source), "tokenizer": spec,
           "text_field": text_field, "text_column": text_column, "out": out.suffix}
    n_docs, n_tokens = _resume_point(out, job)
    total = docs.count(source)
    bar = tqdm(total=total, initial=n_docs, unit="doc", file=sys.stderr, disable=not progress,
               desc=f"tokenize {out.name}")
    # the bar closes (ends its line) before an error is printed
    with bar, open(out, "ab") as ids, open(docs_path(out), "ab") as starts:
        ids.truncate(n_tokens * dtype.itemsize)  # what was written after the last commit
        starts.truncate(n_docs * 8)
        stream = docs.documents(source, text_field, text_column, skip=n_docs)
        for chunk in _chunks(stream):
            if stop_after is not None:
                chunk = chunk[:max(0, stop_after - n_docs)]
                if not chunk:
                    return n_docs, n_tokens
            encoded = tokenizer.encode_many([text for _, text in chunk])
            lengths = np.array([len(e) for e in encoded], dtype=np.int64)
            np.concatenate([n_tokens, n_tokens + np.cumsum(lengths[:-1])], axis=None).astype("<u8").tofile(starts)
            np.concatenate(encoded).astype(dtype.newbyteorder("<")).tofile(ids)
            for f in (ids, starts):
                f.flush()
                os.fsync(f.fileno())
            n_docs, n_tokens = n_docs + len(chunk), n_tokens + int(lengths.sum())
            write_atomic(progress_path(out), json.dumps({**job, "documents": n_docs, "tokens": n_tokens}))
            bar.update(len(chunk))
    _finish(out, spec, tokenizer)
    return n_docs, n_tokens


def _finish(out: Path, spec: str, tokenizer) -> None:
    """The tokenizer beside the file, and no progress file: the file is whole."""
    if spec != BYTES:
        write_atomic(out.with_name(out.name + ".tokenizer.json"), tokenizer.path.read_text())
    progress_path(out).unlink(missing_ok=True)
