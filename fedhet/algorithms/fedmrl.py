"""FedMRL: a shared small model beside each client's own, fused and trained as Matryoshka representations.

Paper: Yi et al., "Federated Model Heterogeneous Matryoshka Representation Learning", NeurIPS 2024
(arXiv 2406.00488). Each client holds its own (heterogeneous) model ``F = (F_ex, F_hd)``, a copy of
a small homogeneous model ``G = (G_ex, G_hd)`` shared by all clients, and a personal lightweight
projector ``P`` (one linear layer). Per batch: ``R = P([G_ex(x) ; F_ex(x)])`` (the two
representations concatenated, projected to ``F_hd``'s input width ``d_1``); the coarse granularity
``R[:, :d_2]`` (``d_2`` = the small model's feature width) feeds the shared head ``G_hd``, the fine one
``R`` (all ``d_1`` dims) the client's head ``F_hd``; the loss is ``m_1 CE(G_hd(R[:, :d_2]), y) +
m_2 CE(F_hd(R), y)`` (:func:`fedhet.functional.matryoshka.matryoshka_loss`, ``m_1 = m_2 = 1``), and
one SGD step trains ``G``, ``F`` and ``P`` together.

Upload: the small model's weights (``WeightsPayload``) and the client's number of training examples.
Download: the aggregated small model (from round 0 on: every client starts from one small model).
Server phase: closed-form averaging of the small models over the round's participants,
example-weighted (``small_weighting="samples"``, FedAvg as in the paper) or uniform (HtFLlib).
Client state kept across rounds: its own model, the projector and the optimizer state; the small
model is overwritten by each download.
Prediction: the client's head on the fused representation (``prediction="fine"``, HtFLlib's
evaluation), or the sum of both heads' logits (``"sum"``).

Deviations from paper/official code (HtFLlib ``clientmrl.py`` / ``servermrl.py``), each following
the paper where the two differ:

* HtFLlib reloads the projector's initial weights every round (it never saves the trained one);
  fedhet keeps the trained projector in the client state, as the paper's personal projector.
* HtFLlib averages the small models uniformly; the default here is the example-weighted FedAvg
  average (``small_weighting="uniform"`` is HtFLlib's).
* The small model is a registered model (``small_model``) whose features are pooled to
  ``small_feature_dim`` (HtFLlib's ``BaseHeadSplit`` pooling, ``-sfd 128`` with ``-fd 512``); the CPU
  default 16 fits fedhet's smallest backbones, paper-scale configs set 128. It is initialised from
  a seed every client shares (``shared_init_seed``). The projector draws its initialisation from
  the global RNG when the client is built (HtFLlib: ``torch.manual_seed(0)`` on every client).
* One optimizer (the declared local one) trains all three parts; HtFLlib's three SGD optimizers of
  one learning rate are the same step without momentum.
* The client models need not share a feature width (each projector maps to its own ``d_1``); every
  ``d_1`` must be at least ``small_feature_dim``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from fedhet.algorithms.base import Algorithm, Batch, Capabilities, ClientModule, ServerPhase
from fedhet.algorithms.shared.common import (
    SharedSubmoduleServer,
    SharedWeighting,
    SubmoduleSharingClient,
    build_shared_model,
)
from fedhet.core.payloads import WeightsPayload
from fedhet.errors import ConfigError
from fedhet.functional.matryoshka import matryoshka_loss, nested_prefixes
from fedhet.hparams import LocalOptimizer, NonNegativeFloat, PositiveInt, knob, log_uniform

Prediction = Literal["fine", "sum"]


@dataclass(frozen=True)
class FedMRLHparams(LocalOptimizer):
    """FedMRL's hyperparameters (paper: ``m_1 = m_2 = 1``; HtFLlib: ``-sfd 128``, SGD 0.01)."""

    small_model: str = knob("simple_cnn", "registered model name of the shared homogeneous small model")
    small_feature_dim: PositiveInt = knob(
        16, "d_2, the small model's feature width and the coarse granularity (HtFLlib -sfd; 128 at paper scale)"
    )
    coarse_weight: NonNegativeFloat = knob(
        1.0, "m_1, weight of the shared head's loss on the coarse representation", log_uniform(1e-2, 10.0)
    )
    fine_weight: NonNegativeFloat = knob(
        1.0, "m_2, weight of the client head's loss on the fine representation", log_uniform(1e-2, 10.0)
    )
    prediction: Prediction = knob("fine", "fine (the client's head, HtFLlib) or sum (both heads' logits added)")
    small_weighting: SharedWeighting = knob(
        "samples", "averaging of small models: samples (paper) or uniform (HtFLlib)"
    )
    shared_init_seed: int = knob(0, "seed of the small model's initialisation, the same on every client")


class FedMRLClient(SubmoduleSharingClient):
    """The client's own model, the shared small model and the personal projector, trained together.

    Args:
        model: the client's (possibly heterogeneous) backbone ``F``.
        num_classes: number of classes.
        small: the shared homogeneous small model ``G`` (one architecture for all clients).
        hp: the method's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams = FedMRLHparams
    shared_module = "small"

    def __init__(self, model: nn.Module, num_classes: int, small: nn.Module, hp: Any = None, **overrides: Any) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        self.small = small
        coarse, fine = int(small.num_features), int(model.num_features)  # type: ignore[arg-type]
        if coarse > fine:
            raise ConfigError(
                f"FedMRL: the small model's {coarse} features exceed the client model's {fine} (the fine "
                f"granularity); lower small_feature_dim or raise feature_dim"
            )
        self.projector = nn.Linear(coarse + fine, fine)

    def fused(self, x: Tensor) -> Tensor:
        """``R = P([G_ex(x) ; F_ex(x)])``, the ``[B, d_1]`` Matryoshka representation."""
        return self.projector(torch.cat((self.small.forward_features(x), self.model.forward_features(x)), 1))

    def granularity_logits(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(G_hd(R[:, :d_2]), F_hd(R))``: the coarse and the fine granularity's class scores."""
        representation = self.fused(x)
        coarse, fine = nested_prefixes(representation, [int(self.small.num_features), representation.shape[1]])
        return self.small.forward_head(coarse), self.model.forward_head(fine)

    def forward(self, x: Tensor) -> Tensor:
        coarse, fine = self.granularity_logits(x)
        return fine if self.hp.prediction == "fine" else coarse + fine

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        logits = self.granularity_logits(x)
        return matryoshka_loss(logits, y, [self.hp.coarse_weight, self.hp.fine_weight])


class FedMRLServer(SharedSubmoduleServer):
    """Averages the small models of every participant (one group whatever the architectures)."""

    Hparams = FedMRLHparams
    shared_module = "small"
    weighting_knob = "small_weighting"


class FedMRL(Algorithm):
    """FedMRL (heterogeneous client models, one shared small model)."""

    Hparams = FedMRLHparams
    client_type = FedMRLClient
    capabilities = Capabilities(heterogeneous_models=True)
    upload_type = WeightsPayload
    download_type = WeightsPayload

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        small = build_shared_model(  # features pooled to d_2
            self.hp.small_model, num_classes, self.image_channels(), self.hp.shared_init_seed, "fedmrl-small",
            feature_dim=self.hp.small_feature_dim,
        )  # fmt: skip
        return FedMRLClient(model, num_classes, small, self.hp)

    def build_server(self) -> ServerPhase:
        return FedMRLServer(self.hp)


__all__ = ["FedMRL", "FedMRLClient", "FedMRLHparams", "FedMRLServer"]
