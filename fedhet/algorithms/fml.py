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
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from fedhet.algorithms.base import Algorithm, Batch, Capabilities, ClientModule, ServerPhase
from fedhet.algorithms.shared.common import (
    SeparatelyClippedClient,
    SharedModelHparams,
    SharedSubmoduleServer,
    SharedWeighting,
    SubmoduleSharingClient,
    build_shared_model,
)
from fedhet.core.payloads import WeightsPayload
from fedhet.functional import mutual_learning_losses
from fedhet.functional.mutual_learning import KLReduction
from fedhet.hparams import PositiveFloat, UnitInterval, knob, uniform


@dataclass(frozen=True)
class FMLHparams(SharedModelHparams):
    """FML's hyperparameters (FedKTL App. C: alpha = beta = 0.5; HtFLlib: clipping at 10, one optimizer)."""

    max_grad_norm: PositiveFloat | None = knob(10.0, "per-model gradient clipping norm (HtFLlib: 10); None: off")
    alpha: UnitInterval = knob(
        0.5, "weight of the private model's cross-entropy (1 - alpha weighs its KL term)", uniform(0.0, 1.0)
    )
    beta: UnitInterval = knob(
        0.5, "weight of the meme model's cross-entropy (1 - beta weighs its KL term)", uniform(0.0, 1.0)
    )
    meme_model: str = knob("simple_cnn", "registered model name of the shared meme (FedKTL: the smallest zoo model)")
    kl_reduction: KLReduction = knob("batchmean", "batchmean (per-sample KL) or mean (HtFLlib's element mean)")
    meme_weighting: SharedWeighting = knob("samples", "averaging of memes: samples (FedAvg) or uniform (HtFLlib)")


class FMLClient(SubmoduleSharingClient, SeparatelyClippedClient):
    """The private model and the meme model, trained by deep mutual learning on each batch.

    One optimizer (``hp.optimizer``, ``hp.lr``) trains both models; evaluation uses the private one.

    Args:
        model: the private (possibly heterogeneous) backbone.
        num_classes: number of classes.
        meme: the shared meme model (one architecture for all clients).
        hp: the method's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams = FMLHparams
    shared_module = "meme"

    def __init__(self, model: nn.Module, num_classes: int, meme: nn.Module, hp: Any = None, **overrides: Any) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        self.meme = meme

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        private_loss, meme_loss = mutual_learning_losses(
            self.model(x), self.meme(x), y, self.hp.alpha, self.hp.beta, self.hp.kl_reduction
        )
        return private_loss + meme_loss

    def clip_groups(self) -> Iterator[list[Tensor]]:
        """Parameter groups clipped separately (one per model, as HtFLlib)."""
        yield list(self.model.parameters())
        yield list(self.meme.parameters())


class SharedModelServer(SharedSubmoduleServer):
    """FedAvg of the clients' meme models, one average over every client (``hp.meme_weighting``)."""

    Hparams = FMLHparams
    shared_module = "meme"
    weighting_knob = "meme_weighting"


class FML(Algorithm):
    """FML (heterogeneous private models, one shared meme architecture)."""

    Hparams = FMLHparams
    client_type = FMLClient
    capabilities = Capabilities(heterogeneous_models=True)
    upload_type = WeightsPayload
    download_type = WeightsPayload

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        meme = build_shared_model(
            self.hp.meme_model, num_classes, self.image_channels(), self.hp.shared_init_seed, "fml-meme"
        )
        return FMLClient(model, num_classes, meme, self.hp)

    def build_server(self) -> ServerPhase:
        return SharedModelServer(self.hp)


__all__ = ["FML", "FMLClient", "FMLHparams", "SharedModelServer"]
