"""FedKTL: prototypes up, generated (image, latent) pairs down, through a frozen pretrained generator.

Paper: Zhang, Liu, Hua, Cao, "An Upload-Efficient Scheme for Transferring Knowledge From a
Server-Side Pre-trained Generator to Clients in Heterogeneous Federated Learning", CVPR 2024
(Eq. 1-4, Fig. 3, App. C); official code ``TsingZ0/FedKTL``; spec ``reference/fedktl.md``.

Upload: the client's class prototypes in the K-dimensional ETF space for the classes it holds
(``ClassStatsPayload``: ``|C_i| * K`` floats plus one int64 count per class held).
Download: one generated image per class at the client's resolution, channels and normalisation,
and its latent ``Q-bar^c`` (``GeneratedPairsPayload``: ``C * (ch*h*w + H)`` floats).
Server phase: trainable (:class:`FedKTLServer`). The feature transformer
``F = Linear(K,K)-BN-ReLU-Linear(K,H)`` maps prototypes into the generator's latent space W and
is trained for ``server_epochs`` passes of Adam per round on
``MMD^2(F(P_b), G_m(z)) + centroid_weight * MSE(F(P_b), Cent[y_b])``. The centroid table is reset
to the exact class means of ``F(P)`` before and after training. The final centroids go through
the synthesis network, one image per class.
Client state kept across rounds: backbone ``f_i`` and projection ``h_i`` (the model's ``head``
position, ``Linear(K', K)``) with their optimizer state. The fixed ETF ``V`` is rebuilt from the
shared seed (never trained, not stored). The regression layer ``h'_i = Linear(K', H)`` is
re-initialised from one shared seed at the start of every local fit and never persisted, so it
is identical for all clients and rounds.
Local objective: ``ArcFace(s * cos(theta_y + m))`` against the ETF, plus, once the server has sent
pairs (round 1 on), ``mu * MSE(h'_i(f_i(I_b)), Q_b)`` on a stream of shuffled passes over the
pairs (``B`` pairs per step, ``f_i`` in train mode). Prediction is ``argmax`` of the cosines to
the ETF, without margin.

Deviations from paper/official code, and choices between them:

* Prototypes (``prototype_mode``): ``"unit"`` (default, code) normalises every embedding, averages,
  and re-normalises; ``"mean"`` is the paper's plain mean. The ETF geometry is scale-free, so unit
  prototypes keep architectures with different feature scales comparable.
* Centroids (``centroid_mode``): ``"learned_table"`` (default, code) is an ``nn.Embedding(C, H)``
  co-trained with Adam and reset to exact means before and after training. ``"exact_mean"`` (paper
  Eq. 2) uses the class means of ``F`` over all this round's prototypes as targets at every step.
  In that mode each step forwards all ``M`` prototypes once, so ``F``'s BatchNorm sees all of them
  (the two modes are identical when ``M <= server_batch_size``, the CPU case).
* ``cos(theta + m)`` is computed as ``cos cos m - sin sin m``, the same value as the code's
  ``cos(acos(c) + m)`` without its infinite gradient at ``c = +-1``. No easy-margin fallback (code).
* Classes nobody has uploaded yet get no pair (the code sends the random-initialised centroid).
  A class seen in an earlier round keeps its last centroid. Pairs carry no labels (clients only
  regress latents), so the download is ``n_seen * (ch*h*w + H)`` floats, ``C * (...)`` once every
  class has been seen.
* Server batches of size 1 are dropped (BatchNorm; HtFLlib's fix, spec section 8 #19).
  ``server_epochs`` is an internal pass count. The loop fits the server with the client Trainer
  template, so the server stops itself after one Lightning epoch whatever ``max_epochs`` is.
* The ETF and ``h'_i``'s initialisation come from ``shared_seed`` (the paper's "identical
  initialisation without extra communication"). They stand for the one-time ``K*C`` and
  ``K'*H + H`` floats, which the ledger does not count.
* ``h'_i`` shares the client's optimizer as its own parameter group. Its optimizer state is
  cleared at every fit start, which is equivalent to the code's separate SGD optimizer with the
  same learning rate re-created each round.
* Gradients of the model and of ``h'_i`` (server: ``F`` and the table) are clipped to
  ``grad_clip_norm`` = 100 separately, as in the code.
* ``use_etf=False`` (Table 7 "-ETF"): the model keeps its original trainable classifier with
  cross-entropy, prototypes are the features ``f_i(x)`` (``K'`` = ``feature_dim``) and ``F`` maps
  ``K' -> H`` (spec section 8 #15). ``use_latent_task=False`` or ``mu=0`` is "-L^M", and
  ``centroid_weight=0`` is "-L^MSE".
* Generator: the class default is ``"untrained"``, so ``FedKTL()`` runs anywhere (registry,
  contract tests). The experiment configs select ``"embedded-stylegan"``, the locally
  pretrained substitute for StyleGAN-XL (``docs/generators.md``; built on first use), and
  ``"embedded-stylegan-pool"`` is the same generator pretrained on a broader augmented pool.
  The MMD bandwidths default to the code's ``{10, 15, 20, 50}``, which were tuned for StyleGAN
  W vectors.
* Heterogeneous backbones emit one feature dimension ``K'`` through ``feature_dim`` (the code
  pools every backbone to 512), so ``h'_i`` is literally identical on every client.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
from fedhet.core.payloads import ClassStatsPayload, Payload, check_shape
from fedhet.errors import ConfigError, TrainingError
from fedhet.functional import (
    arcface_logits,
    class_means,
    etf_cosines,
    mean_pairwise_rms,
    mean_rms_change,
    rbf_mmd2,
    simplex_etf,
    unit_class_prototypes,
)
from fedhet.hparams import (
    Hyperparameters,
    LocalOptimizer,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    knob,
    log_uniform,
)
from fedhet.seeding import derive_seed, seeded

if TYPE_CHECKING:
    from fedhet.generators import GeneratorAdapter

log = logging.getLogger("fedhet")

PrototypeMode = Literal["unit", "mean"]
CentroidMode = Literal["learned_table", "exact_mean"]

GENERATOR_PREFIX = "generator."
SYNTHESIS_CHUNK = 32  # images synthesised per generator call (memory only; the code uses 4)
#: images of random latents whose mean pairwise distance is the unit of the class-image diagnostics
SPREAD_SAMPLES = 64


@dataclass(frozen=True)
class GeneratedPairsPayload(Payload):
    """FedKTL's download: generated images at client resolution and the latents they came from.

    ``images[j]`` is ``G_s(latents[j])`` after post-processing to the client's image size,
    channels and normalisation; row ``j`` is one class's centroid, but clients only regress the
    latent from the image, so no labels travel. :meth:`nbytes` is therefore exactly
    ``n * (ch*h*w + H) * 4`` for float32.
    """

    images: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, 0, 0, 0))
    latents: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, 0))

    def validate_pairs(self, latent_dim: int, sender: str = "server") -> None:
        """Validate values, then ``images`` ``[n, ch, h, w]`` and ``latents`` ``[n, latent_dim]``."""
        self.validate(sender)
        if self.images.dim() != 4 or self.images.shape[0] < 1:
            raise TrainingError(
                f"{sender} sent generated images of shape {tuple(self.images.shape)}, expected [n>0, ch, h, w]"
            )
        check_shape(sender, "latents", self.latents, (self.images.shape[0], latent_dim))


def shared_linear_init(in_features: int, out_features: int, seed: int) -> tuple[Tensor, Tensor]:
    """``nn.Linear``'s default initialisation drawn from a private generator seeded with ``seed``.

    PyTorch's default (Kaiming-uniform with ``a = sqrt(5)``, and the bias rule) is
    ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` for both weight and bias. Drawing it from its own
    generator makes every client's ``h'_i`` identical without touching the global RNG.
    """
    generator = torch.Generator().manual_seed(seed)
    bound = 1.0 / in_features**0.5
    weight = torch.empty(out_features, in_features).uniform_(-bound, bound, generator=generator)
    bias = torch.empty(out_features).uniform_(-bound, bound, generator=generator)
    return weight, bias


def to_client_images(
    generated: Tensor, image_size: int, channels: int, mean: Sequence[float], std: Sequence[float]
) -> Tensor:
    """Post-process generator outputs in ``[-1, 1]`` into what a client's loader would produce.

    Map to ``[0, 1]`` and clamp, resize (bilinear, antialiased) to ``image_size``, convert RGB to
    grey or grey to RGB when the channels differ, and normalise with the scenario's
    ``mean``/``std``. This is the official "clientprocess" with fedhet's normalisation in place of
    PFLlib's 0.5/0.5.
    """
    images = ((generated.float() + 1.0) / 2.0).clamp(0.0, 1.0)
    if images.shape[-1] != image_size or images.shape[-2] != image_size:
        size = (image_size, image_size)
        images = F.interpolate(images, size=size, mode="bilinear", align_corners=False, antialias=True)
    if images.shape[1] != channels:
        if channels == 1:
            images = images.mean(dim=1, keepdim=True)
        elif images.shape[1] == 1:
            images = images.expand(-1, channels, -1, -1)
        else:
            raise TrainingError(f"cannot convert {images.shape[1]}-channel generated images to {channels} channels")
    mean_t = torch.tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return ((images - mean_t) / std_t).contiguous()


def _load_generator(name: str) -> GeneratorAdapter:
    """Load the frozen generator by name (imported lazily: only FedKTL needs the generators package)."""
    from fedhet.generators import load_generator

    return load_generator(name)


@dataclass(frozen=True)
class FedKTLHparams(LocalOptimizer):
    """FedKTL's hyperparameters (the paper's defaults; the official code's where the paper gives none)."""

    mu: NonNegativeFloat = knob(
        50.0, "weight of the latent regression task L^M on the downloaded pairs (paper: 50)", log_uniform(0.1, 500.0)
    )
    centroid_weight: NonNegativeFloat = knob(
        1.0, "lambda, weight of the server's MSE to the class centroids (paper: 1)", log_uniform(0.01, 100.0)
    )
    scale: PositiveFloat = knob(64.0, "ArcFace scale s (paper: 64)")
    margin: NonNegativeFloat = knob(0.5, "ArcFace additive angular margin m in radians (paper: 0.5)")
    etf_dim: PositiveInt | None = knob(None, "K, size of the ETF space (None: the number of classes, the paper)")
    generator: str = knob(
        "untrained",
        "frozen generator: untrained (no artifact; not the paper), embedded-stylegan (configs), "
        "embedded-stylegan-pool, stylegan-pkl:<path> or stable-diffusion:<dir>",
    )
    server_lr: PositiveFloat = knob(
        0.01, "Adam learning rate eta_S of the feature transformer (paper: 0.01)", log_uniform(1e-4, 0.1)
    )
    server_epochs: PositiveInt = knob(100, "passes E_S over the prototypes per round (paper: 100)")
    server_batch_size: PositiveInt = knob(100, "B_S, prototypes per server step (paper: 100; >= 2 for BatchNorm)")
    mmd_bandwidths: tuple[PositiveFloat, ...] = knob(
        (10.0, 15.0, 20.0, 50.0), "the a_k of the RBF-sum MMD kernel (code: 10, 15, 20, 50)"
    )
    centroid_mode: CentroidMode = knob("learned_table", "learned_table (code) or exact_mean (paper Eq. 2)")
    prototype_mode: PrototypeMode = knob("unit", "unit (code: normalised prototypes) or mean (paper)")
    use_latent_task: bool = knob(True, "train on the downloaded pairs (False: the -L^M ablation)")
    use_etf: bool = knob(True, "fixed ETF with ArcFace (False: the -ETF ablation, original classifier)")
    grad_clip_norm: PositiveFloat | None = knob(
        100.0, "gradient norm clip of client model, h'_i, F and centroids, each separately (code: 100)"
    )
    shared_seed: int = knob(0, "public seed of the ETF and of h'_i's initialisation, shared by all parties")

    def check(self) -> None:
        if self.server_batch_size < 2:
            raise ConfigError(f"server_batch_size={self.server_batch_size} must be >= 2 (BatchNorm in F)")


# ---------------------------------------------------------------------------------------------
# Client
# ---------------------------------------------------------------------------------------------


class FedKTLClient(ClientModule):
    """ArcFace against a fixed ETF, plus regressing the server's latents from its generated images.

    Reads ``scale``, ``margin``, ``mu``, ``use_latent_task`` (build ``h'_i`` and train on the
    downloaded pairs), ``prototype_mode`` and ``grad_clip_norm`` (model and ``h'_i`` clipped
    separately) of :class:`FedKTLHparams`.

    Args:
        model: the backbone; its ``head`` is replaced by the projection ``h_i = Linear(K', K)``
            when ``etf`` is given.
        num_classes: ``C``.
        etf: the fixed ``[K, C]`` simplex ETF, or ``None`` for the "-ETF" ablation (original
            trainable classifier and cross-entropy; prototypes in feature space).
        latent_dim: ``H``, the generator's latent size (output of ``h'_i``).
        latent_head_seed: seed of ``h'_i``'s initialisation, shared by every client.
        hp: FedKTL's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams = FedKTLHparams
    #: ``h'_i`` is re-initialised from a shared seed every round (the code), never kept.
    received_modules = ("latent_head",)

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        etf: Tensor | None,
        latent_dim: int,
        latent_head_seed: int,
        hp: Any = None,
        **overrides: Any,
    ) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        num_features = int(model.num_features)
        self.use_etf = etf is not None
        if etf is not None:
            if etf.shape[1] != num_classes:
                raise ValueError(f"ETF of shape {tuple(etf.shape)} for {num_classes} classes")
            self.model.head = nn.Linear(num_features, etf.shape[0])  # h_i in the classifier's position
            # A constant rebuilt from the shared seed: identical everywhere, never trained or stored.
            self.register_buffer("etf", etf.detach().clone().float(), persistent=False)
        self.latent_head_seed = latent_head_seed
        self.latent_head = nn.Linear(num_features, latent_dim) if self.hp.use_latent_task else None
        self.reset_latent_head()
        self.pair_images: Tensor | None = None
        self.pair_latents: Tensor | None = None
        self._pair_order: Tensor | None = None
        self._pair_cursor = 0

    # ------------------------------------------------------------------ h'_i
    def reset_latent_head(self) -> None:
        """Put ``h'_i`` back to the shared initialisation (every fit: it is never persisted)."""
        if self.latent_head is None:
            return
        head = self.latent_head
        weight, bias = shared_linear_init(head.in_features, head.out_features, self.latent_head_seed)
        with torch.no_grad():
            self.latent_head.weight.copy_(weight)
            self.latent_head.bias.copy_(bias)

    def on_train_start(self) -> None:
        self.reset_latent_head()
        if self.latent_head is not None:
            # A fresh h'_i gets fresh optimizer state (the carrier restored last round's).
            for optimizer in self.trainer.optimizers:
                for parameter in self.latent_head.parameters():
                    optimizer.state.pop(parameter, None)
        if self.pair_images is not None and self.pair_latents is not None:
            self.pair_images = self.pair_images.to(self.device)
            self.pair_latents = self.pair_latents.to(self.device)
        self._pair_order, self._pair_cursor = None, 0

    # ------------------------------------------------------------------ objective
    def embed(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(f_i(x), h_i(f_i(x)))``: features and their projection (or logits without the ETF)."""
        features = self.model.forward_features(x)
        return features, self.model.forward_head(features)

    def forward(self, x: Tensor) -> Tensor:
        """Cosines to the ETF columns (argmax = prediction); logits without the ETF."""
        projected = self.model(x)
        return etf_cosines(projected.float(), self.etf) if self.use_etf else projected

    def classification_loss(self, projected: Tensor, y: Tensor) -> Tensor:
        """``L_A``: ArcFace against the ETF (cross-entropy on the logits without it)."""
        if not self.use_etf:
            return F.cross_entropy(projected, y)
        logits = arcface_logits(etf_cosines(projected.float(), self.etf), y, self.hp.scale, self.hp.margin)
        return F.cross_entropy(logits, y)

    def next_pairs(self, batch_size: int) -> tuple[Tensor, Tensor]:
        """The next ``min(batch_size, n)`` downloaded pairs from a stream of shuffled passes.

        Always a full batch (a short tail of one pass is topped up from the next pass), so
        BatchNorm in ``f_i`` never sees a single generated image.
        """
        assert self.pair_images is not None and self.pair_latents is not None
        total = self.pair_latents.shape[0]
        wanted = min(batch_size, total)
        picked: list[Tensor] = []
        while wanted > 0:
            if self._pair_order is None or self._pair_cursor >= total:
                self._pair_order, self._pair_cursor = torch.randperm(total), 0
            take = self._pair_order[self._pair_cursor : self._pair_cursor + wanted]
            self._pair_cursor += len(take)
            wanted -= len(take)
            picked.append(take)
        index = torch.cat(picked).to(self.pair_latents.device)
        return self.pair_images[index], self.pair_latents[index]

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        _, projected = self.embed(x)
        loss = self.classification_loss(projected, y)
        if self.latent_head is not None and self.pair_latents is not None and self.hp.mu != 0.0:
            images, latents = self.next_pairs(x.shape[0])
            predicted = self.latent_head(self.model.forward_features(images))
            loss = loss + self.hp.mu * F.mse_loss(predicted, latents)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.hp.grad_clip_norm is None:
            return
        nn.utils.clip_grad_norm_(self.model.parameters(), self.hp.grad_clip_norm)
        if self.latent_head is not None:
            nn.utils.clip_grad_norm_(self.latent_head.parameters(), self.hp.grad_clip_norm)

    # ------------------------------------------------------------------ federation hooks
    def on_receive(self, download: Payload | None) -> None:
        if not isinstance(download, GeneratedPairsPayload):
            self.pair_images = self.pair_latents = None
            return
        if self.latent_head is not None:
            download.validate_pairs(self.latent_head.out_features)
        self.pair_images, self.pair_latents = download.images, download.latents

    def make_upload(self, train_batches: Iterable[Batch]) -> ClassStatsPayload:
        vectors, labels = [], []
        for x, y in train_batches:
            features, projected = self.embed(x)
            vectors.append((projected if self.use_etf else features).float())
            labels.append(y)
        if not vectors:
            raise TrainingError("a FedKTL client without training data cannot upload prototypes")
        embeddings, targets = torch.cat(vectors), torch.cat(labels)
        if self.hp.prototype_mode == "unit":
            prototypes, counts = unit_class_prototypes(embeddings, targets, self.num_classes)
        else:
            prototypes, counts = class_means(embeddings, targets, self.num_classes)
        return ClassStatsPayload(values=prototypes.cpu(), counts=counts.cpu())


# ---------------------------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------------------------


class FedKTLServer(TrainableServerPhase):
    """Domain alignment of prototypes to the generator's W, then one generated pair per class.

    Reads ``centroid_weight`` (``lambda``), ``server_lr`` (Adam's ``eta_S``), ``server_epochs``
    (``E_S``), ``server_batch_size`` (``B_S``), ``mmd_bandwidths``, ``centroid_mode``,
    ``grad_clip_norm`` (``F`` and the centroid table clipped separately) and, for the prototypes'
    size, ``use_etf`` and ``etf_dim`` of :class:`FedKTLHparams`: ``K = etf_dim`` (``None``: the
    number of classes) with the ETF, the clients' feature size without it (the "-ETF" ablation,
    read from the clients' initial state).

    Args:
        generator: the frozen generator (``sample_w`` and ``synthesize``).
        hp: FedKTL's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams: ClassVar[type[Hyperparameters]] = FedKTLHparams

    def __init__(self, generator: GeneratorAdapter, hp: Any = None, **overrides: Any) -> None:
        super().__init__()
        self.hp: Any = hparams_for(type(self), hp, overrides)
        self.generator = generator
        #: ``K``, known at set-up (the number of classes, or the feature size in the -ETF ablation)
        self.prototype_dim: int | None = self.hp.etf_dim if self.hp.use_etf else None
        self.in_feature_space = not self.hp.use_etf
        self.mmd_bandwidths = tuple(float(a) for a in self.hp.mmd_bandwidths)
        self.num_classes = 0
        self.held: Tensor | None = None  # [clients, classes] examples each client holds, when the context knows
        self.transformer: nn.Sequential | None = None
        self.centroids: nn.Embedding | None = None
        self.prototypes = torch.zeros(0, 0)
        self.prototype_labels = torch.zeros(0, dtype=torch.long)
        self.pair_images: Tensor | None = None
        self.pair_latents: Tensor | None = None
        self.image_spec: tuple[int, int, tuple[float, ...], tuple[float, ...]] | None = None
        #: the unit of the class-image diagnostics: the mean distance between images of random latents
        self.image_spread: float | None = None
        self.image_change: float | None = None  # the class images' change this round, in that unit
        self._finished = True
        self._sums: dict[str, float] = {}
        self._steps = 0

    # ------------------------------------------------------------------ setup and state
    def setup_server(self, context: ServerContext) -> None:
        super().setup_server(context)
        self.num_classes = context.num_classes
        self.held = context.label_counts
        dim = self.prototype_dim or context.num_classes
        if self.in_feature_space:
            head = context.initial_client_state(0)["model.head.weight"]
            dim = int(head.shape[1])
        self.prototype_dim = dim
        latent_dim = self.generator.latent_dim
        with seeded(derive_seed(context.seed, "fedktl-server-init")):
            self.transformer = nn.Sequential(
                nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.ReLU(), nn.Linear(dim, latent_dim)
            )
            self.centroids = nn.Embedding(context.num_classes, latent_dim)
        self.register_buffer("seen", torch.zeros(context.num_classes, dtype=torch.bool))
        self.prototypes = torch.zeros(0, dim)

    def server_state(self) -> dict[str, Any]:
        """``F``, the centroid table and the classes seen, plus the current pairs; not the frozen generator."""
        state = {k: v for k, v in self.state_dict().items() if not k.startswith(GENERATOR_PREFIX)}
        if self.pair_images is not None and self.pair_latents is not None:
            state["pair_images"], state["pair_latents"] = self.pair_images, self.pair_latents
        return state

    def load_server_state(self, state: Mapping[str, Any]) -> None:
        state = dict(state)
        images, latents = state.pop("pair_images", None), state.pop("pair_latents", None)
        state.update({GENERATOR_PREFIX + k: v for k, v in self.generator.state_dict().items()})
        self.load_state_dict(state)
        self.pair_images, self.pair_latents = images, latents

    # ------------------------------------------------------------------ round set-up (step 5a)
    def check_upload(self, upload: ClientUpload) -> None:
        """``[C, K]`` float32 prototypes (``K`` known at set-up) and int64 counts within what the client holds."""
        payload = upload.expect(ClassStatsPayload, "ClassStatsPayload prototypes")
        held = None if self.held is None else self.held[upload.client_id]
        payload.validate_shape(self.num_classes, self.prototype_dim, upload.sender, dtype=torch.float32, held=held)

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        assert self.transformer is not None and self.centroids is not None, "setup_server() was not called"
        prototypes, labels = [torch.zeros(0, self.prototype_dim or 0)], [torch.zeros(0, dtype=torch.long)]
        for upload in uploads:
            payload = upload.payload
            assert isinstance(payload, ClassStatsPayload)  # check_upload passed it
            held = payload.counts > 0
            prototypes.append(payload.values[held].float())
            labels.append(held.nonzero().squeeze(1))
        self.prototypes, self.prototype_labels = torch.cat(prototypes), torch.cat(labels)
        self.set_centroids_to_class_means()
        self._finished = False
        self._sums, self._steps = {}, 0

    @torch.no_grad()
    def set_centroids_to_class_means(self) -> Tensor:
        """``Cent[c] = mean F(P)`` over this round's prototypes of ``c`` (eval mode); returns the classes present."""
        assert self.transformer is not None and self.centroids is not None
        device = self.centroids.weight.device
        present = torch.zeros(self.num_classes, dtype=torch.bool, device=device)
        if len(self.prototypes) == 0:
            return present
        was_training = self.transformer.training
        self.transformer.eval()
        mapped = self.transformer(self.prototypes.to(device))
        self.transformer.train(was_training)
        means, counts = class_means(mapped, self.prototype_labels.to(device), self.num_classes)
        present = counts > 0
        self.centroids.weight[present] = means[present]
        return present

    def server_dataloader(self, seed: int) -> Iterable[Any]:
        """``E_S`` shuffled passes of minibatch index sets over this round's prototypes (size-1 batches dropped).

        Also records the scenario's image size, channels and normalisation for the generated images.
        """
        data_format = self.context.data_format
        if data_format is None:
            raise TrainingError("FedKTL's server needs the scenario's image format in its context")
        self.image_spec = (data_format.image_size, data_format.channels, data_format.mean, data_format.std)
        order_rng = torch.Generator().manual_seed(seed)
        batches = []
        for _ in range(self.hp.server_epochs):
            for chunk in torch.randperm(len(self.prototypes), generator=order_rng).split(self.hp.server_batch_size):
                if len(chunk) > 1:
                    batches.append(chunk)
        return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)

    # ------------------------------------------------------------------ training (step 5b)
    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.transformer is not None and self.centroids is not None
        params = list(self.transformer.parameters())
        if self.hp.centroid_mode == "learned_table":
            params += list(self.centroids.parameters())
        # Re-created by every fit, so Adam's moments restart every round as in the code.
        return torch.optim.Adam(params, lr=self.hp.server_lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def server_losses(self, index: Tensor) -> dict[str, Tensor]:
        """MMD to fresh generator latents and MSE to the centroids for the prototypes ``index``."""
        assert self.transformer is not None and self.centroids is not None
        prototypes = self.prototypes.to(self.device)
        labels = self.prototype_labels.to(self.device)
        index = index.to(self.device)
        if self.hp.centroid_mode == "exact_mean":
            mapped_all = self.transformer(prototypes)
            targets, _ = class_means(mapped_all, labels, self.num_classes)
            mapped, target = mapped_all[index], targets[labels[index]]
        else:
            mapped, target = self.transformer(prototypes[index]), self.centroids(labels[index])
        with torch.no_grad():
            latents = self.generator.sample_w(len(index)).to(mapped.device, mapped.dtype)
        mmd = rbf_mmd2(mapped, latents, self.mmd_bandwidths)
        mse = F.mse_loss(mapped, target)
        return {"loss": mmd + self.hp.centroid_weight * mse, "mmd": mmd, "mse": mse}

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        losses = self.server_losses(batch)
        for key, value in losses.items():
            self._sums[key] = self._sums.get(key, 0.0) + float(value.detach())
        self._steps += 1
        return losses["loss"]

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.transformer is not None and self.centroids is not None
        if self.hp.grad_clip_norm is not None:
            nn.utils.clip_grad_norm_(self.transformer.parameters(), self.hp.grad_clip_norm)
            nn.utils.clip_grad_norm_(self.centroids.parameters(), self.hp.grad_clip_norm)

    # ------------------------------------------------------------------ steps 5c and 6
    def on_train_end(self) -> None:
        self.finish_round()

    def on_fit_end(self) -> None:
        self.finish_round()  # when Lightning skipped training (fewer than two prototypes)

    @torch.no_grad()
    def finish_round(self) -> None:
        """Final centroids = exact class means of ``F(P)``; one generated image per class seen."""
        if self._finished:
            return
        assert self.centroids is not None
        if self.image_spec is None:
            raise TrainingError("FedKTL's server was fitted without server_dataloader(); the image format is unknown")
        previous_images, previous_seen = self.pair_images, self.seen.clone()
        self.seen |= self.set_centroids_to_class_means().to(self.seen.device)
        latents = self.centroids.weight[self.seen.to(self.centroids.weight.device)].detach()
        # the generator is a child module, so it sits on the centroids' device
        generated = [self.generator.synthesize(chunk) for chunk in latents.split(SYNTHESIS_CHUNK)]
        self.image_change = None
        if generated:
            self.pair_images = to_client_images(torch.cat(generated), *self.image_spec).cpu()
            self.pair_latents = latents.float().cpu().clone()
            self.image_change = self.class_image_change(previous_images, previous_seen)
        self._finished = True

    def class_image_change(self, previous: Tensor | None, previous_seen: Tensor) -> float | None:
        """Mean RMS change of the classes' images since the last round (classes in both), in spread units."""
        assert self.pair_images is not None
        both = (previous_seen & self.seen).cpu()
        if previous is None or not both.any():
            return None
        before = previous[both[previous_seen.cpu()]]
        after = self.pair_images[both[self.seen.cpu()]]
        return float(mean_rms_change(before, after)) / self.generator_spread()

    @torch.no_grad()
    def generator_spread(self) -> float:
        """Mean pairwise distance of the client-format images of :data:`SPREAD_SAMPLES` random latents.

        The latents come from a fixed private RNG, so the unit is the same in every round, run and
        seed, and drawing it leaves the run's RNG untouched (same seed, same numbers).
        """
        if self.image_spread is None:
            assert self.image_spec is not None
            latents = self.generator.sample_w(SPREAD_SAMPLES, torch.Generator().manual_seed(0))
            images = torch.cat([self.generator.synthesize(chunk) for chunk in latents.split(SYNTHESIS_CHUNK)])
            self.image_spread = float(mean_pairwise_rms(to_client_images(images, *self.image_spec)))
        return self.image_spread

    # ------------------------------------------------------------------ download and metrics
    def download_for(self, client_id: int) -> GeneratedPairsPayload | None:
        if self.pair_images is None or self.pair_latents is None:
            return None
        return GeneratedPairsPayload(images=self.pair_images, latents=self.pair_latents)

    def metrics(self) -> dict[str, float]:
        """Mean server losses of the round, the spread of the centroids sent, and the class images' diagnostics.

        The paper's Fig. 5 claims the class images start alike, become class-discriminative and then
        settle. ``image_separation`` is the mean RMS distance between two classes' images and
        ``image_change`` each class image's RMS change since the last round, both as a share of
        :meth:`generator_spread` (0: identical images; about 1: as different as random samples).
        """
        out = {k: v / self._steps for k, v in self._sums.items()} if self._steps else {}
        out["prototypes"] = float(len(self.prototypes))
        if self.pair_latents is not None and len(self.pair_latents) > 1:
            out["centroid_spread"] = float(torch.pdist(self.pair_latents).mean())
        if self.pair_images is not None and len(self.pair_images) > 1 and self.image_spec is not None:
            out["image_separation"] = float(mean_pairwise_rms(self.pair_images)) / self.generator_spread()
        if self.image_change is not None:
            out["image_change"] = self.image_change
        return out

    def images(self) -> dict[str, Tensor]:
        """The class images of the round's download, one per class seen (drawn into the run directory)."""
        return {} if self.pair_images is None else {"class_images": self.pair_images}


# ---------------------------------------------------------------------------------------------
# Algorithm
# ---------------------------------------------------------------------------------------------


class FedKTL(Algorithm):
    """FedKTL (heterogeneous models; one feature dimension ``K'`` through ``feature_dim``)."""

    Hparams = FedKTLHparams
    client_type = FedKTLClient
    capabilities = Capabilities(heterogeneous_models=True, common_feature_dim=True)
    upload_type = ClassStatsPayload
    download_type = GeneratedPairsPayload
    _generator: GeneratorAdapter | None = None

    def frozen_generator(self) -> GeneratorAdapter:
        """The generator, loaded once per run and shared by the server and the clients' ``H``."""
        if self._generator is None:
            self._generator = _load_generator(self.hp.generator)
        return self._generator

    def etf(self, num_classes: int) -> Tensor:
        """The shared simplex ETF ``[K, C]``, from ``shared_seed`` (identical on every party)."""
        dim = self.hp.etf_dim or num_classes
        seed = derive_seed(self.hp.shared_seed, "fedktl-etf", num_classes, dim)
        return simplex_etf(num_classes, dim, torch.Generator().manual_seed(seed))

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        return FedKTLClient(
            model,
            num_classes,
            etf=self.etf(num_classes) if self.hp.use_etf else None,
            latent_dim=self.frozen_generator().latent_dim,
            latent_head_seed=derive_seed(self.hp.shared_seed, "fedktl-latent-head"),
            hp=self.hp,
        )

    def build_server(self) -> ServerPhase:
        if self.hp.generator == "untrained":
            log.warning("FedKTL uses the untrained generator: fine for tests, but it does not reproduce the paper")
        return FedKTLServer(self.frozen_generator(), self.hp)


__all__ = [
    "FedKTL",
    "FedKTLClient",
    "FedKTLHparams",
    "FedKTLServer",
    "GeneratedPairsPayload",
    "shared_linear_init",
    "to_client_images",
]
