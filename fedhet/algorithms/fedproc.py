"""FedProc: FedAvg whose clients contrast their features against global class prototypes.

Paper: Mu, Shen, Cheng, Geng, Fu, Zhang and Zhang, "FedProc: Prototypical Contrastive Federated
Learning on Non-IID Data", FGCS 143 (2023), arXiv:2109.12273. Reference code: the FCCL+ authors'
FedProc (``models/fedproc.py`` of their federated framework, the run behind FCCL+ Tab. XV); the
paper text was not available offline, so where the two could differ this follows that code.

Upload: the client's model weights, plus its per-class mean features and class counts
(:class:`WeightsAndPrototypesPayload`).
Download: the global model weights and the global class prototypes of every class some client
holds (no prototype rows before the first aggregation).
Server phase: closed-form. Weights: FedAvg's example-weighted average (:class:`FedAvgServer`).
Prototypes: per-class average of the uploaded class means over the clients holding the class
(:func:`fedhet.functional.aggregate_class_means`), example-weighted (``proto_weighting="count"``,
the default: the prototype is then the mean feature of the class over all participants' data) or
one vote per client (``"uniform"``, the authors' code).
Client state kept across rounds: the optimizer state; weights and prototypes come with each
download.
Local objective: ``alpha_t * L_proto + (1 - alpha_t) * CE``, ``L_proto`` the InfoNCE of the
feature against all global prototypes with its own class as the positive
(:func:`fedhet.functional.prototypical_contrastive_loss`, cosine similarity, ``tau = 1``) and
``alpha_t = 1 - t / (T - 1)`` (:func:`fedhet.functional.fedproc_alpha`), decaying from 1 to 0.

Deviations from paper/official code:

* Round 0 has no global prototypes: the loss is plain CE. The authors' code multiplies a zero
  prototype loss by ``alpha_0 = 1`` and CE by ``0``, so its clients do not learn in round 0.
* ``alpha_schedule="constant"`` keeps ``alpha`` fixed (0.5, the value FCCL+ Tab. VII lists for
  FedProc), for comparison with the schedule.
* Class means are computed after local training, in eval mode, over the client's training set
  (as fedhet's FedProto); the code averages the training-mode features of the last local epoch.
* ``L_proto`` averages over the samples whose class has a prototype; the code divides the same
  sum by the batch size. Under domain shift every class has one and the two agree.
* Features are the backbone's pooled features (the authors' code); the paper's extra projection
  layers are not added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms.base import Batch, ClientUpload, ServerContext, ServerPhase, hparams_for
from fedhet.algorithms.shared.common import ClassSums, FedAvgClient, FedAvgServer, WeightAveraging, Weighting
from fedhet.core.payloads import ClassStatsPayload, Payload, WeightsPayload
from fedhet.core.state import clone_state
from fedhet.errors import TrainingError
from fedhet.functional import aggregate_class_means, fedproc_alpha, prototypical_contrastive_loss
from fedhet.hparams import (
    Hyperparameters,
    LocalOptimizer,
    PositiveFloat,
    UnitInterval,
    categorical,
    knob,
    log_uniform,
    uniform,
)

AlphaSchedule = Literal["linear", "constant"]


@dataclass(frozen=True)
class FedProcHparams(LocalOptimizer):
    """FedProc's hyperparameters (clients read the loss settings, the server ``proto_weighting``)."""

    temperature: PositiveFloat = knob(
        1.0, "tau of the prototype InfoNCE (1: cosine similarity, the authors' code)", log_uniform(0.05, 5.0)
    )
    alpha_schedule: AlphaSchedule = knob(
        "linear",
        "prototype-loss weight schedule: linear (alpha_t = 1 - t / (T - 1), the authors' code) or constant",
        categorical("linear", "constant"),
    )
    alpha: UnitInterval = knob(
        0.5, "weight of the prototype loss when alpha_schedule=constant (FCCL+ Tab. VII: 0.5)", uniform(0.0, 1.0)
    )
    proto_weighting: Weighting = knob(
        "count", "global prototype weighting: count (example-weighted class means) or uniform (the authors' code)"
    )


@dataclass(frozen=True)
class WeightsAndPrototypesPayload(WeightsPayload):
    """Model weights plus per-class mean features: FedProc's upload and download.

    ``prototypes[c]`` is the mean feature of class ``c`` over ``counts[c]`` examples (a download
    carries ``counts = 1`` for every class that has a global prototype). A download before any
    prototype exists carries a ``[C, 0]`` tensor and zero counts. Only held rows are on the wire.
    """

    prototypes: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, 0))
    counts: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def class_stats(self) -> ClassStatsPayload:
        """The prototype half as a :class:`ClassStatsPayload` (its byte count and checks)."""
        return ClassStatsPayload(values=self.prototypes, counts=self.counts)

    def nbytes(self) -> int:
        return WeightsPayload(weights=self.weights).nbytes() + self.class_stats().nbytes()

    def validate_prototypes(self, num_classes: int, dim: int | None, sender: str, held: Tensor | None = None) -> None:
        """Validate values, then ``prototypes`` is ``[num_classes, dim]`` float32 with int64 counts within ``held``."""
        self.class_stats().validate_shape(num_classes, dim, sender, dtype=torch.float32, held=held)


