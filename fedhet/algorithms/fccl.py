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
Collaborative phase: FCCL+'s (:class:`~fedhet.algorithms.fccl_plus.CrossCorrelationCollaboration`)
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
    OptimizerName,
    RunPhase,
)
from fedhet.algorithms.common import PreviousModelClient
from fedhet.algorithms.fccl_plus import CollaborativeOptimizer, CrossCorrelationCollaboration
from fedhet.core.state import copy_state_into
from fedhet.functional import dual_domain_distillation
from fedhet.hparams import Momentum, NonNegativeFloat, NonNegativeInt, PositiveFloat

#: The run phase (and local stage) in which FCCL clients pretrain on their private data.
PRETRAIN = "pretrain"


class FCCLClient(PreviousModelClient):
    """Local updating of FCCL: cross-entropy plus distillation from two frozen teachers.

    Args:
        model: the backbone.
        num_classes: number of classes.
        pretrain_epochs: epochs of local pretraining before the first local update.
        pretrain_lr: initial Adam learning rate of pretraining (cosine-annealed per epoch).
        pretrain_min_lr: final learning rate of the cosine schedule.
        teacher_train_mode: run the teachers in train mode as the authors' code does (``False``: eval).
        optimizer: local optimizer.
        lr: local learning rate (before the platform's schedule).
        momentum: SGD momentum.
        weight_decay: L2 weight decay.
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        pretrain_epochs: int = 50,
        pretrain_lr: float = 1e-3,
        pretrain_min_lr: float = 1e-6,
        teacher_train_mode: bool = True,
        optimizer: OptimizerName = "adam",
        lr: float = 1e-3,
        momentum: float = 0.0,
        weight_decay: float = 1e-5,
    ) -> None:
        super().__init__(
            model, num_classes, "previous_round", teacher_train_mode, optimizer, lr, momentum, weight_decay
        )
        self.pretrain_epochs = pretrain_epochs
        self.pretrain_lr = pretrain_lr
        self.pretrain_min_lr = pretrain_min_lr
        self.pretrained_model = copy.deepcopy(model).requires_grad_(False)
        # Part of the client state, so that pretraining happens once even across a resume.
        self.register_buffer("pretrained", torch.zeros((), dtype=torch.bool))

    def ready_to_collaborate(self) -> bool:
        return bool(self.pretrained)

    # ------------------------------------------------------------------ the "pretrain" run phase
    def local_stages(self) -> Sequence[LocalStage]:
        if self.phase == PRETRAIN:
            return (LocalStage(PRETRAIN, epochs=self.pretrain_epochs),)
        return super().local_stages()

    def configure_optimizers(self) -> Any:
        if self.stage != PRETRAIN:
            return super().configure_optimizers()
        optimizer = torch.optim.Adam(self.model.parameters(), lr=self.pretrain_lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=max(self.pretrain_epochs, 1), eta_min=self.pretrain_min_lr
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "epoch"}}

    def on_train_start(self) -> None:
        if self.stage != PRETRAIN:
            super().on_train_start()

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
            self.pretrained_model.train(self.teacher_train_mode)
            pretrained_logits = self.pretrained_model(x)
        return F.cross_entropy(logits, y) + dual_domain_distillation(logits, self.teacher_logits(x), pretrained_logits)


class FCCL(Algorithm):
    """FCCL (CVPR 2022; heterogeneous models, unlabeled public data; designed for domain shift).

    Args:
        off_diag_weight: lambda, weight of FCCM's off-diagonal term (0.0051).
        off_diag_target: FCCM off-diagonal target, -1 (code) or 0 (Barlow Twins).
        fisl_weight: omega of FCCL+'s FISL added to the collaboration (0: FCCL; 3 gives the
            "FCCM + FISL" row of FCCL+'s ablation Tab. X, which keeps FCCL's local objective).
        similarity_temperature: mu of FISL (used only when ``fisl_weight > 0``).
        pretrain_epochs: local pretraining epochs of every client before the federation (50 in the code).
        pretrain_lr: initial Adam learning rate of pretraining (1e-3).
        pretrain_min_lr: final learning rate of pretraining's cosine schedule (1e-6).
        teacher_train_mode: run the local teachers in train mode (authors' code; ``False``: eval).
        public_lr: learning rate of the collaborative Adam (1e-3; ``federation.lr_schedule`` scales it).
        public_epochs: passes over the public set per round.
        collaborative_optimizer: ``"fresh_each_step"`` (code) or ``"per_round"``.
        std_eps: added to the per-dimension std of FCCM (0: exactly the code).
        optimizer: local optimizer (Adam in the code).
        lr: local learning rate (1e-3).
        momentum: SGD momentum.
        weight_decay: local L2 weight decay (1e-5 in the code).
    """

    capabilities = Capabilities(heterogeneous_models=True, needs_public_data=True)
    upload_type = None
    download_type = None

    def __init__(
        self,
        off_diag_weight: NonNegativeFloat = 0.0051,
        off_diag_target: float = -1.0,
        fisl_weight: NonNegativeFloat = 0.0,
        similarity_temperature: PositiveFloat = 0.02,
        pretrain_epochs: NonNegativeInt = 50,
        pretrain_lr: PositiveFloat = 1e-3,
        pretrain_min_lr: NonNegativeFloat = 1e-6,
        teacher_train_mode: bool = True,
        public_lr: PositiveFloat = 1e-3,
        public_epochs: NonNegativeInt = 1,
        collaborative_optimizer: CollaborativeOptimizer = "fresh_each_step",
        std_eps: NonNegativeFloat = 1e-5,
        optimizer: OptimizerName = "adam",
        lr: PositiveFloat = 1e-3,
        momentum: Momentum = 0.0,
        weight_decay: NonNegativeFloat = 1e-5,
    ) -> None:
        super().__init__(optimizer, lr, momentum, weight_decay)
        self.off_diag_weight = off_diag_weight
        self.off_diag_target = off_diag_target
        self.fisl_weight = fisl_weight
        self.similarity_temperature = similarity_temperature
        self.pretrain_epochs = pretrain_epochs
        self.pretrain_lr = pretrain_lr
        self.pretrain_min_lr = pretrain_min_lr
        self.teacher_train_mode = teacher_train_mode
        self.public_lr = public_lr
        self.public_epochs = public_epochs
        self.collaborative_optimizer: CollaborativeOptimizer = collaborative_optimizer
        self.std_eps = std_eps

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        return FCCLClient(
            model,
            num_classes,
            pretrain_epochs=self.pretrain_epochs,
            pretrain_lr=self.pretrain_lr,
            pretrain_min_lr=self.pretrain_min_lr,
            teacher_train_mode=self.teacher_train_mode,
            **self.optimizer_kwargs(),
        )

    def build_collaborative_phase(self, clients: Sequence[ClientModule]) -> CollaborativePhase:
        return CrossCorrelationCollaboration(
            clients,  # type: ignore[arg-type]
            off_diag_weight=self.off_diag_weight,
            off_diag_target=self.off_diag_target,
            fisl_weight=self.fisl_weight,
            similarity_temperature=self.similarity_temperature,
            public_lr=self.public_lr,
            collaborative_optimizer=self.collaborative_optimizer,
            std_eps=self.std_eps,
        )

    def collaborative_epochs(self) -> int:
        return self.public_epochs

    def phases(self) -> Sequence[RunPhase]:
        """Local pretraining of every client before the federation (the code's 50 epochs)."""
        return (RunPhase(PRETRAIN, "before", rounds=1, participation=None, exchange=False),)
