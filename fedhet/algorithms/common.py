"""Building blocks several methods share: one place for each, never another method's file.

* weight sharing: :class:`SubmoduleAveragingServer` (FedAvg and its family, LG-FedAvg's head,
  FML's meme) and :class:`SubmoduleSharingClient`;
* per-parameter client state kept across rounds: :class:`ParameterBuffers` (FedDyn's gradient
  state, SCAFFOLD's control variate);
* class statistics: :class:`ClassMeanRegularizedClient` / :class:`FedProtoClient` (FedProto, FD,
  FedGH, FedTGP) and :class:`ClassMeanServer`;
* servers trained on uploaded prototypes: :class:`PrototypeTrainingServer` (FedGH, FedTGP);
* lock-step public-data distillation: :class:`PublicDistillationPhase` and
  :class:`PublicDistillationAlgorithm` (FedMD, FedDF, RHFL, FedMatch);
* clients with auxiliary models: :class:`PreviousModelClient` (FCCL, FCCL+),
  :class:`SeparatelyClippedClient` and :func:`build_shared_model` (FML, FedKD).
"""

from __future__ import annotations

import copy
import dataclasses
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

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
    CollaborativePhase,
    OptimizerName,
    ServerContext,
    ServerPhase,
    TrainableServerPhase,
    build_optimizer,
)
from fedhet.core.payloads import ClassStatsPayload, Payload, WeightsPayload, check_shape
from fedhet.core.state import clone_state, copy_state_into
from fedhet.errors import ConfigError, TrainingError
from fedhet.functional import (
    aggregate_class_means,
    class_means,
    prototype_examples,
    weighted_average,
)
from fedhet.hparams import Momentum, NonNegativeFloat, NonNegativeInt, PositiveFloat
from fedhet.seeding import derive_seed

MODEL_PREFIX = "model."


SHARED = "shared"


