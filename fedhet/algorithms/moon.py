"""MOON: model-contrastive federated learning (FedAvg plus a representation-level contrastive term).

Paper: Li, He and Song, "Model-Contrastive Federated Learning", CVPR 2021 (Sec. 3.3, Eq. 1-4;
network = base encoder + 2-layer MLP projection head + output layer on the projection). Official
code: github.com/QinbinLi/MOON (``train_net_fedcon``). Defaults ``mu = 1``, ``tau = 0.5``: MOON's
CIFAR-100 setting and FCCL+ Tab. VII. FCCL+ Tab. XV's "MOON (tau=5)" / "(tau=1)" are most likely
``mu`` in {5, 1} (reference/fccl-plus.md section 5): run ``--method.mu 5`` for the other row.

Upload: the client's model weights (``WeightsPayload``) and its number of examples.
Download: the global model weights.
Server phase: FedAvg's closed-form example-weighted average (:class:`FedAvgServer`).
Client state kept across rounds: the local model after its last local training (it is the
negative of the next round, so no extra copy is stored), a flag saying whether that model was
trained yet, and the optimizer state.
Local objective: ``CE(f(x), y) + mu * l_con(z, z_glob, z_prev; tau)``
(:func:`fedhet.functional.model_contrastive_loss`), ``z`` the representation fed to the output
layer, ``z_glob`` / ``z_prev`` those of the frozen global and previous local models in eval mode.

Deviations from paper/official code:

* ``projection_dim=256`` (default) wraps the backbone as in the paper: features -> Linear -> ReLU ->
  Linear(256) -> output layer; the backbone's own head is dropped. ``projection_dim=None`` uses
  the backbone unchanged with ``z`` = its pooled features, as the FCCL+ authors' code does (and
  then ``mu = 0`` is FedAvg bit for bit, tested).
* At a client's first participation there is no previous local model: the term is zero, as in
  the official code's round 0 (its negative pool is empty). Later, the negative is the client's
  own model from its last participation; the official code keeps every client's model of the
  last round, trained or not, and supports a pool of several previous models (size 1 here, the
  paper's default).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms.base import Batch, ClientModule
from fedhet.algorithms.shared.common import FedAvgClient, WeightAveraging
from fedhet.core.payloads import Payload, WeightsPayload
from fedhet.core.state import copy_state_into
from fedhet.functional import model_contrastive_loss
from fedhet.hparams import LocalOptimizer, NonNegativeFloat, PositiveFloat, PositiveInt, knob, log_uniform


@dataclass(frozen=True)
class MoonHparams(LocalOptimizer):
    """MOON's hyperparameters (the client reads ``mu`` and ``temperature``; the Algorithm ``projection_dim``)."""

    mu: NonNegativeFloat = knob(
        1.0,
        "weight of the model-contrastive term (MOON: 1 on CIFAR-100, 5 on CIFAR-10; 0 gives FedAvg)",
        log_uniform(0.01, 10.0),
    )
    temperature: PositiveFloat = knob(
        0.5, "tau of the contrastive term (0.5, MOON and FCCL+ Tab. VII)", log_uniform(0.05, 5.0)
    )
    projection_dim: PositiveInt | None = knob(
        256, "output size of the paper's projection head; null contrasts the backbone's features (FCCL+ code)"
    )



class ProjectedClassifier(nn.Module):
    """MOON's network: the backbone's features, a 2-layer MLP projection head, an output layer.

    It follows the :class:`fedhet.models.FeatureClassifier` contract, ``forward_features`` being
    the projection (MOON's representation ``R_w(x)``), so every method helper works on it.

    Args:
        backbone: a registered model; its ``head`` is replaced by ``nn.Identity`` (unused).
        num_classes: number of classes of the output layer.
        projection_dim: output size of the projection head (256 in the paper).
    """

    def __init__(self, backbone: nn.Module, num_classes: int, projection_dim: int = 256) -> None:
        super().__init__()
        backbone_features = int(backbone.num_features)
        backbone.head = nn.Identity()  # dead weights would otherwise be averaged and sent every round
        self.backbone = backbone
        self.projection = nn.Sequential(
            nn.Linear(backbone_features, backbone_features),
            nn.ReLU(inplace=True),
            nn.Linear(backbone_features, projection_dim),
        )
        self.head = nn.Linear(projection_dim, num_classes)
        self.num_features = projection_dim
        self.num_classes = num_classes

    def forward_features(self, x: Tensor) -> Tensor:
        return self.projection(self.backbone.forward_features(x))

    def forward_head(self, z: Tensor) -> Tensor:
        return self.head(z)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


def _frozen_copy(model: nn.Module) -> nn.Module:
    """A copy that never trains: eval mode (BatchNorm running statistics), no gradients."""
    frozen = copy.deepcopy(model).eval()
    for parameter in frozen.parameters():
        parameter.requires_grad_(False)
    return frozen


class MoonClient(FedAvgClient):
    """Cross-entropy plus ``mu`` times the model-contrastive loss.

    ``model`` is the whole network: a :class:`ProjectedClassifier` (MOON builds it when
    ``projection_dim`` is set) or a plain backbone; the client never wraps it itself.
    """

    Hparams = MoonHparams

    def __init__(self, model: nn.Module, num_classes: int, hp: Any = None, **overrides: Any) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        # Persisted in client_state: whether ``model`` holds a locally trained model (the negative).
        self.register_buffer("has_previous_model", torch.zeros((), dtype=torch.bool))
        # The positive and negative models are kept out of the module tree on purpose: they are not
        # trained, not averaged, and not stored (the previous model is the stored local model).
        self.anchor_models: dict[str, nn.Module] = {"global": _frozen_copy(model), "previous": _frozen_copy(model)}
        self.has_global_model = False

    def on_receive(self, download: Payload | None) -> None:
        if isinstance(download, WeightsPayload):
            if bool(self.has_previous_model):
                copy_state_into(self.anchor_models["previous"], self.model.state_dict())
            copy_state_into(self.anchor_models["global"], download.weights)
            self.has_global_model = True
        super().on_receive(download)

    def load_client_state(self, state: Mapping[str, Tensor]) -> None:
        super().load_client_state(state)
        self.has_global_model = False

    def on_fit_start(self) -> None:
        for anchor in self.anchor_models.values():
            anchor.to(self.device)

    def on_train_end(self) -> None:
        self.has_previous_model.fill_(True)

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        features = self.model.forward_features(x)
        loss = F.cross_entropy(self.model.forward_head(features), y)
        if self.hp.mu != 0 and self.has_global_model and bool(self.has_previous_model):
            with torch.no_grad():
                global_features = self.anchor_models["global"].forward_features(x)
                previous_features = self.anchor_models["previous"].forward_features(x)
            contrastive = model_contrastive_loss(features, global_features, previous_features, self.hp.temperature)
            loss = loss + self.hp.mu * contrastive
        return loss


class MOON(WeightAveraging):
    """MOON (homogeneous models only)."""

    Hparams = MoonHparams
    client_type = MoonClient

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        dim = self.hp.projection_dim
        network = model if dim is None else ProjectedClassifier(model, num_classes, dim)
        return self.client_type(network, num_classes, self.hp)


__all__ = ["MOON", "MoonClient", "MoonHparams", "ProjectedClassifier"]
