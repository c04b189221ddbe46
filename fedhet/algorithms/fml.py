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

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from fedhet.algorithms.base import (
    Algorithm,
    Batch,
    Capabilities,
    ClientModule,
    ClientUpload,
    OptimizerName,
    ServerContext,
    ServerPhase,
)
from fedhet.algorithms.fedavg import FedAvgServer
from fedhet.federation.payloads import Payload, WeightsPayload
from fedhet.federation.state import copy_state_into
from fedhet.federation.trainer import clone_state
from fedhet.functional import mutual_learning_losses, weighted_average
from fedhet.functional.mutual_learning import KLReduction
from fedhet.hparams import Momentum, NonNegativeFloat, PositiveFloat, PositiveInt, UnitInterval
from fedhet.seeding import derive_seed

SharedWeighting = Literal["samples", "uniform"]


def build_shared_model(name: str, num_classes: int, in_channels: int, seed: int, purpose: str) -> nn.Module:
    """A registered model initialised identically on every client (the seed is not per client).

    Shared auxiliary models (FML's meme, FedKD's student) are averaged across clients, so they
    must start from one initialisation; :func:`fedhet.models.create_model` draws it under its own
    seed without touching the global RNG.
    """
    from fedhet.models import create_model

    return create_model(name, num_classes=num_classes, in_channels=in_channels, seed=derive_seed(seed, purpose, name))


def state_with_prefix(module_state: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The entries of a client module's state dict under ``prefix`` (``"meme."``), prefix removed."""
    return {k[len(prefix) :]: v for k, v in module_state.items() if k.startswith(prefix)}


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


class FMLClient(SeparatelyClippedClient):
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

    def on_receive(self, download: Payload | None) -> None:
        if isinstance(download, WeightsPayload):
            copy_state_into(self.meme, download.weights)

    def make_upload(self, train_batches: Iterable[Batch]) -> WeightsPayload:
        return WeightsPayload(weights=clone_state(self.meme.state_dict()))


class SharedModelServer(FedAvgServer):
    """FedAvg of one shared sub-module of the client modules (FML's meme).

    Args:
        prefix: where the shared model sits in a client module's state dict (``"meme."``).
        weighting: ``"samples"`` (example-weighted, FedAvg) or ``"uniform"`` (HtFLlib).
    """

    def __init__(self, prefix: str, weighting: SharedWeighting = "samples") -> None:
        super().__init__()
        self.prefix = prefix
        self.weighting: SharedWeighting = weighting

    def setup(self, context: ServerContext) -> None:
        self.global_weights = state_with_prefix(context.initial_client_state(0), self.prefix)

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        if not uploads:
            return
        for upload in uploads:
            assert isinstance(upload.payload, WeightsPayload)
            upload.payload.validate_against(self.global_weights, f"client {upload.client_id}")
        weights = [u.payload.num_examples if self.weighting == "samples" else 1 for u in uploads]
        self.global_weights = weighted_average([u.payload.weights for u in uploads], weights)  # type: ignore[attr-defined]


class FML(Algorithm):
    """FML (heterogeneous private models, one shared meme architecture).

    Args:
        alpha: weight of the private model's cross-entropy (FedKTL App. C: 0.5).
        beta: weight of the meme model's cross-entropy (FedKTL App. C: 0.5).
        meme_model: registered model name of the shared meme (FedKTL: the smallest zoo model).
        shared_in_channels: image channels the meme model takes (3 for every built-in dataset).
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
        shared_in_channels: PositiveInt = 3,
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
        self.shared_in_channels = shared_in_channels
        self.shared_init_seed = shared_init_seed
        self.kl_reduction: KLReduction = kl_reduction
        self.meme_weighting: SharedWeighting = meme_weighting
        self.max_grad_norm = max_grad_norm

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        meme = build_shared_model(self.meme_model, num_classes, self.shared_in_channels, self.shared_init_seed, "fml-meme")
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
