"""The documents of a text source, read one at a time: the standard library's files, a
folder's files, the records of a JSON Lines or Parquet file, or a single text file (one
document). Each document is its bytes plus a newline, named by what decides its split (a
file's relative path, a record's number). Sources: docs/data.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from loomtrain.data.tokenfile import TOKEN_FILE_SUFFIXES, is_token_file
from loomtrain.errors import ConfigError, DataError

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# data.source names of the standard library: all of it, its code without the test modules,
# and the test modules alone
STDLIB_DOMAINS = ("stdlib", "stdlib-code", "stdlib-tests")
# package folders whose every file is a test module, at any depth (test/, unittest/test/,
# lib2to3/tests/ with its data/, idlelib/idle_test/)
TEST_PACKAGES = frozenset({"test", "tests", "idle_test"})
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIX = ".parquet"
# Parquet rows read per batch: a batch of text is held in memory at a time
_PARQUET_BATCH = 1024


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


def source_path(source: str) -> Path:
    """The path data.source names; DataError naming the choices if there is nothing there."""
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(
            f"data.source={source!r} does not exist; give \"stdlib\" (or \"stdlib-code\", "
            f"\"stdlib-tests\"), \"digits\", a text file, a folder of text files, a JSON Lines "
            f"({', '.join(JSONL_SUFFIXES)}) or Parquet ({PARQUET_SUFFIX}) file, or a token file "
            f"({', '.join(TOKEN_FILE_SUFFIXES)})")
    return path


def source_files(source: str) -> tuple[Path, list[Path]]:
    """(root, files) of a source made of files (the stdlib or a folder), in sorted order; a
    single file is its own root and only file."""
    if source in STDLIB_DOMAINS:
        return stdlib_files(source)
    path = source_path(source)
    if not path.is_dir():
        return path.parent, [path]
    files = sorted((p for p in path.rglob("*") if p.is_file()),
                   key=lambda p: p.relative_to(path).as_posix())
    if not files:
        raise DataError(f"data.source={source!r} is a folder with no files in it")
    return path, files


def kind_of(source: str) -> str:
    """"files" (the stdlib, a folder), "jsonl", "parquet", "tokens" or "text" (one file)."""
    if source in STDLIB_DOMAINS:
        return "files"
    path = source_path(source)
    if path.is_dir():
        return "files"
    if is_token_file(path):
        return "tokens"
    return {PARQUET_SUFFIX: "parquet", **dict.fromkeys(JSONL_SUFFIXES, "jsonl")}.get(path.suffix, "text")


def identity(source: str) -> str:
    """A hash of what the source's content is taken to be: every file's relative path, size
    and modification time (not its bytes: reading a corpus to key a cache would cost as much
    as the tokenizer). Editing a file changes it."""
    root, files = source_files(source)
    digest = hashlib.sha256(f"{source in STDLIB_DOMAINS and sys.version}\n".encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.relative_to(root).as_posix()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def documents(source: str, text_field: str = "text", text_column: str = "text",
              skip: int = 0) -> Iterator[tuple[str, bytes]]:
    """(name, bytes + b"\\n") of every document of a text source after the first `skip`, in
    order; DataError names a record or file that cannot be read."""
    kind = kind_of(source)
    if kind == "jsonl":
        yield from _jsonl(source_path(source), text_field, skip)
    elif kind == "parquet":
        yield from _parquet(source_path(source), text_column, skip)
    else:
        assert kind != "tokens", "a token file holds no text"
        root, files = source_files(source)
        for path in files[skip:]:
            yield path.relative_to(root).as_posix(), _read(path, source) + b"\n"


def _read(path: Path, source: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:  # a file without read permission, a device that fails to read
        raise DataError(f"data.source={source!r}: cannot read {str(path)!r} "
                        f"({err.strerror or err})") from None


def _jsonl(path: Path, field: str, skip: int) -> Iterator[tuple[str, bytes]]:
    """A JSON Lines file's records' `field`; blank lines are not records."""
    where = lambda n: f"data.source={str(path)!r}, line {n}"  # noqa: E731
    try:
        lines = open(path, "rb")
    except OSError as err:
        raise DataError(f"data.source={str(path)!r} cannot be read ({err.strerror or err})") from None
    with lines:
        record = 0
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record += 1
            if record <= skip:
                continue
            try:
                value = json.loads(line)
            except ValueError as err:
                raise DataError(f"{where(n)} is not JSON ({err}); JSON Lines hold one JSON "
                                "object per line") from None
            if not isinstance(value, dict) or not isinstance(value.get(field), str):
                keys = sorted(value) if isinstance(value, dict) else type(value).__name__
                raise DataError(f"{where(n)} has no text in field {field!r} (its keys: {keys}); "
                                f"set data.text_field (or --text-field) to the field with the text")
            yield str(record - 1), value[field].encode("utf-8") + b"\n"


def count(source: str) -> int | None:
    """The number of documents, where it is known without reading them (None: JSON Lines)."""
    kind = kind_of(source)
    if kind == "parquet":
        with _parquet_errors(source_path(source)):
            return _pyarrow_parquet().ParquetFile(source_path(source)).metadata.num_rows
    return None if kind == "jsonl" else len(source_files(source)[1])


def _pyarrow_parquet():
    try:
        import pyarrow.parquet
    except ImportError:
        raise ConfigError("a Parquet source is read with pyarrow, which is not installed: "
                          "pip install 'loomtrain[hf]' (or pip install pyarrow)") from None
    return pyarrow.parquet


@contextlib.contextmanager
def _parquet_errors(path: Path):
    """A file pyarrow cannot read as Parquet, as a DataError naming it."""
    import pyarrow
    try:
        yield
    except (pyarrow.ArrowException, OSError) as err:
        raise DataError(f"data.source={str(path)!r} cannot be read as Parquet ({err})") from None


def _parquet(path: Path, column: str, skip: int) -> Iterator[tuple[str, bytes]]:
    """A Parquet file's rows' `column`, read a batch of rows at a time; null rows are empty."""
    pq = _pyarrow_parquet()
    with _parquet_errors(path):
        table = pq.ParquetFile(path)
        names = table.schema_arrow.names
        if column not in names:
            raise DataError(f"data.source={str(path)!r} has no column {column!r} (its columns: "
                            f"{names}); set data.text_column (or --text-column)")
        row = 0
        for batch in table.iter_batches(batch_size=_PARQUET_BATCH, columns=[column]):
            for text in batch.column(0).to_pylist():
                row += 1
                if row <= skip:
                    continue
                if text is not None and not isinstance(text, (str, bytes)):
                    raise DataError(f"data.source={str(path)!r}: column {column!r} holds "
                                    f"{type(text).__name__} values, not text")
                data = text.encode("utf-8") if isinstance(text, str) else text or b""
                yield str(row - 1), data + b"\n"
