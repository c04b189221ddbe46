"""The round-loop settings (``federation:`` in a config), declared and checked once.

The command line builds a :class:`FederationSettings` from the ``federation:`` block and hands it
whole to :class:`~fedhet.federation.FederationLoop`; programs that build a loop in Python do the
same. The loop reads these values; it does not list, document or check them again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from fedhet.errors import ConfigError
from fedhet.federation.aggregation import Aggregator
from fedhet.federation.attacks import UploadAttack
from fedhet.federation.executors import Executor
from fedhet.federation.lr_schedule import LRSchedule
from fedhet.federation.privacy import PayloadNoise
from fedhet.hparams import Fraction, NonNegativeInt, PositiveInt

StateStoreKind = Literal["auto", "memory", "disk"]
#: Default ``upload_norm_bound``: an update may be at most this many times the norm of the global
#: model it started from. Honest shipped configs measured stay below 0.21 (docs/concepts.md,
#: "Invalid and poisoned uploads"); a model scaled x50 is at 49.
UPLOAD_NORM_BOUND = 10.0
#: Default ``upload_value_bound``: no honest upload holds a value this large; 1e30 weights or
#: prototypes do.
UPLOAD_VALUE_BOUND = 1e6
EvalClients = Literal["auto", "all", "participants"] | int


class FederationSettings:
    """Round-loop settings.

    Args:
        participation: fraction of clients per round (a number in (0, 1]; ``1`` and ``1.0`` mean
            all clients) or a count of clients per round (an integer >= 2).
        eval_every: evaluate every this many rounds (the last round always).
        state_store: ``"memory"``, ``"disk"`` (one file per client under the run directory) or
            ``"auto"`` (disk when there are more than ``disk_threshold`` clients).
        disk_threshold: client count above which ``"auto"`` keeps client states on disk.
        executor: where client steps run: ``null`` (sequential, in-process) or an executor class
            with its arguments, e.g. ``{class_path: fedhet.federation.ProcessExecutor, init_args:
            {workers: 2}}``; ``sequential``, ``process`` and ``ray`` name the three executors
            (``--federation.executor ray --federation.executor.workers 2``).
        eval_clients: which clients are evaluated: ``"all"``, ``"participants"`` (the round's), a
            number sampled per evaluation, or ``"auto"`` (all up to 100 clients, participants above).
        extra_rounds: full-participation rounds after the federated rounds (equal budgets for
            baselines of methods with a post-federation phase, e.g. FedVTC's).
        on_invalid_upload: ``"fail"`` (stop, naming the sender) or ``"drop"`` (continue without it,
            counted in ``comm/dropped_uploads`` and in ``summary.json``): non-finite values, wrong
            keys, shapes or dtypes (float16 is refused), bad counts and uploads over either bound.
        upload_norm_bound: refuse uploads whose model weights moved more than this multiple of
            the global model's norm, naming the client (``null``: no bound; docs/concepts.md).
        upload_value_bound: refuse uploads holding any value larger in magnitude than this
            (``null``: no bound).
        aggregator: how weight-averaging methods combine uploads: ``{rule: mean}`` (FedAvg, the
            default), ``median``, ``trimmed_mean`` (``beta``) or ``krum`` (``f``, ``m``; m > 1 is
            Multi-Krum), e.g. ``--federation.aggregator.rule median``.
        upload_attack: simulated malicious clients for robustness studies, e.g. ``{clients: [0, 1],
            kind: sign_flip, factor: 4}`` (``scale``, ``sign_flip`` or ``value``); ``null``: none.
        persist_optimizer_state: carry each client's optimizer state (momentum, Adam moments)
            across rounds; off restarts the optimizer every round as HtFLlib does.
        lr_schedule: per-round factor on every client learning rate (local stages and the
            public-data phase) of every method alike: ``{kind: none}`` (constant, the default) or
            ``{kind: linear, final_fraction: 0.1}`` (the FCCL+ authors' shared loop); federated
            rounds only (``docs/concepts.md``).
        upload_noise: FedPCL-style Gaussian perturbation of every upload (privacy studies,
            FedKTL Tab. 10 "NC"); ``null``: none.
        download_noise: the same for every download ("NG"); ``null``: none.
        target_accuracy: metrics and target percentages, e.g. ``{acc_server: [75, 80]}``: the summary's
            ``rounds_to_target`` gives the first round each reached its target (``null`` if never;
            FedFTG's Table 2).
        eval_after_local_training: also score every client's model as its last local training
            left it, before the next download (``pre/`` metrics beside the usual ones): the FCCL+
            authors' scoring of homogeneous FedAvg-family clients, where the usual score is the
            global model's.
        seal_test: score on validation only and make every test split unreadable (a read raises):
            how the tuning stage of ``fedhet bench`` runs its trials, so that nothing is selected
            on test numbers (``docs/results_pages.md``).

    Raises:
        ConfigError: a value out of its range (one line naming the key), for programs that
            build settings in Python; the command line's parser checks the same ranges first.
    """

    def __init__(
        self,
        participation: Fraction | PositiveInt = 1.0,
        eval_every: PositiveInt = 1,
        state_store: StateStoreKind = "auto",
        disk_threshold: NonNegativeInt = 50,
        executor: Executor | None = None,
        eval_clients: Literal["auto", "all", "participants"] | PositiveInt = "auto",
        extra_rounds: NonNegativeInt = 0,
        on_invalid_upload: Literal["fail", "drop"] = "fail",
        upload_norm_bound: float | None = UPLOAD_NORM_BOUND,
        upload_value_bound: float | None = UPLOAD_VALUE_BOUND,
        aggregator: Aggregator | None = None,
        upload_attack: UploadAttack | None = None,
        persist_optimizer_state: bool = True,
        upload_noise: PayloadNoise | None = None,
        download_noise: PayloadNoise | None = None,
        target_accuracy: dict[str, float | list[float]] | None = None,
        lr_schedule: LRSchedule | None = None,
        eval_after_local_training: bool = False,
        seal_test: bool = False,
    ) -> None:
        if eval_every < 1:
            raise ConfigError(f"federation.eval_every={eval_every}: must be >= 1")
        if extra_rounds < 0:
            raise ConfigError(f"federation.extra_rounds={extra_rounds}: must be >= 0")
        if isinstance(eval_clients, int) and not isinstance(eval_clients, bool) and eval_clients < 1:
            raise ConfigError(f"federation.eval_clients={eval_clients}: evaluate at least one client")
        if on_invalid_upload not in ("fail", "drop"):
            raise ConfigError(f"federation.on_invalid_upload={on_invalid_upload!r}: use 'fail' or 'drop'")
        if upload_norm_bound is not None and not upload_norm_bound > 0.0:
            raise ConfigError(
                f"federation.upload_norm_bound={upload_norm_bound}: give a positive multiple of the global "
                f"model's norm (default {UPLOAD_NORM_BOUND:g}) or null for none"
            )
        if upload_value_bound is not None and not upload_value_bound > 0.0:
            raise ConfigError(
                f"federation.upload_value_bound={upload_value_bound}: give a positive magnitude "
                f"(default {UPLOAD_VALUE_BOUND:g}) or null for none"
            )
        self.participation = participation
        self.eval_every = eval_every
        self.state_store = state_store
        self.disk_threshold = disk_threshold
        self.executor = executor
        self.eval_clients = eval_clients
        self.extra_rounds = extra_rounds
        self.on_invalid_upload = on_invalid_upload
        self.upload_norm_bound = upload_norm_bound
        self.upload_value_bound = upload_value_bound
        self.aggregator = aggregator or Aggregator()
        self.upload_attack = upload_attack
        self.persist_optimizer_state = persist_optimizer_state
        self.upload_noise = upload_noise
        self.download_noise = download_noise
        self.target_accuracy = target_accuracy
        self.lr_schedule = lr_schedule
        self.eval_after_local_training = eval_after_local_training
        self.seal_test = seal_test
        self.targets()  # checked here, once

    def targets(self) -> dict[str, list[float]]:
        """``target_accuracy`` as ``{metric: [percentages]}`` (a single target becomes a list of one)."""
        targets = {
            key: [float(t) for t in (values if isinstance(values, Sequence) else [values])]
            for key, values in (self.target_accuracy or {}).items()
        }
        for key, values in targets.items():
            if not values or not all(0.0 < t <= 100.0 for t in values):
                raise ConfigError(
                    f"federation.target_accuracy.{key}={values}: give one or more percentages in (0, 100]"
                )
        return targets


__all__ = ["EvalClients", "FederationSettings", "StateStoreKind"]
