"""FedProto: clients share per-class prototypes (mean features) instead of models.

Paper: Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients",
AAAI 2022 (Eq. 4-8, Algorithm 1). Hyperparameter default from FedKTL's baseline table
(lambda = 0.1, HtFLlib).

Upload: per-class mean features of the client's training data, ``C_i^(j)``, for the classes it
holds, with the per-class counts (``ClassStatsPayload``).
Download: the global prototypes ``C-bar^(j)`` of every class some client holds.
Server phase: closed-form. Paper Eq. 6 weights client ``i``'s prototype of class ``j`` by
``|D_{i,j}| / N_j`` (``proto_weighting="count"``, the default); HtFLlib takes the unweighted mean
over the clients holding the class (``"uniform"``). Classes missing on a client are ignored.
Client state kept across rounds: the local model and optimizer state (models are never shared).
Local objective: ``CE(f(x), y) + lambda * MSE(z(x), C-bar^(y))`` over the samples whose class has
a global prototype (paper Eq. 8; MSE averaged over feature elements as in HtFLlib).
Deviations from paper/official code: prototypes are computed after local training in eval mode
(HtFLlib does the same; the paper's Algorithm 1 averages embeddings seen during training).
Evaluation uses the client's own classifier head, not nearest-prototype classification (which
HtFLlib uses); both are personalised predictions of the same model. Heterogeneous backbones
emit one feature dimension through ``feature_dim`` (HtFLlib's ``-fd``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms.base import (
    Algorithm,
    Batch,
    Capabilities,
    ClientModule,
    ClientUpload,
    OptimizerName,
    ServerContext,
    ServerPhase,
)
from fedhet.federation.payloads import ClassStatsPayload, Payload
from fedhet.functional import aggregate_class_means, class_means
from fedhet.hparams import Momentum, NonNegativeFloat, PositiveFloat

Weighting = Literal["count", "uniform"]


class ClassMeanRegularizedClient(ClientModule):
    """Cross-entropy plus ``lam * MSE(s(x), global[y])`` for a per-sample statistic ``s``.

    The statistic is the feature vector (FedProto) or the logits (FD); the client uploads its
    class means of the statistic. Subclasses define :meth:`statistic_and_logits`.

    Args:
        model: the backbone.
        num_classes: number of classes.
        lam: weight of the regulariser.
        optimizer: local optimizer.
        lr: local learning rate.
        momentum: SGD momentum.
        weight_decay: L2 weight decay.
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        lam: float = 0.1,
        optimizer: OptimizerName = "sgd",
        lr: float = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(model, num_classes, optimizer, lr, momentum, weight_decay)
        self.lam = lam
        self.global_means: Tensor | None = None
        self.global_present: Tensor | None = None

    def statistic_and_logits(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The shared statistic of each sample, and the logits (abstract)."""
        raise NotImplementedError(f"abstract: {type(self).__name__} must define statistic_and_logits()")

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        statistic, logits = self.statistic_and_logits(x)
        loss = F.cross_entropy(logits, y)
        if self.global_means is not None and self.global_present is not None:
            means = self.global_means.to(statistic.device)
            known = self.global_present.to(y.device)[y]
            if bool(known.any()):
                loss = loss + self.lam * F.mse_loss(statistic[known], means[y[known]])
        return loss

    def on_receive(self, download: Payload | None) -> None:
        if isinstance(download, ClassStatsPayload):
            self.global_means = download.values
            self.global_present = download.counts > 0

    def make_upload(self, train_batches: Iterable[Batch]) -> ClassStatsPayload:
        sums: Tensor | None = None
        counts = torch.zeros(self.num_classes, dtype=torch.long)
        for x, y in train_batches:
            statistic, _ = self.statistic_and_logits(x)
            means, batch_counts = class_means(statistic.double(), y, self.num_classes)
            batch_sums = means * batch_counts.unsqueeze(1)
            sums = batch_sums if sums is None else sums + batch_sums
            counts += batch_counts.cpu()
        assert sums is not None, "a client without training data cannot upload class means"
        values = (sums.cpu() / counts.clamp_min(1).unsqueeze(1)).float()
        return ClassStatsPayload(values=values, counts=counts)


class FedProtoClient(ClassMeanRegularizedClient):
    """The statistic is the feature vector ``z = forward_features(x)``."""

    def statistic_and_logits(self, x: Tensor) -> tuple[Tensor, Tensor]:
        features = self.model.forward_features(x)
        return features, self.model.forward_head(features)


class ClassMeanServer(ServerPhase):
    """Aggregates per-class means across clients; classes nobody holds stay absent.

    Args:
        weighting: ``"count"`` (example-weighted, FedProto Eq. 6) or ``"uniform"`` (HtFLlib).
    """

    def __init__(self, weighting: Weighting = "count") -> None:
        self.weighting = weighting
        self.num_classes = 0
        self.global_means: Tensor | None = None
        self.present: Tensor | None = None

    def setup(self, context: ServerContext) -> None:
        self.num_classes = context.num_classes

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        if not uploads:
            return
        dim = uploads[0].payload.values.shape[1]  # type: ignore[attr-defined]
        for upload in uploads:
            assert isinstance(upload.payload, ClassStatsPayload)
            upload.payload.validate_shape(self.num_classes, dim, f"client {upload.client_id}")
        self.global_means, self.present = aggregate_class_means(
            [u.payload.values for u in uploads],  # type: ignore[attr-defined]
            [u.payload.counts for u in uploads],  # type: ignore[attr-defined]
            self.weighting,
        )

    def download_for(self, client_id: int) -> ClassStatsPayload | None:
        if self.global_means is None or self.present is None:
            return None
        return ClassStatsPayload(values=self.global_means, counts=self.present.long())

    def state_dict(self) -> dict[str, Any]:
        return {} if self.global_means is None else {"global_means": self.global_means, "present": self.present}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.global_means = state.get("global_means")
        self.present = state.get("present")


class FedProto(Algorithm):
    """FedProto (heterogeneous models; needs one feature dimension).

    Args:
        lam: weight of the prototype regulariser (lambda in the paper).
        proto_weighting: ``"count"`` (paper Eq. 6) or ``"uniform"`` (HtFLlib).
        optimizer: local optimizer, ``"sgd"``, ``"adam"`` or ``"adamw"``.
        lr: local learning rate.
        momentum: SGD momentum.
        weight_decay: L2 weight decay.
    """

    capabilities = Capabilities(heterogeneous_models=True, common_feature_dim=True)
    upload_type = ClassStatsPayload
    download_type = ClassStatsPayload

    def __init__(
        self,
        lam: NonNegativeFloat = 0.1,
        proto_weighting: Weighting = "count",
        optimizer: OptimizerName = "sgd",
        lr: PositiveFloat = 0.01,
        momentum: Momentum = 0.0,
        weight_decay: NonNegativeFloat = 0.0,
    ) -> None:
        super().__init__(optimizer, lr, momentum, weight_decay)
        self.lam = lam
        self.proto_weighting: Weighting = proto_weighting

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        return FedProtoClient(model, num_classes, lam=self.lam, **self.optimizer_kwargs())

    def build_server(self) -> ServerPhase:
        return ClassMeanServer(self.proto_weighting)
