"""Byte-level corpora and token files, split into train and validation token arrays.

Sources: the standard library ("stdlib", and its "stdlib-code" and "stdlib-tests" halves), a
text file or folder, or a pre-tokenized uint16 token file. Files are documents, and validation
holds out whole files. Details: docs/training.md, "Data", and docs/finetune.md.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loomtrain.errors import DataError

TOKEN_FILE_SUFFIXES = (".bin", ".u16")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# data.source names of the standard library: all of it, its code without the test modules,
# and the test modules alone
STDLIB_DOMAINS = ("stdlib", "stdlib-code", "stdlib-tests")
# package folders whose every file is a test module, at any depth (test/, unittest/test/,
# lib2to3/tests/ with its data/, idlelib/idle_test/)
TEST_PACKAGES = frozenset({"test", "tests", "idle_test"})


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # 1-D token ids (uint8 for bytes, uint16 for token files)
    val: np.ndarray
    description: str
    # offsets of the documents' first tokens in `train` / `val` (None: not made of files)
    train_doc_starts: np.ndarray | None = None
    val_doc_starts: np.ndarray | None = None


def is_stdlib_test(rel_path: str) -> bool:
    """Whether the standard-library file at `rel_path` (relative to the stdlib root, with "/")
    is a test module: a folder on its path is named test, tests or idle_test, or its name is
    test_*.py. Python 3.11: 1,056 of the 1,790 files (19.4 of 31.5 MB), 820 of them under
    test/; unittest/ itself and doctest.py are library code."""
    *folders, name = rel_path.split("/")
    return name.startswith("test_") or any(f in TEST_PACKAGES for f in folders)


def stdlib_files(domain: str = "stdlib") -> tuple[Path, list[Path]]:
    """(root, files) of a `STDLIB_DOMAINS` domain, in sorted relative-path order."""
    assert domain in STDLIB_DOMAINS, domain
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        files.extend(Path(folder) / n for n in names if n.endswith(".py"))
    files = sorted(files, key=lambda p: p.relative_to(root).as_posix())
    if domain == "stdlib":
        return root, files
    tests = domain == "stdlib-tests"
    return root, [p for p in files if is_stdlib_test(p.relative_to(root).as_posix()) == tests]


def _is_val(rel_path: str, val_fraction: float) -> bool:
    return zlib.crc32(rel_path.encode()) < val_fraction * 2**32


def _read_files(root: Path, files: list[Path], val_fraction: float) -> tuple[np.ndarray, ...]:
    train, val = [], []
    for path in files:
        rel = path.relative_to(root).as_posix()
        (val if _is_val(rel, val_fraction) else train).append(path.read_bytes() + b"\n")
    if not val:  # too few files for the hash to pick one: hold out the last file
        val.append(train.pop())
    as_array = lambda parts: np.frombuffer(b"".join(parts), dtype=np.uint8)  # noqa: E731
    starts = lambda parts: np.cumsum([0] + [len(p) for p in parts[:-1]])  # noqa: E731
    return as_array(train), as_array(val), starts(train), starts(val)


def _tail_split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = len(tokens) - max(1, int(len(tokens) * val_fraction))
    return tokens[:cut], tokens[cut:]


def _token_file(path: Path, vocab_size: int) -> np.ndarray:
    size = path.stat().st_size
    if size == 0 or size % 2:
        raise DataError(
            f"data.source={str(path)!r} is a token file ({'/'.join(TOKEN_FILE_SUFFIXES)}) but its "
            f"size ({size} bytes) is not a positive multiple of 2: token files hold raw uint16 ids"
        )
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    top = max(int(tokens[i:i + (1 << 24)].max()) for i in range(0, len(tokens), 1 << 24))
    if top >= vocab_size:
        raise DataError(
            f"data.source={str(path)!r} holds token id {top}, but model.vocab_size={vocab_size}; "
            f"set model.vocab_size to at least {top + 1}"
        )
    return tokens


def load_corpus(source: str, val_fraction: float, vocab_size: int) -> Corpus:
    """The train and validation tokens of `source`; DataError names what cannot be used."""
    try:
        return _load_corpus(source, val_fraction, vocab_size)
    except OSError as err:  # a file without read permission, a device that fails to read
        raise DataError(f"data.source={source!r}: cannot read {str(err.filename or source)!r} "
                        f"({err.strerror or err})") from None


def _load_corpus(source: str, val_fraction: float, vocab_size: int) -> Corpus:
    starts = [None, None]
    if source in STDLIB_DOMAINS:
        root, files = stdlib_files(source)
        train, val, *starts = _read_files(root, files, val_fraction)
        part = {"stdlib-code": " without its test modules", "stdlib-tests": " test modules"}
        desc = (f"Python {'.'.join(map(str, __import__('sys').version_info[:2]))} stdlib"
                f"{part.get(source, '')}, {len(files)} files")
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(
                f"data.source={source!r} does not exist; give \"stdlib\" (or \"stdlib-code\", "
                f"\"stdlib-tests\"), \"digits\", a text file, a folder of text files, or a uint16 "
                f"token file ({', '.join(TOKEN_FILE_SUFFIXES)})"
            )
        if path.is_dir():
            files = sorted((p for p in path.rglob("*") if p.is_file()),
                           key=lambda p: p.relative_to(path).as_posix())
            if not files:
                raise DataError(f"data.source={source!r} is a folder with no files in it")
            train, val, *starts = _read_files(path, files, val_fraction)
            desc = f"{source}: {len(files)} files"
        elif path.suffix in TOKEN_FILE_SUFFIXES:
            train, val = _tail_split(_token_file(path, vocab_size), val_fraction)
            desc = f"{source}: uint16 tokens"
        else:
            train, val = _tail_split(np.frombuffer(path.read_bytes(), dtype=np.uint8), val_fraction)
            desc = f"{source}: bytes"
    if train.dtype == np.uint8 and vocab_size < 256:  # the stdlib too: its bytes reach 255
        top = max(int(split.max()) for split in (train, val) if len(split))
        raise DataError(
            f"data.source={source!r} is read as bytes (ids 0-255; its largest is {top}), but "
            f"model.vocab_size={vocab_size}; set model.vocab_size = 256"
        )
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
    """data.packing needs documents: a source made of files."""
    if corpus.train_doc_starts is None:
        raise DataError(
            f"data.packing=true masks attention at document boundaries, and the documents are "
            f"the source's files, but data.source={source!r} is a single file; give \"stdlib\" "
            f"or a folder of text files, or set data.packing=false")
