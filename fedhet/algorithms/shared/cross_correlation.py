"""The cross-correlation collaboration FCCL and FCCL+ share: one lock-step FCCM (+ FISL) step per public batch.

Paper: Huang, Ye, Shi, Du, "Generalizable Heterogeneous Federated Cross-Correlation and Instance
Similarity Learning", TPAMI 2023 (Eq. 1-6, Algorithm 1), code ``WenkeHuang/FCCL`` (``fccl+/``);
spec ``reference/fccl-plus.md`` sections 2, 3 and 7. FCCL (CVPR 2022) is FCCM alone. Both method
files use it; neither imports the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from fedhet.algorithms.base import Batch, ClientModule, CollaborativePhase, build_optimizer, hparams_for
from fedhet.algorithms.shared.common import PreviousModelClient, PreviousModelHparams
from fedhet.core.payloads import Payload, check_shape
from fedhet.errors import TrainingError
from fedhet.functional import fccm_loss, fisl_loss, instance_similarity
from fedhet.hparams import (
    Hyperparameters,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    categorical,
    knob,
    log_uniform,
)

CollaborativeOptimizer = Literal["fresh_each_step", "per_round"]


@dataclass(frozen=True)
class PublicOutputsPayload(Payload):
    """What crosses the network per public batch: logits and (FCCL+ only) similarity logits.

    ``similarity`` is empty (``[0]``) when FISL is off (FCCL), so it adds no bytes.
    """

    logits: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, 0))
    similarity: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0))

    def validate_shape(self, batch: int, num_classes: int, with_similarity: bool, sender: str) -> None:
        """Finite floating values, logits ``[B, C]`` and, with FISL, similarities ``[B, B-1]``."""
        self.validate(sender)
        for name, tensor in self.tensors():
            if not tensor.is_floating_point():
                raise TrainingError(f"{sender} sent '{name}' with dtype {tensor.dtype}, expected a floating dtype")
        check_shape(sender, "logits", self.logits, (batch, num_classes))
        if with_similarity:
            check_shape(sender, "similarity", self.similarity, (batch, batch - 1))


@dataclass(frozen=True)
class CrossCorrelationHparams(PreviousModelHparams):
    """The collaboration's hyperparameters (FCCL, FCCL+; the paper's and the authors' code's defaults)."""

    off_diag_weight: NonNegativeFloat = knob(
        0.0051, "lambda, weight of FCCM's off-diagonal term", log_uniform(1e-4, 1e-1)
    )
    off_diag_target: float = knob(
        -1.0, "FCCM off-diagonal target: -1 (paper Fig. 2, code) or 0 (Barlow Twins)", categorical(-1.0, 0.0)
    )
    fisl_weight: NonNegativeFloat = knob(
        3.0, "omega, weight of FISL (3 on Digits/Office31, 1 on Office-Home)", log_uniform(0.1, 10.0)
    )
    similarity_temperature: PositiveFloat = knob(
        0.02, "mu, temperature of the instance similarities", log_uniform(1e-3, 1.0)
    )
    public_lr: PositiveFloat = knob(
        1e-3, "learning rate of the collaborative Adam (federation.lr_schedule scales it)", log_uniform(1e-5, 1e-1)
    )
    public_epochs: NonNegativeInt = knob(1, "passes over the public set per round (2 on Office-Home)")
    collaborative_optimizer: CollaborativeOptimizer = knob(
        "fresh_each_step", "fresh_each_step (code: a new Adam per public batch) or per_round (one Adam per round)"
    )
    std_eps: NonNegativeFloat = knob(1e-5, "added to the per-dimension std of FCCM (0: exactly the code)")


class CrossCorrelationCollaboration(CollaborativePhase):
    """FCCL / FCCL+ collaborative updating: one synchronous step per public batch.

    Every ready participant forwards the batch once (train mode), uploads ``Z_i`` (and ``S_i``
    when FISL is on), the server averages them over all uploaders, and each participant steps
    on ``FCCM(Z_i, Zbar) + fisl_weight * FISL(S_i, Sbar)`` with the averages detached.

    Args:
        clients: the participating client modules.
        hp: the method's hyperparameters (``None``: the declared defaults).
        **overrides: single hyperparameters by name, applied on top of ``hp``.
    """

    Hparams: ClassVar[type[Hyperparameters]] = CrossCorrelationHparams

    def __init__(self, clients: Sequence[PreviousModelClient], hp: Any = None, **overrides: Any) -> None:
        super().__init__(clients)
        self.hp: Any = hparams_for(type(self), hp, overrides)

    def fisl_weight(self) -> float:
        """omega; 0 turns FISL off (no similarity computed or exchanged)."""
        return self.hp.fisl_weight

    def client_optimizer(self, client: ClientModule) -> torch.optim.Optimizer:
        return build_optimizer(client.model.parameters(), "adam", self.hp.public_lr, 0.0, 0.0)

    def ready(self) -> list[int]:
        """Indices of the participants taking part in this phase (not those left out of it, :meth:`accept`)."""
        return [i for i, client in enumerate(self.clients) if client.ready_to_collaborate() and i not in self.dropped]

    def collaborative_losses(self, x: Tensor) -> list[Tensor]:
        """One loss per participant (zero for those not ready); records the bytes exchanged."""
        active = self.ready()
        fisl_weight = self.fisl_weight()
        with_fisl = fisl_weight != 0.0
        outputs: dict[int, tuple[Tensor, Tensor | None]] = {}
        uploads: list[PublicOutputsPayload] = []
        for i in active:
            model = self.clients[i].model
            features = model.forward_features(x)
            logits = model.forward_head(features)
            similarity = instance_similarity(features, self.hp.similarity_temperature) if with_fisl else None
            upload = PublicOutputsPayload(
                logits=logits.detach().float(),
                similarity=similarity.detach().float() if similarity is not None else torch.zeros(0, device=x.device),
            )
            sender, classes = f"participant {i}", logits.shape[1]

            def check(upload: PublicOutputsPayload = upload, classes: int = classes, sender: str = sender) -> None:
                upload.validate_shape(x.shape[0], classes, with_fisl, sender)  # shape, then finite values
                upload.check_value_bound(self.value_bound, sender)

            if not self.accept(i, check):
                continue  # left out under on_invalid_upload: drop; its loss stays a constant zero
            outputs[i] = (logits, similarity)
            uploads.append(upload)
        losses = [x.new_zeros(()) for _ in self.clients]
        if not uploads:
            return losses
        # server: the mean over all uploaders, the receiver included; a constant for every client
        download = PublicOutputsPayload(
            logits=torch.stack([u.logits for u in uploads]).mean(0),
            similarity=torch.stack([u.similarity for u in uploads]).mean(0),
        )
        for upload in uploads:
            self.record_upload(upload)
        self.record_download(download, receivers=len(uploads))
        for i, (logits, similarity) in outputs.items():
            target = download.logits.to(logits.dtype)
            loss = fccm_loss(logits, target, self.hp.off_diag_weight, self.hp.off_diag_target, self.hp.std_eps)
            if similarity is not None:
                loss = loss + fisl_weight * fisl_loss(similarity, download.similarity.to(similarity.dtype))
            losses[i] = loss
        return losses

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        x = batch[0]
        if x.shape[0] < 2:  # neither a per-dimension std nor a similarity to another image exists
            return
        active = self.ready()
        if not active:
            return
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        losses = self.collaborative_losses(x)
        for i in active:
            if self.hp.collaborative_optimizer == "fresh_each_step":
                optimizers[i].optimizer.state.clear()  # exactly a new Adam (moments and step count reset)
            optimizers[i].zero_grad()
        # Targets are detached, so the sum back-propagates each loss into its own client only.
        self.manual_backward(torch.stack([losses[i] for i in active]).sum())
        for i in active:
            optimizers[i].step()


__all__ = [
    "CollaborativeOptimizer",
    "CrossCorrelationCollaboration",
    "CrossCorrelationHparams",
    "PublicOutputsPayload",
]
