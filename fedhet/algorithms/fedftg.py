"""FedFTG: the averaged global model fine-tuned by data-free distillation on the server.

Paper: Zhang, Shen, Ding, Tao & Duan, "Fine-tuning Global Model via Data-Free Knowledge
Distillation for Non-IID Federated Learning", CVPR 2022 (Algorithms 1 and 2, Eqs. 2-10);
implementation spec ``reference/fedftg.md``; authors' code ``ZhangLin-PKU/FedFTG``.

A server plugin: it wraps any weight-averaging base chosen in the config (FedAvg, FedProx,
FedDyn, SCAFFOLD, MOON: Table 3), whose clients, uploads and closed-form aggregation it keeps.

Upload: the base method's (the whole local model, BatchNorm buffers included; SCAFFOLD adds its
control-variate change), plus each client's label counts ``n_k^y``, sent once before training
(the paper allows it for static data) as :class:`LabelCountsPayload` s and charged to round 0's
traffic (:meth:`DataFreeFineTuning.setup_uploads`).
Download: the *fine-tuned* global model, plus the base method's extras (SCAFFOLD's ``c``).
Server round (Algorithm 2): the base aggregates; then, with the round's client models as frozen
teachers (eval mode, their own BatchNorm statistics) and the persistent conditional generator
``G(z, y)`` (never sent), ``I`` iterations of

* a batch ``(Z, Y)`` of ``Q`` noises ``z ~ N(0, I_d)`` and labels ``y ~ p_t(y)``, the customized
  label sampling ``p_t(y) ∝ sum_{k in S_t} n_k^y`` (Eq. 9);
* ``I_g`` hard-sample-mining steps of the generator (global model in eval mode), minimising
  ``-L_md + lambda_cls L_cls + lambda_dis L_dis`` with the class-level ensemble weights
  ``alpha^{k,y} = n_k^y / sum_{i in S_t} n_i^y`` (Eq. 10) in ``L_md`` and ``L_cls``;
* ``I_d`` steps of the global model (train mode, generator in eval mode) minimising ``L_md`` on
  the same ``(Z, Y)``, the generated images detached.

``I = 10, I_g = 1, I_d = 5, lambda_cls = lambda_dis = 1``, generator Adam at
``0.01 * 0.998^t`` and global-model SGD at ``0.1 * 0.998^t`` with weight decay ``1e-3``, both
re-created every round (the generator's weights persist). ``acc_server`` evaluates the
fine-tuned model, the one broadcast; ``acc_server_plain_average`` the base's plain average of
the same round before fine-tuning (evaluation only, :meth:`FedFTG.reference_models`).
Client state kept across rounds: the base method's.

Deviations from paper/official code (all switchable, defaults follow the code where the paper
is silent or where the code produced the reported numbers):

* ``L_md`` (A1): the paper writes ``KL(global || teacher_k)`` per teacher. The code trains the
  global model with the soft cross-entropy to the alpha-weighted teacher *probability* ensemble
  (mean over batch and classes) and the generator with the alpha-weighted mean absolute logit
  difference; these are the defaults (``student_loss="soft_ce"``,
  ``generator_discrepancy="l1_logits"``), the paper's form is ``"kl_global_first"`` for either.
* ``I_g`` (A2): the code takes one generator step per teacher per iteration, on that teacher's
  terms with ``L_dis / |S_t|``; default ``generator_step_per_teacher=True``. ``False`` is the
  paper's single step on the alpha-weighted sum.
* ``L_cls`` is weighted per sample as Eq. (6) writes it (the code multiplies a batch-mean CE by
  the mean weight).
* Labels (A3) are drawn i.i.d. from ``p_t`` as the paper writes (the code draws exact
  proportional quotas); noises and labels come from the round's server seed.
* The global model's BatchNorm runs in train mode during its steps, as in the code
  (``server_bn_mode="train"``); ``"frozen"`` keeps the running statistics of the average
  (pitfall 1). Teachers are never registered submodules, so Lightning cannot flip them to train
  mode.
* The clients' learning rate is not decayed by ``0.998^t`` (the code decays it); every base in
  fedhet's comparison trains at the same constant rate.
* One architecture only: FedFTG refines a weight average (the paper's setting).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from fedhet.algorithms.base import (
    Capabilities,
    ClientUpload,
    LocalStage,
    ServerContext,
    ServerPhase,
    ServerPlugin,
    ServerRefinement,
    hparams_for,
)
from fedhet.algorithms.shared.common import FedAvgServer, freeze_batch_norm
from fedhet.core.payloads import Payload, WeightsPayload
from fedhet.core.state import clone_state, copy_state_into
from fedhet.errors import ConfigError
from fedhet.functional.data_free import (
    class_ensemble_weights,
    ensemble_probabilities,
    label_sampling_distribution,
    soft_cross_entropy,
    weighted_fidelity,
    weighted_global_first_kl,
    weighted_logit_l1,
)
from fedhet.functional.mutual_learning import diversity_loss
from fedhet.hparams import (
    Hyperparameters,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    int_uniform,
    knob,
    log_uniform,
)
from fedhet.seeding import derive_seed, seeded

StudentLoss = Literal["soft_ce", "kl_global_first"]
GeneratorDiscrepancy = Literal["l1_logits", "kl_global_first"]
ServerBatchNorm = Literal["train", "frozen"]


@dataclass(frozen=True)
class LabelCountsPayload(Payload):
    """One client's training examples per class ``n_k^y`` (int64, ``[num_classes]``), sent once before training."""

    counts: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))


