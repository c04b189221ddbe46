"""The method contract: what a federated method implements, and nothing else.

A method lives in one file, ``fedhet/algorithms/<method>.py``, and defines:

* its payload types (or reuses those in :mod:`fedhet.federation.payloads`);
* ``<Method>Client(ClientModule)``: a LightningModule holding one client's model and local
  objective. The round loop calls, per selected client and round, in this order:
  ``load_client_state`` -> ``on_receive(download)`` -> ``Trainer.fit`` (the local budget) ->
  ``make_upload(loader)`` -> ``client_state()``. It is an ordinary LightningModule: it also
  trains on its own under a plain ``Trainer`` or ``LightningCLI``;
* ``<Method>Server(ServerPhase)``: closed-form (``aggregate`` then ``download_for``), or a
  :class:`TrainableServerPhase`, a LightningModule the loop fits each round with its own lean
  Trainer on server-side data (public data, synthetic data, noise);
* ``<Method>(Algorithm)``: the object configs select (``method.class_path``). Its typed
  ``__init__`` arguments are the method's hyperparameters; it builds the client modules and the
  server and declares :class:`Capabilities`, which the command line checks against the scenario
  and model family before anything runs;
* optionally a :class:`CollaborativePhase`: all participating client modules stepping together,
  batch by batch, on public data (FCCL, FCCL+, FedMD's digest, RHFL).

A method file holds no round loop, sampling, partitioning, file I/O or printing; its math lives
in :mod:`fedhet.functional` when two methods share it. ``docs/adding_a_method.md`` walks through
an example.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.federation.payloads import Payload
from fedhet.federation.state import copy_state_into

Batch = tuple[Tensor, Tensor]
OptimizerName = Literal["sgd", "adam", "adamw"]


@dataclass(frozen=True)
class Capabilities:
    """What a method needs from the scenario and the model family, checked at start-up.

    Attributes:
        heterogeneous_models: ``False`` when the method exchanges whole weights and so needs one
            architecture for every client (FedAvg, FedProx ...).
        needs_public_data: the method uses the scenario's unlabeled public set.
        scenario_kinds: the scenario kinds it was designed and evaluated for.
        common_feature_dim: clients exchange features, so every backbone must emit one feature
            dimension (set ``feature_dim`` to add a linear neck to heterogeneous backbones).
    """

    heterogeneous_models: bool = True
    needs_public_data: bool = False
    common_feature_dim: bool = False
    scenario_kinds: tuple[str, ...] = ("label_skew", "domain_shift")


@dataclass(frozen=True)
class ClientUpload:
    """An upload as the server receives it: who sent it, with which architecture, and what."""

    client_id: int
    architecture: str
    payload: Payload


@dataclass(frozen=True)
class ServerContext:
    """What a server learns once, before round 0."""

    num_clients: int
    num_classes: int
    architectures: tuple[str, ...]
    seed: int
    initial_client_state: Any  # callable (client_id) -> client module state dict


def build_optimizer(
    params: Iterable[Tensor], name: OptimizerName, lr: float, momentum: float, weight_decay: float
) -> torch.optim.Optimizer:
    """The optimizers clients and servers choose between by name (a typed config value)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; use 'sgd', 'adam' or 'adamw'")


