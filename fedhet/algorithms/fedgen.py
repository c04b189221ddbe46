"""FedGen: a server-side conditional generator of features regularises the clients' shared heads.

Paper: Zhu, Hong, Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated
Learning", ICML 2021 (Eq. 4-7, Algorithm 1); official code ``zhuangdizhu/FedGen``.
Heterogeneous form and defaults from HtFLlib ``servergen.py`` / ``clientgen.py`` and FedKTL's
baseline table (App. C: noise dim 32, generator lr 0.1, hidden dim = feature dim, 100 server
epochs, i.e. generator steps).

Upload: the client's head ``Linear(K', C)`` weights and its per-class training counts
(``HeadCountsPayload``; Table 5 counts the head only, ``K'C + C`` floats; the ``C`` int64 counts
are HtFLlib's one-time ``sample_per_class``, sent every round here).
Download: the averaged head, the generator's parameters, and the global label counts
(``FedGenDownload``; Table 5: head + generator parameters).
Server phase: trainable (:class:`FedGenServer`, a LightningModule). The heads are FedAvg-ed by
examples (HtFLlib); then the generator ``G(z, y)`` (``Linear(noise+C, H) + BN + ReLU + Linear(H,
K')``, ``z ~ U[0,1)`` as both codes) is fitted with Adam for ``generator_steps`` batches on
``CE(sum_k a_k(y) head_k(G(z, y)), y) + diversity_weight * L_div(z, G(z, y))``, labels drawn
from the round's label counts.
Client state kept across rounds: the model (its head replaced by each download) and optimizer
state; the generator is the server's and is not kept.
Local objective: ``CE(f(x), y) + generated_weight * CE(head(G(z, y^)), y^)
+ latent_kl_weight * KL(softmax(head(G(z, y)) / T) || softmax(f(x) / T))``, ``y^`` drawn from
the global label counts, ``y`` the real batch's labels (the official code's ``user_latent_loss``:
the head's output on generated features of the same labels is the target), the generator in
training mode (batch statistics) as HtFLlib (the official client runs it in eval mode).
``latent_kl_weight`` is 0 by default (HtFLlib);
FedMD-CG's baselines use 1 with ``T = 10`` (its authors' FedGen, spec ``reference/fedmdcg.md``
section 8).
Deviations from paper/official code: the ensemble weights ``a_k(y)`` are the paper's per-class
shares ``n_k^y / sum_j n_j^y`` (``ensemble_weighting="label"``); HtFLlib uses sample shares
``n_k / n`` (``"samples"``). The weights enter the loss as in HtFLlib and the paper's Eq. 4 (one
cross-entropy of the weighted sum of the heads' logits); the official ``train_generator`` instead
sums each head's own cross-entropy weighted by ``a_k(y)``. Labels (the server's and the clients'
``y^``) are drawn from the label counts, the paper's ``y ~ p^(y)`` and HtFLlib's (each label
repeated by its count); the official code draws them uniformly over the labels present. The
diversity loss (paper Eq. 7, official ``DiversityLoss('l1')``,
weight 1) is on; HtFLlib has none (``diversity_weight=0``). As in HtFLlib, clients add by default
only the generated-feature CE with a constant weight 1 (the official code also adds the KL term,
``latent_kl_weight``, and decays both weights by 0.98 per round; the decay is not reproduced),
and heads are shared (HtFLlib; the official code averages whole models). Sharing only the heads
is the partial-sharing FedGen of FedMD-CG's paper ("FedGen shares clients' classifiers").
Clients train without the regulariser until the generator has been trained once (HtFLlib
already uses its untrained generator in round 0).

Stability: the generator's last layer is unbounded, and after its first fit (Adam 0.1, 100
steps) the generated features are large, so the generated-feature CE and its gradient on the
head are too (client losses of 80-3,700 in the round after). At SGD 0.05 with momentum 0.9 the
``digits_dir`` config diverged (seed 2, round 15) and ended at 30-51 % local accuracy at the
other seeds, and the ``mnist_mdcg`` config (plain SGD 0.05) diverged at seed 0, round 11; the
Digits and ``mnist_mdcg`` configs therefore clip client gradients at norm 5
(``trainer.gradient_clip_val``, as every ``mnist_vtc`` method), which neither paper nor HtFLlib
does (``docs/results/archive/stability_2026-11-26.md``, ``docs/results/fedmdcg_mnist.md``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
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
    ClientUpload,
    ServerContext,
    ServerPhase,
    TrainableServerPhase,
    hparams_for,
)
from fedhet.algorithms.shared.common import state_with_prefix
from fedhet.core.payloads import Payload, WeightsPayload, check_counts
from fedhet.core.state import clone_state, copy_state_into
from fedhet.errors import TrainingError
from fedhet.functional import distillation_kl_loss, diversity_loss, weighted_average
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

EnsembleWeighting = Literal["label", "samples"]
HEAD_PREFIX = "model.head."


class FeatureGenerator(nn.Module):
    """FedGen's conditional generator of features, as HtFLlib's ``Generative``.

    ``[z, onehot(y)] -> Linear(noise_dim + C, H) -> BatchNorm1d -> ReLU -> Linear(H, feature_dim)``.

    Args:
        noise_dim: size of the uniform noise ``z``.
        num_classes: number of classes (size of the one-hot label input).
        hidden_dim: hidden width ``H``.
        feature_dim: size of the generated features (the heads' input size).
    """

    def __init__(self, noise_dim: int, num_classes: int, hidden_dim: int, feature_dim: int) -> None:
        super().__init__()
        self.noise_dim = noise_dim
        self.num_classes = num_classes
        self.fc1 = nn.Sequential(nn.Linear(noise_dim + num_classes, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.ReLU())
        self.fc = nn.Linear(hidden_dim, feature_dim)

    def forward(self, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Features for ``labels`` and the noise they were drawn with (for the diversity loss)."""
        noise = torch.rand(labels.shape[0], self.noise_dim, device=labels.device)
        inputs = torch.cat([noise, F.one_hot(labels, self.num_classes).to(noise.dtype)], dim=1)
        return self.fc(self.fc1(inputs)), noise


@dataclass(frozen=True)
class HeadCountsPayload(WeightsPayload):
    """A client's head weights plus its per-class training counts ``[C]`` (int64)."""

    label_counts: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def validate_head(
        self, reference: Mapping[str, Tensor], num_classes: int, sender: str, held: Tensor | None = None
    ) -> None:
        """Validate the head against ``reference`` (keys, shapes, dtypes) and ``[C]`` int64 counts within ``held``."""
        self.validate_against(reference, sender)
        check_counts(sender, "label_counts", self.label_counts, num_classes, held, "label counts")


@dataclass(frozen=True)
class FedGenDownload(Payload):
    """The global head, the generator's parameters and the global per-class counts."""

    head: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    generator: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    label_counts: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.long))


