"""Ditto: a FedAvg global model, and per client a personal model pulled towards it.

Paper: Li et al., "Ditto: Fair and Robust Federated Learning Through Personalization", ICML 2021
(Algorithm 1). Each selected client updates the global model ``w`` as FedAvg does, and its
personal model ``v_k`` on ``F_k(v_k) + lam/2 ||v_k - w^t||^2``, where ``w^t`` is the global model
it received this round.

Upload: the client's updated copy of the global model (``WeightsPayload``) and its example count.
Download: the global model.
Server phase: FedAvg's closed-form example-weighted averaging.
Client state kept across rounds: the personal model ``v_k`` (and the global copy, overwritten by
every download). Evaluation scores the personal model.
Local stages: ``global`` (the FedAvg update of ``w``), then ``personal`` (the update of ``v_k``),
each the configured local budget, each its own optimizer state.
Deviations from paper/official code: the paper's ``s`` personal steps are the stage's local
epochs (the Trainer budget), as for every other method's local work; the proximal anchor is
``w^t`` as received, as in Algorithm 1 (not the client's updated ``w_k``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms.base import Algorithm, Batch, Capabilities, LocalStage, ServerPhase
from fedhet.algorithms.shared.common import SubmoduleAveragingServer, SubmoduleSharingClient
from fedhet.core.payloads import Payload, WeightsPayload
from fedhet.functional import proximal_term
from fedhet.hparams import LocalOptimizer, NonNegativeFloat, knob, log_uniform

PERSONAL = "personal"


@dataclass(frozen=True)
class DittoHparams(LocalOptimizer):
    """Ditto's hyperparameters."""

    lam: NonNegativeFloat = knob(
        0.1, "lambda, the pull of the personal model to the received global model", log_uniform(1e-3, 10.0)
    )


class DittoClient(SubmoduleSharingClient):
    """The global copy ``model`` (shared) and the personal model ``personal`` (kept, evaluated)."""

    Hparams = DittoHparams

    def __init__(self, model: nn.Module, num_classes: int, hp: Any = None, **overrides: Any) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        self.personal = copy.deepcopy(model)
        self.anchor: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.personal(x)

    def local_stages(self) -> Sequence[LocalStage]:
        return (LocalStage("global"), LocalStage(PERSONAL))

    def on_receive(self, download: Payload | None) -> None:
        super().on_receive(download)
        received = isinstance(download, WeightsPayload)
        self.anchor = [p.detach().clone() for p in self.model.parameters()] if received else []

    def on_fit_start(self) -> None:
        self.anchor = [a.to(self.device) for a in self.anchor]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.local_optimizer((self.personal if self.stage == PERSONAL else self.model).parameters())

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        if self.stage != PERSONAL:
            return F.cross_entropy(self.model(x), y)
        loss = F.cross_entropy(self.personal(x), y)
        if self.anchor:
            loss = loss + self.hp.lam / 2 * proximal_term(self.personal.parameters(), self.anchor)
        return loss


class Ditto(Algorithm):
    """Ditto (homogeneous models: the global model is averaged)."""

    Hparams = DittoHparams
    client_type = DittoClient
    capabilities = Capabilities(heterogeneous_models=False)
    upload_type = WeightsPayload
    download_type = WeightsPayload

    def build_server(self) -> ServerPhase:
        return SubmoduleAveragingServer()


__all__ = ["Ditto", "DittoClient", "DittoHparams"]
