"""FedMD-CG: decoupled models, local conditional generators of latent features, crossed data-free KD.

Paper: Luo, Wang, Li, Lan, Gao, Shu, "Privacy-Preserving Federated Learning with Consistency via
Knowledge Distillation Using Conditional Generator" (Eq. 1-12, Algorithm 1 in App. B, App. C/E);
code ``lkyddd/FedMD-CG`` (LightFed); spec ``reference/fedmdcg.md``.

Each client model is split into a private feature extractor ``F_i`` (``model.forward_features``)
and a classifier ``D_i`` (``model.head``; with ``lenet5`` the paper's three FC layers). Each
client also keeps a conditional generator ``G_i(z, y)`` of latent features.

Upload: ``(G_i, D_i)`` (generator parameters and BatchNorm buffers, classifier state) and the
client's per-class training counts ``c_i`` (:class:`GeneratorClassifierPayload`). ``F_i`` never
leaves the client.
Download: the global ``(G, D)`` and the global per-class counts (``p(y)``), from the end of round
0 on (the paper's round 1 is plain CE and keeps the local classifier).
Server phase: trainable (:class:`FedMDCGServer`). ``(G, D)`` is the example-weighted average of
the uploads, then refined for ``server_steps`` Adam steps on the crossed distillation
``L_kl,1 + L_kl,2 + L_kl,3`` with class-level weights ``tau_{i,y}`` (Eq. 10-12, ``KDC_agg``), or
FedCG's ensemble distillation (``KD_agg``), or not at all (``AVE_agg``): Table 3's switches.
Client state kept across rounds: ``F_i``, ``D_i`` (overwritten by the download at the start of
the next round), ``G_i`` (never replaced by ``G``), and both optimizers' states (the runtime
carries each stage's optimizer, as the code's once-created SGD and Adam).
Local objective, two stages of ``local_steps`` mini-batches each (Algorithm 1 lines 7-14):

1. model update (``F_i``, ``D_i`` trained; ``G`` frozen, eval mode):
   ``CE + r*l1*CE(D_i(G(z', y^)), y^) + r*l2*MSE(F_i(x), G(z, y)) + r*l3*KL(D_i(G(z, y)) || D_i(F_i(x)))``,
   ``y^ ~ p(y)``, ``r`` the ramp ``((round-1)/R)^d`` (0 in the first round);
2. generator update (``G_i`` trained; ``F_i``, ``D_i`` frozen, eval mode):
   ``KL(D_i(F_i(x)) || D_i(G_i(z, y))) + l4*MSE(G_i(z, y), F_i(x)) + l5*CE(D_i(G_i(z, y)), y) + l6*L_div``.

Evaluation (the paper's metrics): L.acc is each client's model after local training and before
the download (``clients_before_download``, reported as ``acc_local`` on class-balanced local
test shards, scenario option ``local_test: test_shards``); G.acc is the "virtual global model",
the ``n_i``-weighted average of every client's whole model, built by the loop from the stored
states for evaluation only (``virtual_global``, reported as ``acc_server``). All clients start
from one initialisation (``identical_client_init``), as in the code; G.acc needs it.

Conflicts between paper [P] and code [C], and how they are resolved (spec sections 3, 9):

* KL directions (B1): teacher-first ``KL(target || student)`` (the code; standard KD) by default,
  ``kl_direction="as_printed"`` for the paper's order.
* Temperatures (B2): the paper states none, so every KL uses ``T = 1`` by default; the code's
  ``T = 10`` for stage 1 and the server is ``client_temperature=10, server_temperature=10``.
* Noise (B3): ``N(0, I)`` [P]; ``noise="uniform"`` is the code's ``U[0, 1)``.
* Server noise (B4): one ``(z, y)`` fed to every generator [P]; ``share_server_noise=False`` [C].
* Stage 2 (B5): ``local_steps`` fresh mini-batches [P], not the code's pass over a growing cache.
* Label counter (B6): the full static training histogram (data are static, so the counter of
  seen labels converges to it); classes nobody holds get ``tau = 0`` and are never sampled.
* Ramp (B7): ``((r-1)/R)^1`` [P]; ``ramp="code"`` is ``(step/(R-1))^3``. All lambdas 1 [P]
  (the code's ``lambda_2 = 0.1`` is a config value).
* MSE (pitfall 6): the mean over batch and dimensions (code), not the squared norm, so lambda = 1
  does not let a 400-dimensional sum swamp the CE.
* Diversity (pitfall 5): ``L_div^2`` with the code's mean-based distances
  (``diversity_norm="mean"``); ``"paper"`` is the literal norms, whose ``exp`` underflows.
* Server KL (B11): summed over classes by default; ``server_kl_reduction="mean_classes"`` is the
  code's division by ``C``. The code's ``L_kl,3`` bug (``softmax`` passed as log-probabilities) is
  not reproduced: all three terms are true KLs.
* BatchNorm (B13): ``G`` trains in train mode on the server; ``G_i`` teachers and the frozen ``G``
  on clients run in eval mode; BN buffers are uploaded and averaged with the weights.
* Server optimizer: Adam(3e-4, wd 1e-4) [P], created fresh every round (the code keeps one Adam
  for the whole run; the paper does not say).
* Classifier depth (B8): the paper's three FC layers (``lenet5``), not the code's two linear ones.
* Weight decay 1e-4 on every optimizer [P] (the code's local SGD has none).
* ``knowledge_transfer="feature"`` keeps only ``L->mse`` in stage 1 (Table 3's ``AVE_agg``
  feature-only row); ``"feature_logit"`` is the full stage 1.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from fedhet.algorithms.base import (
    Algorithm,
    Batch,
    Capabilities,
    ClientModule,
    ClientUpload,
    CollaborativePhase,
    DataFormat,
    LocalStage,
    OptimizerName,
    RunPhase,
    ServerContext,
    ServerPhase,
    TrainableServerPhase,
    build_optimizer,
)
from fedhet.algorithms.common import state_with_prefix
from fedhet.core.payloads import Payload, check_like, check_shape
from fedhet.core.state import clone_state, copy_state_into
from fedhet.errors import ConfigError, TrainingError
from fedhet.functional import (
    class_client_weights,
    crossed_distillation_loss,
    distillation_kl_loss,
    ensemble_distillation_kl,
    label_aware_diversity_loss,
    ramp_weight,
    weighted_average,
)
from fedhet.functional.conditional_generators import DiversityKind, DiversityNorm, KLDirection, RampForm
from fedhet.hparams import Momentum, NonNegativeFloat, PositiveFloat, PositiveInt
from fedhet.seeding import derive_seed, seeded

NoiseKind = Literal["gaussian", "uniform"]
Aggregation = Literal["kdc", "kd", "ave"]
KnowledgeTransfer = Literal["feature_logit", "feature"]
KLReduction = Literal["sum_classes", "mean_classes"]

GENERATOR_PREFIX = "generator."
CLASSIFIER_PREFIX = "model.head."


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
        self, generator: Mapping[str, Tensor], classifier: Mapping[str, Tensor], num_classes: int, sender: str
    ) -> None:
        """Finite values, the reference layouts, and non-negative integer counts of shape ``[C]``."""
        self.validate(sender)
        check_like(sender, "generator", self.generator, generator, "the global generator")
        check_like(sender, "classifier", self.classifier, classifier, "the global classifier")
        check_shape(sender, "label_counts", self.label_counts, (num_classes,))
        if self.label_counts.is_floating_point() or bool((self.label_counts < 0).any()):
            raise TrainingError(f"{sender} sent invalid label counts (must be non-negative integers)")


@dataclass(frozen=True)
class FedMDCGObjective:
    """The weights and forms of FedMD-CG's client losses (all lambdas 1 in the paper).

    Attributes:
        generated_ce: lambda_1, ``L->ce`` (CE of ``D_i`` on ``G(z', y^)``).
        feature_mse: lambda_2, ``L->mse``.
        logit_kl: lambda_3, ``L->kl``.
        generator_kl: weight of ``L<-kl`` (1 in Eq. 9).
        generator_mse: lambda_4, ``L<-mse``.
        generator_ce: lambda_5, ``L<-ce``.
        diversity: lambda_6, ``L_div``.
        diversity_kind: ``div0``, ``div1``, ``div2`` (paper default) or ``none``.
        diversity_norm: ``"mean"`` (code) or ``"paper"`` (literal norms).
        ramp: ``"paper"`` or ``"code"`` (see :func:`fedhet.functional.ramp_weight`).
        ramp_power: ``d`` of the paper's ramp.
        kl_direction: ``"teacher_first"`` or ``"as_printed"``.
        client_temperature: ``T`` of ``L->kl``.
        generator_temperature: ``T`` of ``L<-kl``.
        generated_batch_size: labels drawn from ``p(y)`` per step for ``L->ce``.
        knowledge_transfer: ``"feature_logit"`` (full stage 1) or ``"feature"`` (``L->mse`` only).
    """

    generated_ce: float = 1.0
    feature_mse: float = 1.0
    logit_kl: float = 1.0
    generator_kl: float = 1.0
    generator_mse: float = 1.0
    generator_ce: float = 1.0
    diversity: float = 1.0
    diversity_kind: DiversityKind = "div2"
    diversity_norm: DiversityNorm = "mean"
    ramp: RampForm = "paper"
    ramp_power: float = 1.0
    kl_direction: KLDirection = "teacher_first"
    client_temperature: float = 1.0
    generator_temperature: float = 1.0
    generated_batch_size: int = 64
    knowledge_transfer: KnowledgeTransfer = "feature_logit"


class FedMDCGClient(ClientModule):
    """``F_i``/``D_i`` (the model) and ``G_i``, trained in two stages; ``G`` is received, never kept.

    Args:
        model: the backbone; ``forward_features`` is ``F_i`` and ``head`` is ``D_i``.
        num_classes: ``C``.
        generator: the client's own generator ``G_i`` (a copy becomes the frozen global ``G``).
        local_steps: ``I_c``, mini-batches per stage.
        generator_lr: Adam learning rate of ``G_i``.
        generator_weight_decay: Adam weight decay of ``G_i``.
        generated_ce, feature_mse, logit_kl, generator_kl, generator_mse, generator_ce, diversity,
        diversity_kind, diversity_norm, ramp, ramp_power, kl_direction, client_temperature,
        generator_temperature, generated_batch_size, knowledge_transfer: the fields of
            :class:`FedMDCGObjective` (plain values: they are the module's hyperparameters).
        optimizer: optimizer of ``[F_i, D_i]``.
        lr: its learning rate.
        momentum: SGD momentum.
        weight_decay: its L2 weight decay.
    """

    received_modules = ("global_generator",)
    #: ``G_i`` shapes training, never predictions.
    training_only_state = ("generator",)

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        generator: ConditionalFeatureGenerator,
        local_steps: int = 20,
        generator_lr: float = 3e-4,
        generator_weight_decay: float = 1e-4,
        generated_ce: float = 1.0,
        feature_mse: float = 1.0,
        logit_kl: float = 1.0,
        generator_kl: float = 1.0,
        generator_mse: float = 1.0,
        generator_ce: float = 1.0,
        diversity: float = 1.0,
        diversity_kind: DiversityKind = "div2",
        diversity_norm: DiversityNorm = "mean",
        ramp: RampForm = "paper",
        ramp_power: float = 1.0,
        kl_direction: KLDirection = "teacher_first",
        client_temperature: float = 1.0,
        generator_temperature: float = 1.0,
        generated_batch_size: int = 64,
        knowledge_transfer: KnowledgeTransfer = "feature_logit",
        optimizer: OptimizerName = "sgd",
        lr: float = 0.05,
        momentum: float = 0.0,
        weight_decay: float = 1e-4,
    ) -> None:
        super().__init__(model, num_classes, optimizer, lr, momentum, weight_decay)
        self.generator = generator
        self.global_generator = copy.deepcopy(generator).requires_grad_(False)
        self.objective = FedMDCGObjective(
            generated_ce, feature_mse, logit_kl, generator_kl, generator_mse, generator_ce, diversity,
            diversity_kind, diversity_norm, ramp, ramp_power, kl_direction, client_temperature,
            generator_temperature, generated_batch_size, knowledge_transfer,
        )  # fmt: skip
        self.local_steps = local_steps
        self.generator_lr = generator_lr
        self.generator_weight_decay = generator_weight_decay
        self.label_distribution: Tensor | None = None
        self.has_global = False
        self.last_parts: dict[str, float] = {}

    # ------------------------------------------------------------------ stages
    def local_stages(self) -> Sequence[LocalStage]:
        return (LocalStage("model", steps=self.local_steps), LocalStage("generator", steps=self.local_steps))

    def generator_stage(self) -> bool:
        return self.stage == "generator"

    def on_train_start(self) -> None:
        # Freezing by requires_grad (not no_grad): gradients still flow *through* a frozen D_i into G_i.
        training_generator = self.generator_stage()
        self.model.requires_grad_(not training_generator)
        self.generator.requires_grad_(training_generator)

    def on_train_end(self) -> None:
        self.model.requires_grad_(True)
        self.generator.requires_grad_(True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.generator_stage():
            return torch.optim.Adam(
                self.generator.parameters(), lr=self.generator_lr, weight_decay=self.generator_weight_decay
            )
        return build_optimizer(self.model.parameters(), self.optimizer_name, self.lr, self.momentum, self.weight_decay)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.generator_update_loss(x, y) if self.generator_stage() else self.model_update_loss(x, y)
        if self._trainer is not None and self.trainer.logger is not None:
            self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def local_loss(self, batch: Batch) -> Tensor:
        return self.model_update_loss(*batch)

    # ------------------------------------------------------------------ losses
    def ramp(self) -> float:
        """The stage-1 ramp factor of this round (0 in the first round)."""
        return ramp_weight(self.round_idx, max(self.total_rounds, 1), self.objective.ramp, self.objective.ramp_power)

    def model_update_loss(self, x: Tensor, y: Tensor) -> Tensor:
        """Stage 1, Eq. 4: CE plus the ramped transfer from the frozen global generator."""
        objective = self.objective
        features = self.model.forward_features(x)
        logits = self.model.forward_head(features)
        loss = F.cross_entropy(logits, y)
        ramp = self.ramp()
        if not self.has_global or ramp == 0.0:
            return loss
        self.global_generator.eval()
        with torch.no_grad():
            generated, _ = self.global_generator(y)
        if objective.feature_mse:
            loss = loss + ramp * objective.feature_mse * F.mse_loss(features, generated)
        if objective.knowledge_transfer == "feature":
            return loss
        if objective.logit_kl:
            target = self.model.forward_head(generated).detach()  # [C] B14: only D_i(F_i(x)) is pulled
            kl = distillation_kl_loss(logits, target, objective.client_temperature, objective.kl_direction)
            loss = loss + ramp * objective.logit_kl * kl
        if objective.generated_ce and self.label_distribution is not None:
            distribution = self.label_distribution.to(x.device)
            labels = torch.multinomial(distribution, objective.generated_batch_size, replacement=True)
            with torch.no_grad():
                sampled, _ = self.global_generator(labels)
            ce = F.cross_entropy(self.model.forward_head(sampled), labels)
            loss = loss + ramp * objective.generated_ce * ce
        return loss

    def generator_update_loss(self, x: Tensor, y: Tensor) -> Tensor:
        """Stage 2, Eq. 9: ``G_i`` mimics ``F_i`` and is classified right by the frozen ``D_i``."""
        objective = self.objective
        self.model.eval()
        self.generator.train()
        with torch.no_grad():
            features = self.model.forward_features(x)
            target_logits = self.model.forward_head(features)
        generated, noise = self.generator(y)
        logits = self.model.forward_head(generated)
        kl = distillation_kl_loss(logits, target_logits, objective.generator_temperature, objective.kl_direction)
        mse = F.mse_loss(generated, features)
        ce = F.cross_entropy(logits, y)
        onehot = F.one_hot(y, self.num_classes)
        diversity = label_aware_diversity_loss(
            generated, noise, onehot, objective.diversity_kind, objective.diversity_norm
        )
        self.last_parts = {k: float(v.detach()) for k, v in (("kl", kl), ("mse", mse), ("ce", ce), ("div", diversity))}
        return (
            objective.generator_kl * kl
            + objective.generator_mse * mse
            + objective.generator_ce * ce
            + objective.diversity * diversity
        )

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


class FedMDCGServer(TrainableServerPhase):
    """Weighted average of ``(G_i, D_i)``, then the crossed (or plain) data-free distillation.

    Args:
        make_generator: builds a generator of the clients' architecture.
        aggregation: ``"kdc"`` (FedMD-CG, Eq. 10-12), ``"kd"`` (FedCG's ensemble KD) or ``"ave"``.
        steps: ``I_s``, server steps per round.
        batch_size: labels per server step.
        lr: Adam learning rate of ``G`` and ``D``.
        weight_decay: Adam weight decay.
        temperature: softmax temperature of the server KLs.
        kl_direction: see :mod:`fedhet.functional.conditional_generators`.
        kl_reduction: ``"sum_classes"`` or ``"mean_classes"`` (code, B11).
        share_noise: feed one noise batch to every generator (paper) or fresh noise to each (code).
        kd_reduction: reduction of ``KD_agg`` (see :func:`fedhet.functional.ensemble_distillation_kl`).
    """

    def __init__(
        self,
        make_generator: Any,
        aggregation: Aggregation = "kdc",
        steps: int = 50,
        batch_size: int = 64,
        lr: float = 3e-4,
        weight_decay: float = 1e-4,
        temperature: float = 1.0,
        kl_direction: KLDirection = "teacher_first",
        kl_reduction: KLReduction = "sum_classes",
        share_noise: bool = True,
        kd_reduction: Literal["batchmean", "mean", "hinton"] = "batchmean",
    ) -> None:
        super().__init__()
        if aggregation not in ("kdc", "kd", "ave"):
            raise ConfigError(f"aggregation={aggregation!r}: use 'kdc', 'kd' or 'ave'")
        self.make_generator = make_generator
        self.aggregation: Aggregation = aggregation
        self.steps = steps
        self.batch_size = batch_size
        self.lr = lr
        self.weight_decay = weight_decay
        self.temperature = temperature
        self.kl_direction: KLDirection = kl_direction
        self.kl_reduction: KLReduction = kl_reduction
        self.share_noise = share_noise
        self.kd_reduction: Literal["batchmean", "mean", "hinton"] = kd_reduction
        #: which of L_kl,1..3 the crossed distillation uses (all three; tests switch them singly)
        self.terms: tuple[bool, bool, bool] = (True, True, True)
        self.num_classes = 0
        # the round's frozen teachers: a plain list, outside the module tree and the checkpoint
        self.teachers: list[tuple[nn.Module, nn.Module]] = []
        self.round_tau: Tensor | None = None
        self.round_counts: Tensor | None = None
        self.round_sample_weights: Tensor | None = None
        self.first_loss = float("nan")
        self.last_loss = float("nan")
        self.steps_done = 0

    def setup_server(self, context: ServerContext) -> None:
        if context.model_factory is None:
            raise ConfigError(f"{type(self).__name__} needs a model factory to build the global classifier")
        initial = context.initial_client_state(0)
        self.num_classes = context.num_classes
        self.generator = self.make_generator()
        copy_state_into(self.generator, state_with_prefix(initial, GENERATOR_PREFIX))
        network = context.model_factory(context.architectures[0], context.seed)
        self.classifier = copy.deepcopy(network.head)
        copy_state_into(self.classifier, state_with_prefix(initial, CLASSIFIER_PREFIX))
        self.register_buffer(
            "client_label_counts", torch.zeros(context.num_clients, self.num_classes, dtype=torch.long)
        )
        self.register_buffer("rounds_aggregated", torch.zeros((), dtype=torch.long))

    # ------------------------------------------------------------------ aggregation
    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        self.teachers = []
        if not uploads:
            return
        generator_ref = self.generator.state_dict()
        classifier_ref = self.classifier.state_dict()
        payloads: list[GeneratorClassifierPayload] = []
        for upload in uploads:
            payload = upload.payload
            if not isinstance(payload, GeneratorClassifierPayload):
                raise TrainingError(f"client {upload.client_id} sent {type(payload).__name__}, expected (G_i, D_i)")
            payload.validate_against(generator_ref, classifier_ref, self.num_classes, f"client {upload.client_id}")
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
        if self.aggregation != "ave":
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
        return self.aggregation != "ave" and bool(self.teachers)

    def server_dataloader(self, seed: int) -> DataLoader:
        if self.round_counts is None:
            raise TrainingError("FedMD-CG's server was fitted before any upload arrived")
        generator = torch.Generator().manual_seed(derive_seed(seed, "fedmdcg-labels"))
        labels = torch.multinomial(self.round_counts, self.steps * self.batch_size, True, generator=generator)
        return DataLoader(TensorDataset(labels), batch_size=self.batch_size, shuffle=False)

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
            local_noise = noise if self.share_noise else local_generator.sample_noise(labels.shape[0], labels.device)
            with torch.no_grad():
                local_features, _ = local_generator(labels, local_noise)
                targets.append(local_classifier(local_features))
            if self.aggregation == "kdc":
                global_on_local.append(self.classifier(local_features))  # L_kl,2: trains D only
                local_on_global.append(local_classifier(global_features))  # L_kl,3: trains G only
        if self.aggregation == "kd":
            assert self.round_sample_weights is not None
            return ensemble_distillation_kl(
                global_logits, torch.stack(targets), self.round_sample_weights, self.temperature, self.kd_reduction
            )
        assert self.round_tau is not None
        return crossed_distillation_loss(
            global_logits,
            torch.stack(targets),
            torch.stack(global_on_local),
            torch.stack(local_on_global),
            self.round_tau.to(labels.device)[:, labels],
            self.temperature,
            self.kl_direction,
            self.kl_reduction,
            self.terms,
        )

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.distillation_loss(batch[0])
        if self.steps_done == 0:
            self.first_loss = float(loss.detach())
        self.last_loss = float(loss.detach())
        self.steps_done += 1
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        parameters = [*self.generator.parameters(), *self.classifier.parameters()]
        return torch.optim.Adam(parameters, lr=self.lr, weight_decay=self.weight_decay)

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


class FedMDCG(Algorithm):
    """FedMD-CG (label skew; extractors may differ when they share ``feature_dim`` and the classifier).

    Args:
        local_steps: ``I_c``, mini-batches of each client stage per round (20).
        server_steps: ``I_s``, server distillation steps per round (50).
        server_batch_size: ``B`` of the server steps (64).
        generated_batch_size: labels drawn from ``p(y)`` per stage-1 step for ``L->ce`` (64).
        noise_dim: ``q`` (128).
        generator_hidden: the generator's two hidden widths (512, 256).
        noise: ``"gaussian"`` (paper) or ``"uniform"`` (code).
        lambda_generated_ce: lambda_1, weight of ``L->ce`` (1).
        lambda_feature_mse: lambda_2, weight of ``L->mse`` (1; code 0.1).
        lambda_logit_kl: lambda_3, weight of ``L->kl`` (1).
        lambda_generator_mse: lambda_4, weight of ``L<-mse`` (1).
        lambda_generator_ce: lambda_5, weight of ``L<-ce`` (1).
        lambda_diversity: lambda_6, weight of ``L_div`` (1).
        generator_kl_weight: weight of ``L<-kl`` (1 in Eq. 9).
        diversity: ``"div2"`` (paper), ``"div1"``, ``"div0"`` or ``"none"``.
        diversity_norm: ``"mean"`` (code distances) or ``"paper"`` (literal norms).
        ramp: ``"paper"`` (``((r-1)/R)^d``) or ``"code"`` (``(step/(R-1))^3``).
        ramp_power: ``d`` (1).
        kl_direction: ``"teacher_first"`` (code, standard KD) or ``"as_printed"`` (paper's order).
        client_temperature: ``T`` of ``L->kl`` (1; code 10).
        generator_temperature: ``T`` of ``L<-kl`` (1, as the code).
        server_temperature: ``T`` of the server KLs (1; code 10).
        server_kl_reduction: ``"sum_classes"`` (a KL) or ``"mean_classes"`` (code).
        share_server_noise: one noise batch for every generator on the server (paper).
        aggregation: ``"kdc"`` (KDC_agg), ``"kd"`` (KD_agg) or ``"ave"`` (AVE_agg): Table 3.
        knowledge_transfer: ``"feature_logit"`` or ``"feature"`` (Table 3's AVE_agg rows).
        generator_lr: Adam learning rate of ``G_i`` (3e-4).
        generator_weight_decay: its weight decay (1e-4).
        server_lr: Adam learning rate of ``G`` and ``D`` on the server (3e-4).
        server_weight_decay: its weight decay (1e-4).
        optimizer: optimizer of ``[F_i, D_i]`` (SGD).
        lr: its learning rate (searched in {0.01, 0.05, 0.08}; code 0.05).
        momentum: SGD momentum (0).
        weight_decay: L2 weight decay (1e-4).
    """

    capabilities = Capabilities(heterogeneous_models=True, common_feature_dim=True, scenario_kinds=("label_skew",))
    upload_type = GeneratorClassifierPayload
    download_type = GeneratorClassifierPayload
    evaluation = ("clients_before_download", "virtual_global")
    identical_client_init = True

    def __init__(
        self,
        local_steps: PositiveInt = 20,
        server_steps: PositiveInt = 50,
        server_batch_size: PositiveInt = 64,
        generated_batch_size: PositiveInt = 64,
        noise_dim: PositiveInt = 128,
        generator_hidden: tuple[int, int] = (512, 256),
        noise: NoiseKind = "gaussian",
        lambda_generated_ce: NonNegativeFloat = 1.0,
        lambda_feature_mse: NonNegativeFloat = 1.0,
        lambda_logit_kl: NonNegativeFloat = 1.0,
        lambda_generator_mse: NonNegativeFloat = 1.0,
        lambda_generator_ce: NonNegativeFloat = 1.0,
        lambda_diversity: NonNegativeFloat = 1.0,
        generator_kl_weight: NonNegativeFloat = 1.0,
        diversity: DiversityKind = "div2",
        diversity_norm: DiversityNorm = "mean",
        ramp: RampForm = "paper",
        ramp_power: PositiveFloat = 1.0,
        kl_direction: KLDirection = "teacher_first",
        client_temperature: PositiveFloat = 1.0,
        generator_temperature: PositiveFloat = 1.0,
        server_temperature: PositiveFloat = 1.0,
        server_kl_reduction: KLReduction = "sum_classes",
        share_server_noise: bool = True,
        aggregation: Aggregation = "kdc",
        knowledge_transfer: KnowledgeTransfer = "feature_logit",
        generator_lr: PositiveFloat = 3e-4,
        generator_weight_decay: NonNegativeFloat = 1e-4,
        server_lr: PositiveFloat = 3e-4,
        server_weight_decay: NonNegativeFloat = 1e-4,
        optimizer: OptimizerName = "sgd",
        lr: PositiveFloat = 0.05,
        momentum: Momentum = 0.0,
        weight_decay: NonNegativeFloat = 1e-4,
    ) -> None:
        super().__init__(optimizer, lr, momentum, weight_decay)
        choices = {
            "diversity": (diversity, ("div0", "div1", "div2", "none")),
            "diversity_norm": (diversity_norm, ("mean", "paper")),
            "ramp": (ramp, ("paper", "code")),
            "kl_direction": (kl_direction, ("teacher_first", "as_printed")),
            "server_kl_reduction": (server_kl_reduction, ("sum_classes", "mean_classes")),
            "aggregation": (aggregation, ("kdc", "kd", "ave")),
            "knowledge_transfer": (knowledge_transfer, ("feature_logit", "feature")),
            "noise": (noise, ("gaussian", "uniform")),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise ConfigError(f"{type(self).__name__}: {name}={value!r}; use one of {', '.join(allowed)}")
        if len(generator_hidden) != 2 or min(generator_hidden) < 1:
            raise ConfigError(f"generator_hidden={list(generator_hidden)}: give two positive widths")
        self.local_steps = local_steps
        self.server_steps = server_steps
        self.server_batch_size = server_batch_size
        self.noise_dim = noise_dim
        self.generator_hidden = (int(generator_hidden[0]), int(generator_hidden[1]))
        self.noise: NoiseKind = noise
        self.objective = FedMDCGObjective(
            generated_ce=lambda_generated_ce,
            feature_mse=lambda_feature_mse,
            logit_kl=lambda_logit_kl,
            generator_kl=generator_kl_weight,
            generator_mse=lambda_generator_mse,
            generator_ce=lambda_generator_ce,
            diversity=lambda_diversity,
            diversity_kind=diversity,
            diversity_norm=diversity_norm,
            ramp=ramp,
            ramp_power=ramp_power,
            kl_direction=kl_direction,
            client_temperature=client_temperature,
            generator_temperature=generator_temperature,
            generated_batch_size=generated_batch_size,
            knowledge_transfer=knowledge_transfer,
        )
        self.server_temperature = server_temperature
        self.server_kl_reduction: KLReduction = server_kl_reduction
        self.share_server_noise = share_server_noise
        self.aggregation: Aggregation = aggregation
        self.generator_lr = generator_lr
        self.generator_weight_decay = generator_weight_decay
        self.server_lr = server_lr
        self.server_weight_decay = server_weight_decay
        self.feature_dim: int | None = None

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
            return ConditionalFeatureGenerator(self.noise_dim, classes, feature_dim, self.generator_hidden, self.noise)

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        self.feature_dim = int(model.num_features)  # type: ignore[arg-type]
        return FedMDCGClient(
            model,
            num_classes,
            self.make_generator(self.feature_dim, num_classes),
            local_steps=self.local_steps,
            generator_lr=self.generator_lr,
            generator_weight_decay=self.generator_weight_decay,
            **dataclasses.asdict(self.objective),
            **self.optimizer_kwargs(),
        )

    def server_kwargs(self) -> dict[str, Any]:
        """The :class:`FedMDCGServer` arguments of this configuration."""
        return {
            "aggregation": self.aggregation,
            "steps": self.server_steps,
            "batch_size": self.server_batch_size,
            "lr": self.server_lr,
            "weight_decay": self.server_weight_decay,
            "temperature": self.server_temperature,
            "kl_direction": self.objective.kl_direction,
            "kl_reduction": self.server_kl_reduction,
            "share_noise": self.share_server_noise,
        }

    def build_server(self) -> ServerPhase:
        return FedMDCGServer(self.make_generator, **self.server_kwargs())


class PaperProtocol(Algorithm):
    """Any method evaluated as FedMD-CG's paper evaluates its baselines (L.acc and G.acc).

    The base method is unchanged; only what is measured changes: every client starts from one
    initialisation, ``acc_local`` is each client's model after local training and before the
    download (L.acc), and ``acc_server`` the virtual global model (G.acc), built by the loop for
    evaluation only. ``method: {class_path: fedhet.algorithms.fedmdcg.PaperProtocol, init_args:
    {base: {class_path: fedhet.algorithms.LGFedAvg, init_args: {lr: 0.05}}}}``.

    Args:
        base: the method evaluated.
    """

    def __init__(self, base: Algorithm) -> None:
        self.base = base
        self.capabilities = base.capabilities  # type: ignore[misc]
        self.upload_type = base.upload_type  # type: ignore[misc]
        self.download_type = base.download_type  # type: ignore[misc]
        self.label_counts_uploaded = base.label_counts_uploaded  # type: ignore[misc]
        self.evaluation = ("clients_before_download", "virtual_global")  # type: ignore[misc]
        self.identical_client_init = True  # type: ignore[misc]
        self.data_format = None

    @property
    def name(self) -> str:
        return self.base.name

    def configure(self, data_format: DataFormat) -> None:
        super().configure(data_format)
        self.base.configure(data_format)

    def optimizer_kwargs(self) -> dict[str, Any]:
        return self.base.optimizer_kwargs()

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        return self.base.build_client(model, num_classes)

    def build_server(self) -> ServerPhase:
        return self.base.build_server()

    def build_collaborative_phase(self, clients: Sequence[ClientModule]) -> CollaborativePhase | None:
        return self.base.build_collaborative_phase(clients)

    def collaborative_epochs(self) -> int:
        return self.base.collaborative_epochs()

    def phases(self) -> Sequence[RunPhase]:
        return self.base.phases()
