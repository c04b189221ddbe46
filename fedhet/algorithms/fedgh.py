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
(``server_epochs`` passes in one Lightning epoch); it therefore ignores ``trainer.max_epochs``
but is cut by ``trainer.max_steps`` / ``limit_train_batches`` when those are set, since the loop
builds the server Trainer from the client template. Heterogeneous backbones emit one feature
dimension through ``feature_dim`` (HtFLlib's ``-fd``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from fedhet.algorithms.base import (
    Algorithm,
    Batch,
    Capabilities,
    ClientModule,
    ClientUpload,
    OptimizerName,
    ServerContext,
    TrainableServerPhase,
    build_optimizer,
)
from fedhet.algorithms.fedproto import FedProtoClient
from fedhet.algorithms.lg_fedavg import head_weights
from fedhet.errors import ConfigError
from fedhet.federation.payloads import ClassStatsPayload, Payload, WeightsPayload
from fedhet.federation.state import copy_state_into
from fedhet.federation.trainer import clone_state
from fedhet.functional import prototype_examples
from fedhet.hparams import Momentum, NonNegativeFloat, PositiveFloat, PositiveInt


class EpochShuffledBatches(Sampler[list[int]]):
    """``epochs`` passes over ``size`` items, each reshuffled and cut into batches (last may be short).

    HtFLlib builds a fresh shuffling ``DataLoader(drop_last=False)`` per server epoch; one pass of
    this sampler is all of a round's server epochs, so the whole server budget is one Lightning
    epoch whatever the client template's ``max_epochs``. Shuffles draw from torch's global RNG,
    which the loop seeds around every server fit.
    """

    def __init__(self, size: int, batch_size: int, epochs: int) -> None:
        self.size = size
        self.batch_size = batch_size
        self.epochs = epochs

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.epochs):
            order = torch.randperm(self.size).tolist()
            for start in range(0, self.size, self.batch_size):
                yield order[start : start + self.batch_size]

    def __len__(self) -> int:
        return self.epochs * -(-self.size // self.batch_size)


class PrototypeTrainingServer(TrainableServerPhase, ABC):
    """A server trained each round on the uploaded (class prototype, class) pairs (FedGH, FedTGP).

    Subclasses build their trainable parts in :meth:`build` and define :meth:`prototype_loss`.

    Args:
        server_lr: learning rate of the server's SGD.
        server_epochs: passes over the round's prototypes per round.
        server_batch_size: prototypes per server step.
    """

    def __init__(self, server_lr: float = 0.01, server_epochs: int = 100, server_batch_size: int = 10) -> None:
        super().__init__()
        if server_epochs < 1 or server_batch_size < 1 or server_lr <= 0:
            raise ConfigError(
                f"server_epochs={server_epochs}, server_batch_size={server_batch_size} and server_lr={server_lr} "
                "must all be positive"
            )
        self.server_lr = server_lr
        self.server_epochs = server_epochs
        self.server_batch_size = server_batch_size
        self.num_classes = 0
        self.feature_dim = 0
        self.round_prototypes = torch.zeros(0, 0)
        self.round_labels = torch.zeros(0, dtype=torch.long)
        self.loss_sum = torch.zeros(())
        self.loss_steps = 0

    def setup_server(self, context: ServerContext) -> None:
        head = head_weights(context.initial_client_state(0))
        if "weight" not in head:
            raise ConfigError(f"{type(self).__name__} needs client models with a linear 'head' (FeatureClassifier)")
        self.num_classes = context.num_classes
        self.feature_dim = int(head["weight"].shape[1])
        self.build(context, head)

    @abstractmethod
    def build(self, context: ServerContext, initial_head: dict[str, Tensor]) -> None:
        """Create the trainable parts once the class count and feature size are known."""

    @abstractmethod
    def prototype_loss(self, prototypes: Tensor, labels: Tensor) -> Tensor:
        """The server objective on one batch of uploaded prototypes."""

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        for upload in uploads:
            assert isinstance(upload.payload, ClassStatsPayload)
            upload.payload.validate_shape(self.num_classes, self.feature_dim, f"client {upload.client_id}")
        if not uploads:
            self.round_prototypes = torch.zeros(0, self.feature_dim)
            self.round_labels = torch.zeros(0, dtype=torch.long)
            return
        self.round_prototypes, self.round_labels = prototype_examples(
            [u.payload.values.float() for u in uploads],  # type: ignore[attr-defined]
            [u.payload.counts for u in uploads],  # type: ignore[attr-defined]
        )

    def server_dataloader(self, scenario: Any, seed: int) -> DataLoader:
        dataset = TensorDataset(self.round_prototypes, self.round_labels)
        sampler = EpochShuffledBatches(len(dataset), self.server_batch_size, self.server_epochs)
        return DataLoader(dataset, batch_sampler=sampler)

    # ------------------------------------------------------------------ Lightning hooks
    def on_train_epoch_start(self) -> None:
        self.loss_sum, self.loss_steps = torch.zeros((), device=self.device), 0

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        prototypes, labels = batch
        loss = self.prototype_loss(prototypes, labels)
        self.loss_sum = self.loss_sum + loss.detach()  # no host sync per step on an accelerator
        self.loss_steps += 1
        return loss

    def on_train_epoch_end(self) -> None:
        # the sampler already holds all server_epochs passes: never repeat it
        self.trainer.should_stop = True

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return build_optimizer(self.parameters(), "sgd", self.server_lr, 0.0, 0.0)

    def metrics(self) -> dict[str, float]:
        """``loss``: the mean server loss over this round's server steps."""
        return {"loss": float(self.loss_sum) / self.loss_steps} if self.loss_steps else {}


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
