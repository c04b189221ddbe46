"""User-facing errors.

Every error a user can cause with bad input (a config key, a dataset root, a checkpoint ...)
is raised as a :class:`FedhetError` whose message is one line naming the problem and the fix.
The command line prints that line and exits non-zero; it never prints a traceback for them.
"""

import argparse
from typing import NoReturn


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


class CommandParser(argparse.ArgumentParser):
    """``argparse`` for fedhet's sub-commands: a usage error is a :class:`ConfigError` naming the help.

    The command line prints it as one line and exits 2, like every other user error, instead of
    argparse's usage dump and exit.
    """

    def error(self, message: str) -> NoReturn:
        """Raise the usage error as a one-line :class:`ConfigError`."""
        raise ConfigError(f"{message}; see '{self.prog} --help'")
