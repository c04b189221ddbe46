"""FCCL+: federated cross-correlation and instance similarity learning, non-target distillation.

Paper: Huang, Ye, Shi, Du, "Generalizable Heterogeneous Federated Cross-Correlation and Instance
Similarity Learning", TPAMI 2023 (Eq. 1-14, Algorithm 1); code ``WenkeHuang/FCCL`` (``fccl+/``).
Spec: ``reference/fccl-plus.md`` (sections 2, 3, 7).

Upload: none after local training. During the collaborative phase, per public batch, each
participant sends its logits ``Z_i`` ``[B, C]`` and instance-similarity logits ``S_i``
``[B, B-1]`` (:class:`PublicOutputsPayload`, validated: shape, dtype, finite).
Download: per public batch, the averages ``Zbar`` and ``Sbar`` over all participants, the
receiver included (paper Alg. 1 and code). Both directions are counted in the ledger as
float32 bytes.
Server phase: none persistent; the collaborative phase averages per batch.
Collaborative phase (each round, before local updating): every participant forwards the same
weakly augmented public batch once in train mode, ``H_i = f_i(x)``, ``Z_i = head(H_i)``, and
takes one step on ``L_FCCM(Z_i, Zbar) + omega * L_FISL(S_i, Sbar)`` (Eq. 6); with
``average_after_collaboration`` (homogeneous setting, spec 2.4) all participants' parameters
and BatchNorm buffers are then averaged with equal weights.
Local objective: ``CE + tau^2 * FNTD(z, z_prev; tau)`` (Eq. 14 with the code's tau^2), the
teacher being the client's own model at the end of the previous round's local update.
Client state kept across rounds: the model and the frozen teacher snapshot ``theta^{e-1}``
(initialised to the random initial model; overwritten at the end of each local update). No
optimizer state: configs set ``federation.persist_optimizer_state: false`` (code: a new local
Adam every round). With ``average_after_collaboration`` (homogeneous setting) every client starts
from one initial model (:attr:`Algorithm.identical_client_init`), as the authors synchronise
their homogeneous clients.

Optimizer defaults follow the authors' code, since it produced the published numbers and the
paper does not contradict it (it only gives Adam, lr 1e-3): the collaborative Adam is created
anew for every public batch (``collaborative_optimizer="fresh_each_step"``; its first step is a
sign-SGD-like step of size lr), the local Adam (weight decay 1e-5) anew every round, and the
FNTD teacher runs in train mode. The code's linear per-round decay of both learning rates,
``lr0 * (1 - 0.9 * max(e-1, 0) / E)``, sits in the authors' shared training loop and applies to
every method, so here it is the platform's ``federation.lr_schedule: {kind: linear}`` (set by the
shipped configs for every method of a comparison), not an FCCL+ argument. The paper-only reading
(one Adam per round in collaboration, constant lr) is ``collaborative_optimizer="per_round"``
with ``federation.lr_schedule: {kind: none}``.

Deviations from paper/official code:
- one forward per client returns ``(H, Z = head(H))``; the code runs the network twice (logits,
  then features), updating BatchNorm statistics twice per batch.
- ``1e-5`` is added to the per-dimension std of FCCM (the code has no guard; ``std_eps=0``
  restores it); public batches of fewer than 2 images are skipped (no std, no similarity).
- the FNTD probabilities are not renormalised over the non-target classes, as in Eq. 13 and the
  code (``fntd_renormalize=True`` gives the zero-target-gradient form Eq. 12 describes).
- the Fig. 9 ablation teacher ``theta^e`` (``teacher="post_collaboration"``) is the model at the
  start of local updating, i.e. after this round's collaboration (and averaging, if on).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms.base import (
    Algorithm,
    Batch,
    Capabilities,
    ClientModule,
    CollaborativePhase,
    OptimizerName,
    build_optimizer,
)
from fedhet.algorithms.common import PreviousModelClient, TeacherChoice
from fedhet.core.payloads import Payload, check_shape
from fedhet.core.state import copy_state_into
from fedhet.errors import TrainingError
from fedhet.functional import (
    fccm_loss,
    fisl_loss,
    fntd_loss,
    instance_similarity,
    kd_loss,
    weighted_average,
)
from fedhet.hparams import Momentum, NonNegativeFloat, NonNegativeInt, PositiveFloat

LocalDistillation = Literal["fntd", "kd", "none"]
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


class FCCLPlusClient(PreviousModelClient):
    """Local updating of FCCL+: ``CE + tau^2 * FNTD`` against the previous-round model (Eq. 14).

    Args:
        model: the backbone.
        num_classes: number of classes.
        local_distillation: ``"fntd"`` (paper), ``"kd"`` (Fig. 10 ablation) or ``"none"``.
        temperature: tau of FNTD / KD.
        fntd_renormalize: softmax over the non-target classes only.
        teacher: ``"previous_round"`` (paper) or ``"post_collaboration"`` (Fig. 9 ablation).
        teacher_train_mode: run the teacher in train mode as the authors' code does (``False``: eval).
        optimizer: local optimizer.
        lr: local learning rate (before the platform's schedule).
        momentum: SGD momentum.
        weight_decay: L2 weight decay.
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        local_distillation: LocalDistillation = "fntd",
        temperature: float = 3.0,
        fntd_renormalize: bool = False,
        teacher: TeacherChoice = "previous_round",
        teacher_train_mode: bool = True,
        optimizer: OptimizerName = "adam",
        lr: float = 1e-3,
        momentum: float = 0.0,
        weight_decay: float = 1e-5,
    ) -> None:
        super().__init__(model, num_classes, teacher, teacher_train_mode, optimizer, lr, momentum, weight_decay)
        self.local_distillation: LocalDistillation = local_distillation
        self.temperature = temperature
        self.fntd_renormalize = fntd_renormalize

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        if self.local_distillation == "fntd":
            loss = loss + fntd_loss(logits, self.teacher_logits(x), y, self.temperature, self.fntd_renormalize)
        elif self.local_distillation == "kd":
            loss = loss + kd_loss(logits, self.teacher_logits(x), self.temperature)
        return loss


