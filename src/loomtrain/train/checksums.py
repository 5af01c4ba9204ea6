"""Checksums of a checkpoint's files: written when it is published, checked before it is read.

DCP has no checksums: bytes changed inside a tensor file keep its length and load silently
(torch 2.13). So `publish` records every file's size and SHA-256 in loom.json (`files`), and
loom.json's own SHA-256 over its other keys (`sha256`); `check` compares them before DCP opens
anything. SHA-256 rather than CRC-32 (about twice as fast here) because `sha256sum` checks the
same figures by hand and no damage goes unseen by chance; the cost: docs/checkpoints.md,
"Checksums".
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from loomtrain.errors import CheckpointError

FILES, SEAL = "files", "sha256"  # loom.json keys


def file_sha256(file: Path) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def manifest(folder: Path, skip: str) -> dict[str, dict]:
    """{name: {"bytes": size, "sha256": hex}} of every file in `folder` except `skip`."""
    return {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
            for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != skip}


def _seal_of(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != SEAL}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def sealed(meta: dict, files: dict[str, dict]) -> dict:
    """`meta` with the manifest `files` and the seal over both: what loom.json holds."""
    meta = {**meta, FILES: files}
    return {**meta, SEAL: _seal_of(meta)}


def check_seal(path: Path, name: str, meta: dict) -> None:
    """loom.json (`name`) of checkpoint `path` unchanged since it was written, if it is sealed."""
    if SEAL not in meta and FILES not in meta:
        return  # written before checksums: `check` says so
    if meta.get(SEAL) != _seal_of(meta) or not isinstance(meta.get(FILES), dict):
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {name} differs from its "
                              f"checksum (its \"{SEAL}\" key): a value in it was changed")


def check(path: Path, meta: dict) -> bool:
    """Every file in loom.json's manifest is in `path` with its size and SHA-256
    (CheckpointError naming the first that is not). False: `meta` has no manifest (a
    checkpoint written before checksums), nothing checked."""
    files = meta.get(FILES)
    if files is None:
        return False
    for name, want in sorted(files.items()):
        file = Path(path) / name
        if Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"checkpoint {str(path)!r}: its manifest names file {name!r}")
        if not file.is_file():
            problem = "is missing"
        elif file.stat().st_size != want["bytes"]:
            problem = f"has {file.stat().st_size} of its {want['bytes']} bytes"
        elif (digest := file_sha256(file)) != want["sha256"]:
            problem = (f"has other bytes than were saved (SHA-256 {digest[:16]}..., saved as "
                       f"{want['sha256'][:16]}...)")
        else:
            continue
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {name} {problem}")
    return True