@dataclass(frozen=True)
class FedGenHparams(LocalOptimizer):
    """FedGen's hyperparameters (defaults: FedKTL App. C and HtFLlib; the paper's where they differ)."""

    noise_dim: PositiveInt = knob(32, "generator noise size (FedKTL App. C: 32)")
    generator_hidden_dim: PositiveInt | None = knob(
        None, "generator hidden width (None: the feature dimension, FedKTL App. C)"
    )
    generator_lr: PositiveFloat = knob(
        0.1, "Adam learning rate of the generator (FedKTL App. C: 0.1)", log_uniform(1e-3, 1.0)
    )
    generator_steps: PositiveInt = knob(100, "generator steps per round (FedKTL App. C server epochs: 100)")
    generator_batch_size: PositiveInt = knob(10, "labels per generator step (HtFLlib: the client batch size, 10)")
    diversity_weight: NonNegativeFloat = knob(
        1.0, "weight of the generator's diversity loss (paper: 1; HtFLlib: 0)", log_uniform(1e-2, 10.0)
    )
    ensemble_weighting: EnsembleWeighting = knob(
        "label",
        "ensemble weights a_k(y): label (paper, per-class shares) or samples (HtFLlib)",
        categorical("label", "samples"),
    )
    generated_weight: NonNegativeFloat = knob(
        1.0, "weight of the clients' generated-feature cross-entropy (HtFLlib: 1)", log_uniform(1e-2, 10.0)
    )
    latent_kl_weight: NonNegativeFloat = knob(
        0.0, "weight of the clients' KL to head(G(z, y)) (official FedGen's user_latent_loss; HtFLlib: 0)"
    )
    latent_kl_temperature: PositiveFloat = knob(1.0, "its temperature (official FedGen: 1; FedMD-CG's code: 10)")


