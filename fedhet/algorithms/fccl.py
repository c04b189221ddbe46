"""FCCL: federated cross-correlation learning with dual-domain knowledge distillation.

Paper: Huang, Ye, Du, "Learn from Others and Be Yourself in Heterogeneous Federated Learning",
CVPR 2022; as re-implemented in the FCCL+ code (``WenkeHuang/FCCL``, ``fccl+/models/fccl.py``)
and described in FCCL+ (TPAMI 2023) Eq. 1-2 and Eq. 19. Spec: ``reference/fccl-plus.md``
sections 2.2, 2.6, 3.3 and 5.

Upload: none after local training. During the collaborative phase, per public batch, each
participant sends its logits ``Z_i`` ``[B, C]`` (validated) and receives the mean ``Zbar`` over
all participants (float32 bytes in the ledger).
Download: per public batch, ``Zbar``.
Server phase: none persistent.
Collaborative phase: FCCL+'s (:class:`~fedhet.algorithms.shared.cross_correlation.CrossCorrelationCollaboration`)
with FCCM only: one step per public batch on ``FCCM(Z_i, Zbar)``, Adam 1e-3 created anew per
step (code). The code's linear per-round lr decay is the platform's ``federation.lr_schedule``
(it sits in the authors' shared loop and applies to every method).
Local objective: ``CE + KL(p_prev || p) + KL(p_pre || p)`` at temperature 1 with unit weights
(FCCL+ Eq. 19), ``prev`` the client's model at the end of the previous round's local update
and ``pre`` a frozen model pre-trained on the client's private data.
Client state kept across rounds: the model, the previous-round snapshot, the pre-trained model
and a flag saying pretraining is done (so a resumed run never pretrains twice).
Pretraining (code: before round 1, 50 epochs, Adam 1e-3, cosine to 1e-6): a ``pretrain`` run
phase before the federated rounds (every client, purely local, logged and checkpointed as its
own step); the live model and both teachers then start from the pre-trained weights, and every
client collaborates from round 0 on, as in the code.

Deviations from paper/official code:
- the FCCM target is the plain mean of all participants' current logits, as in ``fccl+/``; the
  conference code's "progressive" target (own previous-round logits in place of own current
  logits) is not offered.
- no weight decay in pretraining (the spec lists Adam 1e-3 and the cosine schedule only).
- one forward per client in collaboration; ``1e-5`` added to FCCM's std (``std_eps=0``: code).
  The teachers run in train mode as in the code (``teacher_train_mode=False``: eval mode).
- FCCL's homogeneous variant (FedAvg after local updating) is not implemented.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms.base import (
    Algorithm,
    Batch,
    Capabilities,
    ClientModule,
    CollaborativePhase,
    LocalStage,
    RunPhase,
)
from fedhet.algorithms.shared.common import PreviousModelClient
from fedhet.algorithms.shared.cross_correlation import CrossCorrelationCollaboration, CrossCorrelationHparams
from fedhet.core.state import copy_state_into
from fedhet.functional import dual_domain_distillation
from fedhet.hparams import NonNegativeFloat, NonNegativeInt, PositiveFloat, knob, log_uniform

#: The run phase (and local stage) in which FCCL clients pretrain on their private data.
PRETRAIN = "pretrain"


@dataclass(frozen=True)
class FCCLHparams(CrossCorrelationHparams):
    """FCCL's hyperparameters (the FCCL+ code's re-implementation and its defaults)."""

    fisl_weight: NonNegativeFloat = knob(
        0.0,
        "omega of FCCL+'s FISL added to the collaboration (0: FCCL; 3 gives the FCCM + FISL row of FCCL+'s "
        "ablation Tab. X, which keeps FCCL's local objective)",
    )
    pretrain_epochs: NonNegativeInt = knob(50, "local pretraining epochs of every client before the federation")
    pretrain_lr: PositiveFloat = knob(1e-3, "initial Adam learning rate of pretraining", log_uniform(1e-5, 1e-1))
    pretrain_min_lr: NonNegativeFloat = knob(1e-6, "final learning rate of pretraining's cosine schedule")


class FCCLClient(PreviousModelClient):
    """Local updating of FCCL: cross-entropy plus distillation from two frozen teachers."""

    Hparams = FCCLHparams

    def __init__(self, model: nn.Module, num_classes: int, hp: Any = None, **overrides: Any) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        self.pretrained_model = copy.deepcopy(model).requires_grad_(False)
        # Part of the client state, so that pretraining happens once even across a resume.
        self.register_buffer("pretrained", torch.zeros((), dtype=torch.bool))

    def ready_to_collaborate(self) -> bool:
        return bool(self.pretrained)

    # ------------------------------------------------------------------ the "pretrain" run phase
    def local_stages(self) -> Sequence[LocalStage]:
        if self.phase == PRETRAIN:
            return (LocalStage(PRETRAIN, epochs=self.hp.pretrain_epochs),)
        return super().local_stages()

    def configure_optimizers(self) -> Any:
        if self.stage != PRETRAIN:
            return super().configure_optimizers()
        optimizer = torch.optim.Adam(self.model.parameters(), lr=self.hp.pretrain_lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=max(self.hp.pretrain_epochs, 1), eta_min=self.hp.pretrain_min_lr
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "epoch"}}

    def on_train_end(self) -> None:
        if self.stage != PRETRAIN:
            super().on_train_end()

    def on_fit_end(self) -> None:
        """After pretraining (also with zero epochs): freeze the intra-domain teacher, start the previous one.

        The previous-round teacher starts from the same weights (code: ``prev_nets`` are deep
        copies of the pre-trained nets).
        """
        if self.stage == PRETRAIN:
            copy_state_into(self.pretrained_model, self.model.state_dict())
            self.snapshot_teacher()
            self.pretrained.fill_(True)

    def local_loss(self, batch: Batch) -> Tensor:
        """Cross-entropy while pretraining; then plus the dual-domain distillation from both teachers.

        The stage switch lives here rather than in ``training_step`` so that the base class's
        ``train/loss`` logging (under a Trainer with a logger) covers pretraining too.
        """
        x, y = batch
        logits = self.model(x)
        if self.stage == PRETRAIN:
            return F.cross_entropy(logits, y)
        with torch.no_grad():
            self.pretrained_model.train(self.hp.teacher_train_mode)
            pretrained_logits = self.pretrained_model(x)
        return F.cross_entropy(logits, y) + dual_domain_distillation(logits, self.teacher_logits(x), pretrained_logits)


class FCCL(Algorithm):
    """FCCL (CVPR 2022; heterogeneous models, unlabeled public data; designed for domain shift)."""

    Hparams = FCCLHparams
    client_type = FCCLClient
    capabilities = Capabilities(heterogeneous_models=True, needs_public_data=True)
    upload_type = None
    download_type = None

    def build_collaborative_phase(self, clients: Sequence[ClientModule]) -> CollaborativePhase:
        return CrossCorrelationCollaboration(clients, self.hp)  # type: ignore[arg-type]

    def collaborative_epochs(self) -> int:
        return self.hp.public_epochs

    def phases(self) -> Sequence[RunPhase]:
        """Local pretraining of every client before the federation (the code's 50 epochs)."""
        return (RunPhase(PRETRAIN, "before", rounds=1, participation=None, exchange=False),)


__all__ = ["FCCL", "FCCLClient", "FCCLHparams"]
