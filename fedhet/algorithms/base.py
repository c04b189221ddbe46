"""The method contract: what a federated method implements, and nothing else.

A method lives in one file, ``fedhet/algorithms/<method>.py``, and defines:

* its payload types (or reuses those in :mod:`fedhet.core.payloads`);
* ``<Method>Client(ClientModule)``: a LightningModule holding one client's model and local
  objective. Per selected client and step the runtime calls, in this order:
  ``load_client_state`` (what the client keeps) -> ``on_receive(download)`` (what it only
  receives) -> one ``Trainer.fit`` per declared :class:`LocalStage` (``self.stage`` set; each
  stage its own optimizer(s), budget and optimisation mode) -> ``make_upload(batches)`` ->
  ``client_state()``. It is an ordinary LightningModule: it also trains on its own under a
  plain ``Trainer`` or ``LightningCLI``;
* ``<Method>Server(ServerPhase)``: ``aggregate(uploads)`` (closed form) -> its trained
  :class:`RefineStage` s, each fitted with the ``server_trainer`` template and its own budget ->
  ``download_for(client)``; :meth:`ServerPhase.server_models` names what is evaluated as
  ``acc_server``. A :class:`TrainableServerPhase` is its own refine stage; a
  :class:`ServerPlugin` adds a :class:`ServerRefinement` on top of any base method chosen in
  the config (``feddf_server``, FedFTG);
* ``<Method>Hparams(Hyperparameters)``: the method's hyperparameters, declared once as a frozen
  dataclass of :func:`fedhet.hparams.knob` fields (default, meaning, range, search space). The
  Algorithm's ``__init__`` signature is generated from it (what configs and the command line
  see); the Algorithm, its client and its server each read it as ``self.hp``;
* ``<Method>(Algorithm)``: the object configs select (``method.class_path``). It names its
  ``Hparams`` and ``client_type``, builds the server and declares :class:`Capabilities`
  (checked against the scenario and model family before anything runs), its evaluation targets
  and its run phases (:class:`RunPhase`, before or after the rounds);
* optionally a :class:`CollaborativePhase`: all participating client modules stepping together,
  batch by batch, on public data (FCCL, FCCL+, FedMD's digest, RHFL).

What a server may know is its :class:`ServerContext` (architectures, a model factory, the data
format, the clients' label counts, the public data). Building blocks several methods share live
in :mod:`fedhet.algorithms.shared.common`.

A method file holds no round loop, sampling, partitioning, file I/O or printing; its math lives
in :mod:`fedhet.functional` when two methods share it. ``docs/adding_a_method.md`` walks through
an example.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.core.payloads import Payload
from fedhet.core.reuse import guarded_upload, init_hyperparameters
from fedhet.core.state import copy_state_into
from fedhet.errors import ConfigError, TrainingError
from fedhet.hparams import Hyperparameters, LocalOptimizer, OptimizerName, knobs, projected

Batch = tuple[Tensor, Tensor]
P = TypeVar("P", bound=Payload)


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

    @property
    def sender(self) -> str:
        """``"client <id>"``: how every message about this upload names its sender."""
        return f"client {self.client_id}"

    def expect(self, payload_type: type[P], what: str) -> P:
        """The payload, when it is a finite ``payload_type`` with a non-negative example count.

        The common start of every :meth:`ServerPhase.check_upload`: the payload type (``what``
        names it in the message), finite floating values (:meth:`Payload.validate`, repeated here
        so that a server driven without the loop checks the same) and ``num_examples >= 0``.
        The per-field checks against the server's own state follow, with
        :func:`fedhet.core.payloads.check_tensor`, :func:`~fedhet.core.payloads.check_like` and
        :func:`~fedhet.core.payloads.check_counts`.

        Raises:
            TrainingError: one line naming the client and the problem.
        """
        if not isinstance(self.payload, payload_type):
            raise TrainingError(f"{self.sender} sent {type(self.payload).__name__}, expected {what}")
        count = self.payload.num_examples
        if not isinstance(count, int) or isinstance(count, bool):
            raise TrainingError(f"{self.sender} sent an example count of type {type(count).__name__}, expected an int")
        if count < 0:
            raise TrainingError(f"{self.sender} sent a negative example count ({count})")
        self.payload.validate(self.sender)
        return self.payload


@dataclass(frozen=True)
class DataFormat:
    """The image format every client model sees (what a server needs to build or feed one).

    Attributes:
        image_size: height and width of the (square) images.
        channels: image channels.
        mean: per-channel normalisation mean applied by the scenario.
        std: per-channel normalisation standard deviation.
        num_classes: number of classes of the task.
    """

    image_size: int
    channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_classes: int


@dataclass(frozen=True)
class ServerContext:
    """What a server learns once, before the first round.

    Attributes:
        num_clients: number of clients.
        num_classes: number of classes.
        architectures: the registered model name of every client.
        seed: the experiment seed.
        initial_client_state: ``(client_id) -> state dict`` of that client's module before training.
        data_format: the image format (size, channels, normalisation).
        label_counts: ``[num_clients, num_classes]`` training examples per class of every client,
            counted once by the runtime from the training splits. A server that uses them as the
            clients' upload returns them from :meth:`ServerPhase.setup_uploads`, so that they count
            as uploaded bytes. ``None``
            for scenarios that generate clients on demand (``SyntheticScenario``): read them with
            :meth:`client_label_counts`, which counts them on first use.
        model_factory: ``(architecture, seed) -> nn.Module``: a client network of that architecture
            exactly as the method builds it (channels, classes, feature dimension, wrappers).
        public_loader: ``(seed) -> loader`` of the scenario's unlabeled public data, or ``None``.
        aggregate_states: ``(state dicts, example counts) -> state dict``, the rule the
            weight-averaging servers combine a group's uploads with (``federation.aggregator``;
            ``None``: the example-weighted mean). Only servers whose
            :meth:`ServerPhase.supports_aggregator` is true receive anything but ``None``.
    """

    num_clients: int
    num_classes: int
    architectures: tuple[str, ...]
    seed: int
    initial_client_state: Callable[[int], dict[str, Tensor]]
    data_format: DataFormat | None = None
    label_counts: Tensor | None = None
    model_factory: Callable[[str, int], nn.Module] | None = None
    public_loader: Callable[[int], Iterable[Any]] | None = None
    label_counts_source: Callable[[], Tensor] | None = None
    aggregate_states: Callable[[Sequence[Mapping[str, Tensor]], Sequence[float]], dict[str, Tensor]] | None = None

    def client_label_counts(self) -> Tensor | None:
        """:attr:`label_counts`, counted now (once, by the runtime) when the scenario generates clients on demand.

        Counting visits every client's training split, so a run with thousands of lazily
        generated clients pays it only if its method reads the counts.
        """
        if self.label_counts is not None or self.label_counts_source is None:
            return self.label_counts
        return self.label_counts_source()

    def require(self, field: str, server: str, purpose: str) -> Any:
        """The value of ``field``, or one :class:`ConfigError` line naming the server, the purpose and the fix.

        The round loop fills every field a scenario has; a context built by hand (a server reused
        in one's own loop) may leave out what a server needs, and the server says so when attached.
        ``label_counts`` is read through :meth:`client_label_counts` (counted on first use).
        """
        value = self.client_label_counts() if field == "label_counts" else getattr(self, field)
        if value is None:
            raise ConfigError(f"{server} needs the server context's {field} {purpose}; "
                              f"build the ServerContext with {field}=...")
        return value


@dataclass(frozen=True)
class LocalStage:
    """One ordered stage of a client's local update: one lean Trainer fit.

    A client declares its stages in :meth:`ClientModule.local_stages`; the runtime sets
    :attr:`ClientModule.stage` to the stage's name, fits the module once per stage in order, and
    carries each stage's optimizer state across rounds separately. ``configure_optimizers``
    reads ``self.stage`` to return that stage's optimizer(s).

    Attributes:
        name: the stage's name (``self.stage`` during its fit; ``train/<name>_loss`` in the logs).
        epochs: local epochs of this stage; with ``steps`` also ``None`` the Trainer template's
            budget (``trainer.max_epochs`` / ``trainer.max_steps``) applies.
        steps: optimisation steps of this stage instead of epochs.
        manual: manual optimisation (the module steps its optimizers in ``training_step`` and
            returns the detached loss for the runtime's loss accounting).
    """

    name: str = "local"
    epochs: int | None = None
    steps: int | None = None
    manual: bool = False


@dataclass(frozen=True)
class RunPhase:
    """A phase of the run before or after the federated rounds (pretraining, fine-tuning ...).

    The loop runs ``rounds`` steps of the phase, each like a round with the phase's name set on
    every client module (:attr:`ClientModule.phase`) and passed to the server, checkpointed and
    resumable like rounds and logged with ``phase`` and ``phase_step``.

    Attributes:
        name: the phase's name, e.g. ``"pretrain"``, ``"finetune"``, ``"extra"``.
        when: ``"before"`` or ``"after"`` the federated rounds.
        rounds: steps of this phase.
        participation: fraction or count of clients per step (``None``: every client).
        exchange: clients receive downloads and send uploads (``False``: purely local work).
    """

    name: str
    when: Literal["before", "after"]
    rounds: int = 1
    participation: float | int | None = None
    exchange: bool = True


#: Evaluation targets a method may declare (:attr:`Algorithm.evaluation`): the client models after
#: the download, before it, and the server-side models on the global sets
#: (:meth:`Algorithm.evaluation_models`: the server's models, or what the method builds instead).
EvaluationTarget = Literal["clients", "clients_before_download", "server"]


@dataclass(frozen=True)
class ClientStates:
    """A read-only view of every client's stored state, for models a method builds to evaluate only.

    Reading states through the view, not through uploads, keeps the communication ledger honest:
    nothing here is sent (FedMD-CG's "virtual global model" is the example).

    Attributes:
        architectures: the registered model name of every client.
        module_state: ``(client_id) -> state dict`` of that client's module as stored now (its
            initial state before it first trained).
        num_examples: ``(client_id) -> `` its number of training examples.
        build_network: ``(architecture) -> nn.Module``: a fresh network of that architecture
            (weights to be overwritten).
    """

    architectures: tuple[str, ...]
    module_state: Callable[[int], Mapping[str, Tensor]]
    num_examples: Callable[[int], int]
    build_network: Callable[[str], nn.Module]


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


def hparams_for(part: type, hp: Any, overrides: Mapping[str, Any]) -> Any:
    """``part.Hparams`` taken from ``hp`` (its Algorithm's object, or ``None`` for the defaults) plus ``overrides``.

    Clients and servers read the hyperparameters their method declares; built by the Algorithm
    they take its values, built alone the declared defaults, so the two cannot drift apart.
    """
    try:
        return projected(part.Hparams, hp, **overrides)  # type: ignore[attr-defined]
    except ConfigError as error:
        raise ConfigError(f"{part.__name__}: {error}") from None


class ClientModule(pl.LightningModule):
    """Base LightningModule of a federated client: one model, cross-entropy, one optimizer.

    Subclasses change the local objective in :meth:`local_loss` (or :meth:`training_step`) and
    add the federation hooks they need. The runtime measures the training loss from what
    ``training_step`` returns (a callback, so client Trainers run without a logger); trained
    on its own under a plain ``Trainer`` with a logger, the module logs ``train/loss`` itself.

    Reusable on its own (``docs/reuse.md``): the init arguments of the whole subclass chain are
    saved as hyperparameters (``self.hparams``), except modules and tensors, which are weights:
    ``type(module).load_from_checkpoint(path, model=..., <other module arguments>)``. Every
    :meth:`make_upload` override is wrapped when the subclass is created so that it runs in eval
    mode under ``torch.no_grad`` (modes restored afterwards) and returns tensors detached from
    the module, wherever it is called from.

    Declared state: every sub-module is kept across rounds (stored in the client's state) except
    those named in :attr:`received_modules`, which the client only receives from the server
    (FedGen's generator, FedKTL's latent head): they are left out of :meth:`client_state` and
    left untouched by :meth:`load_client_state`.

    Hyperparameters: :attr:`Hparams` declares what the client reads (``self.hp``). Its Algorithm
    passes its own object and the client takes the same-named fields from it; built alone,
    ``Client(model, num_classes, lr=0.1)`` starts from the declared defaults, so a client reused
    on its own trains the objective its method trains.

    Args:
        model: a backbone following the :class:`fedhet.models.FeatureClassifier` contract
            (``forward_features``, ``forward_head``, ``num_features``).
        num_classes: number of classes of the task.
        hp: the hyperparameters (an Algorithm's ``hp`` or any object with the same field names);
            ``None``: the declared defaults.
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    #: The hyperparameters this client reads (its method's declaration).
    Hparams: ClassVar[type[Hyperparameters]] = LocalOptimizer
    #: Sub-modules the client receives every round but does not keep (not in its stored state).
    received_modules: ClassVar[tuple[str, ...]] = ()
    #: Kept state that only shapes training, never predictions (FedDyn's gradient state, SCAFFOLD's
    #: control variate): left out of the evaluation fingerprint, so clients holding the same model
    #: after the download are scored on the shared sets once.
    training_only_state: ClassVar[tuple[str, ...]] = ()

    def __init__(self, model: nn.Module, num_classes: int, hp: Any = None, **overrides: Any) -> None:
        super().__init__()
        self.hp: Any = hparams_for(type(self), hp, overrides)
        # Once per module (modules are built once per architecture, not per round): the plain init
        # arguments of the whole subclass chain, weights left out, with ``hp`` spelled out by name
        # so that ``load_from_checkpoint(path, model=...)`` rebuilds the same client.
        given = init_hyperparameters(inspect.currentframe())
        given.pop("hp", None)
        self.save_hyperparameters({**given, **self.hp.values()})
        self.model = model
        self.num_classes = num_classes
        # Set by the runtime before each fit: the stage being trained, the run phase, the round.
        self.stage = "local"
        self.phase = "federation"
        self.round_idx = 0
        self.total_rounds = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Make every ``make_upload`` a subclass defines safe to call anywhere (:func:`guarded_upload`)."""
        super().__init_subclass__(**kwargs)
        upload = cls.__dict__.get("make_upload")
        if upload is not None and not getattr(upload, "__fedhet_guarded__", False):
            cls.make_upload = guarded_upload(upload)  # type: ignore[method-assign]

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
        self.log_train_loss(loss)
        return loss

    def log_train_loss(self, loss: Tensor) -> None:
        """``train/loss`` (per step and per epoch, on the progress bar) for a plain Trainer with a logger.

        The round loop's lean Trainer has no logger: the runtime records each stage's loss itself,
        and skipping ``self.log`` keeps Lightning's metric bookkeeping out of every step.
        """
        if self._trainer is not None and self.trainer.logger is not None:
            self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True)

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        x, y = batch
        self.log("val/acc", (self(x).argmax(1) == y).float().mean(), prog_bar=True)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        x, y = batch
        self.log("test/acc", (self(x).argmax(1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.local_optimizer(p for p in self.parameters() if p.requires_grad)

    def local_optimizer(self, params: Iterable[Tensor]) -> torch.optim.Optimizer:
        """The declared local optimizer (``hp.optimizer``, ``hp.lr`` ...) over ``params``."""
        return build_optimizer(params, self.hp.optimizer, self.hp.lr, self.hp.momentum, self.hp.weight_decay)

    # ------------------------------------------------------------------ federation hooks
    def local_stages(self) -> Sequence[LocalStage]:
        """The ordered local stages of this client in the current :attr:`phase` (default: one)."""
        return (LocalStage(),)

    def stage_dataloader(self, private: Iterable[Any], seed: int) -> Iterable[Any]:
        """The data the current stage (:attr:`stage`) trains on: the client's private loader by default.

        A stage that trains on data the client makes itself (FedVTC's synthetic fine-tuning set)
        returns its own loader; ``seed`` is the stage's seed (the global RNG is already seeded with it).
        """
        return private

    def on_receive(self, download: Payload | None) -> None:
        """Take what the server sent this round (``None`` before the server has anything)."""

    def download_replaces_state(self, download: Payload | None) -> bool:
        """Whether :meth:`on_receive` of ``download`` overwrites everything :meth:`client_state` holds.

        When it does, a client's own initial state is never seen in a round that starts with that
        download, and the runtime does not build it (a model initialisation per client at first
        touch). Default: ``False`` (not known).
        """
        return False

    def make_upload(self, train_batches: Iterable[Batch]) -> Payload | None:
        """What leaves the client after local training; ``train_batches`` is its training set in eval order.

        Overrides run in eval mode under ``torch.no_grad`` and their tensors come back detached
        from the module (see the class docstring), so they need not take care of either.
        """
        return None

    def _is_received(self, key: str) -> bool:
        return any(key.startswith(name + ".") for name in self.received_modules)

    def client_state(self) -> dict[str, Tensor]:
        """Everything that persists on this client between rounds: the state dict minus received modules."""
        state = self.state_dict()
        if not self.received_modules:
            return state
        return {k: v for k, v in state.items() if not self._is_received(k)}

    def load_client_state(self, state: Mapping[str, Tensor]) -> None:
        """Restore what :meth:`client_state` returned (received modules keep their current values)."""
        if self.received_modules:
            current = {k: v for k, v in self.state_dict().items() if self._is_received(k)}
            state = {**dict(state), **current}
        copy_state_into(self, dict(state))


class ServerPhase:
    """A server round: ``aggregate(uploads)`` -> trained :meth:`refine_stages` -> ``download_for``.

    The closed-form part keeps its state (global weights, global prototypes ...) in tensors and
    returns it from :meth:`server_state` so that round checkpoints restore it exactly. Trained parts
    are :class:`RefineStage` LightningModules the loop fits after ``aggregate`` with the
    ``server_trainer`` template and the stage's own budget (never the clients' Trainer settings).
    The loop sets :attr:`phase` and :attr:`round_idx` to the run phase and step being aggregated,
    and :attr:`total_rounds` to the run's federated rounds (as on every client), so a server whose
    message after the last round differs (FedVTC) reads the budget where every part reads it.

    The server's hooks carry their own names (:meth:`setup_server`, :meth:`server_state`,
    :meth:`load_server_state`) so that a server which is also a LightningModule
    (:class:`TrainableServerPhase`) keeps Lightning's ``setup(stage)`` and ``state_dict()`` with
    their Lightning meaning: one name, one meaning, no dispatch on argument types.
    """

    #: The run phase of the current step (``"federation"`` during the rounds).
    phase: str = "federation"
    #: The index within its run phase of the step last aggregated (the federated round during the rounds).
    round_idx: int = 0
    #: The run's number of federated rounds, as the clients see it (0 until a loop sets it).
    total_rounds: int = 0

    def setup_server(self, context: ServerContext) -> None:
        """Build the server state from the run's context; kept as :attr:`context`.

        Called once before round 0, and again on resume before :meth:`load_server_state`.
        Overrides call ``super().setup_server(context)`` when they read ``self.context`` later.
        """
        self.context = context

    def check_upload(self, upload: ClientUpload) -> None:
        """Raise a one-line :class:`TrainingError` naming the sender unless this server expects ``upload``.

        The loop calls it for every upload before :meth:`aggregate`, so that with
        ``federation.on_invalid_upload: drop`` an upload of the wrong keys, shapes, dtypes or
        counts is dropped like a non-finite one, and with ``fail`` the offender is named in the
        round it sends. Compare against the server's own state or a declared spec (the global
        model, the class count, the feature width), never against another upload, or an
        honest client can be blamed for the first one's fault. The loop has run the generic
        :meth:`Payload.validate` (finite floating tensors) first; the default adds nothing.

        Overrides start with :meth:`ClientUpload.expect` and check each field with the shared
        helpers of :mod:`fedhet.core.payloads` (``check_like``, ``check_tensor``,
        ``check_counts``); :meth:`aggregate` then repeats none of it.
        """

    def supports_aggregator(self) -> bool:
        """Whether this server combines uploads with ``context.aggregate_states`` (``federation.aggregator``)."""
        return False

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        """Fold this round's (validated) uploads into the server state."""

    def refine_stages(self) -> Sequence[RefineStage]:
        """Trained stages fitted, in order, after :meth:`aggregate` (default: none)."""
        return ()

    def download_for(self, client_id: int) -> Payload | None:
        """What client ``client_id`` receives at the start of the next round (``None``: nothing).

        The loop asks once per client and round and caches the answer.
        """
        return None

    def server_models(self) -> dict[str, nn.Module]:
        """Server-side models evaluated once per evaluation on the global sets (``acc_server``)."""
        return {}

    def metrics(self) -> dict[str, float]:
        """Scalars logged under ``server/`` after the server phase."""
        return {}

    def images(self) -> dict[str, Tensor]:
        """Named image batches ``[n, c, h, w]`` the server holds after the round (default: none).

        A server that makes images (FedKTL's class images) returns them here; the run directory
        keeps each round's and draws ``images_<name>.png``, a round-by-image grid, when the run ends.
        """
        return {}

    def setup_uploads(self) -> Sequence[Payload]:
        """What the clients sent once, before the first round, for this server's set-up (default: nothing).

        A server that needs something of every client before training (FedFTG's per-client label
        counts) returns it here as payloads, after :meth:`setup_server`; the loop counts their bytes
        in the first step's uploads, measured like every transfer.
        """
        return ()

    def server_state(self) -> dict[str, Any]:
        """What persists across rounds (tensors and plain values), saved in every round checkpoint."""
        return {}

    def load_server_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`server_state` returned (after :meth:`setup_server`)."""


class RefineStage(pl.LightningModule):
    """A trained server stage, fitted once per round on server-side data (distillation, generators).

    The loop builds a lean Trainer from the ``server_trainer`` template with the budget of
    :meth:`refine_budget` and fits the stage on :meth:`server_dataloader`; the fit ends when that
    budget is spent, so a stage never stops Lightning from a hook. A stage whose loader is empty
    this round (nothing uploaded yet) is skipped.
    """

    def server_dataloader(self, seed: int) -> Iterable[Any]:
        """The data the stage trains on this round (public data, noise, synthetic samples)."""
        raise NotImplementedError(f"{type(self).__name__} must define server_dataloader(seed)")

    def refine_budget(self) -> LocalStage:
        """The per-round budget: by default one pass over :meth:`server_dataloader`."""
        return LocalStage(name="refine", epochs=1)

    def should_refine(self) -> bool:
        """Whether to fit this round (``False`` e.g. before anything was uploaded)."""
        return True


class TrainableServerPhase(RefineStage, ServerPhase):
    """A server that is its own refine stage (FedGen, FedGH, FedTGP, FedKTL).

    ``aggregate(round, uploads)`` sets the round up, the loop fits the module on
    :meth:`server_dataloader`, then asks :meth:`download_for` for every client. Lightning's
    ``setup(stage)``, ``state_dict()`` and ``load_state_dict()`` keep their Lightning meaning;
    the loop calls the server's own :meth:`setup_server`, :meth:`server_state` and
    :meth:`load_server_state`.
    """

    def refine_stages(self) -> Sequence[RefineStage]:
        return (self,)

    def server_state(self) -> dict[str, Any]:
        """The module's state dict (its parameters and buffers); override to leave out what setup rebuilds."""
        return self.state_dict()

    def load_server_state(self, state: Mapping[str, Any]) -> None:
        self.load_state_dict(state)


class ServerRefinement(RefineStage):
    """A refine stage that composes with any base server (a server plugin: FedDF's server, FedFTG).

    :class:`RefinedServer` calls :meth:`attach` once with the base server and the context, then
    :meth:`begin_round` after every base ``aggregate`` with the round's uploads; the stage trains
    the base server's models in place (write-back, if any, in ``on_train_end``).
    """

    def attach(self, base: ServerPhase, context: ServerContext) -> None:
        """Remember the base server and build what the refinement needs."""
        self.base = base
        self.context = context

    def setup_uploads(self) -> Sequence[Payload]:
        """What the clients sent once, before round 0, for the refinement (:meth:`ServerPhase.setup_uploads`)."""
        return ()

    def begin_round(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        """Set the round's refinement up from the uploads (teachers, label counts ...)."""

    def metrics(self) -> dict[str, float]:
        """Scalars logged under ``server/``."""
        return {}

    def refinement_state(self) -> dict[str, Any]:
        """What a checkpoint needs to restore the refinement (default: its module state)."""
        return self.state_dict()

    def load_refinement_state(self, state: Mapping[str, Any]) -> None:
        self.load_state_dict(dict(state))


def _base_attribute(name: str) -> property:
    """An attribute of :class:`RefinedServer` that lives on its base server (the loop sets it on the wrapper)."""
    return property(
        lambda self: getattr(self.base, name),
        lambda self, value: setattr(self.base, name, value),
        doc=f"The base server's ``{name}`` (set by the loop on the wrapper, read by the base).",
    )


class RefinedServer(ServerPhase):
    """A base server followed by a :class:`ServerRefinement` (the composition the plugins use).

    The run position the loop sets on a server (``phase``, ``round_idx``, ``total_rounds``) is
    the base server's own, so a base that schedules by round behaves the same wrapped or not.
    """

    phase = _base_attribute("phase")  # type: ignore[assignment]
    round_idx = _base_attribute("round_idx")  # type: ignore[assignment]
    total_rounds = _base_attribute("total_rounds")  # type: ignore[assignment]

    def __init__(self, base: ServerPhase, refinement: ServerRefinement) -> None:
        self.base = base
        self.refinement = refinement

    def setup_server(self, context: ServerContext) -> None:
        super().setup_server(context)
        self.base.setup_server(context)
        self.refinement.attach(self.base, context)

    def check_upload(self, upload: ClientUpload) -> None:
        self.base.check_upload(upload)

    def supports_aggregator(self) -> bool:
        return self.base.supports_aggregator()

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        self.base.aggregate(round_idx, uploads)
        self.refinement.begin_round(round_idx, uploads)

    def refine_stages(self) -> Sequence[RefineStage]:
        return (*self.base.refine_stages(), self.refinement)

    def download_for(self, client_id: int) -> Payload | None:
        return self.base.download_for(client_id)

    def server_models(self) -> dict[str, nn.Module]:
        return self.base.server_models()

    def metrics(self) -> dict[str, float]:
        return {**self.base.metrics(), **self.refinement.metrics()}

    def images(self) -> dict[str, Tensor]:
        return self.base.images()

    def setup_uploads(self) -> Sequence[Payload]:
        return (*self.base.setup_uploads(), *self.refinement.setup_uploads())

    def server_state(self) -> dict[str, Any]:
        return {"base": self.base.server_state(), "refinement": self.refinement.refinement_state()}

    def load_server_state(self, state: Mapping[str, Any]) -> None:
        self.base.load_server_state(state["base"])
        self.refinement.load_refinement_state(state["refinement"])


class CollaborativePhase(pl.LightningModule):
    """All participating clients stepping together on each public batch (lock-step).

    FCCL, FCCL+, FedMD's digest step and RHFL compute every client's target from the *current*
    outputs of all clients on the same public batch, so one upload per round would change the
    method. The loop fits this module with a lean Trainer over the scenario's public loader,
    every client receiving the same augmented batch; it uses manual optimisation, one optimizer
    per client. Subclasses implement :meth:`collaborative_losses`.

    Attributes:
        exchanged_bytes_up / exchanged_bytes_down: bytes the phase exchanged (per-batch logits,
            averaged targets ...), measured from payloads with :meth:`record_upload` and
            :meth:`record_download` and added to the round's communication ledger by the loop.
        drop_invalid: set by the runtime under ``federation.on_invalid_upload: drop``: a
            participant whose exchanged outputs fail their check is left out of the rest of the
            phase (:meth:`accept`) instead of stopping the run.
        value_bound: ``federation.upload_value_bound``, set by the runtime: the phase's checks
            (:meth:`accept`) refuse a larger value in what a participant sends, as the loop does in an upload.
        dropped: ``{participant index: reason}`` of the participants left out this phase. They
            neither contribute to anyone's target nor step (their loss is a constant zero, so
            their parameters get no gradient), exactly as if they had not taken part.
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
        self.drop_invalid = False
        self.value_bound: float | None = None
        self.dropped: dict[int, str] = {}

    def accept(self, index: int, check: Callable[[], None]) -> bool:
        """Whether participant ``index`` still exchanges, after ``check`` of what it is about to send.

        ``check`` raises :class:`~fedhet.errors.TrainingError` on an invalid output. Under
        :attr:`drop_invalid` the participant is then recorded in :attr:`dropped` and left out of
        this and every later batch of the phase; otherwise the error stops the run, naming it.
        """
        if index in self.dropped:
            return False
        try:
            check()
        except TrainingError as error:
            if not self.drop_invalid:
                raise
            self.dropped[index] = str(error)
            return False
        return True

    def record_upload(self, payload: Payload) -> None:
        """Count the bytes a participant sends in this phase (measured; checked in :meth:`accept`)."""
        self.exchanged_bytes_up += payload.nbytes()

    def record_download(self, payload: Payload, receivers: int = 1) -> None:
        """Count the bytes of what the server sends back to ``receivers`` participants."""
        self.exchanged_bytes_down += payload.nbytes() * receivers

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


def _hparams_init(cls: type) -> Callable[..., None]:
    """An ``__init__`` for ``cls`` taking its ``Hparams`` fields as keyword arguments.

    jsonargparse (the command line, YAML, sweeps) reads constructor signatures, types and
    docstrings; this one is built from the declaration: the explicit parameters of the nearest
    hand-written ``__init__`` above (a plugin's ``base``), then one keyword per knob, with its type,
    default and one-line meaning.
    """
    parent_init = next(
        base.__dict__["__init__"]
        for base in cls.__mro__[1:]
        if "__init__" in base.__dict__ and getattr(base.__dict__["__init__"], "__fedhet_extra_parameters__", False)
    )
    signature = inspect.signature(parent_init)
    hints = typing.get_type_hints(parent_init, globalns=vars(sys.modules[parent_init.__module__]))
    extra = [
        p.replace(annotation=hints.get(p.name, p.annotation))
        for p in list(signature.parameters.values())[1:]
        if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    ]
    declared = knobs(cls.Hparams)  # type: ignore[attr-defined]
    KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY  # noqa: N806

    def __init__(self: Any, *args: Any, **values: Any) -> None:
        parent_init(self, *args, **values)

    parameters = [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *extra,
        *(inspect.Parameter(k.name, KEYWORD_ONLY, default=k.default, annotation=k.type) for k in declared),
    ]
    __init__.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
    __init__.__annotations__ = {p.name: p.annotation for p in parameters[1:]} | {"return": None}
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__module__ = cls.__module__
    lines = [f"        {p.name}: {_first_line(p, parent_init)}" for p in extra]
    lines += [f"        {k.name}: {k.help}" for k in declared]
    __init__.__doc__ = f"{cls.__name__}'s hyperparameters ({cls.Hparams.__name__}).\n\n    Args:\n" + "\n".join(lines)  # type: ignore[attr-defined]
    return __init__


def _first_line(parameter: inspect.Parameter, function: Callable[..., Any]) -> str:
    """The docstring line of ``parameter`` in ``function``'s ``Args:`` section (empty if none)."""
    for line in (function.__doc__ or "").splitlines():
        if line.strip().startswith(f"{parameter.name}:"):
            return line.split(":", 1)[1].strip()
    return ""


class Algorithm:
    """A federated method: its hyperparameters, its parts, and what it needs.

    Subclasses name their :attr:`Hparams` (a :class:`fedhet.hparams.Hyperparameters` dataclass)
    and :attr:`client_type`, set the class attributes and implement :meth:`build_server`. The
    ``__init__`` signature of every subclass is generated from its ``Hparams`` (keyword arguments
    with the declared types, defaults and one-line meanings), so the command line, YAML,
    ``--print_config`` and sweeps read the declaration and nothing restates it; the values are
    kept as ``self.hp``. A subclass that needs more constructor arguments than hyperparameters (a
    plugin's ``base``) defines ``__init__(self, <extra>, **values)``; its subclasses' signatures
    then start with those extras.
    """

    #: The method's hyperparameters (what ``__init__`` takes, what ``self.hp`` holds).
    Hparams: ClassVar[type[Hyperparameters]] = LocalOptimizer
    #: The client module :meth:`build_client` builds around each architecture.
    client_type: ClassVar[type[ClientModule]] = ClientModule
    capabilities: ClassVar[Capabilities] = Capabilities()
    upload_type: ClassVar[type[Payload] | None] = None
    download_type: ClassVar[type[Payload] | None] = None
    #: What the loop evaluates: client models after the download (``"clients"``), before it
    #: (``"clients_before_download"``, FedMD-CG's L.acc), and the server's models once (``"server"``).
    evaluation: ClassVar[tuple[EvaluationTarget, ...]] = ("clients",)

    def __init__(self, **values: Any) -> None:
        try:
            self.hp: Any = self.Hparams(**values)
        except ConfigError as error:
            raise ConfigError(f"{self.name}: {error}") from None
        except TypeError as error:  # an unknown keyword from a Python caller
            raise ConfigError(f"{self.name}: {error}; its hyperparameters: {', '.join(self.hparam_names())}") from None
        self.data_format: DataFormat | None = None

    # the hand-written constructor every generated one calls (its only explicit parameter: self)
    __init__.__fedhet_extra_parameters__ = True  # type: ignore[attr-defined]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Give the subclass an ``__init__`` whose signature and docstring are its ``Hparams``' fields."""
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__.__fedhet_extra_parameters__ = True  # type: ignore[attr-defined]
            return
        cls.__init__ = _hparams_init(cls)  # type: ignore[method-assign]

    @classmethod
    def hparam_names(cls) -> list[str]:
        """The names of the method's hyperparameters (its config keys), in declaration order."""
        return [knob.name for knob in knobs(cls.Hparams)]

    @property
    def name(self) -> str:
        return type(self).__name__

    def configure(self, data_format: DataFormat) -> None:
        """Called by the runtime before any module is built: the scenario's image format."""
        self.data_format = data_format

    def image_channels(self) -> int:
        """Channels of the scenario's images (3 before :meth:`configure`; every built-in dataset is RGB)."""
        return self.data_format.channels if getattr(self, "data_format", None) is not None else 3

    def client_optimizer(self) -> LocalOptimizer:
        """The clients' local optimizer settings (what every config of a comparison folder shares)."""
        return projected(LocalOptimizer, self.hp)  # type: ignore[return-value]

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        """A :attr:`client_type` module around ``model``, reading ``self.hp``; once per architecture."""
        return self.client_type(model, num_classes, self.hp)

    def build_server(self) -> ServerPhase:
        """The server (closed-form, with trained refine stages, or a composition)."""
        return ServerPhase()

    def build_collaborative_phase(self, clients: Sequence[ClientModule]) -> CollaborativePhase | None:
        """The lock-step phase on public data run before local training, or ``None``."""
        return None

    def initialisation_of(self, client_id: int) -> int:
        """Whose initialisation client ``client_id`` starts from: its own by default.

        A method whose clients all start from one model (FedMD-CG's code, FCCL+'s homogeneous
        variant) returns ``0``.
        """
        return client_id

    def evaluation_models(self, server: ServerPhase, clients: ClientStates) -> dict[str, nn.Module]:
        """The server-side models scored on the global sets (``acc_server``) when ``"server"`` is a target.

        Default: the server's own (:meth:`ServerPhase.server_models`). A method may instead build
        models from the clients' stored states, to evaluate only and never send (FedMD-CG's
        virtual global model, :class:`fedhet.algorithms.shared.common.AveragedClientModels`).
        """
        return server.server_models()

    def reference_models(self, server: ServerPhase) -> dict[str, nn.Module]:
        """Extra server-side models scored next to ``acc_server`` and logged as ``acc_server_<name>``.

        They are never part of ``acc_server`` and never sent: a reference point for what the
        server's own processing adds, e.g. FedFTG's plain average before its fine-tuning
        (``acc_server_plain_average``). Default: none.
        """
        return {}

    def collaborative_epochs(self) -> int:
        """Epochs over the public set of the collaborative phase per round (0 when there is none)."""
        return 0

    def phases(self) -> Sequence[RunPhase]:
        """Run phases before and after the federated rounds (default: none)."""
        return ()


class ServerPlugin(Algorithm):
    """A server refinement on top of any base method chosen in the config (FedDF's server, FedFTG).

    The base method supplies the clients, their objective, the uploads and the closed-form
    aggregation; the plugin adds a :class:`ServerRefinement` after it (a :class:`RefinedServer`).
    One plugin class thus serves every base: ``method: {class_path: FedDFServer, init_args:
    {base: {class_path: FedProx, init_args: {mu: 0.01}}}}``. The client optimizer settings are
    the base method's.

    The plugin's own hyperparameters are its :attr:`Hparams` (no optimizer: the clients are the
    base's); ``base`` is the one constructor argument besides them.
    """

    Hparams: ClassVar[type[Hyperparameters]] = Hyperparameters
    #: The base used when a config names none (FedAvg; set by the registry, which imports both).
    default_base: ClassVar[type[Algorithm] | None] = None
    #: The refinement trains on the scenario's public data.
    refinement_needs_public_data: ClassVar[bool] = False
    #: The refinement allows several architectures (the base averages within each); ``None``:
    #: the base's rule.
    refinement_heterogeneous_models: ClassVar[bool | None] = None

    def __init__(self, base: Algorithm | None = None, **values: Any) -> None:
        """A plugin on ``base``.

        Args:
            base: the weight-averaging base method whose clients and averaging the plugin refines
                (``None``: FedAvg with its defaults).
            **values: the plugin's own hyperparameters.
        """
        super().__init__(**values)
        if base is None:
            if self.default_base is None:
                raise ConfigError(f"{type(self).__name__} needs a base method: method.init_args.base")
            base = self.default_base()
        if base.collaborative_epochs() > 0:
            raise ConfigError(f"{type(self).__name__} refines a server, but {base.name} has a lock-step phase")
        self.base = base
        caps = base.capabilities
        heterogeneous = self.refinement_heterogeneous_models
        self.capabilities = dataclasses.replace(  # type: ignore[misc]
            caps,
            needs_public_data=caps.needs_public_data or self.refinement_needs_public_data,
            heterogeneous_models=caps.heterogeneous_models if heterogeneous is None else heterogeneous,
        )
        self.upload_type = base.upload_type  # type: ignore[misc]
        self.download_type = base.download_type  # type: ignore[misc]
        self.evaluation = base.evaluation  # type: ignore[misc]

    @property
    def name(self) -> str:
        base = getattr(self, "base", None)  # not yet set while the plugin's own hyperparameters are checked
        return type(self).__name__ if base is None else f"{type(self).__name__}({base.name})"

    def configure(self, data_format: DataFormat) -> None:
        super().configure(data_format)
        self.base.configure(data_format)

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        return self.base.build_client(model, num_classes)

    def initialisation_of(self, client_id: int) -> int:
        return self.base.initialisation_of(client_id)

    def client_optimizer(self) -> LocalOptimizer:
        return self.base.client_optimizer()

    def evaluation_models(self, server: ServerPhase, clients: ClientStates) -> dict[str, nn.Module]:
        return self.base.evaluation_models(server, clients)

    def build_refinement(self) -> ServerRefinement:
        """The refine stage added after the base server's aggregation."""
        raise NotImplementedError(f"{type(self).__name__} must define build_refinement()")

    def build_server(self) -> ServerPhase:
        return RefinedServer(self.base.build_server(), self.build_refinement())

    def phases(self) -> Sequence[RunPhase]:
        return self.base.phases()