@dataclass(frozen=True)
class FedFTGHparams(Hyperparameters):
    """FedFTG's server fine-tuning (no optimizer: the clients are the base method's)."""

    iterations: NonNegativeInt = knob(10, "I, server iterations per round (paper: 10)", int_uniform(1, 20))
    generator_steps: PositiveInt = knob(1, "I_g, generator steps per iteration (paper: 1)", int_uniform(1, 5))
    student_steps: PositiveInt = knob(5, "I_d, global-model steps per iteration (paper: 5)", int_uniform(1, 10))
    batch_size: PositiveInt = knob(50, "Q, generated samples per iteration, >= 2 (code: the local batch size, 50)")
    noise_dim: PositiveInt = knob(100, "d, the noise size (paper: 100 for CIFAR-10, 256 for CIFAR-100)")
    generator_width: PositiveInt = knob(64, "the generator's ngf (paper: 64)")
    generator_lr: PositiveFloat = knob(
        0.01, "Adam learning rate of the generator at round 0 (paper: 0.01)", log_uniform(1e-4, 1e-1)
    )
    student_lr: PositiveFloat = knob(
        0.1, "SGD learning rate of the global model at round 0 (paper: 0.1)", log_uniform(1e-3, 1.0)
    )
    student_weight_decay: NonNegativeFloat = knob(1e-3, "weight decay of that SGD (code: 1e-3)")
    lr_decay: PositiveFloat = knob(0.998, "both server rates are multiplied by lr_decay ** round (code: 0.998)")
    lambda_cls: NonNegativeFloat = knob(1.0, "weight of the fidelity loss L_cls (paper: 1)", log_uniform(0.1, 10.0))
    lambda_dis: NonNegativeFloat = knob(1.0, "weight of the diversity loss L_dis (paper: 1)", log_uniform(0.1, 10.0))
    hard_sample_mining: bool = knob(
        True, "the generator maximises L_md (false: the -hsm ablation, fidelity and diversity only)"
    )
    label_sampling: bool = knob(True, "customized label sampling (false: the -cls ablation, uniform labels)")
    class_ensemble: bool = knob(True, "class-level ensemble weights (false: the -abe ablation, 1/|S_t|)")
    generator_step_per_teacher: bool = knob(
        True, "one generator step per teacher per iteration (code) instead of one on the weighted sum (paper)"
    )
    student_loss: StudentLoss = knob("soft_ce", "soft_ce (code) or kl_global_first (paper Eq. 4)")
    generator_discrepancy: GeneratorDiscrepancy = knob("l1_logits", "l1_logits (code) or kl_global_first (paper Eq. 4)")
    server_bn_mode: ServerBatchNorm = knob(
        "train", "the global model's BatchNorm during its steps: train (code) or frozen (the average's statistics)"
    )

    def check(self) -> None:
        if self.batch_size < 2:
            raise ConfigError(f"batch_size={self.batch_size} must be >= 2")


