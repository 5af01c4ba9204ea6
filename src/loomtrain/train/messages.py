"""Errors inside the ranks reach the user once. A rank that ends on an error meant for people
(a UserError, a non-finite abort, a failed collective) leaves its message in a folder its
launcher made (`leave`) and exits with the error's code; the launcher prints each distinct
message once (`report`), or, for a lost parameter-server worker, in the one line that reports
the loss (`take`). Printed by the ranks, the same message came once per rank, and torch's
launcher added its traceback; under torchrun or at nproc 1 the rank prints it itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import NoReturn

COLLECTIVE = 4  # a failed collective: the exit code of a rank whose peer went away


def process_code(code: int) -> int:
    """A rank that ends on a message exits 2, 3 or 4; a message about a peer that died without
    one calls for the job's exit code 1 (a crash), which this rank's own exit code must not
    claim: the launcher would take this rank for the crashed one."""
    return code if code in (2, 3, 4) else COLLECTIVE


def leave(errors: Path | str | None, code: int, text: str, cause: bool = True) -> NoReturn:
    """End this process (from any thread) on `text`, which calls for the job's exit code
    `code`: left in `errors` for the launcher (the file whole, or not there; `cause`: the text
    names the cause, not a consequence of another rank's failure), or printed here when there
    is no such folder or it cannot take it (its disk is full too). The exit skips the
    interpreter's teardown, where gloo may abort a rank whose peers are gone ("terminate
    called without an active exception": exit -6 instead of the code)."""
    try:
        if errors is None:
            raise OSError("no folder for messages")
        partial = Path(errors) / f"{os.getpid()}.partial"
        partial.write_text(text)
        kind = "" if cause else "-after"
        os.replace(partial, partial.with_name(f"{os.getpid()}-{code}{kind}.txt"))
    except OSError:
        print(f"error: {text}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(process_code(code))


def keep_traceback(errors: Path | str, rank: int) -> None:
    """The traceback of the exception being handled (a bug: not an error for people, which
    ends its rank through `leave`), left in `errors` for the launcher to print once: torch's
    worker wrapper catches it into its own error file, and its launcher reports one failed
    rank, not always this one (measured, torch 2.13: the rank a crashed peer's collective
    failed in)."""
    import traceback

    with contextlib.suppress(OSError):  # the launcher then says only which rank ended
        # its own partial name: the heartbeat's thread may be leaving a message (`leave`) too
        partial = Path(errors) / f"{os.getpid()}.traceback-partial"
        partial.write_text(traceback.format_exc())
        os.replace(partial, Path(errors) / f"rank{rank}-{os.getpid()}.traceback")


def print_traceback(errors: Path) -> None:
    """The first traceback a rank kept (`keep_traceback`), each line marked with its rank,
    once; every kept one is removed (the same bug in another rank would only repeat it)."""
    kept = sorted(Path(errors).glob("*.traceback"), key=lambda p: p.stat().st_mtime)
    if kept:
        rank = kept[0].stem.split("-")[0].removeprefix("rank")
        print("".join(f"[rank {rank}] {line}\n" for line in kept[0].read_text().splitlines()),
              end="", file=sys.stderr, flush=True)
    for file in kept:
        file.unlink()


def _left(errors: Path, pattern: str) -> list[tuple[int, bool, str]]:
    """(exit code, whether it names the cause, message) of the files matching `pattern`,
    first written first."""
    files = sorted(Path(errors).glob(pattern), key=lambda p: p.stat().st_mtime)
    found = []
    for p in files:
        parts = p.stem.split("-")
        found.append((int(parts[1]), parts[2:] != ["after"], p.read_text()))
    return found


def codes(errors: Path) -> set[int]:
    """The exit codes the messages left in `errors` call for (said ones included)."""
    return {code for code, _, _ in _left(errors, "*.txt") + _left(errors, "*.said")}


def named(errors: Path) -> bool:
    """Whether a message left in `errors` names a cause (not only a failed collective)."""
    return any(cause for _, cause, _ in _left(errors, "*.txt"))


def take(errors: Path, pid: int) -> str | None:
    """The message rank `pid` left, if any, marked as said: `report` does not repeat it."""
    for file in Path(errors).glob(f"{pid}-*.txt"):
        text = file.read_text()
        file.rename(file.with_suffix(".said"))
        return text
    return None


def report(errors: Path) -> int:
    """Print each distinct message the ranks left in `errors` once, first come first, and
    return the exit code of the first (0: none was left). A rank whose collective failed
    because a peer left (on an error of its own, or dead) only echoes that: such messages
    are printed only when no rank left one that names a cause. Messages already said
    (`take`) are not printed again."""
    said = {text for _, _, text in _left(errors, "*.said")}
    found = _left(errors, "*.txt")
    causes = [m for m in found if m[1]] or found
    for text in dict.fromkeys(text for _, _, text in causes if text not in said):
        print(f"error: {text}", file=sys.stderr, flush=True)
    return causes[0][0] if causes else 0
