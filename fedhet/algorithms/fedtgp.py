"""FedTGP: trainable global prototypes learned with adaptive-margin-enhanced contrastive learning.

Paper: Zhang et al., "FedTGP: Trainable Global Prototypes with Adaptive-Margin-Enhanced
Contrastive Learning for Data and Model Heterogeneity in Federated Learning", AAAI 2024
(Eq. 4-9, Algorithm 1). Defaults of the authors' code (HtFLlib ``servertgp.py`` /
``clienttgp.py``, FedTGP ``run_me.sh``): ``lam = 10`` with MSE, margin threshold
``tau = 100``, ``server_epochs = 100``, server SGD with the local learning rate (0.01) in batches of
the client batch size (10).

Upload: per-class mean features of the classes the client holds, with counts
(``ClassStatsPayload``): ``|C_i| * K'`` floats plus one int64 count per held class.
Download: the trainable global prototypes ``G^c`` of every class uploaded so far
(``ClassStatsPayload``, ``counts = 1`` marking them); nothing before the first server phase.
Server phase: trainable (:class:`TrainableServerPhase`). ``G^c = W2 relu(W1 e^c + b1) + b2`` with
a learnable embedding ``e^c`` per class (hidden size ``K'``), kept across rounds. Each round:
the margin ``delta = min(max_c min_{c'!=c} ||Q^c - Q^c'||, tau)`` from the per-class averages
``Q^c`` of the round's uploads (:func:`fedhet.functional.adaptive_margin`), then ``server_epochs``
reshuffled passes of SGD on :func:`fedhet.functional.margin_contrastive_loss` over the uploaded
(prototype, class) pairs; the optimizer is rebuilt every round (as in HtFLlib).
Client state kept across rounds: the local model and optimizer state (models are never shared).
Local objective: ``CE(f(x), y) + lam * d(z(x), G^y)`` over the samples whose class has a global
prototype; ``d`` is MSE over feature elements (``prototype_distance="mse"``, the authors' code) or
the Euclidean distance of paper Eq. 4 (``"euclidean"``, use ``lam = 0.1`` as in the paper).
Prediction: the client's own head (``prediction="head"``), or HtFLlib's nearest global prototype
by squared distance (``"prototype"``).
Deviations from paper/official code: distances are computed from differences with a clamped
square root (HtFLlib expands ``|a|^2 - 2ab + |b|^2``, which can give NaN); only classes some
client has uploaded are downloaded (HtFLlib sends the never-trained prototypes of unseen
classes too); samples of classes without a global prototype are left out of the MSE mean (in
HtFLlib they add zeros to it). The server budget is carried by its data loader, as in
:mod:`fedhet.algorithms.fedgh` (cut by ``trainer.max_steps`` / ``limit_train_batches``).
Prototypes are computed after local training in eval mode, as in HtFLlib (``class_means_from``;
``"training_steps"`` would average the training steps' features instead).

Stability: the margin ``min(max inter-prototype distance, tau)`` grows with the clients'
prototypes, the server pushes the global ones apart by it, and the clients pull their features
onto them (``lam`` 10 x MSE), so the client loss grows every round (2 -> 100-600 over 20 rounds
of ``digits_dir``). At SGD 0.05 with momentum 0.9 (HtFLlib: SGD 0.01) that diverged at 3 of 5
seeds and ended at 53-59 % local accuracy at the other two (clipped: 77-86 % at all five); the
Digits configs clip client gradients at norm 5 (``trainer.gradient_clip_val``), which neither the
paper nor HtFLlib does (``docs/results/archive/stability_2026-11-26.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from fedhet.algorithms.base import (
    Algorithm,
    Capabilities,
    ClientUpload,
    ServerContext,
)
from fedhet.algorithms.shared.common import FedProtoClient, PrototypeServerHparams, PrototypeTrainingServer
from fedhet.core.payloads import ClassStatsPayload
from fedhet.functional import (
    adaptive_margin,
    aggregate_class_means,
    margin_contrastive_loss,
    pairwise_distances,
    prototype_alignment_loss,
)
from fedhet.functional.prototype_learning import AlignmentDistance
from fedhet.hparams import NonNegativeFloat, knob, log_uniform
from fedhet.seeding import derive_seed, seeded

Prediction = Literal["head", "prototype"]


class TrainablePrototypes(nn.Module):
    """``G^c = fc(relu(middle(e^c)))``: one learnable embedding per class through a 2-layer MLP.

    The shared MLP couples the classes, so a prototype moves even in rounds where its class is
    not uploaded (HtFLlib's ``Trainable_prototypes``).
    """

    def __init__(self, num_classes: int, feature_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(num_classes, feature_dim)
        self.middle = nn.Sequential(nn.Linear(feature_dim, hidden_dim), nn.ReLU())
        self.fc = nn.Linear(hidden_dim, feature_dim)

    def forward(self) -> Tensor:
        """All ``[C, K']`` global prototypes."""
        return self.fc(self.middle(self.embeddings.weight))


@dataclass(frozen=True)
class FedTGPHparams(PrototypeServerHparams):
    """FedTGP's hyperparameters (HtFLlib's names; its server SGD reuses the local rate, 0.01)."""

    lam: NonNegativeFloat = knob(
        10.0,
        "weight of the client's prototype regulariser (10 with MSE, the authors' scripts; the paper's 0.1 goes "
        "with prototype_distance=euclidean)",
        log_uniform(1e-2, 100.0),
    )
    prototype_distance: AlignmentDistance = knob("mse", "mse (authors' code) or euclidean (paper Eq. 4)")
    prediction: Prediction = knob(
        "head", "head (the client's classifier) or prototype (nearest global prototype, HtFLlib's evaluation)"
    )
    margin_threshold: NonNegativeFloat = knob(100.0, "tau, the cap of the adaptive margin (HtFLlib -mart)")


class FedTGPClient(FedProtoClient):
    """FedProto's client with TGP's distance choice and optional nearest-prototype prediction."""

    Hparams = FedTGPHparams

    def regulariser(self, statistic: Tensor, targets: Tensor) -> Tensor:
        """The prototype alignment: the authors' MSE or the paper's Euclidean distance (Eq. 4)."""
        return prototype_alignment_loss(statistic, targets, self.hp.prototype_distance)

    def forward(self, x: Tensor) -> Tensor:
        if self.hp.prediction == "head" or self.global_means is None or self.global_present is None:
            return self.model(x)
        features = self.model.forward_features(x)
        means, present = self.global_on(features.device)
        return (-pairwise_distances(features, means).pow(2)).masked_fill(~present, float("-inf"))


class FedTGPServer(PrototypeTrainingServer):
    """Trains the global prototypes against the uploaded ones with the adaptive margin."""

    Hparams = FedTGPHparams

    def build(self, context: ServerContext, initial_head: dict[str, Tensor]) -> None:
        with seeded(derive_seed(context.seed, "fedtgp-prototypes")):
            self.prototypes = TrainablePrototypes(self.num_classes, self.feature_dim, self.feature_dim)
        self.register_buffer("seen", torch.zeros(self.num_classes, dtype=torch.bool))
        self.register_buffer("margin", torch.zeros(()))

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        super().aggregate(round_idx, uploads)
        if not uploads:
            return
        class_averages, present = aggregate_class_means(
            [u.payload.values.float() for u in uploads],  # type: ignore[attr-defined]
            [u.payload.counts for u in uploads],  # type: ignore[attr-defined]
            "uniform",
        )
        self.margin.copy_(adaptive_margin(class_averages, present, self.hp.margin_threshold))
        self.seen |= present.to(self.seen.device)

    def prototype_loss(self, prototypes: Tensor, labels: Tensor) -> Tensor:
        return margin_contrastive_loss(prototypes, labels, self.prototypes(), self.margin)

    @torch.no_grad()
    def download_for(self, client_id: int) -> ClassStatsPayload | None:
        if not bool(self.seen.any()):
            return None
        return ClassStatsPayload(values=self.prototypes().detach().cpu().clone(), counts=self.seen.long().cpu())

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "margin": float(self.margin)}


class FedTGP(Algorithm):
    """FedTGP (heterogeneous backbones; needs one feature dimension)."""

    Hparams = FedTGPHparams
    client_type = FedTGPClient
    capabilities = Capabilities(heterogeneous_models=True, common_feature_dim=True)
    upload_type = ClassStatsPayload
    download_type = ClassStatsPayload

    def build_server(self) -> FedTGPServer:
        return FedTGPServer(self.hp)


__all__ = ["FedTGP", "FedTGPClient", "FedTGPHparams", "FedTGPServer", "TrainablePrototypes"]