def state_with_prefix(module_state: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The entries of a client module's state dict under ``prefix`` (``"meme."``), prefix removed."""
    return {k[len(prefix) :]: v for k, v in module_state.items() if k.startswith(prefix)}


def model_weights(module_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The backbone's weights inside a client module's state dict (keys without ``model.``)."""
    return state_with_prefix(module_state, MODEL_PREFIX)


class SubmoduleSharingClient(ClientModule):
    """The client half of weight sharing: one sub-module is replaced by each download and uploaded.

    Subclasses name the shared sub-module in :attr:`shared_module` (a dotted attribute path):
    ``"model"`` (FedAvg and its family), ``"model.head"`` (LG-FedAvg), ``"meme"`` (FML).
    """

    shared_module: ClassVar[str] = "model"

    def shared(self) -> nn.Module:
        """The shared sub-module."""
        module: nn.Module = self
        for name in self.shared_module.split("."):
            module = getattr(module, name)
        return module

    def on_receive(self, download: Payload | None) -> None:
        if isinstance(download, WeightsPayload):
            copy_state_into(self.shared(), download.weights)

    def make_upload(self, train_batches: Iterable[Batch]) -> Payload | None:
        return WeightsPayload(weights=clone_state(self.shared().state_dict()))


class SubmoduleAveragingServer(ServerPhase):
    """Example- (or uniformly) weighted averaging of one sub-module of the client modules.

    The one closed-form server of the weight-sharing methods: FedAvg and its family (the whole
    ``model.``, averaged within each architecture), FML's meme model (``meme.``), LG-FedAvg's head
    (``model.head.``), shared by every architecture.

    Args:
        prefix: where the averaged sub-module sits in a client module's state dict.
        weighting: ``"samples"`` (example-weighted, FedAvg) or ``"uniform"`` (HtFLlib's FML).
        per_architecture: average within each architecture (FedDF's per-architecture fusion;
            with one architecture, FedAvg); otherwise one average over every client.
        send_initial: download the initial sub-module before anything was aggregated (FedAvg's
            common start); otherwise clients keep their own until the first average (LG-FedAvg).
    """

    def __init__(
        self,
        prefix: str = MODEL_PREFIX,
        weighting: Literal["samples", "uniform"] = "samples",
        per_architecture: bool = True,
        send_initial: bool = True,
    ) -> None:
        self.prefix = prefix
        self.weighting = weighting
        self.per_architecture = per_architecture
        self.send_initial = send_initial
        self.global_by_architecture: dict[str, dict[str, Tensor]] = {}
        self.aggregated: set[str] = set()
        self.architectures: tuple[str, ...] = ()
        self.context: ServerContext | None = None
        self._eval_models: dict[str, nn.Module] = {}

    def group(self, architecture: str) -> str:
        """The key clients of ``architecture`` share their average under."""
        return architecture if self.per_architecture else SHARED

    def setup(self, context: ServerContext) -> None:
        self.context = context
        self.architectures = context.architectures
        for client_id, architecture in enumerate(context.architectures):
            key = self.group(architecture)
            if key not in self.global_by_architecture:
                self.global_by_architecture[key] = state_with_prefix(
                    context.initial_client_state(client_id), self.prefix
                )

    @property
    def global_weights(self) -> dict[str, Tensor]:
        """The global sub-module of the (first) group: *the* global model of homogeneous runs."""
        return next(iter(self.global_by_architecture.values()))

    def weights_for(self, client_id: int) -> dict[str, Tensor]:
        """The global sub-module ``client_id`` receives."""
        return self.global_by_architecture[self.group(self.architectures[client_id])]

    def group_uploads(self, uploads: Sequence[ClientUpload]) -> dict[str, list[ClientUpload]]:
        """The uploads of each group, in arrival order."""
        groups: dict[str, list[ClientUpload]] = {}
        for upload in uploads:
            groups.setdefault(self.group(upload.architecture), []).append(upload)
        return groups

    def group_sizes(self) -> dict[str, int]:
        """How many clients (participating or not) each group has."""
        return dict(Counter(self.group(architecture) for architecture in self.architectures))

    def zeros_per_group(self, context: ServerContext, prefix: str, method: str) -> dict[str, dict[str, Tensor]]:
        """Per group, zeros shaped like the client state under ``prefix`` (FedDyn's ``h``, SCAFFOLD's ``c``)."""
        zeros: dict[str, dict[str, Tensor]] = {}
        for client_id, architecture in enumerate(context.architectures):
            key = self.group(architecture)
            if key in zeros:
                continue
            state = state_with_prefix(context.initial_client_state(client_id), prefix + ".")
            if not state:
                raise ConfigError(f"{method}'s server needs {method} clients (no '{prefix}' in the client state)")
            zeros[key] = {name: torch.zeros_like(value) for name, value in state.items()}
        return zeros

    def check_upload(self, upload: ClientUpload) -> None:
        """The upload holds the global sub-module's keys, shapes and exact dtypes, all finite."""
        sender = f"client {upload.client_id}"
        if not isinstance(upload.payload, WeightsPayload):
            raise TrainingError(f"{sender} sent {type(upload.payload).__name__}, expected model weights")
        if self.group(upload.architecture) not in self.global_by_architecture:
            raise TrainingError(f"{sender} sent weights of architecture {upload.architecture!r}, unknown to the server")
        upload.payload.validate_against(self.global_by_architecture[self.group(upload.architecture)], sender)
        if self.weighting == "samples" and upload.payload.num_examples < 0:
            raise TrainingError(f"{sender} sent a negative example count ({upload.payload.num_examples})")

    def supports_aggregator(self) -> bool:
        """True unless a subclass combines uploads its own way (overrides :meth:`aggregate`)."""
        return type(self).aggregate is SubmoduleAveragingServer.aggregate

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        for upload in uploads:
            self.check_upload(upload)  # the loop checked already; kept for servers driven directly
        combine = (self.context.aggregate_states if self.context is not None else None) or weighted_average
        for key, members in self.group_uploads(uploads).items():
            weights = [u.payload.num_examples if self.weighting == "samples" else 1 for u in members]
            self.global_by_architecture[key] = combine([u.payload.weights for u in members], weights)  # type: ignore[attr-defined]
            self.aggregated.add(key)

    def download_for(self, client_id: int) -> WeightsPayload | None:
        if not self.send_initial and self.group(self.architectures[client_id]) not in self.aggregated:
            return None
        return WeightsPayload(weights=self.weights_for(client_id))

    def server_models(self) -> dict[str, nn.Module]:
        """The global model of every architecture (whole-model averaging only), built once by the factory."""
        if self.prefix != MODEL_PREFIX or self.context is None or self.context.model_factory is None:
            return {}
        for key, weights in self.global_by_architecture.items():
            if key not in self._eval_models:
                architecture = key if self.per_architecture else self.architectures[0]
                self._eval_models[key] = self.context.model_factory(architecture, self.context.seed)
            copy_state_into(self._eval_models[key], weights)
        return dict(self._eval_models)

    def state_dict(self) -> dict[str, Any]:
        return {"global_by_architecture": self.global_by_architecture, "aggregated": sorted(self.aggregated)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.global_by_architecture = {a: dict(w) for a, w in state["global_by_architecture"].items()}
        self.aggregated = set(state.get("aggregated", ()))


class ParameterBuffers(nn.Module):
    """One zero-initialised buffer per parameter of ``module``, under the parameter's own name.

    Per-parameter client state that must persist between rounds (FedDyn's gradient state
    ``grad L_k(theta_k)``, SCAFFOLD's control variate ``c_i``): registered as a sub-module of the
    client, its buffers are in the client's state dict and so stored by the state store, moved to
    the accelerator with the module and restored by ``load_client_state``. The buffers sit in
    nested sub-modules mirroring the parameter paths, so ``model.body.0.weight``'s buffer has
    the key ``<attribute>.body.0.weight`` in the client's state.

    Args:
        module: the module whose parameters are mirrored (the client's backbone).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.names: tuple[str, ...] = tuple(name for name, _ in module.named_parameters())
        for name, parameter in module.named_parameters():
            *path, leaf = name.split(".")
            owner: nn.Module = self
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                child = owner._modules[part]
                assert child is not None
                owner = child
            owner.register_buffer(leaf, torch.zeros_like(parameter, requires_grad=False))

    def tensors(self) -> list[Tensor]:
        """The buffers in the order of ``module.named_parameters()``."""
        return [self.get_buffer(name) for name in self.names]

    def as_dict(self) -> dict[str, Tensor]:
        """``{parameter name: buffer}`` (the live tensors, not copies)."""
        return dict(zip(self.names, self.tensors(), strict=True))


HEAD_PREFIX = "head."


def batch_norm_layers(module: nn.Module) -> Iterator[nn.modules.batchnorm._BatchNorm]:
    """Every BatchNorm layer of ``module`` (1d, 2d, 3d and sync), in module order."""
    return (m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))


def freeze_batch_norm(module: nn.Module) -> None:
    """Put ``module``'s BatchNorm layers in eval mode, the rest of it untouched.

    They then normalise with, and keep, their running statistics while the rest trains; their
    affine weights still get gradients.
    """
    for layer in batch_norm_layers(module):
        layer.eval()


def head_weights(module_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The classifier head's weights inside a client module's state dict (keys without ``model.head.``)."""
    return {k[len(HEAD_PREFIX) :]: v for k, v in model_weights(module_state).items() if k.startswith(HEAD_PREFIX)}


SharedWeighting = Literal["samples", "uniform"]


def build_shared_model(name: str, num_classes: int, in_channels: int, seed: int, purpose: str) -> nn.Module:
    """A registered model initialised identically on every client (the seed is not per client).

    Shared auxiliary models (FML's meme, FedKD's student) are averaged across clients, so they
    must start from one initialisation; :func:`fedhet.models.create_model` draws it under its own
    seed without touching the global RNG.
    """
    from fedhet.models import create_model

    return create_model(name, num_classes=num_classes, in_channels=in_channels, seed=derive_seed(seed, purpose, name))


class SeparatelyClippedClient(ClientModule):
    """A client holding several models whose gradient norms are clipped one model at a time (HtFLlib).

    Subclasses set ``max_grad_norm`` (``None``: off) and yield one parameter list per model
    from :meth:`clip_groups`; Lightning's own ``gradient_clip_val`` still applies afterwards.
    """

    max_grad_norm: float | None = None

    def clip_groups(self) -> Iterator[list[Tensor]]:
        yield list(self.parameters())

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        if self.max_grad_norm is not None:
            for group in self.clip_groups():
                torch.nn.utils.clip_grad_norm_(group, self.max_grad_norm)
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


Weighting = Literal["count", "uniform"]


class ClassMeanRegularizedClient(ClientModule):
    """Cross-entropy plus ``lam * MSE(s(x), global[y])`` for a per-sample statistic ``s``.

    The statistic is the feature vector (FedProto) or the logits (FD); the client uploads its
    class means of the statistic. Subclasses define :meth:`statistic_and_logits`.

    Args:
        model: the backbone.
        num_classes: number of classes.
        lam: weight of the regulariser.
        optimizer: local optimizer.
        lr: local learning rate.
        momentum: SGD momentum.
        weight_decay: L2 weight decay.
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        lam: float = 0.1,
        optimizer: OptimizerName = "sgd",
        lr: float = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(model, num_classes, optimizer, lr, momentum, weight_decay)
        self.lam = lam
        self.global_means: Tensor | None = None
        self.global_present: Tensor | None = None

    def statistic_and_logits(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The shared statistic of each sample, and the logits (abstract)."""
        raise NotImplementedError(f"abstract: {type(self).__name__} must define statistic_and_logits()")

    def regulariser(self, statistic: Tensor, targets: Tensor) -> Tensor:
        """Distance of each sample's statistic to its class's global value (MSE; FD may use cross-entropy)."""
        return F.mse_loss(statistic, targets)

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        statistic, logits = self.statistic_and_logits(x)
        loss = F.cross_entropy(logits, y)
        if self.global_means is not None and self.global_present is not None:
            means = self.global_means.to(statistic.device)
            known = self.global_present.to(y.device)[y]
            if bool(known.any()):
                loss = loss + self.lam * self.regulariser(statistic[known], means[y[known]])
        return loss

    def on_receive(self, download: Payload | None) -> None:
        if isinstance(download, ClassStatsPayload):
            self.global_means = download.values
            self.global_present = download.counts > 0

    def make_upload(self, train_batches: Iterable[Batch]) -> ClassStatsPayload:
        sums: Tensor | None = None
        counts = torch.zeros(self.num_classes, dtype=torch.long)
        for x, y in train_batches:
            statistic, _ = self.statistic_and_logits(x)
            means, batch_counts = class_means(statistic.double(), y, self.num_classes)
            batch_sums = means * batch_counts.unsqueeze(1)
            sums = batch_sums if sums is None else sums + batch_sums
            counts += batch_counts.cpu()
        assert sums is not None, "a client without training data cannot upload class means"
        values = (sums.cpu() / counts.clamp_min(1).unsqueeze(1)).float()
        return ClassStatsPayload(values=values, counts=counts)


class FedProtoClient(ClassMeanRegularizedClient):
    """The statistic is the feature vector ``z = forward_features(x)``."""

    def statistic_and_logits(self, x: Tensor) -> tuple[Tensor, Tensor]:
        features = self.model.forward_features(x)
        return features, self.model.forward_head(features)


class ClassMeanServer(ServerPhase):
    """Aggregates per-class means across clients; classes nobody holds stay absent.

    Args:
        weighting: ``"count"`` (example-weighted, FedProto Eq. 6) or ``"uniform"`` (HtFLlib).
        dim: the width of the uploaded statistic, declared so every upload is checked against
            the server's expectation (never against another upload): ``"features"`` (the
            classifier head's input width: prototypes), ``"classes"`` (logits, FD) or a number.
    """

    def __init__(self, weighting: Weighting = "count", dim: Literal["features", "classes"] | int = "features") -> None:
        self.weighting = weighting
        self.dim_spec = dim
        self.num_classes = 0
        self.dim: int | None = None
        self.label_counts: Tensor | None = None
        self.global_means: Tensor | None = None
        self.present: Tensor | None = None

    def setup(self, context: ServerContext) -> None:
        self.num_classes = context.num_classes
        self.label_counts = context.label_counts
        if isinstance(self.dim_spec, int):
            self.dim = self.dim_spec
        elif self.dim_spec == "classes":
            self.dim = context.num_classes
        else:
            head = head_weights(context.initial_client_state(0))
            # a model without a linear head: fall back to the first aggregated width (old behaviour)
            self.dim = int(head["weight"].shape[1]) if "weight" in head else None

    def check_upload(self, upload: ClientUpload) -> None:
        """``[num_classes, dim]`` float32 values, integer counts within what the client holds."""
        sender = f"client {upload.client_id}"
        if not isinstance(upload.payload, ClassStatsPayload):
            raise TrainingError(f"{sender} sent {type(upload.payload).__name__}, expected class statistics")
        dim = self.dim if self.dim is not None else (None if self.global_means is None else self.global_means.shape[1])
        held = None if self.label_counts is None else self.label_counts[upload.client_id]
        upload.payload.validate_shape(self.num_classes, dim, sender, dtype=torch.float32, held=held)

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        if not uploads:
            return
        for upload in uploads:
            self.check_upload(upload)
        if self.dim is None and self.global_means is None:
            # no declared width (a model without a linear head): the uploads must at least agree
            width = int(uploads[0].payload.values.shape[1])  # type: ignore[attr-defined]
            for upload in uploads:
                upload.payload.validate_shape(self.num_classes, width, f"client {upload.client_id}")  # type: ignore[attr-defined]
        self.global_means, self.present = aggregate_class_means(
            [u.payload.values for u in uploads],  # type: ignore[attr-defined]
            [u.payload.counts for u in uploads],  # type: ignore[attr-defined]
            self.weighting,
        )

    def download_for(self, client_id: int) -> ClassStatsPayload | None:
        if self.global_means is None or self.present is None:
            return None
        return ClassStatsPayload(values=self.global_means, counts=self.present.long())

    def state_dict(self) -> dict[str, Any]:
        return {} if self.global_means is None else {"global_means": self.global_means, "present": self.present}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.global_means = state.get("global_means")
        self.present = state.get("present")


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

    def check_upload(self, upload: ClientUpload) -> None:
        """``[num_classes, feature_dim]`` floating prototypes and non-negative integer counts."""
        sender = f"client {upload.client_id}"
        if not isinstance(upload.payload, ClassStatsPayload):
            raise TrainingError(f"{sender} sent {type(upload.payload).__name__}, expected class prototypes")
        upload.payload.validate_shape(self.num_classes, self.feature_dim, sender)

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        for upload in uploads:
            self.check_upload(upload)
        if not uploads:
            self.round_prototypes = torch.zeros(0, self.feature_dim)
            self.round_labels = torch.zeros(0, dtype=torch.long)
            return
        self.round_prototypes, self.round_labels = prototype_examples(
            [u.payload.values.float() for u in uploads],  # type: ignore[attr-defined]
            [u.payload.counts for u in uploads],  # type: ignore[attr-defined]
        )

    def server_dataloader(self, seed: int) -> DataLoader:
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

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return build_optimizer(self.parameters(), "sgd", self.server_lr, 0.0, 0.0)

    def metrics(self) -> dict[str, float]:
        """``loss``: the mean server loss over this round's server steps."""
        return {"loss": float(self.loss_sum) / self.loss_steps} if self.loss_steps else {}


@dataclass(frozen=True)
class PublicLogitsPayload(Payload):
    """One participant's logits on one public batch, as the server of a lock-step method receives them."""

    logits: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, 0))

    def validate_shape(self, batch_size: int, num_classes: int, sender: str = "client") -> None:
        """Reject non-finite values and any shape other than ``[batch_size, num_classes]``."""
        self.validate(sender)
        check_shape(sender, "logits", self.logits, (batch_size, num_classes))


class PublicDistillationPhase(CollaborativePhase, ABC):
    """The lock-step frame shared by FedMD, FedDF, RHFL and FedMatch in FCCL+'s benchmark.

    Per public batch (one augmented batch for everyone): every participant computes its logits
    in train mode; they are validated and counted as uploads; :meth:`distillation_losses`
    builds one loss per participant from detached targets (one ``|B0| x C`` target per
    participant is counted as its download); each participant takes one step with its own
    optimizer.

    Args:
        clients: the round's participating client modules.
        optimizer: optimizer of the collaborative steps.
        lr: learning rate of the collaborative steps.
        weight_decay: L2 weight decay of the collaborative steps.
        reset_optimizer_each_step: clear the optimizer state before every step, reproducing the
            benchmark code's new optimizer per public batch (Adam then takes sign-like steps).
        start_round: rounds before this one skip collaboration (local-only warm-up).
    """

    def __init__(
        self,
        clients: Sequence[ClientModule],
        optimizer: OptimizerName = "adam",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        reset_optimizer_each_step: bool = True,
        start_round: int = 0,
    ) -> None:
        super().__init__(clients)
        self.public_optimizer: OptimizerName = optimizer
        self.public_lr = lr
        self.public_weight_decay = weight_decay
        self.reset_optimizer_each_step = reset_optimizer_each_step
        self.start_round = start_round

    def client_optimizer(self, client: ClientModule) -> torch.optim.Optimizer:
        trainable = [p for p in client.parameters() if p.requires_grad]
        return build_optimizer(trainable, self.public_optimizer, self.public_lr, 0.0, self.public_weight_decay)

    @abstractmethod
    def distillation_losses(self, logits: list[Tensor], x: Tensor) -> list[Tensor]:
        """One loss per participant from everyone's logits on public batch ``x``."""

    def public_logits(self, x: Tensor) -> list[Tensor]:
        """Every participant's logits on ``x``, validated as the server would receive them."""
        logits = []
        for index, client in enumerate(self.clients):
            z = client(x)
            upload = PublicLogitsPayload(logits=z.detach().float())
            upload.validate_shape(x.shape[0], client.num_classes, f"participant {index}")
            self.record_upload(upload, f"participant {index}")
            # the server answers each participant with one target of the same shape
            self.record_download(PublicLogitsPayload(logits=upload.logits))
            logits.append(z)
        return logits

    def collaborative_losses(self, x: Tensor) -> list[Tensor]:
        return self.distillation_losses(self.public_logits(x), x)

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        if self.round_idx < self.start_round:
            return
        if self.reset_optimizer_each_step:
            optimizers = self.optimizers()
            for optimizer in optimizers if isinstance(optimizers, list) else [optimizers]:
                getattr(optimizer, "optimizer", optimizer).state.clear()
        super().training_step(batch, batch_idx)


class PublicDistillationAlgorithm(Algorithm):
    """Base of the methods whose collaboration is a :class:`PublicDistillationPhase`.

    FedMD, FedDF, RHFL and FedMatch share it: it holds and checks the public-phase settings once, so each method
    only adds its own loss's arguments.

    Args:
        public_epochs: passes over the public set per round (0 disables collaboration).
        public_optimizer: optimizer of the public steps.
        public_lr: learning rate of the public steps.
        public_weight_decay: L2 weight decay of the public steps.
        reset_public_optimizer: new optimizer state for every public batch, as the benchmark code.
        optimizer, lr, momentum, weight_decay: the local optimizer (:class:`Algorithm`).
    """

    capabilities = Capabilities(heterogeneous_models=True, needs_public_data=True)

    def __init__(
        self,
        public_epochs: NonNegativeInt,
        public_optimizer: OptimizerName,
        public_lr: PositiveFloat,
        public_weight_decay: NonNegativeFloat,
        reset_public_optimizer: bool,
        optimizer: OptimizerName,
        lr: PositiveFloat,
        momentum: Momentum,
        weight_decay: NonNegativeFloat,
    ) -> None:
        super().__init__(optimizer, lr, momentum, weight_decay)
        if public_epochs < 0:
            raise ConfigError(f"{self.name}: public_epochs={public_epochs} must be >= 0 (0 disables collaboration)")
        if public_lr <= 0:
            raise ConfigError(f"{self.name}: public_lr={public_lr} must be > 0")
        self.public_epochs = public_epochs
        self.public_optimizer: OptimizerName = public_optimizer
        self.public_lr = public_lr
        self.public_weight_decay = public_weight_decay
        self.reset_public_optimizer = reset_public_optimizer

    def public_phase_kwargs(self) -> dict[str, Any]:
        """The :class:`PublicDistillationPhase` optimizer arguments."""
        return {
            "optimizer": self.public_optimizer,
            "lr": self.public_lr,
            "weight_decay": self.public_weight_decay,
            "reset_optimizer_each_step": self.reset_public_optimizer,
        }

    def collaborative_epochs(self) -> int:
        return self.public_epochs


TeacherChoice = Literal["previous_round", "post_collaboration"]


class PreviousModelClient(ClientModule):
    """A client that keeps a frozen snapshot of its own model as a distillation teacher.

    Shared by FCCL+ (FNTD teacher) and FCCL (previous-round KD teacher). The snapshot starts as
    the initial model and is retaken at the end of every local update (``theta^{e-1}`` in round
    ``e``), or at its start for Fig. 9's ``theta^e`` ablation. The authors' per-round linear
    learning-rate decay is the platform's ``federation.lr_schedule`` (every method alike), not
    the client's.

    Args:
        model: the backbone.
        num_classes: number of classes.
        teacher: ``"previous_round"`` (paper) or ``"post_collaboration"`` (Fig. 9 ablation).
        teacher_train_mode: run the teacher in train mode (BatchNorm on batch statistics), as the
            authors' code does; ``False`` runs it in eval mode.
        optimizer: local optimizer.
        lr: local learning rate (before the platform's schedule).
        momentum: SGD momentum.
        weight_decay: L2 weight decay.
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        teacher: TeacherChoice = "previous_round",
        teacher_train_mode: bool = True,
        optimizer: OptimizerName = "adam",
        lr: float = 1e-3,
        momentum: float = 0.0,
        weight_decay: float = 1e-5,
    ) -> None:
        super().__init__(model, num_classes, optimizer, lr, momentum, weight_decay)
        self.teacher_choice: TeacherChoice = teacher
        self.teacher_train_mode = teacher_train_mode
        self.previous_model = copy.deepcopy(model).requires_grad_(False)

    def ready_to_collaborate(self) -> bool:
        """Whether this client takes part in the collaborative phase (FCCL waits for pretraining)."""
        return True

    def snapshot_teacher(self) -> None:
        """Copy the live model (weights and buffers) into the frozen teacher."""
        copy_state_into(self.previous_model, self.model.state_dict())

    @torch.no_grad()
    def teacher_logits(self, x: Tensor) -> Tensor:
        self.previous_model.train(self.teacher_train_mode)
        return self.previous_model(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return build_optimizer(trainable, self.optimizer_name, self.lr, self.momentum, self.weight_decay)

    def on_train_start(self) -> None:
        if self.teacher_choice == "post_collaboration":
            self.snapshot_teacher()

    def on_train_end(self) -> None:
        if self.teacher_choice == "previous_round":
            self.snapshot_teacher()