class FedGenClient(ClientModule):
    """Cross-entropy plus the CE of generator-sampled features through the client's own head.

    The generator is received every round and never kept (:attr:`received_modules`).

    Args:
        model: the backbone (its ``head`` is shared).
        num_classes: number of classes.
        generator: a generator of the server's architecture, refreshed by each download.
        hp: FedGen's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams = FedGenHparams
    received_modules = ("generator",)

    def __init__(
        self, model: nn.Module, num_classes: int, generator: FeatureGenerator, hp: Any = None, **overrides: Any
    ) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        self.generator = generator.requires_grad_(False)
        self.label_distribution: Tensor | None = None

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        latent_kl = self.hp.latent_kl_weight != 0.0 and self.label_distribution is not None and x.shape[0] > 1
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        if latent_kl:  # the batch's own labels through the generator; BatchNorm needs two samples
            self.generator.train()
            with torch.no_grad():
                same_labels, _ = self.generator(y)
                target = self.model.forward_head(same_labels)
            kl = distillation_kl_loss(logits, target, self.hp.latent_kl_temperature)
            loss = loss + self.hp.latent_kl_weight * kl
        if self.label_distribution is not None and self.hp.generated_weight != 0.0:
            size = max(2, x.shape[0])  # BatchNorm in training mode needs two samples
            labels = torch.multinomial(self.label_distribution.to(x.device), size, replacement=True)
            self.generator.train()
            with torch.no_grad():
                features, _ = self.generator(labels)
            loss = loss + self.hp.generated_weight * F.cross_entropy(self.model.forward_head(features), labels)
        return loss

    def on_receive(self, download: Payload | None) -> None:
        self.label_distribution = None
        if isinstance(download, FedGenDownload):
            copy_state_into(self.model.head, download.head)
            with torch.no_grad():
                for name, parameter in self.generator.named_parameters():
                    parameter.copy_(download.generator[name])
            self.label_distribution = download.label_counts.double()

    def make_upload(self, train_batches: Iterable[Batch]) -> HeadCountsPayload:
        counts = torch.zeros(self.num_classes, dtype=torch.long)
        for _, y in train_batches:
            counts += torch.bincount(y.cpu(), minlength=self.num_classes)
        return HeadCountsPayload(weights=clone_state(self.model.head.state_dict()), label_counts=counts)


class FedGenServer(TrainableServerPhase):
    """Averages heads, then fits the feature generator against the ensemble of uploaded heads.

    Reads ``noise_dim``, ``generator_hidden_dim``, ``generator_lr``, ``generator_steps``,
    ``generator_batch_size``, ``diversity_weight`` and ``ensemble_weighting``.

    Args:
        hp: FedGen's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams: ClassVar[type[Hyperparameters]] = FedGenHparams

    def __init__(self, hp: Any = None, **overrides: Any) -> None:
        super().__init__()
        self.hp: Any = hparams_for(type(self), hp, overrides)
        self.num_classes = 0
        self.held: Tensor | None = None  # [clients, classes] examples each client holds, when the context knows
        self.round_heads: list[dict[str, Tensor]] = []
        self.round_ensemble_weights: Tensor | None = None  # [K, C]
        self.round_counts: Tensor | None = None  # [C]
        self.steps_done = 0
        self.first_loss = float("nan")
        self.last_loss = float("nan")

    # ------------------------------------------------------------------ set-up and aggregation
    def setup_server(self, context: ServerContext) -> None:
        head = state_with_prefix(context.initial_client_state(0), HEAD_PREFIX)
        self.num_classes = context.num_classes
        self.held = context.label_counts
        if "weight" in head:  # the zoo's linear head
            feature_dim = int(head["weight"].shape[1])
            self.global_head: nn.Module = nn.Linear(feature_dim, self.num_classes)
        else:  # a multi-layer classifier head (lenet5): the clients' own architecture
            model_factory = context.require("model_factory", "FedGen", "to build a head that is not one nn.Linear")
            network = model_factory(context.architectures[0], context.seed)
            feature_dim = int(network.num_features)  # type: ignore[arg-type]
            self.global_head = copy.deepcopy(network.head)
        self.global_head.requires_grad_(False)
        copy_state_into(self.global_head, head)
        with seeded(derive_seed(context.seed, "fedgen", "generator")):
            self.generator = FeatureGenerator(
                self.hp.noise_dim, self.num_classes, self.hp.generator_hidden_dim or feature_dim, feature_dim
            )
        self.register_buffer(
            "client_label_counts", torch.zeros(context.num_clients, self.num_classes, dtype=torch.long)
        )
        self.register_buffer("rounds_trained", torch.zeros((), dtype=torch.long))

    def check_upload(self, upload: ClientUpload) -> None:
        """The global head's keys, shapes and dtypes, and ``[C]`` int64 label counts within what the client holds."""
        payload = upload.expect(HeadCountsPayload, "a head with label counts (HeadCountsPayload)")
        held = None if self.held is None else self.held[upload.client_id]
        payload.validate_head(self.global_head.state_dict(), self.num_classes, upload.sender, held)

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        if not uploads:
            return
        for upload in uploads:
            self.client_label_counts[upload.client_id] = upload.payload.label_counts.to(self.client_label_counts.device)
        heads = [clone_state(u.payload.weights) for u in uploads]  # type: ignore[attr-defined]
        examples = torch.tensor([float(u.payload.num_examples) for u in uploads], dtype=torch.float64)
        copy_state_into(self.global_head, weighted_average(heads, examples.tolist()))
        counts = torch.stack([u.payload.label_counts for u in uploads]).to(torch.float64)  # type: ignore[attr-defined]
        if self.hp.ensemble_weighting == "label":
            weights = counts / counts.sum(0, keepdim=True).clamp_min(1.0)
        else:
            weights = (examples / examples.sum()).unsqueeze(1).expand_as(counts)
        self.round_heads = heads
        self.round_ensemble_weights = weights.float()
        self.round_counts = counts.sum(0)
        self.steps_done = 0

    # ------------------------------------------------------------------ generator training
    def server_dataloader(self, seed: int) -> DataLoader:
        if self.round_counts is None:
            raise TrainingError("FedGen's server was fitted before any upload arrived")
        steps, batch_size = self.hp.generator_steps, self.hp.generator_batch_size
        labels = torch.multinomial(self.round_counts, steps * batch_size, replacement=True)
        return DataLoader(TensorDataset(labels), batch_size=batch_size, shuffle=False)

    def ensemble_logits(self, features: Tensor, labels: Tensor) -> Tensor:
        """``sum_k a_k(y) head_k(features)`` over this round's uploaded heads."""
        assert self.round_ensemble_weights is not None
        weights = self.round_ensemble_weights.to(features.device)[:, labels]  # [K, B]
        logits = torch.zeros(features.shape[0], self.num_classes, device=features.device)
        for k, head in enumerate(self.round_heads):
            head_logits = torch.func.functional_call(
                self.global_head, {n: t.to(features.device) for n, t in head.items()}, (features,)
            )
            logits = logits + weights[k].unsqueeze(1) * head_logits
        return logits

    def generator_loss(self, labels: Tensor) -> Tensor:
        """Ensemble cross-entropy of generated features plus the weighted diversity loss."""
        features, noise = self.generator(labels)
        loss = F.cross_entropy(self.ensemble_logits(features, labels), labels)
        if self.hp.diversity_weight != 0.0:
            loss = loss + self.hp.diversity_weight * diversity_loss(noise, features)
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.generator_loss(batch[0])
        if self.steps_done == 0:
            self.first_loss = float(loss.detach())
        self.last_loss = float(loss.detach())
        self.steps_done += 1
        return loss

    def on_fit_end(self) -> None:
        self.rounds_trained += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.generator.parameters(), lr=self.hp.generator_lr)  # Adam's defaults otherwise

    # ------------------------------------------------------------------ download
    def download_for(self, client_id: int) -> FedGenDownload | None:
        if int(self.rounds_trained) == 0:
            return None
        return FedGenDownload(
            head={k: v.detach().cpu() for k, v in self.global_head.state_dict().items()},
            generator={k: v.detach().cpu() for k, v in self.generator.named_parameters()},
            label_counts=self.client_label_counts.sum(0).cpu(),
        )

    def metrics(self) -> dict[str, float]:
        return {"generator_loss_first": self.first_loss, "generator_loss": self.last_loss}


class FedGen(Algorithm):
    """FedGen, heterogeneous form (HtFLlib): shared heads over one feature dimension."""

    Hparams = FedGenHparams
    client_type = FedGenClient
    capabilities = Capabilities(heterogeneous_models=True, common_feature_dim=True)
    upload_type = HeadCountsPayload
    download_type = FedGenDownload

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        feature_dim = int(model.num_features)  # type: ignore[arg-type]
        hidden = self.hp.generator_hidden_dim or feature_dim
        generator = FeatureGenerator(self.hp.noise_dim, num_classes, hidden, feature_dim)
        return FedGenClient(model, num_classes, generator, self.hp)

    def build_server(self) -> ServerPhase:
        return FedGenServer(self.hp)


__all__ = [
    "EnsembleWeighting",
    "FeatureGenerator",
    "FedGen",
    "FedGenClient",
    "FedGenDownload",
    "FedGenHparams",
    "FedGenServer",
    "HeadCountsPayload",
]
