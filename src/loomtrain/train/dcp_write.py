"""A checkpoint's files written by DCP, with write errors named: a full disk, a quota, a
file-size limit, a read-only or failing filesystem during a save end every rank with the same
WriteError, naming each file that failed and its OS error, and nothing of the unfinished
checkpoint is left (train/checkpoint.py publishes only what was written whole). What is
guaranteed: docs/checkpoints.md, "Write errors".
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from loomtrain.errors import CheckpointError, WriteError
from loomtrain.writes import writing


def root_causes(err: CheckpointException) -> str:
    """One line per failed rank instead of DCP's concatenated tracebacks."""
    parts = []
    for rank, (exc, _) in sorted(err.failures.items()):
        lines = str(exc).strip().splitlines()
        parts.append(f"rank {rank}: {type(exc).__name__}" + (f": {lines[0]}" if lines else ""))
    return "; ".join(parts)


def write_state(state: dict, partial: Path, planner=None, no_dist: bool = False,
                remove: bool = True) -> None:
    """`state` written by DCP into the folder `partial` (collective unless `no_dist`). A write
    that fails on any rank raises, on every rank, WriteError naming each failed file and its
    OS error, once DCP has gathered every rank's outcome; then (`remove`: one rank does it)
    the folder is removed, to give back its space. Any other failure: CheckpointError."""
    try:
        with warnings.catch_warnings():  # no_dist is meant: DCP warns that it assumes so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            writer = dcp.FileSystemWriter(partial, sync_files=True)
            writer.fs = _NamingFileSystem()
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=no_dist)
    except CheckpointException as err:
        failed = [exc for _, (exc, _) in sorted(err.failures.items())
                  if isinstance(exc, WriteError)]
        if not failed:
            raise CheckpointError(f"could not write checkpoint {str(partial)!r}: "
                                  f"{root_causes(err)}") from None
        raise not_saved(partial, "; ".join(dict.fromkeys(map(str, failed))), remove) from None


def not_saved(partial: Path, why: str, remove: bool) -> WriteError:
    """The error of a checkpoint not saved because of `why`; its folder `partial` removed
    (`remove`: by one rank)."""
    if remove:
        shutil.rmtree(partial, ignore_errors=True)
    return WriteError(f"checkpoint {partial.name.split('.')[0]} was not saved ({why}; "
                      "what was written of it is removed)")


class _NamingFileSystem(FileSystem):
    """DCP's files, whose failed writes name the file and the OS error (a WriteError, which
    DCP gathers from every rank). A tensor goes through torch.save's zip writer, which reports
    a failed write as "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected
    pos 704 vs 598" and drops the OS error (measured, torch 2.13, a write past RLIMIT_FSIZE);
    one more byte written to the file then fails with the error that stopped it."""

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        # writing() also covers the close, whose flush of what is buffered may fail the same way
        with writing(path), super().create_stream(path, mode) as stream:
            try:
                yield stream
            except RuntimeError:
                stream.write(b"\0")  # with what the failed write left in the buffer:
                stream.flush()  # raises the OS error, if that was the cause
                raise

    def mkdir(self, path) -> None:
        with writing(path):
            super().mkdir(path)

    def rename(self, path, new_path) -> None:
        with writing(new_path):
            super().rename(path, new_path)
