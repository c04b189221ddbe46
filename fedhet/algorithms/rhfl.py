"""RHFL: robust heterogeneous FL, peers' distributions weighted by client confidence, SCE locally.

Paper: Fang & Ye, "Robust Federated Learning with Noisy and Heterogeneous Clients", CVPR 2022
(heterogeneous collaborative learning, symmetric cross-entropy local loss, client confidence
re-weighting), as run in FCCL+'s benchmark (Huang et al., TPAMI 2023, Tab. VII: alpha 0.1,
beta 1.0). Official code: ``HHF/HHF.py`` and ``loss.py`` of FangXiuwen/Robust_FL.

Upload: after local training, the client's mean SCE loss on its private data (one float32,
:class:`PrivateLossPayload`). During the collaborative phase, per public batch, its logits
(``|B0| x C`` float32, validated).
Download: at the start of a round, the client's confidence weight ``w_i``
(:class:`ClientConfidencePayload`; none until two losses of it are known). During the
collaborative phase, per public batch, one ``|B0| x C`` target per participant (the weighted
peer distributions), counted as float32 in the ledger.
Server phase: closed-form client confidence re-weighting (CCR), exactly as the code. With
``l_i^e`` client ``i``'s mean private SCE loss after round ``e``'s local training::

    q_i = (l_i^(e-1) - l_i^e) / l_i^e
    a_i = 1 / (K - 1) + ccr_beta * q_i / sum_j q_j          (ccr_beta = 0.5, hard-coded in [C])
    w_i = exp(a_i) / sum_j exp(a_j)

(:func:`fedhet.functional.client_confidence_weights`, over the uploaders whose previous loss
is known). Until then a participant's weight is ``1 / (K - 1)`` with ``K`` the round's
participants, as the code's first round.
Collaborative loss of participant ``i`` on a public batch:
``sum_{j != i} w_j * KL(softmax(z_j) || softmax(z_i))`` (batchmean, T = 1), peers detached,
Adam 1e-3 re-created every step as the code.
Local objective: ``SCE = alpha * CE + beta * RCE`` with ``alpha = 0.1``, ``beta = 1.0`` and the
one-hot label clamped to ``[1e-4, 1]`` inside RCE's logarithm.
Client state kept across rounds: the local model and its optimizer state (the server keeps
every client's last loss and confidence weight).
Deviations from paper/official code:
* CCR's losses are measured after local training (eval mode, no gradient), which is the state
  the code measures at the start of the next round (it measures in train mode, so BatchNorm
  uses batch statistics there). The code also measures once before round 0, on its
  pre-trained nets; random-init nets have no such loss worth using, so CCR starts one round
  later here: uniform ``1 / (K - 1)`` in rounds 0 and 1, CCR from round 2.
* The code pre-trains every net on private data and trains ``max(N0 / N_i, 1)`` local epochs
  per round with Adam without weight decay; FCCL+'s benchmark runs RHFL from random init with
  the common local budget (``trainer.max_epochs``) and Adam 1e-3, weight decay 1e-5, as here.
* MarsFL feeds raw logits to ``KLDivLoss``; this follows the RHFL code's log-softmax/softmax.
* When ``sum_j q_j = 0`` the code divides by zero; the quality term is dropped (uniform weights).
* The mean private loss is the example-weighted mean over the dataset (the code averages the
  per-batch means).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from fedhet.algorithms.base import Batch, ClientModule, ClientUpload, ServerContext, ServerPhase, hparams_for
from fedhet.algorithms.shared.common import (
    PublicDistillationAlgorithm,
    PublicDistillationHparams,
    PublicDistillationPhase,
)
from fedhet.core.payloads import Payload, check_tensor
from fedhet.errors import ConfigError, TrainingError
from fedhet.functional.distillation import client_confidence_weights, symmetric_cross_entropy, weighted_peer_kl
from fedhet.hparams import Hyperparameters, NonNegativeFloat, knob, log_uniform, uniform


@dataclass(frozen=True)
class PrivateLossPayload(Payload):
    """A client's mean loss on its private training data (the input of RHFL's CCR)."""

    loss: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(()))

    def validate_value(self, sender: str) -> None:
        """Reject anything but one non-negative float32 number (the dtype the server keeps losses in).

        :meth:`ClientUpload.expect`, called first, found it finite.
        """
        check_tensor(sender, "loss", self.loss, (), torch.float32)
        if float(self.loss) < 0:
            raise TrainingError(f"{sender} sent an invalid private loss {self.loss!r} (must be a non-negative float)")


@dataclass(frozen=True)
class ClientConfidencePayload(Payload):
    """A client's confidence weight ``w_i``: how much the others learn from it in collaboration."""

    weight: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(()))


@dataclass(frozen=True)
class RHFLHparams(PublicDistillationHparams):
    """RHFL's hyperparameters (FCCL+'s Tab. VII and the RHFL code; the benchmark frame's optimizers)."""

    sce_alpha: NonNegativeFloat = knob(
        0.1, "weight of the cross-entropy in the local SCE loss (Tab. VII: 0.1)", log_uniform(0.01, 1.0)
    )
    sce_beta: NonNegativeFloat = knob(
        1.0, "weight of the reverse cross-entropy in the local SCE loss (Tab. VII: 1.0)", log_uniform(0.1, 10.0)
    )
    ccr_beta: NonNegativeFloat = knob(
        0.5, "weight of the learning-efficiency term of CCR (code: 0.5; 0 gives uniform weights)", uniform(0.0, 1.0)
    )

    def check(self) -> None:
        if self.sce_alpha + self.sce_beta <= 0:
            raise ConfigError(f"sce_alpha={self.sce_alpha}, sce_beta={self.sce_beta} must not both be 0")


