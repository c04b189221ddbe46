"""FML: each client trains its private model together with a small shared "meme" model.

Paper: Shen et al., "Federated Mutual Learning", arXiv:2006.16765, 2020 (Eq. 3-4, Algorithm 1;
deep mutual learning from Zhang et al., CVPR 2018). Hyperparameters from FedKTL's baseline
table (App. C: alpha = beta = 0.5) and HtFLlib ``clientfml.py`` / ``serverfml.py`` (gradient
clipping at norm 10, the same optimizer and learning rate for both models).

Upload: the meme model's weights (``WeightsPayload``) and the number of training examples;
FedKTL Table 5 counts exactly the meme's parameters per client (18.50M for 20 x FedAvgCNN).
Download: the averaged meme model.
Server phase: closed-form FedAvg of the meme models (:func:`fedhet.functional.weighted_average`;
``meme_weighting="samples"`` weights by examples as FedAvg and the paper, ``"uniform"`` is HtFLlib's
plain mean).
Client state kept across rounds: the private model, the meme (overwritten by each download) and
the optimizer state.
Local objective: ``alpha * CE(private) + (1 - alpha) * KL(p_meme || p_private)`` for the private
model and ``beta * CE(meme) + (1 - beta) * KL(p_private || p_meme)`` for the meme
(:func:`fedhet.functional.mutual_learning_losses`); evaluation uses the private model.
Deviations from paper/official code: the meme is a registered model (``meme_model``; FedKTL
uses the smallest zoo member, FedAvgCNN; the CPU default is ``simple_cnn``), initialised from
a seed shared by all clients (``shared_init_seed``) and replaced by the server's copy from
round 0 on. Each peer's prediction is a constant in the other's loss, as in deep mutual
learning; HtFLlib back-propagates both losses through both models (no detach), so each model
also receives the gradient of its peer's KL term. The KL is the per-sample KL
(``kl_reduction="batchmean"``); HtFLlib's ``nn.KLDivLoss()`` divides it by the number of
classes as well (``"mean"``). HtFLlib averages parameters only; BatchNorm buffers of the meme,
if any, are averaged too. HtFLlib's per-round learning-rate decay is off by default there and
not provided.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor, nn

from fedhet.algorithms.base import (
    Algorithm,
    Batch,
    Capabilities,
    ClientModule,
    OptimizerName,
    ServerPhase,
)
from fedhet.algorithms.common import (
    SeparatelyClippedClient,
    SharedWeighting,
    SubmoduleAveragingServer,
    SubmoduleSharingClient,
    build_shared_model,
)
from fedhet.core.payloads import WeightsPayload
from fedhet.functional import mutual_learning_losses
from fedhet.functional.mutual_learning import KLReduction
from fedhet.hparams import Momentum, NonNegativeFloat, PositiveFloat, UnitInterval


class FMLClient(SubmoduleSharingClient, SeparatelyClippedClient):
    """The private model and the meme model, trained by deep mutual learning on each batch.

    Args:
        model: the private (possibly heterogeneous) backbone; evaluation uses it.
        num_classes: number of classes.
        meme: the shared meme model (one architecture for all clients).
        alpha: weight of the private model's cross-entropy (1 - alpha weighs its KL term).
        beta: weight of the meme model's cross-entropy (1 - beta weighs its KL term).
        kl_reduction: ``"batchmean"`` (per-sample KL) or ``"mean"`` (HtFLlib, also over classes).
        max_grad_norm: clip each model's gradient norm separately (HtFLlib: 10); ``None``: off.
        optimizer: local optimizer (one for both models).
        lr: local learning rate (both models).
        momentum: SGD momentum.
        weight_decay: L2 weight decay.
    """

    shared_module = "meme"

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        meme: nn.Module,
        alpha: float = 0.5,
        beta: float = 0.5,
        kl_reduction: KLReduction = "batchmean",
        max_grad_norm: float | None = 10.0,
        optimizer: OptimizerName = "sgd",
        lr: float = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(model, num_classes, optimizer, lr, momentum, weight_decay)
        self.meme = meme
        self.alpha = alpha
        self.beta = beta
        self.kl_reduction: KLReduction = kl_reduction
        self.max_grad_norm = max_grad_norm

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        private_loss, meme_loss = mutual_learning_losses(
            self.model(x), self.meme(x), y, self.alpha, self.beta, self.kl_reduction
        )
        return private_loss + meme_loss

    def clip_groups(self) -> Iterator[list[Tensor]]:
        """Parameter groups clipped separately (one per model, as HtFLlib)."""
        yield list(self.model.parameters())
        yield list(self.meme.parameters())


class SharedModelServer(SubmoduleAveragingServer):
    """FedAvg of one shared sub-module of the client modules, one average over every client (FML's meme).

    Args:
        prefix: where the shared model sits in a client module's state dict (``"meme."``).
        weighting: ``"samples"`` (example-weighted, FedAvg) or ``"uniform"`` (HtFLlib).
    """

    def __init__(self, prefix: str, weighting: SharedWeighting = "samples") -> None:
        super().__init__(prefix, weighting, per_architecture=False, send_initial=True)


class FML(Algorithm):
    """FML (heterogeneous private models, one shared meme architecture).

    Args:
        alpha: weight of the private model's cross-entropy (FedKTL App. C: 0.5).
        beta: weight of the meme model's cross-entropy (FedKTL App. C: 0.5).
        meme_model: registered model name of the shared meme (FedKTL: the smallest zoo model).
        shared_init_seed: seed of the meme initialisation, common to all clients.
        kl_reduction: ``"batchmean"`` (per-sample KL) or ``"mean"`` (HtFLlib's element mean).
        meme_weighting: ``"samples"`` (FedAvg) or ``"uniform"`` (HtFLlib) averaging of memes.
        max_grad_norm: per-model gradient clipping norm (HtFLlib: 10); ``None`` turns it off.
        optimizer: local optimizer, ``"sgd"``, ``"adam"`` or ``"adamw"``.
        lr: local learning rate of both models.
        momentum: SGD momentum.
        weight_decay: L2 weight decay.
    """

    capabilities = Capabilities(heterogeneous_models=True)
    upload_type = WeightsPayload
    download_type = WeightsPayload

    def __init__(
        self,
        alpha: UnitInterval = 0.5,
        beta: UnitInterval = 0.5,
        meme_model: str = "simple_cnn",
        shared_init_seed: int = 0,
        kl_reduction: KLReduction = "batchmean",
        meme_weighting: SharedWeighting = "samples",
        max_grad_norm: PositiveFloat | None = 10.0,
        optimizer: OptimizerName = "sgd",
        lr: PositiveFloat = 0.01,
        momentum: Momentum = 0.0,
        weight_decay: NonNegativeFloat = 0.0,
    ) -> None:
        super().__init__(optimizer, lr, momentum, weight_decay)
        self.alpha = alpha
        self.beta = beta
        self.meme_model = meme_model
        self.shared_init_seed = shared_init_seed
        self.kl_reduction: KLReduction = kl_reduction
        self.meme_weighting: SharedWeighting = meme_weighting
        self.max_grad_norm = max_grad_norm

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        meme = build_shared_model(
            self.meme_model, num_classes, self.image_channels(), self.shared_init_seed, "fml-meme"
        )
        return FMLClient(
            model,
            num_classes,
            meme,
            alpha=self.alpha,
            beta=self.beta,
            kl_reduction=self.kl_reduction,
            max_grad_norm=self.max_grad_norm,
            **self.optimizer_kwargs(),
        )

    def build_server(self) -> ServerPhase:
        return SharedModelServer("meme.", self.meme_weighting)