class ClientModule(pl.LightningModule):
    """Base LightningModule of a federated client: one model, cross-entropy, one optimizer.

    Subclasses change the local objective in :meth:`training_step` and add the federation hooks
    they need. The loop reads the mean training loss from :attr:`train_loss_sum` and
    :attr:`train_steps` rather than through ``self.log``, so client Trainers run without a
    logger at no per-step logging cost.

    Args:
        model: a backbone following the :class:`fedhet.models.FeatureClassifier` contract
            (``forward_features``, ``forward_head``, ``num_features``).
        num_classes: number of classes of the task.
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"``.
        lr: learning rate of the local optimizer.
        momentum: SGD momentum (ignored by Adam).
        weight_decay: L2 weight decay.
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        optimizer: OptimizerName = "sgd",
        lr: float = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.model = model
        self.num_classes = num_classes
        self.optimizer_name: OptimizerName = optimizer
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.train_loss_sum = torch.zeros(())
        self.train_steps = 0
        # Set by the round loop before each client step (schedules that decay over rounds read them).
        self.round_idx = 0
        self.total_rounds = 1

    # ------------------------------------------------------------------ Lightning hooks
    def forward(self, x: Tensor) -> Tensor:
        """Class scores used for evaluation (methods predicting differently override this)."""
        return self.model(x)

    def local_loss(self, batch: Batch) -> Tensor:
        """The local objective on one private batch; cross-entropy unless a method adds terms."""
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = self.local_loss(batch)
        self.train_loss_sum = self.train_loss_sum.to(loss.device) + loss.detach()
        self.train_steps += 1
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        x, y = batch
        self.log("val/acc", (self(x).argmax(1) == y).float().mean(), prog_bar=True)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        x, y = batch
        self.log("test/acc", (self(x).argmax(1) == y).float().mean())

    def on_train_epoch_start(self) -> None:
        self.train_loss_sum = torch.zeros((), device=self.device)
        self.train_steps = 0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return build_optimizer(trainable, self.optimizer_name, self.lr, self.momentum, self.weight_decay)

    # ------------------------------------------------------------------ federation hooks
    def on_receive(self, download: Payload | None) -> None:
        """Take what the server sent this round (``None`` before the server has anything)."""

    def make_upload(self, train_batches: Iterable[Batch]) -> Payload | None:
        """What leaves the client after local training; ``train_batches`` is its training set in eval order."""
        return None

    def client_state(self) -> dict[str, Tensor]:
        """Everything that persists on this client between rounds (default: the module's state dict)."""
        return self.state_dict()

    def load_client_state(self, state: Mapping[str, Tensor]) -> None:
        """Restore what :meth:`client_state` returned."""
        copy_state_into(self, dict(state))

    def mean_train_loss(self) -> float:
        """Mean loss over the last local epoch (``nan`` when no step ran)."""
        return float(self.train_loss_sum) / self.train_steps if self.train_steps else float("nan")


class ServerPhase:
    """A closed-form server: it aggregates uploads and prepares each client's download.

    Subclasses keep their state (global weights, global prototypes ...) in tensors and return it
    from :meth:`state_dict` so that round checkpoints restore it exactly.
    """

    def setup(self, context: ServerContext) -> None:
        """Called once before round 0 (and again on resume, before ``load_state_dict``)."""

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        """Fold this round's (validated) uploads into the server state."""

    def download_for(self, client_id: int) -> Payload | None:
        """What client ``client_id`` receives at the start of the next round (``None``: nothing)."""
        return None

    def metrics(self) -> dict[str, float]:
        """Scalars logged under ``server/`` after the server phase."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class TrainableServerPhase(pl.LightningModule, ServerPhase):
    """A server phase trained with its own lean Trainer each round (distillation, generators).

    The loop calls ``aggregate(round, uploads)`` to set the round up, then fits the module on
    :meth:`server_dataloader`, then asks :meth:`download_for` for every client.
    """

    def setup(self, context: ServerContext | str | None = None, stage: str | None = None) -> None:  # type: ignore[override]
        """The loop's ``setup(context)`` goes to :meth:`setup_server`; Lightning's ``setup(stage)`` hook does nothing."""
        if isinstance(context, ServerContext):
            self.setup_server(context)

    def setup_server(self, context: ServerContext) -> None:
        """Build the server state from the run's context (once before round 0, and again on resume)."""

    def server_dataloader(self, scenario: Any, seed: int) -> Iterable[Any]:
        """The data the server trains on this round (public data, noise, synthetic samples)."""
        raise NotImplementedError(f"{type(self).__name__} must define server_dataloader()")

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return pl.LightningModule.state_dict(self, *args, **kwargs)

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        return pl.LightningModule.load_state_dict(self, state, strict=strict, assign=assign)


class CollaborativePhase(pl.LightningModule):
    """All participating clients stepping together on each public batch (lock-step).

    FCCL, FCCL+, FedMD's digest step and RHFL compute every client's target from the *current*
    outputs of all clients on the same public batch, so one upload per round would change the
    method. The loop fits this module with a lean Trainer over the scenario's public loader,
    every client receiving the same augmented batch; it uses manual optimisation, one optimizer
    per client. Subclasses implement :meth:`collaborative_losses`.

    Attributes:
        exchanged_bytes_up / exchanged_bytes_down: bytes the phase exchanged (per-batch logits,
            averaged targets ...), added to the round's communication ledger by the loop.
    """

    def __init__(self, clients: Sequence[ClientModule]) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.clients = nn.ModuleList(clients)
        self.exchanged_bytes_up = 0
        self.exchanged_bytes_down = 0
        # Set by the round loop after building the phase (schedules that decay over rounds read them).
        self.round_idx = 0
        self.total_rounds = 1

    def collaborative_losses(self, x: Tensor) -> list[Tensor]:
        """One loss per client for public batch ``x`` (unlabeled)."""
        raise NotImplementedError(f"{type(self).__name__} must define collaborative_losses()")

    def client_optimizer(self, client: ClientModule) -> torch.optim.Optimizer:
        """The optimizer a client uses in this phase (default: the client's own configuration)."""
        optimizer = client.configure_optimizers()
        assert isinstance(optimizer, torch.optim.Optimizer)
        return optimizer

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.client_optimizer(client) for client in self.clients]

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        losses = self.collaborative_losses(batch[0])
        for optimizer in optimizers:
            optimizer.zero_grad()
        # Targets are detached inside collaborative_losses, so the sum back-propagates each
        # loss into its own client only.
        self.manual_backward(torch.stack(losses).sum())
        for optimizer in optimizers:
            optimizer.step()


class Algorithm:
    """A federated method: its hyperparameters, its parts, and what it needs.

    Subclasses set the class attributes and implement :meth:`build_client` and
    :meth:`build_server`; hyperparameters are typed ``__init__`` arguments with defaults and a
    docstring line each (the command line and sweeps read them).

    Args:
        optimizer: local optimizer, ``"sgd"``, ``"adam"`` or ``"adamw"``.
        lr: local learning rate.
        momentum: SGD momentum.
        weight_decay: L2 weight decay.
    """

    capabilities: ClassVar[Capabilities] = Capabilities()
    upload_type: ClassVar[type[Payload] | None] = None
    download_type: ClassVar[type[Payload] | None] = None

    def __init__(
        self, optimizer: OptimizerName = "sgd", lr: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0
    ) -> None:
        self.optimizer = optimizer
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay

    @property
    def name(self) -> str:
        return type(self).__name__

    def optimizer_kwargs(self) -> dict[str, Any]:
        """The client optimizer arguments, passed on to every :class:`ClientModule`."""
        return {"optimizer": self.optimizer, "lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        """A client module around ``model``; called once per architecture (weights are swapped in)."""
        return ClientModule(model, num_classes, **self.optimizer_kwargs())

    def build_server(self) -> ServerPhase:
        """The server phase (closed-form or trainable)."""
        return ServerPhase()

    def build_collaborative_phase(self, clients: Sequence[ClientModule]) -> CollaborativePhase | None:
        """The lock-step phase on public data run before local training, or ``None``."""
        return None

    def collaborative_epochs(self) -> int:
        """Epochs over the public set of the collaborative phase per round (0 when there is none)."""
        return 0
