"""Building blocks several methods share: one place for each, never another method's file.

* weight sharing: :class:`SubmoduleAveragingServer` (FedAvg and its family, LG-FedAvg's head,
  FML's meme) and :class:`SubmoduleSharingClient`; FedAvg's own client and server and the
  :class:`WeightAveraging` frame its family builds on;
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
    ClientStates,
    ClientUpload,
    CollaborativePhase,
    OptimizerName,
    ServerContext,
    ServerPhase,
    TrainableServerPhase,
    build_optimizer,
    hparams_for,
)
from fedhet.core.payloads import ClassStatsPayload, Payload, WeightsPayload, check_like, check_shape
from fedhet.core.state import clone_state, copy_state_into
from fedhet.errors import ConfigError, TrainingError
from fedhet.functional import (
    aggregate_class_means,
    class_means,
    prototype_examples,
    weighted_average,
)
from fedhet.hparams import (
    Hyperparameters,
    LocalOptimizer,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    knob,
    log_uniform,
)
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

    def shared_state(self) -> dict[str, Tensor]:
        """What is uploaded of the shared sub-module (all of it; FedBN leaves its BatchNorm out)."""
        return self.shared().state_dict()

    def on_receive(self, download: Payload | None) -> None:
        if isinstance(download, WeightsPayload):
            # a download may cover part of the sub-module (FedBN): the rest stays the client's own
            copy_state_into(self.shared(), {**self.shared().state_dict(), **download.weights})

    def download_replaces_state(self, download: Payload | None) -> bool:
        """True when the client keeps nothing but the shared sub-module and ``download`` holds all of it (FedAvg)."""
        if not isinstance(download, WeightsPayload):
            return False
        prefix = self.shared_module + "."
        return set(self.client_state()) == {prefix + key for key in download.weights}

    def make_upload(self, train_batches: Iterable[Batch]) -> Payload | None:
        return WeightsPayload(weights=clone_state(self.shared_state()))


class AveragedClientModels:
    """Per architecture, the example-weighted average of every client's stored model, for evaluation only.

    FedMD-CG's "virtual global model" (G.acc): the ``model.`` entries of each client's state
    (BatchNorm buffers included) averaged with weights ``n_i``, read through
    :class:`ClientStates` so nothing counts as sent. Named ``virtual_global``
    (``virtual_global_<architecture>`` when there are several). Networks are built once and reused.
    """

    def __init__(self) -> None:
        self.networks: dict[str, nn.Module] = {}

    def __call__(self, clients: ClientStates) -> dict[str, nn.Module]:
        groups: dict[str, tuple[list[dict[str, Tensor]], list[float]]] = {}
        for cid, architecture in enumerate(clients.architectures):
            members, sizes = groups.setdefault(architecture, ([], []))
            members.append(model_weights(clients.module_state(cid)))
            sizes.append(float(clients.num_examples(cid)))
        models: dict[str, nn.Module] = {}
        for architecture, (members, sizes) in groups.items():
            name = "virtual_global" if len(groups) == 1 else f"virtual_global_{architecture}"
            if name not in self.networks:
                self.networks[name] = clients.build_network(architecture)
            copy_state_into(self.networks[name], weighted_average(members, sizes))
            models[name] = self.networks[name]
        return models


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

    def setup_server(self, context: ServerContext) -> None:
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
        self.check_weights(upload, upload.expect(WeightsPayload, "model weights"))

    def check_weights(self, upload: ClientUpload, payload: WeightsPayload) -> None:
        """``payload.weights`` against the global sub-module of the sender's group (subclasses' uploads extend it)."""
        if self.group(upload.architecture) not in self.global_by_architecture:
            raise TrainingError(
                f"{upload.sender} sent weights of architecture {upload.architecture!r}, unknown to the server"
            )
        reference = self.global_by_architecture[self.group(upload.architecture)]
        check_like(upload.sender, "weights", payload.weights, reference, "the global model")

    def supports_aggregator(self) -> bool:
        """True unless a subclass combines uploads its own way (overrides :meth:`aggregate`)."""
        return type(self).aggregate is SubmoduleAveragingServer.aggregate

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        # every upload passed check_upload where it entered the loop
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

    def server_state(self) -> dict[str, Any]:
        return {"global_by_architecture": self.global_by_architecture, "aggregated": sorted(self.aggregated)}

    def load_server_state(self, state: Mapping[str, Any]) -> None:
        self.global_by_architecture = {a: dict(w) for a, w in state["global_by_architecture"].items()}
        self.aggregated = set(state.get("aggregated", ()))


class FedAvgClient(SubmoduleSharingClient):
    """Cross-entropy locally; starts each round from the global model and uploads the whole model."""

    shared_module = "model"


class SharedSubmoduleServer(SubmoduleAveragingServer):
    """One average of a shared sub-model over every client, whatever their architectures.

    The server of methods whose heterogeneous clients each carry one shared homogeneous model
    (FML's meme, FedMRL's small model, FedType's proxy): subclasses name the method's ``Hparams``, the
    ``shared_module`` (the clients' attribute, also their ``shared_module``) and the
    ``weighting_knob`` holding ``"samples"`` or ``"uniform"``; the initial model is sent in round 0.

    Args:
        hp: the method's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams: ClassVar[type[Hyperparameters]]
    shared_module: ClassVar[str]
    weighting_knob: ClassVar[str]

    def __init__(self, hp: Any = None, **overrides: Any) -> None:
        self.hp: Any = hparams_for(type(self), hp, overrides)
        weighting = getattr(self.hp, self.weighting_knob)
        super().__init__(self.shared_module + ".", weighting, per_architecture=False, send_initial=True)


class FedAvgServer(SubmoduleAveragingServer):
    """Holds the global model of each architecture; aggregates by example-weighted averaging.

    Uploads are averaged within each architecture (FedDF's per-architecture fusion; with one
    architecture this is FedAvg). Every client receives its architecture's global model, which is
    also the server-side model evaluated once per evaluation (``acc_server``): the whole model,
    example-weighted, per architecture, the initial model sent in round 0 (the base's defaults).
    """


class CorrectedAverageServer(FedAvgServer, ABC):
    """FedAvg's uniform mean, then a per-architecture correction that keeps a state of its own.

    FedDyn's ``h`` and SCAFFOLD's ``c``: shaped like the clients' buffers under :attr:`state_prefix`,
    zero at the start (a resumed server keeps what its checkpoint restores), checkpointed under
    :attr:`state_key`. Subclasses define :meth:`correct`.

    Args:
        hp: the method's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams: ClassVar[type[Hyperparameters]]
    #: the client-state prefix of the buffers the server state is shaped like
    state_prefix: ClassVar[str]
    #: the server state's key in checkpoints
    state_key: ClassVar[str]
    #: the method's name in messages
    method_name: ClassVar[str]

    def __init__(self, hp: Any = None, **overrides: Any) -> None:
        super().__init__()
        self.hp: Any = hparams_for(type(self), hp, overrides)
        self.weighting = "uniform"
        self.state_by_architecture: dict[str, dict[str, Tensor]] = {}
        self.clients_by_architecture: dict[str, int] = {}

    def setup_server(self, context: ServerContext) -> None:
        super().setup_server(context)
        self.clients_by_architecture = self.group_sizes()
        if not self.state_by_architecture:  # a resumed server keeps the state its checkpoint restores
            self.state_by_architecture = self.zeros_per_group(context, self.state_prefix, self.method_name)

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        previous = {key: dict(weights) for key, weights in self.global_by_architecture.items()}
        super().aggregate(round_idx, uploads)  # validates; global <- uniform mean of the uploads (buffers too)
        for key, members in self.group_uploads(uploads).items():
            state, model = self.state_by_architecture[key], self.global_by_architecture[key]
            self.correct(state, model, previous[key], members, self.clients_by_architecture[key])

    @abstractmethod
    def correct(
        self,
        state: dict[str, Tensor],
        model: dict[str, Tensor],
        previous: Mapping[str, Tensor],
        members: Sequence[ClientUpload],
        clients: int,
    ) -> None:
        """Update one architecture's ``state`` and its averaged ``model`` in place.

        ``previous`` is the global model before this round, ``members`` the round's uploads of
        the architecture and ``clients`` how many clients (participating or not) it has.
        """

    def server_state(self) -> dict[str, Any]:
        return {**super().server_state(), self.state_key: self.state_by_architecture}

    def load_server_state(self, state: Mapping[str, Any]) -> None:
        super().load_server_state(state)
        self.state_by_architecture = {a: dict(s) for a, s in state[self.state_key].items()}


class WeightAveraging(Algorithm):
    """The weight-averaging frame of FedAvg and its family (FedProx, FedDyn, SCAFFOLD, MOON, FedProc, FedRS).

    Homogeneous models, whole-model weights up and down, FedAvg's server (which the family's
    servers extend), and both the clients and the global model evaluated. A family member names
    its ``Hparams`` and ``client_type`` and, where its server keeps more state, its server.
    """

    client_type: ClassVar[type[ClientModule]] = FedAvgClient
    capabilities = Capabilities(heterogeneous_models=False)
    upload_type = WeightsPayload
    download_type = WeightsPayload
    evaluation = ("clients", "server")

    def build_server(self) -> ServerPhase:
        return FedAvgServer()


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


def batch_norm_state_keys(module: nn.Module) -> set[str]:
    """The state-dict keys of every BatchNorm layer of ``module`` (affine parameters and running statistics)."""
    names = {name for name, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    return {key for key in module.state_dict() if key.rpartition(".")[0] in names}


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


def build_shared_model(
    name: str, num_classes: int, in_channels: int, seed: int, purpose: str, **model_kwargs: Any
) -> nn.Module:
    """A registered model initialised identically on every client (the seed is not per client).

    Shared auxiliary models (FML's meme, FedKD's student, FedMRL's small model) are averaged
    across clients, so they must start from one initialisation; :func:`fedhet.models.create_model`
    draws it under its own seed without touching the global RNG. ``model_kwargs`` go to the
    model's constructor (FedMRL's ``feature_dim``).
    """
    from fedhet.models import create_model

    seed = derive_seed(seed, purpose, name)
    return create_model(name, num_classes=num_classes, in_channels=in_channels, seed=seed, **model_kwargs)


@dataclass(frozen=True)
class SharedModelHparams(LocalOptimizer):
    """The hyperparameters of a :class:`SeparatelyClippedClient` with a shared auxiliary model (FML, FedKD, FedType)."""

    shared_init_seed: int = knob(0, "seed of the shared model's initialisation, the same on every client")
    max_grad_norm: PositiveFloat | None = knob(
        None, "clip each model's gradient norm separately at this value; None: off"
    )



class SeparatelyClippedClient(ClientModule):
    """A client holding several models whose gradient norms are clipped one model at a time (HtFLlib).

    Subclasses yield one parameter list per model from :meth:`clip_groups`; ``hp.max_grad_norm``
    (``None``: off) bounds each; Lightning's own ``gradient_clip_val`` still applies afterwards.
    """

    Hparams = SharedModelHparams

    def clip_groups(self) -> Iterator[list[Tensor]]:
        yield list(self.parameters())

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        if self.hp.max_grad_norm is not None:
            for group in self.clip_groups():
                torch.nn.utils.clip_grad_norm_(group, self.hp.max_grad_norm)
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


class ClassSums:
    """Per-class sums (float64) and counts of a per-sample statistic, added batch by batch.

    What a class-mean upload accumulates, over an eval pass or over a fit's training steps.
    """

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.sums: Tensor | None = None
        self.counts = torch.zeros(num_classes, dtype=torch.long)

    def add(self, statistic: Tensor, labels: Tensor) -> None:
        """Add a batch's ``[B, D]`` statistic (detached) under its ``[B]`` labels."""
        means, counts = class_means(statistic.detach().double(), labels, self.num_classes)
        sums = means * counts.unsqueeze(1)
        self.sums = sums if self.sums is None else self.sums + sums
        self.counts += counts.cpu()

    def means(self) -> Tensor:
        """``[C, D]`` float32 class means on the CPU; zero rows for classes never added."""
        assert self.sums is not None, "no batch was added"
        return (self.sums.cpu() / self.counts.clamp_min(1).unsqueeze(1)).float()


Weighting = Literal["count", "uniform"]
ClassMeansFrom = Literal["eval_pass", "training_steps"]


@dataclass(frozen=True)
class ClassStatisticHparams(LocalOptimizer):
    """The local optimizer, and where a :class:`ClassMeanRegularizedClient`'s uploaded class means come from."""

    class_means_from: ClassMeansFrom = knob(
        "eval_pass",
        "the uploaded class means: an eval-mode pass over the training data after local training (the papers' "
        "definition, at the uploaded model) or the training steps' own outputs over every local epoch "
        "(FedProto's and FD's code, HtFLlib's FedProto and FD: no extra pass)",
    )


@dataclass(frozen=True)
class ClassMeanRegularizedHparams(ClassStatisticHparams):
    """The hyperparameters of a :class:`ClassMeanRegularizedClient` regularised by ``lam`` (FedProto)."""

    lam: NonNegativeFloat = knob(
        0.1, "weight of the pull of a sample's statistic to its class's global value", log_uniform(1e-3, 10.0)
    )


class ClassMeanRegularizedClient(ClientModule):
    """Cross-entropy plus ``lam * MSE(s(x), global[y])`` for a per-sample statistic ``s``.

    The statistic is the feature vector (FedProto) or the logits (FD); the client uploads its
    class means of the statistic. Subclasses define :meth:`statistic_and_logits`.
    """

    Hparams = ClassMeanRegularizedHparams

    def __init__(self, model: nn.Module, num_classes: int, hp: Any = None, **overrides: Any) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        self.global_means: Tensor | None = None
        self.global_present: Tensor | None = None
        #: the class sums of this fit's training steps (``class_means_from="training_steps"``)
        self.training_sums: ClassSums | None = None

    def statistic_and_logits(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The shared statistic of each sample, and the logits (abstract)."""
        raise NotImplementedError(f"abstract: {type(self).__name__} must define statistic_and_logits()")

    def regulariser_weight(self) -> float:
        """The regulariser's weight (``lam``; FD calls it ``gamma``)."""
        return self.hp.lam

    def regulariser(self, statistic: Tensor, targets: Tensor) -> Tensor:
        """Distance of each sample's statistic to its class's global value (MSE; FD may use cross-entropy)."""
        return F.mse_loss(statistic, targets)

    def global_on(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The received global values and presence mask on ``device``, moved there once per download.

        A ``.to(device)`` of a CPU tensor in every step is a host-to-device copy that waits for
        the GPU's queue every step; the moved tensors replace the received ones, so later steps
        find them in place (the download of the next round brings CPU tensors again).
        """
        assert self.global_means is not None and self.global_present is not None
        self.global_means, self.global_present = self.global_means.to(device), self.global_present.to(device)
        return self.global_means, self.global_present

    def on_train_start(self) -> None:
        """A fit begins: the training-step sums of an earlier fit (another client's, round's) are not this one's."""
        self.training_sums = None

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        statistic, logits = self.statistic_and_logits(x)
        if self.training and self.hp.class_means_from == "training_steps":
            if self.training_sums is None:
                self.training_sums = ClassSums(self.num_classes)
            self.training_sums.add(statistic, y)
        loss = F.cross_entropy(logits, y)
        if self.global_means is not None and self.global_present is not None:
            means, present = self.global_on(statistic.device)
            known = present[y]
            if bool(known.any()):
                loss = loss + self.regulariser_weight() * self.regulariser(statistic[known], means[y[known]])
        return loss

    def on_receive(self, download: Payload | None) -> None:
        if isinstance(download, ClassStatsPayload):
            self.global_means = download.values
            self.global_present = download.counts > 0

    def make_upload(self, train_batches: Iterable[Batch]) -> ClassStatsPayload:
        """The class means of the statistic with the client's class counts (``|D_ij|``, paper Eq. 6's weights).

        ``eval_pass``: one pass over the training data with the trained model. ``training_steps``:
        the means of what every training step of this fit computed (train mode, the model of that
        step, every local epoch); the counts are still the data's, for each class the steps saw.
        """
        if self.hp.class_means_from == "training_steps":
            seen = self.training_sums
            if seen is None or seen.sums is None:
                raise TrainingError(
                    f"{type(self).__name__}: class_means_from='training_steps' but no training step ran in this fit; "
                    "give the client a local budget or use class_means_from='eval_pass'"
                )
            held = torch.zeros(self.num_classes, dtype=torch.long)
            for _, y in train_batches:
                held += torch.bincount(y.cpu(), minlength=self.num_classes)
            return ClassStatsPayload(values=seen.means(), counts=torch.where(seen.counts > 0, held, 0))
        sums = ClassSums(self.num_classes)
        for x, y in train_batches:
            statistic, _ = self.statistic_and_logits(x)
            sums.add(statistic, y)
        assert sums.sums is not None, "a client without training data cannot upload class means"
        return ClassStatsPayload(values=sums.means(), counts=sums.counts)


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

    def setup_server(self, context: ServerContext) -> None:
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
        payload = upload.expect(ClassStatsPayload, "class statistics")
        dim = self.dim if self.dim is not None else (None if self.global_means is None else self.global_means.shape[1])
        held = None if self.label_counts is None else self.label_counts[upload.client_id]
        payload.validate_shape(self.num_classes, dim, upload.sender, dtype=torch.float32, held=held)

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        if not uploads:
            return
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

    def server_state(self) -> dict[str, Any]:
        return {} if self.global_means is None else {"global_means": self.global_means, "present": self.present}

    def load_server_state(self, state: Mapping[str, Any]) -> None:
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


@dataclass(frozen=True)
class PrototypeServerHparams(ClassStatisticHparams):
    """The server settings of a :class:`PrototypeTrainingServer` (FedGH, FedTGP; HtFLlib's names)."""

    server_lr: PositiveFloat = knob(0.01, "learning rate of the server's SGD (HtFLlib -slr)", log_uniform(1e-3, 1.0))
    server_epochs: PositiveInt = knob(100, "passes over the round's uploaded prototypes per round (HtFLlib -se)")
    server_batch_size: PositiveInt = knob(10, "prototypes per server step (HtFLlib: the client batch size)")


class PrototypeTrainingServer(TrainableServerPhase, ABC):
    """A server trained each round on the uploaded (class prototype, class) pairs (FedGH, FedTGP).

    Subclasses build their trainable parts in :meth:`build` and define :meth:`prototype_loss`.

    Args:
        hp: the method's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams: ClassVar[type[Hyperparameters]] = PrototypeServerHparams

    def __init__(self, hp: Any = None, **overrides: Any) -> None:
        super().__init__()
        self.hp: Any = hparams_for(type(self), hp, overrides)
        self.num_classes = 0
        self.feature_dim = 0
        self.label_counts: Tensor | None = None  # [clients, classes] held per client, when the context knows
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
        self.label_counts = context.label_counts
        self.build(context, head)

    @abstractmethod
    def build(self, context: ServerContext, initial_head: dict[str, Tensor]) -> None:
        """Create the trainable parts once the class count and feature size are known."""

    @abstractmethod
    def prototype_loss(self, prototypes: Tensor, labels: Tensor) -> Tensor:
        """The server objective on one batch of uploaded prototypes."""

    def check_upload(self, upload: ClientUpload) -> None:
        """``[num_classes, feature_dim]`` float32 prototypes, int64 counts within what the client holds."""
        payload = upload.expect(ClassStatsPayload, "class prototypes")
        held = None if self.label_counts is None else self.label_counts[upload.client_id]
        payload.validate_shape(self.num_classes, self.feature_dim, upload.sender, dtype=torch.float32, held=held)

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
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
        sampler = EpochShuffledBatches(len(dataset), self.hp.server_batch_size, self.hp.server_epochs)
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
        return build_optimizer(self.parameters(), "sgd", self.hp.server_lr, 0.0, 0.0)

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


@dataclass(frozen=True)
class BenchmarkLocalOptimizer(LocalOptimizer):
    """The local optimizer of FCCL+'s benchmark frame: Adam 1e-3 with weight decay 1e-5."""

    optimizer: OptimizerName = knob("adam", "local optimizer: sgd, adam or adamw")
    lr: PositiveFloat = knob(1e-3, "local learning rate", log_uniform(1e-5, 1e-1))
    weight_decay: NonNegativeFloat = knob(1e-5, "local L2 weight decay")


class BenchmarkClient(ClientModule):
    """A cross-entropy client with the benchmark frame's local optimizer (FedMD, FedDF, FedMatch)."""

    Hparams = BenchmarkLocalOptimizer


@dataclass(frozen=True)
class PublicDistillationHparams(BenchmarkLocalOptimizer):
    """The local and public-phase settings of the lock-step distillation methods (FedMD, FedDF, RHFL, FedMatch).

    Defaults are FCCL+'s benchmark frame, which all four ran in: local Adam 1e-3 with weight
    decay 1e-5; one pass over the public set per round, each step with a new Adam 1e-3.
    """

    public_epochs: NonNegativeInt = knob(1, "passes over the public set per round (0 disables collaboration)")
    public_optimizer: OptimizerName = knob("adam", "optimizer of the collaborative steps on public data")
    public_lr: PositiveFloat = knob(1e-3, "learning rate of the collaborative steps", log_uniform(1e-5, 1e-1))
    public_weight_decay: NonNegativeFloat = knob(0.0, "L2 weight decay of the collaborative steps")
    reset_public_optimizer: bool = knob(
        True, "new optimizer state for every public batch, as the benchmark code (Adam then takes sign-like steps)"
    )


class PublicDistillationPhase(CollaborativePhase, ABC):
    """The lock-step frame shared by FedMD, FedDF, RHFL and FedMatch in FCCL+'s benchmark.

    Per public batch (one augmented batch for everyone): every participant computes its logits
    in train mode; they are validated and counted as uploads; :meth:`distillation_losses`
    builds one loss per participant from detached targets (one ``|B0| x C`` target per
    participant is counted as its download); each participant takes one step with its own
    ``public_optimizer``, whose state is cleared before every step with ``reset_public_optimizer``
    (the benchmark code's new optimizer per public batch).

    Args:
        clients: the round's participating client modules.
        hp: the method's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams: ClassVar[type[Hyperparameters]] = PublicDistillationHparams

    def __init__(self, clients: Sequence[ClientModule], hp: Any = None, **overrides: Any) -> None:
        super().__init__(clients)
        self.hp: Any = hparams_for(type(self), hp, overrides)
        #: indices of the participants exchanging on the current batch (set by :meth:`public_logits`)
        self.exchanging: list[int] = list(range(len(clients)))

    def start_round(self) -> int:
        """Rounds before this one skip collaboration (a local-only warm-up; none by default)."""
        return 0

    def client_optimizer(self, client: ClientModule) -> torch.optim.Optimizer:
        trainable = [p for p in client.parameters() if p.requires_grad]
        return build_optimizer(trainable, self.hp.public_optimizer, self.hp.public_lr, 0.0, self.hp.public_weight_decay)

    @abstractmethod
    def distillation_losses(self, logits: list[Tensor], x: Tensor) -> list[Tensor]:
        """One loss per exchanging participant (:attr:`exchanging`, in order) from their logits on ``x``."""

    def public_logits(self, x: Tensor) -> list[Tensor]:
        """The exchanging participants' logits on ``x``, validated as the server would receive them.

        Sets :attr:`exchanging`: the indices of the participants whose logits are valid (all of
        them, unless one was left out under ``on_invalid_upload: drop``; see :meth:`accept`).
        """
        logits, self.exchanging = [], []
        for index, client in enumerate(self.clients):
            if index in self.dropped:
                continue
            z = client(x)
            upload = PublicLogitsPayload(logits=z.detach().float())
            sender, classes = f"participant {index}", client.num_classes

            def check(upload: PublicLogitsPayload = upload, sender: str = sender, classes: int = classes) -> None:
                upload.validate_shape(x.shape[0], classes, sender)  # shape, then finite values
                upload.check_value_bound(self.value_bound, sender)

            if not self.accept(index, check):
                continue
            self.record_upload(upload)
            # the server answers each participant with one target of the same shape
            self.record_download(PublicLogitsPayload(logits=upload.logits))
            logits.append(z)
            self.exchanging.append(index)
        return logits

    def collaborative_losses(self, x: Tensor) -> list[Tensor]:
        logits = self.public_logits(x)
        losses = [x.new_zeros(()) for _ in self.clients]  # a participant left out does not step
        for index, loss in zip(self.exchanging, self.distillation_losses(logits, x) if logits else [], strict=True):
            losses[index] = loss
        return losses

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        if self.round_idx < self.start_round():
            return
        if self.hp.reset_public_optimizer:
            optimizers = self.optimizers()
            for optimizer in optimizers if isinstance(optimizers, list) else [optimizers]:
                getattr(optimizer, "optimizer", optimizer).state.clear()
        super().training_step(batch, batch_idx)


class PublicDistillationAlgorithm(Algorithm):
    """Base of the methods whose collaboration is a :class:`PublicDistillationPhase`.

    FedMD, FedDF, RHFL and FedMatch share it: the public-phase settings are declared once
    (:class:`PublicDistillationHparams`), so each method only declares its own loss's knobs and
    names its :attr:`phase_type`.
    """

    Hparams: ClassVar[type[Hyperparameters]] = PublicDistillationHparams
    client_type: ClassVar[type[ClientModule]] = BenchmarkClient
    #: The lock-step phase built over each round's participants, reading ``self.hp``.
    phase_type: ClassVar[type[PublicDistillationPhase]]
    capabilities = Capabilities(heterogeneous_models=True, needs_public_data=True)

    def build_collaborative_phase(self, clients: Sequence[ClientModule]) -> PublicDistillationPhase:
        return self.phase_type(clients, self.hp)

    def collaborative_epochs(self) -> int:
        return self.hp.public_epochs


TeacherChoice = Literal["previous_round", "post_collaboration"]


@dataclass(frozen=True)
class PreviousModelHparams(LocalOptimizer):
    """The hyperparameters of a :class:`PreviousModelClient` (FCCL, FCCL+; the authors' code's defaults).

    Local Adam 1e-3 with weight decay 1e-5, created anew every round in the code (configs set
    ``federation.persist_optimizer_state: false``).
    """

    optimizer: OptimizerName = knob("adam", "local optimizer: sgd, adam or adamw")
    lr: PositiveFloat = knob(1e-3, "local learning rate (before federation.lr_schedule)", log_uniform(1e-5, 1e-1))
    weight_decay: NonNegativeFloat = knob(1e-5, "local L2 weight decay")
    teacher_train_mode: bool = knob(
        True, "run the local teachers in train mode (BatchNorm on batch statistics), as the authors' code; False: eval"
    )


class PreviousModelClient(ClientModule):
    """A client that keeps a frozen snapshot of its own model as a distillation teacher.

    Shared by FCCL+ (FNTD teacher) and FCCL (previous-round KD teacher). The snapshot starts as
    the initial model and is retaken at the end of every local update (``theta^{e-1}`` in round
    ``e``), or at its start for Fig. 9's ``theta^e`` ablation (:meth:`teacher_choice`). The
    authors' per-round linear learning-rate decay is the platform's ``federation.lr_schedule``
    (every method alike), not the client's.
    """

    Hparams = PreviousModelHparams

    def __init__(self, model: nn.Module, num_classes: int, hp: Any = None, **overrides: Any) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        self.previous_model = copy.deepcopy(model).requires_grad_(False)

    def teacher_choice(self) -> TeacherChoice:
        """When the snapshot is taken: ``"previous_round"`` (the paper's ``theta^{e-1}``; FCCL+ makes it a knob)."""
        return "previous_round"

    def ready_to_collaborate(self) -> bool:
        """Whether this client takes part in the collaborative phase (FCCL waits for pretraining)."""
        return True

    def snapshot_teacher(self) -> None:
        """Copy the live model (weights and buffers) into the frozen teacher."""
        copy_state_into(self.previous_model, self.model.state_dict())

    @torch.no_grad()
    def teacher_logits(self, x: Tensor) -> Tensor:
        self.previous_model.train(self.hp.teacher_train_mode)
        return self.previous_model(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.local_optimizer([p for p in self.model.parameters() if p.requires_grad])

    def on_train_start(self) -> None:
        if self.teacher_choice() == "post_collaboration":
            self.snapshot_teacher()

    def on_train_end(self) -> None:
        if self.teacher_choice() == "previous_round":
            self.snapshot_teacher()