class ConditionalImageGenerator(nn.Module):
    """The conditional generator of FedFTG (the code's ``CGeneratorA``, DFAD's generator with labels).

    ``FC(z) || FC(onehot(y)) -> [2w, s/4, s/4] -> BN -> up x2 -> conv3x3 2w, BN, LeakyReLU(0.2)
    -> up x2 -> conv3x3 w, BN, LeakyReLU(0.2) -> conv3x3 C, Tanh -> BN(affine=False)``. The
    trailing affine-free BatchNorm standardises the output, so generated images live on the
    scale of the normalised real data (``reference/fedftg.md`` 4.2). ``s = 32`` gives the
    paper's 8x8 start; ``s = 28`` a 7x7 start (the spec's CPU variant).

    Args:
        noise_dim: size ``d`` of ``z``.
        num_classes: number of classes ``M`` (the one-hot label size).
        image_size: side ``s`` of the square output, a multiple of 4.
        channels: output channels.
        width: ``ngf`` (64 in the paper; 32 in the CPU variant).
    """

    def __init__(self, noise_dim: int, num_classes: int, image_size: int, channels: int, width: int = 64) -> None:
        super().__init__()
        if image_size % 4:
            raise ConfigError(f"FedFTG's generator needs an image size divisible by 4, got {image_size}")
        self.noise_dim = noise_dim
        self.num_classes = num_classes
        self.start = image_size // 4
        self.width = width
        cells = width * self.start * self.start
        self.noise_layer = nn.Linear(noise_dim, cells)
        self.label_layer = nn.Linear(num_classes, cells)
        self.body = nn.Sequential(
            nn.BatchNorm2d(2 * width),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.LeakyReLU(0.2),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(2 * width, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.LeakyReLU(0.2),
            nn.Conv2d(width, channels, 3, padding=1),
            nn.Tanh(),
            nn.BatchNorm2d(channels, affine=False),
        )

    def forward(self, noise: Tensor, labels: Tensor) -> Tensor:
        onehot = F.one_hot(labels, self.num_classes).to(noise.dtype)
        hidden = torch.cat([self.noise_layer(noise), self.label_layer(onehot)], dim=1)
        return self.body(hidden.view(-1, 2 * self.width, self.start, self.start))


class DataFreeFineTuning(ServerRefinement):
    """FedFTG's server update (Algorithm 2 after the aggregation), one Lightning fit per round.

    One training step is one outer iteration ``i`` of Algorithm 2 on the batch ``(Z, Y)`` the
    loader yields; the stage uses manual optimisation (two optimizers, alternating phases).

    Args:
        hp: FedFTG's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams: ClassVar[type[Hyperparameters]] = FedFTGHparams

    def __init__(self, hp: Any = None, **overrides: Any) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.hp: Any = hparams_for(type(self), hp, overrides)
        self.round_idx = 0
        self.group = ""
        # Teachers live in a plain list, outside the module tree: Lightning's ``.train()`` at fit
        # start must not flip their BatchNorm layers, and no optimizer may see them (pitfall 2).
        self.teachers: list[nn.Module] = []
        self.active_teachers = 0
        self.alpha = torch.zeros(0)  # [K, M] class-level ensemble weights of the round
        self.label_probs = torch.zeros(0)  # [M] p_t(y)
        self.sums: dict[str, float] = {}  # round totals of the logged terms
        self.counts: dict[str, int] = {}
        self.plain_average: dict[str, Tensor] | None = None  # the round's aggregate before fine-tuning
        # the network it is scored in, in a plain list as the teachers: not a submodule, so neither
        # Lightning's mode switches nor the checkpoint see it
        self.plain_average_network: list[nn.Module] = []

    # ------------------------------------------------------------------ set-up
    def attach(self, base: ServerPhase, context: ServerContext) -> None:
        if not isinstance(base, FedAvgServer):
            raise ConfigError(
                f"FedFTG fine-tunes a weight average (FedAvg, FedProx, FedDyn, SCAFFOLD, MOON), not "
                f"{type(base).__name__}; set method.init_args.base to one of them"
            )
        if len(set(context.architectures)) != 1:
            raise ConfigError(
                f"FedFTG fine-tunes one averaged model, but the clients use {len(set(context.architectures))} "
                "architectures; use a homogeneous family, e.g. --models cpu_homo"
            )
        context.require("model_factory", "FedFTG", "to build the teachers and the fine-tuned model")
        data_format = context.require("data_format", "FedFTG", "to shape the generator's images")
        context.require("label_counts", "FedFTG", "to sample labels and weight the teachers by class")
        super().attach(base, context)
        architecture = context.architectures[0]
        self.group = base.group(architecture)
        with seeded(derive_seed(context.seed, "fedftg", "generator")):
            self.generator = ConditionalImageGenerator(
                self.hp.noise_dim,
                context.num_classes,
                data_format.image_size,
                data_format.channels,
                self.hp.generator_width,
            )
        self.student = context.model_factory(architecture, context.seed)
        self.architecture = architecture

    def setup_uploads(self) -> Sequence[Payload]:
        """Every client's label counts, sent once before round 0 (the loop charges them to its traffic)."""
        counts = self.context.client_label_counts()
        assert counts is not None
        return [LabelCountsPayload(counts=row.to(torch.int64)) for row in counts]

    def begin_round(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        assert isinstance(self.base, FedAvgServer) and self.context.model_factory is not None
        label_counts = self.context.client_label_counts()
        assert label_counts is not None
        self.round_idx = round_idx
        self.active_teachers = len(uploads)
        while len(self.teachers) < len(uploads):
            self.teachers.append(self.context.model_factory(self.architecture, self.context.seed).requires_grad_(False))
        for teacher, upload in zip(self.teachers, uploads, strict=False):
            assert isinstance(upload.payload, WeightsPayload)
            copy_state_into(teacher, upload.payload.weights)
            teacher.eval()
        counts = label_counts[[u.client_id for u in uploads]].to(torch.float64)
        self.alpha = class_ensemble_weights(counts, uniform=not self.hp.class_ensemble)
        self.label_probs = label_sampling_distribution(counts, uniform=not self.hp.label_sampling)
        copy_state_into(self.student, self.base.global_by_architecture[self.group])
        # the plain average before fine-tuning, scored next to the fine-tuned model every round
        self.plain_average = clone_state(self.base.global_by_architecture[self.group])
        self.sums, self.counts = {}, {}

    def plain_average_model(self) -> nn.Module | None:
        """The round's plain average (the base's aggregate, before fine-tuning) as a network, for evaluation only."""
        if self.plain_average is None or self.context.model_factory is None:
            return None
        if not self.plain_average_network:
            self.plain_average_network.append(self.context.model_factory(self.architecture, self.context.seed))
        network = self.plain_average_network[0]
        copy_state_into(network, self.plain_average)
        return network

    def should_refine(self) -> bool:
        return self.active_teachers > 0 and self.hp.iterations > 0

    def refine_budget(self) -> LocalStage:
        return LocalStage(name="ftg", epochs=1, manual=True)

    def server_dataloader(self, seed: int) -> Iterable[Any]:
        """``I`` batches ``(Z, Y)``: ``z ~ N(0, I_d)`` and ``y ~ p_t(y)`` i.i.d., from the round's seed."""
        generator = torch.Generator().manual_seed(seed)
        total = self.hp.iterations * self.hp.batch_size
        noise = torch.randn(total, self.hp.noise_dim, generator=generator)
        labels = torch.multinomial(self.label_probs, total, replacement=True, generator=generator)
        return DataLoader(TensorDataset(noise, labels), batch_size=self.hp.batch_size, shuffle=False)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        decay = self.hp.lr_decay**self.round_idx
        return [
            torch.optim.Adam(self.generator.parameters(), lr=self.hp.generator_lr * decay),
            torch.optim.SGD(
                self.student.parameters(), lr=self.hp.student_lr * decay, weight_decay=self.hp.student_weight_decay
            ),
        ]

    def on_fit_start(self) -> None:
        for teacher in self.teachers[: self.active_teachers]:
            teacher.to(self.device)

    # ------------------------------------------------------------------ Algorithm 2, one iteration
    def teacher_logits(self, x: Tensor, teachers: Sequence[nn.Module]) -> Tensor:
        """``[K, B, M]`` logits of ``teachers`` on ``x`` (gradients flow into ``x`` when it needs them)."""
        return torch.stack([teacher(x) for teacher in teachers])

    def discrepancy(self, student_logits: Tensor, teacher_logits: Tensor, weights: Tensor) -> Tensor:
        """``L_md`` as the generator maximises it."""
        if self.hp.generator_discrepancy == "l1_logits":
            return weighted_logit_l1(student_logits, teacher_logits, weights)
        return weighted_global_first_kl(student_logits, teacher_logits, weights)

    def generator_loss(self, noise: Tensor, labels: Tensor, teachers: Sequence[nn.Module], weights: Tensor) -> Tensor:
        """``-L_md + lambda_cls L_cls + lambda_dis L_dis / (teachers per step ratio)`` for one step."""
        x = self.generator(noise, labels)
        teacher_logits = self.teacher_logits(x, teachers)
        fidelity = weighted_fidelity(teacher_logits, labels, weights)
        diversity = diversity_loss(noise, x)
        share = len(teachers) / self.active_teachers
        loss = self.hp.lambda_cls * fidelity + self.hp.lambda_dis * share * diversity
        if self.hp.hard_sample_mining:
            discrepancy = self.discrepancy(self.student(x), teacher_logits, weights)
            loss = loss - discrepancy
            self._add("generator_discrepancy", discrepancy)
        self._add("generator_fidelity", fidelity)
        self._add("generator_diversity", diversity)
        return loss

    def student_objective(self, x: Tensor, teacher_logits: Tensor, weights: Tensor) -> Tensor:
        """``L_md`` as the global model minimises it, on detached generated images."""
        logits = self.student(x)
        if self.hp.student_loss == "soft_ce":
            return soft_cross_entropy(logits, ensemble_probabilities(teacher_logits, weights))
        return weighted_global_first_kl(logits, teacher_logits, weights)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        noise, labels = batch
        generator_optimizer, student_optimizer = self.optimizers()  # type: ignore[misc]
        teachers = self.teachers[: self.active_teachers]
        weights = self.alpha.to(labels.device)[:, labels].t()  # [B, K]: alpha^{k, y_j}

        # Hard-sample mining: the generator moves, the global model and the teachers are frozen.
        self.student.eval().requires_grad_(False)
        self.generator.train()
        everyone = list(range(len(teachers)))
        groups = [[k] for k in everyone] if self.hp.generator_step_per_teacher else [everyone]
        for _ in range(self.hp.generator_steps):
            for group in groups:
                generator_optimizer.zero_grad()
                loss = self.generator_loss(noise, labels, [teachers[k] for k in group], weights[:, group])
                self.manual_backward(loss)
                generator_optimizer.step()
        self.student.requires_grad_(True)

        # Knowledge transfer: the global model moves on the same (Z, Y), images detached.
        self.generator.eval()
        self.student.train()
        if self.hp.server_bn_mode == "frozen":
            freeze_batch_norm(self.student)
        with torch.no_grad():
            x = self.generator(noise, labels)
            teacher_logits = self.teacher_logits(x, teachers)
            agreement = ensemble_probabilities(teacher_logits, weights).argmax(1).eq(labels).float().mean()
        self._add("teacher_accuracy", agreement)
        loss = torch.zeros(())
        for _ in range(self.hp.student_steps):
            student_optimizer.zero_grad()
            loss = self.student_objective(x, teacher_logits, weights)
            self.manual_backward(loss)
            student_optimizer.step()
            self._add("student_loss", loss)
        return loss.detach()

    def on_train_end(self) -> None:
        assert isinstance(self.base, FedAvgServer)
        self.base.global_by_architecture[self.group] = clone_state(self.student.state_dict())

    # ------------------------------------------------------------------ logging and checkpoints
    def _add(self, name: str, value: Tensor) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(value.detach())
        self.counts[name] = self.counts.get(name, 0) + 1

    def metrics(self) -> dict[str, float]:
        """Round means of the generator's terms, the global model's loss, and the teachers' accuracy on ``x~``."""
        return {f"ftg_{name}": total / self.counts[name] for name, total in self.sums.items()}

    def refinement_state(self) -> dict[str, Any]:
        # The generator persists across rounds; the global model is the base's, teachers are per round.
        return {"generator": clone_state(self.generator.state_dict())}

    def load_refinement_state(self, state: Any) -> None:
        self.generator.load_state_dict(dict(state["generator"]))


class FedFTG(ServerPlugin):
    """FedFTG: a weight-averaging base method whose global model the server fine-tunes data-free.

    ``base`` is the method whose clients and averaging FedFTG refines (FedAvg, FedProx, FedDyn,
    SCAFFOLD, MOON; default FedAvg; the paper's headline uses SCAFFOLD).
    """

    Hparams = FedFTGHparams
    capabilities = Capabilities(heterogeneous_models=False)
    upload_type = WeightsPayload
    download_type = WeightsPayload
    evaluation = ("clients", "server")
    refinement_heterogeneous_models = False

    def build_refinement(self) -> ServerRefinement:
        return DataFreeFineTuning(self.hp)

    def reference_models(self, server: ServerPhase) -> dict[str, nn.Module]:
        """``plain_average``: the base's aggregate before fine-tuning (``acc_server_plain_average``).

        Logged every round next to ``acc_server`` (the fine-tuned model, the one broadcast), so each
        round shows what the fine-tuning added or cost.
        """
        refinement = getattr(server, "refinement", None)
        if not isinstance(refinement, DataFreeFineTuning):
            return {}
        model = refinement.plain_average_model()
        return {} if model is None else {"plain_average": model}


__all__ = ["ConditionalImageGenerator", "DataFreeFineTuning", "FedFTG", "FedFTGHparams", "LabelCountsPayload"]
