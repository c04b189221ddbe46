"""What FedMD-CG and FedCG share: per-client conditional generators, ``(G_i, D_i)`` uploads, the server.

Their common hyperparameters are declared here too, once.

Both methods split each client model into a private extractor ``F_i`` (``model.forward_features``)
and a classifier ``D_i`` (``model.head``), keep a conditional generator ``G_i(z, y)`` of latent
features, upload ``(G_i, D_i)`` with the client's label counts, and train in two local stages of
``local_steps`` mini-batches (model, then generator); the server averages ``(G_i, D_i)`` and then
distils them (:class:`GeneratorClassifierServer`). What differs (the stage losses, whether the
downloaded ``G`` replaces ``G_i``, the server's distillation) lives in ``fedmdcg.py`` and
``fedcg.py``; neither imports the other.
"""

from __future__ import annotations

import copy
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from fedhet.algorithms.base import (
    Algorithm,
    Batch,
    Capabilities,
    ClientModule,
    ClientStates,
    ClientUpload,
    LocalStage,
    ServerContext,
    ServerPhase,
    TrainableServerPhase,
    hparams_for,
)
from fedhet.algorithms.shared.common import AveragedClientModels, state_with_prefix
from fedhet.core.payloads import Payload, check_counts, check_like
from fedhet.core.state import clone_state, copy_state_into
from fedhet.errors import ConfigError, TrainingError
from fedhet.functional import (
    class_client_weights,
    crossed_distillation_loss,
    ensemble_distillation_kl,
    weighted_average,
)
from fedhet.functional.conditional_generators import KLDirection
from fedhet.hparams import (
    Hyperparameters,
    LocalOptimizer,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    categorical,
    knob,
    log_uniform,
)
from fedhet.seeding import derive_seed, seeded

NoiseKind = Literal["gaussian", "uniform"]
Aggregation = Literal["kdc", "kd", "ave"]
KLReduction = Literal["sum_classes", "mean_classes"]
KDReduction = Literal["batchmean", "mean", "hinton"]
#: The server distillation's loss form, one for both arms (``KDC_agg`` and ``KD_agg``), see
#: :data:`SERVER_LOSS_FORMS`.
ServerLossForm = Literal["paper", "code", "hinton"]
#: Weight decay of the server's Adam: ``coupled`` adds ``wd * w`` to the gradient (``torch.optim.Adam``,
#: the paper's and both codes' optimizer), ``decoupled`` shrinks the weights (``AdamW``).
WeightDecayMode = Literal["coupled", "decoupled"]

#: What each server loss form is, per arm: the per-sample KL's reduction over classes for
#: ``crossed_distillation_loss`` (``KDC_agg``), the reduction of ``ensemble_distillation_kl``
#: (``KD_agg``), and whether the loss is multiplied by ``T^2``. ``paper``: the KL summed over
#: classes (a true KL, batch mean), as the paper writes it; ``code``: averaged over classes (the
#: authors' ``KLDivLoss`` element mean, 1/C of the paper's); ``hinton``: the paper's form times
#: ``T^2`` (Hinton et al.; the gradient keeps its size as ``T`` grows; FedCG's KD).
SERVER_LOSS_FORMS: dict[str, tuple[KLReduction, KDReduction, bool]] = {
    "paper": ("sum_classes", "batchmean", False),
    "code": ("mean_classes", "mean", False),
    "hinton": ("sum_classes", "hinton", True),
}

GENERATOR_PREFIX = "generator."
CLASSIFIER_PREFIX = "model.head."


