"""Quiet Lightning: one switch for the per-Trainer chatter, shared by every layer that fits modules.

Lives beneath the round loop so that code below it (the generator pretraining of
:mod:`fedhet.generators`) silences Lightning the same way without importing the loop.
"""

from __future__ import annotations

import logging
import warnings


def silence_lightning() -> None:
    """Keep warnings, drop the per-Trainer INFO chatter ("GPU available ...") and tiny-loader hints."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*number of training batches.*smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=".*`training_step` returned `None`.*")
    # client modules keep a validation_step for standalone use; the round loop evaluates itself
    warnings.filterwarnings("ignore", message=".*defined a `validation_step` but have no `val_dataloader`.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*")
    # frozen sub-modules (teachers, FedKTL's pretrained generator) stay in eval mode on purpose
    warnings.filterwarnings("ignore", message=".*module\\(s\\) in eval mode at the start of training.*")
