"""User-facing errors.

Every error a user can cause with bad input (a config key, a dataset root, a checkpoint ...)
is raised as a :class:`FedhetError` whose message is one line naming the problem and the fix.
The command line prints that line and exits non-zero; it never prints a traceback for them.
"""

from __future__ import annotations

import argparse
import errno
from pathlib import Path
from typing import NoReturn

#: The exit status of a command stopped by bad input (a :class:`FedhetError`): the user fixes the input.
EXIT_BAD_INPUT = 2
#: The exit status of a run stopped by its training (a :class:`TrainingError`: a non-finite loss, or an
#: upload the server rejected). It tells a tuner that the trial's hyperparameters ended it, where any
#: other failure (bad input, a full disk, a bug, a kill) says nothing about them.
EXIT_TRAINING_STOPPED = 3


class FedhetError(Exception):
    """A problem caused by input the user can fix; the message says what and how."""


class ConfigError(FedhetError):
    """An invalid experiment configuration (unknown key, wrong type, incompatible pair)."""


class DataError(FedhetError):
    """A dataset is missing, malformed, or cannot be partitioned as asked."""


class CheckpointError(FedhetError):
    """A checkpoint or weights file is missing, corrupt or does not match the run."""


class TrainingError(FedhetError):
    """Training diverged (a non-finite loss or weights) or a payload failed validation."""


class DiskError(FedhetError):
    """A file could not be written: the disk is full, or the directory is read-only or not ours.

    Args:
        path: the file (or directory) that could not be written.
        problem: what went wrong, e.g. ``"no space left on the device (ENOSPC)"``.
        remedy: what frees the way, e.g. ``"free space there"``.
        then: the next step (default: choose another ``--run_dir``; a run that has a checkpoint
            says how to continue it).
    """

    def __init__(self, path: str | Path, problem: str, remedy: str, then: str = "or choose another --run_dir") -> None:
        self.path, self.problem, self.remedy, self.then = str(path), problem, remedy, then
        super().__init__(f"cannot write '{path}': {problem}; {remedy}, {then}")

    def __reduce__(self) -> tuple:
        return type(self), (self.path, self.problem, self.remedy, self.then)

    def with_next_step(self, then: str) -> DiskError:
        """The same fault with another next step (e.g. the ``--resume`` command of the interrupted run)."""
        return DiskError(self.path, self.problem, self.remedy, then)


#: What a write failure means for the user, by ``errno``; other ``OSError``s stay tracebacks (bugs).
DISK_PROBLEMS = {
    errno.ENOSPC: ("no space left on the device", "free space there"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space there"),
    errno.EROFS: ("the file system is read-only", "make it writable"),
    errno.EACCES: ("permission denied", "make it writable"),
    errno.EPERM: ("operation not permitted", "make it writable"),
}


def disk_error(path: str | Path, exc: BaseException) -> DiskError | None:
    """The one-line :class:`DiskError` for a failed write of ``path``, or ``None`` when ``exc`` is another fault.

    A full disk and a read-only run directory are the user's to fix, like a bad config value;
    ``write()`` on a full disk raises ``OSError`` without a file name, so the writer names it.
    The cause may be chained (a library that wraps the ``OSError``).
    """
    cause: BaseException | None = exc
    while cause is not None and not (isinstance(cause, OSError) and cause.errno in DISK_PROBLEMS):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    code = cause.errno  # type: ignore[union-attr]
    problem, remedy = DISK_PROBLEMS[code]
    return DiskError(path, f"{problem} ({errno.errorcode[code]})", remedy)


class CommandParser(argparse.ArgumentParser):
    """``argparse`` for fedhet's sub-commands: a usage error is a :class:`ConfigError` naming the help.

    The command line prints it as one line and exits 2, like every other user error, instead of
    argparse's usage dump and exit.
    """

    def error(self, message: str) -> NoReturn:
        """Raise the usage error as a one-line :class:`ConfigError`."""
        raise ConfigError(f"{message}; see '{self.prog} --help'")