@dataclass(frozen=True)
class GeneratorClassifierHparams(LocalOptimizer):
    """The hyperparameters FedMD-CG and FedCG share (FedMD-CG's paper defaults; FedCG redeclares its server's)."""

    lr: PositiveFloat = knob(
        0.05,
        "learning rate of [F_i, D_i] (FedMD-CG: searched in {0.01, 0.05, 0.08}; code 0.05)",
        log_uniform(1e-3, 0.5),
    )
    weight_decay: NonNegativeFloat = knob(1e-4, "L2 weight decay of [F_i, D_i] (FedMD-CG: 1e-4)")
    local_steps: PositiveInt = knob(20, "I_c, mini-batches of each client stage per round (20)")
    server_steps: PositiveInt = knob(50, "I_s, server distillation steps per round (50)")
    server_batch_size: PositiveInt = knob(64, "B, labels per server step (64)")
    noise_dim: PositiveInt = knob(128, "q, the generator's noise size (128)")
    generator_hidden: tuple[int, int] = knob((512, 256), "the generator's two hidden widths (512, 256)")
    noise: NoiseKind = knob("gaussian", "generator noise: gaussian (paper) or uniform (code, U[0, 1))")
    generator_lr: PositiveFloat = knob(3e-4, "Adam learning rate of G_i (3e-4)", log_uniform(1e-5, 1e-2))
    generator_weight_decay: NonNegativeFloat = knob(1e-4, "Adam weight decay of G_i (1e-4)")
    server_lr: PositiveFloat = knob(3e-4, "Adam learning rate of G and D on the server (3e-4)", log_uniform(1e-5, 1e-2))
    server_weight_decay: NonNegativeFloat = knob(
        1e-4, "its weight decay (1e-4)", categorical(0.0, 1e-6, 1e-5, 1e-4, 1e-3)
    )
    server_weight_decay_mode: WeightDecayMode = knob(
        "coupled",
        "server weight decay: coupled (Adam's L2 added to the gradient; paper, code) or decoupled (AdamW)",
        categorical("coupled", "decoupled"),
    )
    server_temperature: PositiveFloat = knob(
        1.0, "T of the server KLs (1; FedMD-CG's code: 10)", log_uniform(0.5, 20.0)
    )
    server_loss_form: ServerLossForm = knob(
        "paper",
        "server KL of both arms: paper (summed over classes), code (averaged over classes) or hinton (paper x T^2)",
        categorical("paper", "code", "hinton"),
    )

    def check(self) -> None:
        hidden = self.generator_hidden
        if len(hidden) != 2 or min(hidden) < 1:
            raise ConfigError(f"generator_hidden={list(hidden)}: give two positive widths")


@dataclass(frozen=True)
class ServerDistillationHparams(GeneratorClassifierHparams):
    """FedMD-CG's switches of the server's distillation (and of the clients' KL direction)."""

    kl_direction: KLDirection = knob(
        "teacher_first", "KL order: teacher_first (code, standard KD) or as_printed (paper's order)"
    )
    share_server_noise: bool = knob(True, "one noise batch for every generator on the server (paper)")
    aggregation: Aggregation = knob(
        "kdc", "server: kdc (KDC_agg), kd (KD_agg) or ave (AVE_agg), Table 3", categorical("kdc", "kd", "ave")
    )


@dataclass(frozen=True)
class GeneratorServerHparams(ServerDistillationHparams):
    """What :class:`GeneratorClassifierServer` reads: the distillation switches (one loss form for both arms)."""