class CrossCorrelationCollaboration(CollaborativePhase):
    """FCCL / FCCL+ collaborative updating: one synchronous step per public batch.

    Every ready participant forwards the batch once (train mode), uploads ``Z_i`` (and ``S_i``
    when FISL is on), the server averages them over all uploaders, and each participant steps
    on ``FCCM(Z_i, Zbar) + fisl_weight * FISL(S_i, Sbar)`` with the averages detached.

    Args:
        clients: the participating client modules.
        off_diag_weight: lambda of FCCM.
        off_diag_target: FCCM off-diagonal target (-1 paper/code, 0 Barlow Twins).
        fisl_weight: omega; 0 turns FISL off (no similarity computed or exchanged).
        similarity_temperature: mu of the instance similarity.
        public_lr: Adam learning rate of this phase (before the platform's ``lr_schedule``).
        collaborative_optimizer: ``"fresh_each_step"`` (code) or ``"per_round"``.
        average_after_collaboration: FedAvg all parameters and buffers at the end (homogeneous).
        std_eps: added to the per-dimension std in FCCM.
    """

    def __init__(
        self,
        clients: Sequence[PreviousModelClient],
        off_diag_weight: float = 0.0051,
        off_diag_target: float = -1.0,
        fisl_weight: float = 3.0,
        similarity_temperature: float = 0.02,
        public_lr: float = 1e-3,
        collaborative_optimizer: CollaborativeOptimizer = "fresh_each_step",
        average_after_collaboration: bool = False,
        std_eps: float = 1e-5,
    ) -> None:
        super().__init__(clients)
        self.off_diag_weight = off_diag_weight
        self.off_diag_target = off_diag_target
        self.fisl_weight = fisl_weight
        self.similarity_temperature = similarity_temperature
        self.public_lr = public_lr
        self.collaborative_optimizer: CollaborativeOptimizer = collaborative_optimizer
        self.average_after_collaboration = average_after_collaboration
        self.std_eps = std_eps

    def client_optimizer(self, client: ClientModule) -> torch.optim.Optimizer:
        return build_optimizer(client.model.parameters(), "adam", self.public_lr, 0.0, 0.0)

    def ready(self) -> list[int]:
        """Indices of the participants taking part in this phase."""
        return [i for i, client in enumerate(self.clients) if client.ready_to_collaborate()]

    def collaborative_losses(self, x: Tensor) -> list[Tensor]:
        """One loss per participant (zero for those not ready); records the bytes exchanged."""
        active = self.ready()
        with_fisl = self.fisl_weight != 0.0
        outputs: dict[int, tuple[Tensor, Tensor | None]] = {}
        uploads: list[PublicOutputsPayload] = []
        for i in active:
            model = self.clients[i].model
            features = model.forward_features(x)
            logits = model.forward_head(features)
            similarity = instance_similarity(features, self.similarity_temperature) if with_fisl else None
            outputs[i] = (logits, similarity)
            upload = PublicOutputsPayload(
                logits=logits.detach().float(),
                similarity=similarity.detach().float() if similarity is not None else torch.zeros(0, device=x.device),
            )
            upload.validate_shape(x.shape[0], logits.shape[1], with_fisl, f"participant {i}")
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
            self.exchanged_bytes_up += upload.nbytes()  # validated above, where it was made
        self.record_download(download, receivers=len(uploads))
        for i, (logits, similarity) in outputs.items():
            loss = fccm_loss(
                logits, download.logits.to(logits.dtype), self.off_diag_weight, self.off_diag_target, self.std_eps
            )
            if similarity is not None:
                loss = loss + self.fisl_weight * fisl_loss(similarity, download.similarity.to(similarity.dtype))
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
            if self.collaborative_optimizer == "fresh_each_step":
                optimizers[i].optimizer.state.clear()  # exactly a new Adam (moments and step count reset)
            optimizers[i].zero_grad()
        # Targets are detached, so the sum back-propagates each loss into its own client only.
        self.manual_backward(torch.stack([losses[i] for i in active]).sum())
        for i in active:
            optimizers[i].step()

    def on_train_end(self) -> None:
        if not self.average_after_collaboration:
            return
        active = self.ready()
        states = [self.clients[i].model.state_dict() for i in active]
        if len(states) < 2:
            return
        averaged = weighted_average(states, [1.0] * len(states))
        for i in active:
            copy_state_into(self.clients[i].model, averaged)


