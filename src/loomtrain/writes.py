"""Writing a run's files so that a failure names the file and the OS error and leaves the
previous version whole: a full disk (ENOSPC), a quota (EDQUOT), a file-size limit (EFBIG), a
read-only (EROFS) or failing (EIO) filesystem or a permission (EACCES) becomes a `WriteError`
(exit code 2, one paragraph) instead of a traceback. What a run guarantees then:
docs/checkpoints.md, "Write errors". No torch here: `loom report` writes through it too.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from loomtrain.errors import WriteError

# an OSError with one of these, wherever it comes from, is the storage's, not a bug of ours
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS})


def os_error(err: OSError) -> str:
    """The OS error in words and by name: "No space left on device (ENOSPC)"."""
    name = errno.errorcode.get(err.errno) if isinstance(err.errno, int) else None
    words = err.strerror or str(err)
    return f"{words} ({name})" if name else words


def write_error(path, err: OSError) -> WriteError:
    return WriteError(f"cannot write {str(path)!r}: {os_error(err)}")


@contextlib.contextmanager
def writing(path):
    """An OSError inside the block becomes a WriteError naming `path`, the file or folder the
    block writes (a failed write() carries no file name of its own)."""
    try:
        yield
    except OSError as err:
        raise write_error(path, err) from None


def write_atomic(path, text: str) -> None:
    """`path` holding `text`, replaced by one rename: a reader sees the old file or the new
    one, never half of one. A failed write keeps the old file and removes the temporary one
    (space, on a full disk), then raises WriteError naming `path`."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise write_error(path, err) from None