class FedProcClient(FedAvgClient):
    """``alpha_t * L_proto + (1 - alpha_t) * CE``; uploads weights and class-mean features."""

    Hparams = FedProcHparams

    def __init__(self, model: nn.Module, num_classes: int, hp: Any = None, **overrides: Any) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        # the global prototypes and which classes have one, once the server has any
        self.global_prototypes: tuple[Tensor, Tensor] | None = None

    def prototype_weight(self) -> float:
        """``alpha_t`` of the current round."""
        if self.hp.alpha_schedule == "constant":
            return self.hp.alpha
        return fedproc_alpha(self.round_idx, self.total_rounds)

    def on_receive(self, download: Payload | None) -> None:
        super().on_receive(download)
        self.global_prototypes = None
        if isinstance(download, WeightsAndPrototypesPayload) and bool((download.counts > 0).any()):
            self.global_prototypes = (download.prototypes, download.counts > 0)

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        features = self.model.forward_features(x)
        ce = F.cross_entropy(self.model.forward_head(features), y)
        if self.global_prototypes is None:
            return ce
        weight = self.prototype_weight()
        prototypes, available = self.global_prototypes
        proto = prototypical_contrastive_loss(
            features, y, prototypes.to(features.device), available, self.hp.temperature
        )
        return weight * proto + (1.0 - weight) * ce

    def make_upload(self, train_batches: Iterable[Batch]) -> WeightsAndPrototypesPayload:
        sums = ClassSums(self.num_classes)
        for x, y in train_batches:
            sums.add(self.model.forward_features(x), y)
        if sums.sums is None:
            raise TrainingError("a FedProc client without training data cannot upload class prototypes")
        weights = clone_state(self.model.state_dict())
        return WeightsAndPrototypesPayload(weights=weights, prototypes=sums.means(), counts=sums.counts)


class FedProcServer(FedAvgServer):
    """FedAvg's weight average plus per-class prototype aggregation.

    Args:
        hp: the method's hyperparameters (``None``: the declared defaults); it reads ``proto_weighting``.
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams: ClassVar[type[Hyperparameters]] = FedProcHparams

    def __init__(self, hp: Any = None, **overrides: Any) -> None:
        super().__init__()
        self.hp: Any = hparams_for(type(self), hp, overrides)
        self.num_classes = 0
        self.held: Tensor | None = None  # [clients, classes] examples each client holds, when the context knows
        self.global_prototypes: Tensor | None = None
        self.present: Tensor | None = None

    def setup_server(self, context: ServerContext) -> None:
        super().setup_server(context)
        self.num_classes = context.num_classes
        self.held = context.label_counts

    def check_upload(self, upload: ClientUpload) -> None:
        """The global model's layout (FedAvg's check) plus ``[C, p]`` float32 prototypes and held counts.

        ``p`` is the global model's head input width (the feature size), else the width of the
        global prototypes once there are any.
        """
        payload = upload.expect(WeightsAndPrototypesPayload, "weights and prototypes")
        self.check_weights(upload, payload)
        held = None if self.held is None else self.held[upload.client_id]
        payload.validate_prototypes(self.num_classes, self.prototype_dim(), upload.sender, held)

    def prototype_dim(self) -> int | None:
        """The prototypes' width: the global head's input width, else the global prototypes' (``None``: unknown)."""
        head = self.global_weights.get("head.weight")  # one global model: FedProc's models are homogeneous
        if head is not None:
            return int(head.shape[1])
        return None if self.global_prototypes is None else int(self.global_prototypes.shape[1])

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        if not uploads:
            return
        if self.prototype_dim() is None:
            # no declared width (a model without a linear head, round 0): the uploads must at least agree
            width = int(uploads[0].payload.prototypes.shape[1])  # type: ignore[attr-defined]
            for upload in uploads:
                upload.payload.validate_prototypes(self.num_classes, width, upload.sender)  # type: ignore[attr-defined]
        super().aggregate(round_idx, uploads)  # averages the weights
        self.global_prototypes, self.present = aggregate_class_means(
            [u.payload.prototypes for u in uploads],  # type: ignore[attr-defined]
            [u.payload.counts for u in uploads],  # type: ignore[attr-defined]
            self.hp.proto_weighting,
        )

    def download_for(self, client_id: int) -> WeightsAndPrototypesPayload:
        if self.global_prototypes is None or self.present is None:
            return WeightsAndPrototypesPayload(
                weights=self.weights_for(client_id),
                prototypes=torch.zeros(self.num_classes, 0),
                counts=torch.zeros(self.num_classes, dtype=torch.long),
            )
        return WeightsAndPrototypesPayload(
            weights=self.weights_for(client_id), prototypes=self.global_prototypes, counts=self.present.long()
        )

    def server_state(self) -> dict[str, Any]:
        state = super().server_state()
        if self.global_prototypes is not None:
            state.update(global_prototypes=self.global_prototypes, present=self.present)
        return state

    def load_server_state(self, state: Mapping[str, Any]) -> None:
        super().load_server_state(state)
        self.global_prototypes = state.get("global_prototypes")
        self.present = state.get("present")


class FedProc(WeightAveraging):
    """FedProc (homogeneous models only)."""

    Hparams = FedProcHparams
    client_type = FedProcClient
    upload_type = WeightsAndPrototypesPayload
    download_type = WeightsAndPrototypesPayload

    def build_server(self) -> ServerPhase:
        return FedProcServer(self.hp)


__all__ = ["FedProc", "FedProcClient", "FedProcHparams", "FedProcServer", "WeightsAndPrototypesPayload"]