class FCCLPlus(Algorithm):
    """FCCL+ (heterogeneous models, unlabeled public data; designed for domain shift).

    Args:
        off_diag_weight: lambda, weight of FCCM's off-diagonal term (0.0051).
        off_diag_target: FCCM off-diagonal target, -1 (paper Fig. 2, code) or 0 (Barlow Twins).
        use_fisl: add FISL to the collaborative loss (False: the FCCM-only ablation).
        fisl_weight: omega, weight of FISL (3 on Digits/Office31, 1 on Office-Home).
        similarity_temperature: mu, temperature of the instance similarities (0.02).
        local_distillation: ``"fntd"`` (paper), ``"kd"`` (Fig. 10 ablation) or ``"none"`` (CE only).
        temperature: tau of FNTD / KD (3 on Digits/Office31, 1 on Office Caltech/Office-Home).
        fntd_renormalize: softmax over non-target classes only (zero target gradient; not the code).
        teacher: ``"previous_round"`` (theta^{e-1}, paper) or ``"post_collaboration"`` (Fig. 9).
        teacher_train_mode: run the local teacher in train mode (authors' code; ``False``: eval).
        public_lr: learning rate of the collaborative Adam (1e-3; ``federation.lr_schedule`` scales it).
        public_epochs: passes over the public set per round (1; 2 on Office-Home).
        collaborative_optimizer: ``"fresh_each_step"`` (code: new Adam per public batch) or
            ``"per_round"`` (one Adam per round).
        average_after_collaboration: FedAvg all parameters and BatchNorm buffers after the
            collaborative phase (the paper's homogeneous setting; needs one architecture, and
            every client then starts from one initial model, as the authors synchronise them).
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
        use_fisl: bool = True,
        fisl_weight: NonNegativeFloat = 3.0,
        similarity_temperature: PositiveFloat = 0.02,
        local_distillation: LocalDistillation = "fntd",
        temperature: PositiveFloat = 3.0,
        fntd_renormalize: bool = False,
        teacher: TeacherChoice = "previous_round",
        teacher_train_mode: bool = True,
        public_lr: PositiveFloat = 1e-3,
        public_epochs: NonNegativeInt = 1,
        collaborative_optimizer: CollaborativeOptimizer = "fresh_each_step",
        average_after_collaboration: bool = False,
        std_eps: NonNegativeFloat = 1e-5,
        optimizer: OptimizerName = "adam",
        lr: PositiveFloat = 1e-3,
        momentum: Momentum = 0.0,
        weight_decay: NonNegativeFloat = 1e-5,
    ) -> None:
        super().__init__(optimizer, lr, momentum, weight_decay)
        self.off_diag_weight = off_diag_weight
        self.off_diag_target = off_diag_target
        self.use_fisl = use_fisl
        self.fisl_weight = fisl_weight
        self.similarity_temperature = similarity_temperature
        self.local_distillation: LocalDistillation = local_distillation
        self.temperature = temperature
        self.fntd_renormalize = fntd_renormalize
        self.teacher: TeacherChoice = teacher
        self.teacher_train_mode = teacher_train_mode
        self.public_lr = public_lr
        self.public_epochs = public_epochs
        self.collaborative_optimizer: CollaborativeOptimizer = collaborative_optimizer
        self.average_after_collaboration = average_after_collaboration
        self.std_eps = std_eps
        if average_after_collaboration:  # whole-model averaging: refuse mixed architectures at start-up
            self.capabilities = dataclasses.replace(type(self).capabilities, heterogeneous_models=False)
            # homogeneous setting: the authors start every client from one initial model
            self.identical_client_init = True  # type: ignore[misc]

    def build_client(self, model: nn.Module, num_classes: int) -> ClientModule:
        return FCCLPlusClient(
            model,
            num_classes,
            local_distillation=self.local_distillation,
            temperature=self.temperature,
            fntd_renormalize=self.fntd_renormalize,
            teacher=self.teacher,
            teacher_train_mode=self.teacher_train_mode,
            **self.optimizer_kwargs(),
        )

    def build_collaborative_phase(self, clients: Sequence[ClientModule]) -> CollaborativePhase:
        return CrossCorrelationCollaboration(
            clients,  # type: ignore[arg-type]
            off_diag_weight=self.off_diag_weight,
            off_diag_target=self.off_diag_target,
            fisl_weight=self.fisl_weight if self.use_fisl else 0.0,
            similarity_temperature=self.similarity_temperature,
            public_lr=self.public_lr,
            collaborative_optimizer=self.collaborative_optimizer,
            average_after_collaboration=self.average_after_collaboration,
            std_eps=self.std_eps,
        )

    def collaborative_epochs(self) -> int:
        return self.public_epochs