class RHFLClient(ClientModule):
    """Symmetric cross-entropy locally; uploads its mean private SCE loss; holds its confidence."""

    Hparams = RHFLHparams

    def __init__(self, model: nn.Module, num_classes: int, hp: Any = None, **overrides: Any) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        # The weight the server gave this client this round (None: not known yet). Set from the
        # download every round, so a module reused for another client never keeps a stale one.
        self.confidence: float | None = None

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        return symmetric_cross_entropy(self.model(x), y, self.hp.sce_alpha, self.hp.sce_beta)

    def on_receive(self, download: Payload | None) -> None:
        self.confidence = float(download.weight) if isinstance(download, ClientConfidencePayload) else None

    def make_upload(self, train_batches: Iterable[Batch]) -> PrivateLossPayload:
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        for x, y in train_batches:
            loss = symmetric_cross_entropy(self.model(x), y, self.hp.sce_alpha, self.hp.sce_beta)
            total += loss.detach().double().cpu() * y.numel()
            count += y.numel()
        if count == 0:
            raise TrainingError("RHFL: a client without training data cannot measure its private loss")
        return PrivateLossPayload(loss=(total / count).float())


class RHFLPhase(PublicDistillationPhase):
    """Each participant matches every peer's distribution, weighted by that peer's confidence."""

    Hparams = RHFLHparams

    def peer_confidences(self) -> Tensor:
        """``[K]`` confidence of each exchanging participant (``1 / (K - 1)`` until the server has one)."""
        uniform = 1.0 / max(len(self.exchanging) - 1, 1)
        weights = [getattr(self.clients[index], "confidence", None) for index in self.exchanging]
        return torch.tensor([uniform if w is None else w for w in weights])

    def distillation_losses(self, logits: list[Tensor], x: Tensor) -> list[Tensor]:
        if len(logits) < 2:  # nobody to learn from this round
            return [z.sum() * 0.0 for z in logits]
        confidences = self.peer_confidences()
        losses = []
        for i, student in enumerate(logits):
            peers = [j for j in range(len(logits)) if j != i]
            losses.append(weighted_peer_kl(student, [logits[j] for j in peers], confidences[peers]))
        return losses


class ClientConfidenceServer(ServerPhase):
    """Keeps every client's last private loss and computes CCR weights from the losses' decrease.

    Args:
        hp: the method's hyperparameters (``None``: the declared defaults; it reads ``ccr_beta``).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams: ClassVar[type[Hyperparameters]] = RHFLHparams

    def __init__(self, hp: Any = None, **overrides: Any) -> None:
        super().__init__()
        self.hp: Any = hparams_for(type(self), hp, overrides)
        self.previous_loss = torch.zeros(0)
        self.confidence = torch.zeros(0)

    def setup_server(self, context: ServerContext) -> None:
        self.previous_loss = torch.full((context.num_clients,), math.nan)
        self.confidence = torch.full((context.num_clients,), math.nan)

    def check_upload(self, upload: ClientUpload) -> None:
        """One finite, non-negative float32 loss."""
        upload.expect(PrivateLossPayload, "PrivateLossPayload").validate_value(upload.sender)

    def aggregate(self, round_idx: int, uploads: Sequence[ClientUpload]) -> None:
        if not uploads:
            return
        ids = torch.tensor([u.client_id for u in uploads])
        losses = torch.stack([u.payload.loss.float() for u in uploads])  # type: ignore[attr-defined]
        known = ~torch.isnan(self.previous_loss[ids])
        if int(known.sum()) >= 2:
            weights = client_confidence_weights(self.previous_loss[ids[known]], losses[known], self.hp.ccr_beta)
            self.confidence[ids[known]] = weights.float()
        self.previous_loss[ids] = losses

    def download_for(self, client_id: int) -> ClientConfidencePayload | None:
        weight = self.confidence[client_id]
        return None if bool(torch.isnan(weight)) else ClientConfidencePayload(weight=weight.clone())

    def metrics(self) -> dict[str, float]:
        return {f"confidence/{cid}": float(w) for cid, w in enumerate(self.confidence) if not math.isnan(float(w))}

    def server_state(self) -> dict[str, Any]:
        return {"previous_loss": self.previous_loss, "confidence": self.confidence}

    def load_server_state(self, state: Mapping[str, Any]) -> None:
        self.previous_loss = state["previous_loss"].clone()
        self.confidence = state["confidence"].clone()


class RHFL(PublicDistillationAlgorithm):
    """RHFL (heterogeneous models, unlabelled public data, noise-robust local loss)."""

    Hparams = RHFLHparams
    client_type = RHFLClient
    phase_type = RHFLPhase
    upload_type = PrivateLossPayload
    download_type = ClientConfidencePayload

    def build_server(self) -> ServerPhase:
        return ClientConfidenceServer(self.hp)


__all__ = [
    "RHFL",
    "ClientConfidencePayload",
    "ClientConfidenceServer",
    "PrivateLossPayload",
    "RHFLClient",
    "RHFLHparams",
    "RHFLPhase",
]
