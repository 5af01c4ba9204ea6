"""Errors meant for people: raised at the edge (config, CLI, data, checkpoints).

The CLI turns a `UserError` into its one-paragraph message on stderr and exit code 2;
deep code asserts invariants instead.
"""


class UserError(Exception):
    """Bad input from the user: the message names the key, the value and the valid choices."""


class ConfigError(UserError):
    """An invalid configuration value or combination."""


class DataError(UserError):
    """A corpus, text or token file that cannot be used."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or does not match the run."""


class RunFolderBusy(UserError):
    """A run folder another `loom train` (or its ranks) is writing."""


class WriteError(UserError):
    """A file of the run that could not be written: a full disk (ENOSPC), a quota (EDQUOT), a
    file-size limit (EFBIG), a read-only (EROFS) or failing (EIO) filesystem, a permission
    (EACCES). The message names the file and the OS error."""
