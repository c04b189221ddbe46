"""The platform's per-round learning-rate schedule (``federation.lr_schedule``), one for every method.

A comparison of methods is only fair if every method's clients train at the same rates. The
FCCL+ authors' shared training loop decays ``local_lr`` and ``public_lr`` linearly over the
rounds for *every* method of their benchmark (``fccl+/utils/training.py``), so the schedule is
a setting of the round loop, not of a method: the runtime applies it to every optimizer a client
module steps (its local stages) and to every optimizer of a lock-step collaborative phase (the
public-data phase of FCCL, FCCL+, FedMD, FedDF, RHFL, FedMatch), whatever the method's
``configure_optimizers`` builds.

How: :class:`RoundLRScale`, a Lightning callback the runtime adds to every client fit, reads
each parameter group's learning rate as ``configure_optimizers`` built it (when the fit starts,
before a carried optimizer state is restored) and sets it to that base times the round's factor
before the first step (a learning-rate scheduler inside the fit has its ``base_lrs`` scaled
alike). The factor depends on the round index and the number of rounds only, so a resumed run
trains at exactly the rates of an uninterrupted one.

The schedule covers the federated rounds; run phases before or after them (FCCL's pretraining,
FedVTC's fine-tuning, ``extra_rounds``) train at their configured rates. Server-side stages
(distillation, generators) keep their own schedules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from fedhet.errors import ConfigError
from fedhet.functional import linear_round_decay

LRScheduleKind = Literal["none", "linear"]


@dataclass(frozen=True)
class LRSchedule:
    """A per-round factor on every client learning rate.

    Attributes:
        kind: ``"none"`` (constant rates) or ``"linear"``: the FCCL+ authors' shared loop,
            ``1 - (1 - final_fraction) * max(r - 1, 0) / R`` in round ``r`` of ``R`` (0-indexed;
            the code assigns the decayed rate after a round has used it, so rounds 0 and 1 both
            train at the base rate and the last at ``1 - (1 - final_fraction) (R - 2) / R``).
        final_fraction: the fraction the linear decay heads for over the rounds (0.1 in the code).
    """

    kind: LRScheduleKind = "none"
    final_fraction: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in ("none", "linear"):
            raise ConfigError(f"federation.lr_schedule.kind={self.kind!r}: use 'none' or 'linear'")
        if not 0.0 <= float(self.final_fraction) <= 1.0:
            raise ConfigError(
                f"federation.lr_schedule.final_fraction={self.final_fraction}: give a number in [0, 1]"
            )

    def factor(self, round_idx: int, total_rounds: int) -> float:
        """The factor on every base learning rate in federated round ``round_idx`` of ``total_rounds``."""
        if self.kind == "none":
            return 1.0
        return linear_round_decay(round_idx, total_rounds, float(self.final_fraction))


class RoundLRScale(Callback):
    """Set every parameter group's learning rate to its configured base times ``factor`` (see module).

    Added to a fit's callbacks before :class:`~fedhet.federation.trainer.OptimizerStateCarrier`,
    so the base is read from the optimizers ``configure_optimizers`` built, not from a restored
    state (which holds the previous round's scaled rate).

    Args:
        factor: the round's factor (:meth:`LRSchedule.factor`).
    """

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.base_lrs: list[list[Any]] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.base_lrs = [[group["lr"] for group in optimizer.param_groups] for optimizer in trainer.optimizers]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for optimizer, bases in zip(trainer.optimizers, self.base_lrs, strict=True):
            for group, base in zip(optimizer.param_groups, bases, strict=True):
                group["lr"] = base * self.factor
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [base * self.factor for base in scheduler.base_lrs]
