"""FedGH: clients upload class prototypes, the server trains one generalized global head on them.

Paper: Yi et al., "FedGH: Heterogeneous Federated Learning with Generalized Global Header",
ACM MM 2023 (Algorithm 1). Defaults of HtFLlib (``servergh.py`` / ``clientgh.py``), the
implementation FedKTL's Table 1 ran: server SGD with lr 0.01 (FedKTL App. C, HtFLlib ``-slr``),
``server_epochs = 100`` passes (``-se``) in batches of the client batch size (``-lbs 10``).

Upload: the per-class mean features ("local averaged representations") of the classes the
client holds, with the per-class counts (``ClassStatsPayload``): ``|C_i| * K'`` floats
(FedKTL Table 5) plus one int64 count per held class.
Download: the global head ``nn.Linear(K', C)`` (``WeightsPayload``), ``K'*C + C`` floats.
Server phase: trainable (:class:`TrainableServerPhase`, fitted by the loop's server Trainer):
every uploaded (prototype, class) pair is one training example of the head, cross-entropy,
plain SGD, ``server_epochs`` reshuffled passes per round. The head starts from client 0's
initial head and persists across rounds; the optimizer is rebuilt every round (as in HtFLlib).
Client state kept across rounds: the whole model and its optimizer state; the head is replaced
by the global head at the start of every round (round 0 included, as HtFLlib's
``send_parameters`` runs before training).
Local objective: cross-entropy on the whole model (the received head is trained locally too).
Deviations from paper/official code: prototypes are the class means of the features after
local training in eval mode (HtFLlib does the same; the paper averages representations of the
trained model too). The server's per-round budget is carried by its data loader
(``server_epochs`` passes in one Lightning epoch, the stage's one-epoch budget), fitted with the
``server_trainer`` template; the clients' ``trainer`` settings never cut it short.
Heterogeneous backbones emit one feature dimension through ``feature_dim`` (HtFLlib's ``-fd``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms.base import Algorithm, Capabilities, ServerContext
from fedhet.algorithms.shared.common import FedProtoClient, PrototypeServerHparams, PrototypeTrainingServer
from fedhet.core.payloads import ClassStatsPayload, Payload, WeightsPayload
from fedhet.core.state import clone_state, copy_state_into


@dataclass(frozen=True)
class FedGHHparams(PrototypeServerHparams):
    """FedGH's hyperparameters: the local optimizer and the global head's server SGD (HtFLlib's defaults)."""


class FedGHClient(FedProtoClient):
    """Cross-entropy only; uploads its class prototypes and takes the global head each round.

    It receives a head, never global prototypes, so the inherited regulariser (and ``lam``) never
    applies: its hyperparameters are FedGH's.
    """

    Hparams = FedGHHparams

    def on_receive(self, download: Payload | None) -> None:
        if isinstance(download, WeightsPayload):
            copy_state_into(self.model.head, download.weights)


class FedGHServer(PrototypeTrainingServer):
    """Trains the generalized global head on the uploaded prototypes with cross-entropy."""

    Hparams = FedGHHparams

    def build(self, context: ServerContext, initial_head: dict[str, Tensor]) -> None:
        self.head = nn.Linear(self.feature_dim, self.num_classes)
        copy_state_into(self.head, {k: v.detach().float() for k, v in initial_head.items()})

    def prototype_loss(self, prototypes: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(self.head(prototypes), labels)

    def download_for(self, client_id: int) -> WeightsPayload:
        return WeightsPayload(weights=clone_state(self.head.state_dict()))

    @torch.no_grad()
    def accuracy_on(self, prototypes: Tensor, labels: Tensor) -> float:
        """Fraction of ``prototypes`` the global head assigns to their class (diagnostics, tests)."""
        device = self.head.weight.device
        return float((self.head(prototypes.to(device)).argmax(1) == labels.to(device)).float().mean())


class FedGH(Algorithm):
    """FedGH (heterogeneous backbones; needs one feature dimension)."""

    Hparams = FedGHHparams
    client_type = FedGHClient
    capabilities = Capabilities(heterogeneous_models=True, common_feature_dim=True)
    upload_type = ClassStatsPayload
    download_type = WeightsPayload

    def build_server(self) -> FedGHServer:
        return FedGHServer(self.hp)


__all__ = ["FedGH", "FedGHClient", "FedGHHparams", "FedGHServer"]
