"""User-facing errors.

Every error a user can cause with bad input (a config key, a dataset root, a checkpoint ...)
is raised as a :class:`FedhetError` whose message is one line naming the problem and the fix.
The command line prints that line and exits non-zero; it never prints a traceback for them.
"""


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
