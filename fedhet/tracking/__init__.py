"""Run directory (JSON results, checkpoints), W&B logging and console reports."""

from fedhet.tracking.console import ConsoleCallback, format_summary
from fedhet.tracking.rundir import RunDirectory, RunDirectoryCallback
from fedhet.tracking.wandb_logger import WandbCallback, WandbConfig, wandb_credentials_available

__all__ = [
    "ConsoleCallback",
    "RunDirectory",
    "RunDirectoryCallback",
    "WandbCallback",
    "WandbConfig",
    "format_summary",
    "wandb_credentials_available",
]
