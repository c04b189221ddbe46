"""CCVR: classifier calibration with virtual representations, in FedVTC's model-heterogeneous setting.

Paper: Luo, Chen, Hu, Zhang, Liang, Feng, "No Fear of Heterogeneity: Classifier Calibration for
Federated Learning with Non-IID Data", NeurIPS 2021 (Eq. 3-4, Algorithm 1); FedVTC's Table 1
baseline ("utilise virtual feature representations to fine-tune the classifiers of clients ...
CCVR using a Gaussian distribution").

Upload (each round, after local training): per class the client holds, the mean, unbiased
covariance and count of its features ``g_k(x)`` (eval mode, whole training set)
(:class:`GaussianStatsPayload`; ``p x p`` per class: the quadratic cost of Table 2).
Server phase: closed form, CCVR Eq. 3-4 over the round's uploaders: the pooled mean and covariance
of every class; a class nobody uploaded keeps its previous statistics.
Download: the global means and covariances of every class seen so far.
Local objective: cross-entropy on private data (stage ``local``), then the calibration of the
client's classifier ``h_k`` alone (stage ``calibrate``): ``virtual_per_class`` virtual features
per class drawn from ``N(mu_c, Sigma_c + jitter I)`` and ``calibration_epochs`` epochs of
cross-entropy on them, the extractor frozen (CCVR's "classifier calibration").

Deviations (documented in ``docs/fedvtc.md``): CCVR calibrates the one global FedAvg model once
after training; with heterogeneous models there is no global model, so every client calibrates
its own head, every round it participates (in the rounds and in the equal-budget extra rounds),
which is how FedVTC describes the baseline. Clients' feature spaces are not aligned by anything
but the shared label semantics of the virtual features, as in FedVTC's setting. A ``jitter``
(1e-4 by default) is added to the covariance diagonal so that rank-deficient class covariances
(fewer samples than ``p``) can be sampled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from fedhet.algorithms.base import (
    Algorithm,
    Batch,
    Capabilities,
    ClientModule,
    ClientUpload,
    LocalStage,
    ServerContext,
    ServerPhase,
    build_optimizer,
)
from fedhet.algorithms.shared.common import head_weights
from fedhet.core.payloads import Payload, check_counts, check_tensor, held_class_nbytes
from fedhet.errors import ConfigError
from fedhet.functional.calibration import class_gaussian_stats, pool_class_gaussians
from fedhet.hparams import (
    LocalOptimizer,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    int_uniform,
    knob,
    log_uniform,
)

CALIBRATE = "calibrate"


@dataclass(frozen=True)
class GaussianStatsPayload(Payload):
    """Per-class feature Gaussians: means ``[C, p]``, covariances ``[C, p, p]``, counts ``[C]`` (int64).

    Only the classes with a non-zero count are sent (CCVR: each client shares the statistics of
    the classes it holds; the server, those of the classes seen so far), so :meth:`nbytes` counts
    ``p + p^2`` floats and one int64 count per such class; the zero rows of the other classes
    only keep the tensors dense for pooling.
    """

    means: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, 0))
    covariances: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, 0, 0))
    counts: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def nbytes(self) -> int:
        return held_class_nbytes(self.counts, self.means, self.covariances)

    def validate_shape(self, num_classes: int, dim: int, sender: str, held: Tensor | None = None) -> None:
        """Float32 means and covariances of the declared shapes, int64 counts within ``held``.

        The values were found finite by :meth:`ClientUpload.expect`, which the server calls first.
        """
        check_tensor(sender, "means", self.means, (num_classes, dim), torch.float32)
        check_tensor(sender, "covariances", self.covariances, (num_classes, dim, dim), torch.float32)
        check_counts(sender, "counts", self.counts, num_classes, held)


def sampling_factor(covariance: Tensor, jitter: float) -> Tensor:
    """A factor ``L`` with ``L L^T = Sigma + jitter I`` for drawing ``mu + L eps``.

    Cholesky; when float rounding left the pooled covariance slightly indefinite (CCVR's Eq. 4
    subtracts outer products), the eigenvalues are clamped at zero before the jitter is added.
    """
    symmetric = 0.5 * (covariance + covariance.T)
    eye = torch.eye(len(symmetric), dtype=symmetric.dtype)
    factor, info = torch.linalg.cholesky_ex(symmetric + jitter * eye)
    if int(info) == 0:
        return factor
    values, vectors = torch.linalg.eigh(symmetric)
    return vectors * (values.clamp_min(0.0) + jitter).sqrt()


@dataclass(frozen=True)
class CCVRHparams(LocalOptimizer):
    """CCVR's hyperparameters: the local optimizer and the head's calibration on virtual features."""

    virtual_per_class: PositiveInt = knob(
        50, "virtual features per class for each calibration (FedVTC: S/C = 50 on MNIST)", int_uniform(10, 500)
    )
    calibration_epochs: NonNegativeInt = knob(1, "epochs of head calibration per round", int_uniform(0, 5))
    calibration_lr: PositiveFloat = knob(0.01, "SGD learning rate of the calibration", log_uniform(1e-4, 1.0))
    calibration_batch_size: PositiveInt = knob(16, "virtual features per calibration step")
    jitter: NonNegativeFloat = knob(1e-4, "added to the covariance diagonal before sampling")


class CCVRClient(ClientModule):
    """Cross-entropy locally, then the head calibrated on virtual features of the global Gaussians."""

    Hparams = CCVRHparams

    def __init__(self, model: nn.Module, num_classes: int, hp: Any = None, **overrides: Any) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        self.global_stats: GaussianStatsPayload | None = None  # the server's pooled Gaussians, once it has any

    def local_stages(self) -> Sequence[LocalStage]:
        if self.global_stats is None or self.hp.calibration_epochs == 0:
            return (LocalStage(),)
        return (LocalStage(), LocalStage(CALIBRATE, epochs=self.hp.calibration_epochs))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.stage == CALIBRATE:
            return build_optimizer(self.model.head.parameters(), "sgd", self.hp.calibration_lr, 0.0, 0.0)
        return super().configure_optimizers()

    def local_loss(self, batch: Batch) -> Tensor:
        if self.stage == CALIBRATE:
            features, labels = batch
            return F.cross_entropy(self.model.forward_head(features), labels)
        return super().local_loss(batch)

    @torch.no_grad()
    def virtual_features(self, seed: int) -> tuple[Tensor, Tensor]:
        """``virtual_per_class`` draws from ``N(mu_c, Sigma_c + jitter I)`` for every class with statistics."""
        stats = self.global_stats
        assert stats is not None, "local_stages() calibrates only after a download"
        generator = torch.Generator().manual_seed(seed)
        features, labels = [], []
        dim = stats.means.shape[1]
        for c in torch.nonzero(stats.counts).flatten().tolist():  # the classes with statistics
            factor = sampling_factor(stats.covariances[c].double(), self.hp.jitter)
            noise = torch.randn(self.hp.virtual_per_class, dim, generator=generator, dtype=torch.float64)
            features.append((stats.means[c].double() + noise @ factor.T).float())
            labels.append(torch.full((self.hp.virtual_per_class,), c, dtype=torch.long))
        return torch.cat(features), torch.cat(labels)

    def stage_dataloader(self, private: Iterable[Any], seed: int) -> Iterable[Any]:
        if self.stage != CALIBRATE:
            return private
        features, labels = self.virtual_features(seed)
        generator = torch.Generator().manual_seed(seed)
        batch_size = self.hp.calibration_batch_size
        return DataLoader(TensorDataset(features, labels), batch_size=batch_size, shuffle=True, generator=generator)

    def on_receive(self, download: Payload | None) -> None:
        self.global_stats = download if isinstance(download, GaussianStatsPayload) else None

    def make_upload(self, train_batches: Iterable[Batch]) -> GaussianStatsPayload:
        features, labels = [], []
        for x, y in train_batches:
            features.append(self.model.forward_features(x).double().cpu())
            labels.append(y.cpu())
        means, covariances, counts = class_gaussian_stats(torch.cat(features), torch.cat(labels), self.num_classes)
        return GaussianStatsPayload(means=means.float(), covariances=covariances.float(), counts=counts)


class CCVRServer(ServerPhase):
    """Pools every class's Gaussian over the round's uploaders (CCVR Eq. 3-4); absent classes keep theirs."""

    def __init__(self) -> None:
        self.num_classes = 0
        self.dim = 0  # the feature width p: every head's input width (CCVR needs one feature dimension)
        self.held: Tensor | None = None  # [clients, classes] examples each client holds, when the context knows
        self.pooled: GaussianStatsPayload | None = None  # every class's Gaussian so far, once a round had uploads

    def setup_server(self, context: ServerContext) -> None:
        self.num_classes = context.num_classes
        head = head_weights(context.initial_client_state(0))
        if "weight" not in head:
            raise ConfigError("CCVR needs client models with a linear 'head' (FeatureClassifier)")
        self.dim = int(head["weight"].shape[1])
        self.held = context.label_counts

    def check_upload(self, upload: ClientUpload) -> None:
        """``[C, p]`` means, ``[C, p, p]`` covariances (``p``: the heads' input width), counts within what it holds."""
        payload = upload.expect(GaussianStatsPayload, "class Gaussians (GaussianStatsPayload)")
        held = None if self.held is None else self.held[upload.client_id]
        payload.validate_shape(self.num_classes, self.dim, upload.sender, held)

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        if not uploads:
            return
        if self.pooled is None:
            classes, dim = self.num_classes, self.dim
            self.pooled = GaussianStatsPayload(
                means=torch.zeros(classes, dim),
                covariances=torch.zeros(classes, dim, dim),
                counts=torch.zeros(classes, dtype=torch.long),
            )
        pooled = self.pooled
        means = torch.stack([u.payload.means.double() for u in uploads])  # type: ignore[attr-defined]
        covariances = torch.stack([u.payload.covariances.double() for u in uploads])  # type: ignore[attr-defined]
        counts = torch.stack([u.payload.counts for u in uploads])  # type: ignore[attr-defined]
        for c in range(self.num_classes):
            if int(counts[:, c].sum()) == 0:
                continue
            mu, sigma, total = pool_class_gaussians(means[:, c], covariances[:, c], counts[:, c])
            pooled.means[c], pooled.covariances[c], pooled.counts[c] = mu.float(), sigma.float(), int(total)

    def download_for(self, client_id: int) -> GaussianStatsPayload | None:
        return self.pooled

    def server_state(self) -> dict[str, Any]:
        return {} if self.pooled is None else dict(self.pooled.tensors())

    def load_server_state(self, state: Mapping[str, Any]) -> None:
        self.pooled = GaussianStatsPayload(**state) if state else None


class CCVR(Algorithm):
    """CCVR for heterogeneous models (needs one feature dimension: its Gaussians live in it)."""

    Hparams = CCVRHparams
    client_type = CCVRClient
    capabilities = Capabilities(heterogeneous_models=True, common_feature_dim=True, scenario_kinds=("label_skew",))
    upload_type = GaussianStatsPayload
    download_type = GaussianStatsPayload

    def build_server(self) -> ServerPhase:
        return CCVRServer()


__all__ = ["CCVR", "CCVRClient", "CCVRHparams", "CCVRServer", "GaussianStatsPayload"]
