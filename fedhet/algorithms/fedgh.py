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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms.base import (
    Algorithm,
    Capabilities,
    ClientModule,
    OptimizerName,
    ServerContext,
)
from fedhet.algorithms.common import FedProtoClient, PrototypeTrainingServer
from fedhet.core.payloads import ClassStatsPayload, Payload, WeightsPayload
from fedhet.core.state import clone_state, copy_state_into
from fedhet.hparams import Momentum, NonNegativeFloat, PositiveFloat, PositiveInt


class FedGHClient(FedProtoClient):
    """Cross-entropy only; uploads its class prototypes and takes the global head each round."""

    def on_receive(self, download: Payload | None) -> None:
        if isinstance(download, WeightsPayload):
            copy_state_into(self.model.head, download.weights)


class FedGHServer(PrototypeTrainingServer):
    """Trains the generalized global head on the uploaded prototypes with cross-entropy."""

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
    """FedGH (heterogeneous backbones; needs one feature dimension).

    Args:
        server_lr: learning rate of the server's SGD on the global head (HtFLlib ``-slr``).
        server_epochs: passes over the round's uploaded prototypes per round (HtFLlib ``-se``).
        server_batch_size: prototypes per server step (HtFLlib uses the client batch size, 10).
        optimizer: local optimizer, ``"sgd"``, ``"adam"`` or ``"adamw"``.
        lr: local learning rate.
        momentum: SGD momentum.
        weight_decay: L2 weight decay.
    """

    capabilities = Capabilities(heterogeneous_models=True, common_feature_dim=True)
    upload_type = ClassStatsPayload
    download_type = WeightsPayload

    def __init__(
        self,
        server_lr: PositiveFloat = 0.01,
        server_epochs: PositiveInt = 100,
        server_batch_size: PositiveInt = 10,
        optimizer: OptimizerName = "sgd",
        lr: PositiveFloat = 0.01,
        momentum: Momentum = 0.0,
        weight_decay: NonNegativeFloat = 0.0,
    ) -> None:
        super().__init__(optimizer, lr, momentum, weight_decay)
        self.server_lr = server_lr
        self.server_epochs = server_epochs
        self.server_batch_size = server_batch_size

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        return FedGHClient(model, num_classes, lam=0.0, **self.optimizer_kwargs())

    def build_server(self) -> FedGHServer:
        return FedGHServer(self.server_lr, self.server_epochs, self.server_batch_size)