class ConditionalFeatureGenerator(nn.Module):
    """``G(z, y)``: FedMD-CG's generator of latent features (spec 4.2/4.3).

    ``[z, onehot(y)] -> FC(q+C, h1) + BN + ReLU -> FC(h1, h2) + BN + ReLU -> FC(h2, p)``; the last
    layer has no activation (features are unbounded ReLU-pooled conv outputs).

    Args:
        noise_dim: ``q``.
        num_classes: ``C``.
        feature_dim: ``p``, the feature extractor's output size.
        hidden: the two hidden widths (512, 256 in the paper's code).
        noise: ``"gaussian"`` (paper) or ``"uniform"`` (code).
    """

    def __init__(
        self,
        noise_dim: int,
        num_classes: int,
        feature_dim: int,
        hidden: tuple[int, int] = (512, 256),
        noise: NoiseKind = "gaussian",
    ) -> None:
        super().__init__()
        if noise not in ("gaussian", "uniform"):
            raise ConfigError(f"noise={noise!r}: use 'gaussian' or 'uniform'")
        self.noise_dim = noise_dim
        self.num_classes = num_classes
        self.noise = noise
        first, second = hidden
        self.body = nn.Sequential(
            nn.Linear(noise_dim + num_classes, first),
            nn.BatchNorm1d(first),
            nn.ReLU(),
            nn.Linear(first, second),
            nn.BatchNorm1d(second),
            nn.ReLU(),
            nn.Linear(second, feature_dim),
        )

    def sample_noise(self, count: int, device: torch.device | str) -> Tensor:
        """``count`` noise vectors from the global RNG."""
        if self.noise == "gaussian":
            return torch.randn(count, self.noise_dim, device=device)
        return torch.rand(count, self.noise_dim, device=device)

    def forward(self, labels: Tensor, noise: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Features for ``labels`` and the noise they came from (drawn when not given)."""
        if noise is None:
            noise = self.sample_noise(labels.shape[0], labels.device)
        inputs = torch.cat([noise, F.one_hot(labels, self.num_classes).to(noise.dtype)], dim=1)
        return self.body(inputs), noise


@dataclass(frozen=True)
class GeneratorClassifierPayload(Payload):
    """A generator's state, a classifier's state and per-class counts ``[C]`` (int64).

    Up: ``(G_i, D_i, c_i)``; down: ``(G, D, sum_i c_i)``.
    """

    generator: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    classifier: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    label_counts: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def validate_against(
        self,
        generator: Mapping[str, Tensor],
        classifier: Mapping[str, Tensor],
        num_classes: int,
        sender: str,
        held: Tensor | None = None,
    ) -> None:
        """The reference layouts (keys, shapes, dtypes), ``[C]`` int64 counts within ``held``.

        The values were found finite by :meth:`ClientUpload.expect`, which the server calls first.
        """
        check_like(sender, "generator", self.generator, generator, "the global generator")
        check_like(sender, "classifier", self.classifier, classifier, "the global classifier")
        check_counts(sender, "label_counts", self.label_counts, num_classes, held, "label counts")


class GeneratorClassifierClient(ClientModule, ABC):
    """``F_i``/``D_i`` (the model) and ``G_i``, trained in two stages; ``G`` is received, never kept.

    Subclasses define the two stage losses, :meth:`model_update_loss` and
    :meth:`generator_update_loss` (or their own ``training_step`` for the generator stage).

    Args:
        model: the backbone; ``forward_features`` is ``F_i`` and ``head`` is ``D_i``.
        num_classes: ``C``.
        generator: the client's own generator ``G_i`` (a copy becomes the frozen global ``G``).
        hp: the method's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams = GeneratorClassifierHparams
    received_modules = ("global_generator",)
    #: ``G_i`` shapes training, never predictions.
    training_only_state = ("generator",)

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        generator: ConditionalFeatureGenerator,
        hp: Any = None,
        **overrides: Any,
    ) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        self.generator = generator
        self.global_generator = copy.deepcopy(generator).requires_grad_(False)
        self.label_distribution: Tensor | None = None
        self.has_global = False

    # ------------------------------------------------------------------ stages
    def local_stages(self) -> Sequence[LocalStage]:
        return (LocalStage("model", steps=self.hp.local_steps), LocalStage("generator", steps=self.hp.local_steps))

    def generator_stage(self) -> bool:
        return self.stage == "generator"

    def on_train_start(self) -> None:
        # Freezing by requires_grad (not no_grad): gradients still flow *through* a frozen D_i into G_i.
        training_generator = self.generator_stage()
        self.model.requires_grad_(not training_generator)
        self.generator.requires_grad_(training_generator)
        if not training_generator:
            # Stage 1 trains F_i and D_i in train mode (Algorithm 1). Stage 2 put the model in eval
            # mode, and Lightning keeps the mode a module enters a fit with, so without this every
            # stage-1 fit after a client's first ran BatchNorm on frozen running statistics.
            self.model.train()

    def on_train_end(self) -> None:
        self.model.requires_grad_(True)
        self.generator.requires_grad_(True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.generator_stage():
            return torch.optim.Adam(
                self.generator.parameters(), lr=self.hp.generator_lr, weight_decay=self.hp.generator_weight_decay
            )
        return self.local_optimizer(self.model.parameters())

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.generator_update_loss(x, y) if self.generator_stage() else self.model_update_loss(x, y)
        self.log_train_loss(loss)
        return loss

    def local_loss(self, batch: Batch) -> Tensor:
        return self.model_update_loss(*batch)

    # ------------------------------------------------------------------ losses
    @abstractmethod
    def model_update_loss(self, x: Tensor, y: Tensor) -> Tensor:
        """Stage 1: the loss of ``[F_i, D_i]`` on a private batch."""

    def generator_update_loss(self, x: Tensor, y: Tensor) -> Tensor:
        """Stage 2: the loss of ``G_i`` on a private batch (FedMD-CG's).

        Not abstract: FedCG trains its generator as a GAN with two optimizers in its own
        ``training_step`` and never calls this; a subclass that keeps this class's
        ``training_step`` must define it.
        """
        raise NotImplementedError(f"{type(self).__name__} must define generator_update_loss()")

    # ------------------------------------------------------------------ federation hooks
    def on_receive(self, download: Payload | None) -> None:
        self.has_global = False
        self.label_distribution = None
        if isinstance(download, GeneratorClassifierPayload):
            copy_state_into(self.model.head, download.classifier)  # D_i <- D (Algorithm 1 line 5)
            copy_state_into(self.global_generator, download.generator)
            self.label_distribution = download.label_counts.double()
            self.has_global = True

    def make_upload(self, train_batches: Iterable[Batch]) -> GeneratorClassifierPayload:
        counts = torch.zeros(self.num_classes, dtype=torch.long)
        for _, y in train_batches:
            counts += torch.bincount(y.cpu(), minlength=self.num_classes)
        return GeneratorClassifierPayload(
            generator=clone_state(self.generator.state_dict()),
            classifier=clone_state(self.model.head.state_dict()),
            label_counts=counts,
        )


class GeneratorClassifierServer(TrainableServerPhase):
    """Weighted average of ``(G_i, D_i)``, then the crossed (or plain) data-free distillation.

    Reads ``aggregation`` (``"kdc"``: FedMD-CG, Eq. 10-12; ``"kd"``: FedCG's ensemble KD;
    ``"ave"``: no distillation), ``server_steps``, ``server_batch_size``, ``server_lr``,
    ``server_weight_decay``, ``server_weight_decay_mode``, ``server_temperature``, ``kl_direction``,
    ``server_loss_form`` and ``share_server_noise`` (:class:`GeneratorServerHparams`).

    Both arms (``kdc`` and ``kd``) read one ``server_loss_form`` (:data:`SERVER_LOSS_FORMS`), so
    Table 3's ``KDC_agg`` and ``KD_agg`` rows always reduce their KLs the same way: ``paper``
    sums the per-sample KL over classes, ``code`` averages it over classes, ``hinton`` is
    ``paper`` times ``T^2``; every form takes the batch mean.

    Args:
        make_generator: builds a generator of the clients' architecture.
        hp: the method's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams: ClassVar[type[Hyperparameters]] = GeneratorServerHparams

    def __init__(
        self, make_generator: Callable[[], ConditionalFeatureGenerator], hp: Any = None, **overrides: Any
    ) -> None:
        super().__init__()
        self.hp: Any = hparams_for(type(self), hp, overrides)
        self.make_generator = make_generator
        #: which of L_kl,1..3 the crossed distillation uses (all three; tests switch them singly)
        self.terms: tuple[bool, bool, bool] = (True, True, True)
        self.num_classes = 0
        self.held: Tensor | None = None  # [clients, classes] examples each client holds, when the context knows
        # the round's frozen teachers: a plain list, outside the module tree and the checkpoint
        self.teachers: list[tuple[nn.Module, nn.Module]] = []
        self.round_tau: Tensor | None = None
        self.round_counts: Tensor | None = None
        self.round_sample_weights: Tensor | None = None
        self.first_loss = float("nan")
        self.last_loss = float("nan")
        self.steps_done = 0

    def setup_server(self, context: ServerContext) -> None:
        model_factory = context.require("model_factory", f"{type(self).__name__} (the server of FedMD-CG and FedCG)",
                                        "to build the global classifier")
        initial = context.initial_client_state(0)
        self.num_classes = context.num_classes
        self.held = context.label_counts
        self.generator = self.make_generator()
        copy_state_into(self.generator, state_with_prefix(initial, GENERATOR_PREFIX))
        network = model_factory(context.architectures[0], context.seed)
        self.classifier = copy.deepcopy(network.head)
        copy_state_into(self.classifier, state_with_prefix(initial, CLASSIFIER_PREFIX))
        self.register_buffer(
            "client_label_counts", torch.zeros(context.num_clients, self.num_classes, dtype=torch.long)
        )
        self.register_buffer("rounds_aggregated", torch.zeros((), dtype=torch.long))

    # ------------------------------------------------------------------ aggregation
    def check_upload(self, upload: ClientUpload) -> None:
        """The global generator's and classifier's keys, shapes and dtypes, ``[C]`` int64 label counts."""
        payload = upload.expect(GeneratorClassifierPayload, "(G_i, D_i) (GeneratorClassifierPayload)")
        held = None if self.held is None else self.held[upload.client_id]
        payload.validate_against(
            self.generator.state_dict(), self.classifier.state_dict(), self.num_classes, upload.sender, held
        )

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        self.teachers = []
        if not uploads:
            return
        payloads: list[GeneratorClassifierPayload] = []
        for upload in uploads:
            payload = upload.payload
            assert isinstance(payload, GeneratorClassifierPayload)  # check_upload passed it
            self.client_label_counts[upload.client_id] = payload.label_counts.to(self.client_label_counts.device)
            payloads.append(payload)
        examples = [float(p.num_examples) for p in payloads]
        copy_state_into(self.generator, weighted_average([p.generator for p in payloads], examples))
        copy_state_into(self.classifier, weighted_average([p.classifier for p in payloads], examples))
        counts = torch.stack([p.label_counts for p in payloads])
        self.round_tau = class_client_weights(counts)
        self.round_counts = counts.sum(0).to(torch.float64)
        total = torch.tensor(examples, dtype=torch.float32)
        self.round_sample_weights = total / total.sum()
        if self.hp.aggregation != "ave":
            for payload in payloads:
                generator = self.make_generator()
                copy_state_into(generator, payload.generator)
                classifier = copy.deepcopy(self.classifier)
                copy_state_into(classifier, payload.classifier)
                self.teachers.append((generator.eval().requires_grad_(False), classifier.eval().requires_grad_(False)))
        self.rounds_aggregated += 1
        self.steps_done = 0

    # ------------------------------------------------------------------ distillation
    def should_refine(self) -> bool:
        return bool(self.teachers)  # aggregate() keeps no teacher under ``ave``

    def server_dataloader(self, seed: int) -> DataLoader:
        if self.round_counts is None:
            raise TrainingError("FedMD-CG's server was fitted before any upload arrived")
        generator = torch.Generator().manual_seed(derive_seed(seed, "fedmdcg-labels"))
        labels = torch.multinomial(
            self.round_counts, self.hp.server_steps * self.hp.server_batch_size, True, generator=generator
        )
        return DataLoader(TensorDataset(labels), batch_size=self.hp.server_batch_size, shuffle=False)

    def on_train_start(self) -> None:
        self.teachers = [(g.to(self.device), d.to(self.device)) for g, d in self.teachers]

    def distillation_loss(self, labels: Tensor) -> Tensor:
        """``KDC_agg`` (Eq. 12) or ``KD_agg`` on one batch of sampled labels."""
        self.generator.train()
        noise = self.generator.sample_noise(labels.shape[0], labels.device)
        global_features, _ = self.generator(labels, noise)
        global_logits = self.classifier(global_features)
        targets, global_on_local, local_on_global = [], [], []
        for local_generator, local_classifier in self.teachers:
            local_noise = (
                noise if self.hp.share_server_noise else local_generator.sample_noise(labels.shape[0], labels.device)
            )
            with torch.no_grad():
                local_features, _ = local_generator(labels, local_noise)
                targets.append(local_classifier(local_features))
            if self.hp.aggregation == "kdc":
                global_on_local.append(self.classifier(local_features))  # L_kl,2: trains D only
                local_on_global.append(local_classifier(global_features))  # L_kl,3: trains G only
        kl_reduction, kd_reduction, t_squared = SERVER_LOSS_FORMS[self.hp.server_loss_form]
        if self.hp.aggregation == "kd":
            assert self.round_sample_weights is not None
            return ensemble_distillation_kl(
                global_logits,
                torch.stack(targets),
                self.round_sample_weights,
                self.hp.server_temperature,
                kd_reduction,
            )
        assert self.round_tau is not None
        loss = crossed_distillation_loss(
            global_logits,
            torch.stack(targets),
            torch.stack(global_on_local),
            torch.stack(local_on_global),
            self.round_tau.to(labels.device)[:, labels],
            self.hp.server_temperature,
            self.hp.kl_direction,
            kl_reduction,
            self.terms,
        )
        return loss * self.hp.server_temperature**2 if t_squared else loss

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.distillation_loss(batch[0])
        if self.steps_done == 0:
            self.first_loss = float(loss.detach())
        self.last_loss = float(loss.detach())
        self.steps_done += 1
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam on ``G`` and ``D``; ``server_weight_decay_mode`` picks L2 in the gradient (Adam) or AdamW.

        With coupled decay the ``wd * w`` term enters Adam's normalisation with the distillation
        gradient; when that gradient is small (``T = 10`` without ``T^2``, averaged over classes:
        issue 32 measured decay 1.7-77x the KL gradient) the steps mostly shrink the weights.
        Decoupled decay keeps the normalised step the KL's alone.
        """
        parameters = [*self.generator.parameters(), *self.classifier.parameters()]
        optimizer = torch.optim.AdamW if self.hp.server_weight_decay_mode == "decoupled" else torch.optim.Adam
        return optimizer(parameters, lr=self.hp.server_lr, weight_decay=self.hp.server_weight_decay)

    # ------------------------------------------------------------------ download
    def download_for(self, client_id: int) -> GeneratorClassifierPayload | None:
        if int(self.rounds_aggregated) == 0:
            return None
        return GeneratorClassifierPayload(
            generator=clone_state(self.generator.state_dict()),
            classifier=clone_state(self.classifier.state_dict()),
            label_counts=self.client_label_counts.sum(0).cpu(),
        )

    def metrics(self) -> dict[str, float]:
        if not self.steps_done:
            return {}
        return {"distill_loss_first": self.first_loss, "distill_loss": self.last_loss}


class GeneratorClassifierMethod(Algorithm):
    """The Algorithm side FedMD-CG and FedCG share: capabilities, evaluation, one generator initialisation.

    Subclasses set :attr:`Hparams`, :attr:`client_type` (a :class:`GeneratorClassifierClient`) and
    build their server.
    """

    Hparams = GeneratorClassifierHparams
    client_type: ClassVar[type[ClientModule]] = GeneratorClassifierClient
    capabilities = Capabilities(heterogeneous_models=True, common_feature_dim=True, scenario_kinds=("label_skew",))
    upload_type = GeneratorClassifierPayload
    download_type = GeneratorClassifierPayload
    evaluation = ("clients_before_download", "server")
    #: the clients' feature size, known once the first client is built (the server's generator needs it)
    feature_dim: int | None = None

    def make_generator(
        self, feature_dim: int | None = None, num_classes: int | None = None
    ) -> ConditionalFeatureGenerator:
        """A generator ``G(z, y)`` for this run's feature size and classes, from a fixed seed.

        Every client's ``G_i`` and the server's ``G`` start from the same weights (the code's
        common seed); the seed is fixed so the server can rebuild the architecture.
        """
        feature_dim = feature_dim or self.feature_dim
        classes = num_classes or (self.data_format.num_classes if self.data_format is not None else None)
        if feature_dim is None or classes is None:
            raise ConfigError(f"{self.name}: build a client before the server (feature size unknown)")
        with seeded(derive_seed(0, "fedmdcg", "generator")):
            hp = self.hp
            return ConditionalFeatureGenerator(
                hp.noise_dim, classes, feature_dim, (int(hp.generator_hidden[0]), int(hp.generator_hidden[1])), hp.noise
            )

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        self.virtual_global = AveragedClientModels()

    def initialisation_of(self, client_id: int) -> int:
        """Client 0's initialisation for every client, as the code does (G.acc needs it)."""
        return 0

    def evaluation_models(self, server: ServerPhase, clients: ClientStates) -> dict[str, nn.Module]:
        """G.acc: the virtual global model, the example-weighted average of the clients' models."""
        return self.virtual_global(clients)

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        self.feature_dim = int(model.num_features)  # type: ignore[arg-type]
        return self.client_type(model, num_classes, self.make_generator(self.feature_dim, num_classes), self.hp)  # type: ignore[call-arg]


__all__ = [
    "CLASSIFIER_PREFIX",
    "GENERATOR_PREFIX",
    "Aggregation",
    "ConditionalFeatureGenerator",
    "GeneratorClassifierClient",
    "GeneratorClassifierHparams",
    "GeneratorClassifierMethod",
    "GeneratorClassifierPayload",
    "GeneratorClassifierServer",
    "GeneratorServerHparams",
    "KDReduction",
    "KLReduction",
    "NoiseKind",
    "SERVER_LOSS_FORMS",
    "ServerDistillationHparams",
    "ServerLossForm",
    "WeightDecayMode",
]
