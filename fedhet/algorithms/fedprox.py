"""FedProx: FedAvg with a proximal term that keeps local models near the global one.

Paper: Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020 (Eq. 2:
``h_k(w; w_t) = F_k(w) + mu/2 ||w - w_t||^2``).

Upload: the client's model weights and its number of training examples.
Download: the global model weights.
Server phase: closed-form weighted averaging, exactly FedAvg's (:class:`FedAvgServer`).
Client state kept across rounds: optimizer state; the proximal reference ``w_t`` is the
download of the round and is not kept.
Deviations from paper/official code: the paper's inexact solvers and partial work (gamma-inexact
updates, stragglers) are not simulated; every client runs the configured local budget. With
``mu = 0`` FedProx is FedAvg exactly (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms.base import Batch
from fedhet.algorithms.shared.common import FedAvgClient, WeightAveraging
from fedhet.core.payloads import Payload, WeightsPayload
from fedhet.functional import proximal_term
from fedhet.hparams import LocalOptimizer, NonNegativeFloat, knob, log_uniform


@dataclass(frozen=True)
class FedProxHparams(LocalOptimizer):
    """FedProx's hyperparameters."""

    mu: NonNegativeFloat = knob(0.01, "weight of the proximal term (0 gives FedAvg)", log_uniform(1e-4, 1.0))


class FedProxClient(FedAvgClient):
    """Cross-entropy plus ``mu/2 * ||w - w_t||^2``."""

    Hparams = FedProxHparams

    def __init__(self, model: nn.Module, num_classes: int, hp: Any = None, **overrides: Any) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        self.reference: list[Tensor] = []

    def on_receive(self, download: Payload | None) -> None:
        super().on_receive(download)
        # the live module serves every client of its architecture: a client that received no global
        # weights has no proximal anchor (never the previous client's)
        self.reference = (
            [p.detach().clone() for p in self.model.parameters()] if isinstance(download, WeightsPayload) else []
        )

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        if self.reference:
            reference = [r.to(loss.device) for r in self.reference]
            loss = loss + self.hp.mu / 2 * proximal_term(self.model.parameters(), reference)
        return loss

    def on_fit_start(self) -> None:
        self.reference = [r.to(self.device) for r in self.reference]


class FedProx(WeightAveraging):
    """FedProx (homogeneous models only)."""

    Hparams = FedProxHparams
    client_type = FedProxClient


__all__ = ["FedProx", "FedProxClient", "FedProxHparams"]
