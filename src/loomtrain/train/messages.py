"""Errors inside the ranks reach the user once. A rank that ends on an error meant for people
(a UserError, a non-finite abort, a failed collective) leaves its message in a folder its
launcher made (`leave`) and exits with the error's code; the launcher prints each distinct
message once (`report`), or, for a lost parameter-server worker, in the one line that reports
the loss (`take`). Printed by the ranks, the same message came once per rank, and torch's
launcher added its traceback; under torchrun or at nproc 1 the rank prints it itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

COLLECTIVE = 4  # a failed collective: the exit code of a rank whose peer went away


def leave(errors: Path, code: int, text: str) -> NoReturn:
    """Leave `text` in `errors` for the launcher (the file whole, or not there) and exit with
    `code`, without the interpreter's teardown, where gloo may abort a rank whose peers are
    gone ("terminate called without an active exception": exit -6 instead of `code`). If the
    folder cannot take it (its disk is full too), the message is printed here instead."""
    try:
        partial = Path(errors) / f"{os.getpid()}.partial"
        partial.write_text(text)
        os.replace(partial, partial.with_name(f"{os.getpid()}-{code}.txt"))
    except OSError:
        print(f"error: {text}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _left(errors: Path, pattern: str) -> list[tuple[int, str]]:
    """(exit code, message) of the files matching `pattern`, first written first."""
    files = sorted(Path(errors).glob(pattern), key=lambda p: p.stat().st_mtime)
    return [(int(p.stem.rsplit("-", 1)[1]), p.read_text()) for p in files]


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
    (code 4) because a peer left on an error of its own only echoes that error: such
    messages are printed only when no rank left another. Messages already said (`take`) are
    not printed again."""
    said = {text for _, text in _left(errors, "*.said")}
    found = _left(errors, "*.txt")
    causes = [m for m in found if m[0] != COLLECTIVE] or found
    for text in dict.fromkeys(text for _, text in causes if text not in said):
        print(f"error: {text}", file=sys.stderr, flush=True)
    return causes[0][0] if causes else 0
