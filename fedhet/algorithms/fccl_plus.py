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
from one initial model (:meth:`Algorithm.initialisation_of`), as the authors synchronise
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
from typing import Any, Literal

import torch.nn.functional as F
from torch import Tensor

from fedhet.algorithms.base import Algorithm, Batch, Capabilities, ClientModule
from fedhet.algorithms.shared.common import PreviousModelClient, TeacherChoice
from fedhet.algorithms.shared.cross_correlation import CrossCorrelationCollaboration, CrossCorrelationHparams
from fedhet.core.state import copy_state_into
from fedhet.functional import fntd_loss, kd_loss, weighted_average
from fedhet.hparams import PositiveFloat, knob, log_uniform

LocalDistillation = Literal["fntd", "kd", "none"]


@dataclass(frozen=True)
class FCCLPlusHparams(CrossCorrelationHparams):
    """FCCL+'s hyperparameters (paper and authors' code defaults, Digits / Office31 values)."""

    use_fisl: bool = knob(True, "add FISL to the collaborative loss (False: the FCCM-only ablation)")
    local_distillation: LocalDistillation = knob(
        "fntd", "local distillation: fntd (paper), kd (Fig. 10 ablation) or none (CE only)"
    )
    temperature: PositiveFloat = knob(
        3.0, "tau of FNTD / KD (3 on Digits/Office31, 1 on Office Caltech/Office-Home)", log_uniform(0.5, 10.0)
    )
    fntd_renormalize: bool = knob(
        False, "softmax over the non-target classes only (zero target gradient; not the code)"
    )
    teacher: TeacherChoice = knob(
        "previous_round", "local teacher: previous_round (theta^{e-1}, paper) or post_collaboration (Fig. 9)"
    )
    average_after_collaboration: bool = knob(
        False,
        "FedAvg all parameters and BatchNorm buffers after the collaborative phase (the paper's homogeneous "
        "setting; needs one architecture, and every client then starts from one initial model)",
    )


class FCCLPlusClient(PreviousModelClient):
    """Local updating of FCCL+: ``CE + tau^2 * FNTD`` against the previous-round model (Eq. 14)."""

    Hparams = FCCLPlusHparams

    def teacher_choice(self) -> TeacherChoice:
        return self.hp.teacher

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        if self.hp.local_distillation == "fntd":
            loss = loss + fntd_loss(logits, self.teacher_logits(x), y, self.hp.temperature, self.hp.fntd_renormalize)
        elif self.hp.local_distillation == "kd":
            loss = loss + kd_loss(logits, self.teacher_logits(x), self.hp.temperature)
        return loss


class FCCLPlusCollaboration(CrossCorrelationCollaboration):
    """The cross-correlation collaboration with FCCL+'s FISL switch and its homogeneous averaging."""

    Hparams = FCCLPlusHparams

    def fisl_weight(self) -> float:
        return self.hp.fisl_weight if self.hp.use_fisl else 0.0

    def on_train_end(self) -> None:
        """With ``average_after_collaboration``: every ready participant takes the equal-weight average."""
        if not self.hp.average_after_collaboration:
            return
        active = self.ready()
        states = [self.clients[i].model.state_dict() for i in active]
        if len(states) < 2:
            return
        averaged = weighted_average(states, [1.0] * len(states))
        for i in active:
            copy_state_into(self.clients[i].model, averaged)


class HomogeneousSwitch(Algorithm):
    """Sets FCCL+'s capabilities from ``average_after_collaboration`` once its values are known.

    Whole-model averaging after collaborating needs one architecture (refused at start-up, before
    anything runs) and starts every client from one initial model, as the authors synchronise their
    homogeneous clients. A hand-written ``__init__`` taking only ``**values`` leaves the signature
    :class:`FCCLPlus` generates from its declaration unchanged.
    """

    capabilities = Capabilities(heterogeneous_models=True, needs_public_data=True)

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        if self.hp.average_after_collaboration:
            self.capabilities = dataclasses.replace(type(self).capabilities, heterogeneous_models=False)

    def initialisation_of(self, client_id: int) -> int:
        """Client 0's initialisation for everyone when the models are averaged after collaborating."""
        return 0 if self.hp.average_after_collaboration else client_id


class FCCLPlus(HomogeneousSwitch):
    """FCCL+ (heterogeneous models, unlabeled public data; designed for domain shift)."""

    Hparams = FCCLPlusHparams
    client_type = FCCLPlusClient
    upload_type = None
    download_type = None

    def build_collaborative_phase(self, clients: Sequence[ClientModule]) -> FCCLPlusCollaboration:
        return FCCLPlusCollaboration(clients, self.hp)  # type: ignore[arg-type]

    def collaborative_epochs(self) -> int:
        return self.hp.public_epochs


__all__ = ["FCCLPlus", "FCCLPlusClient", "FCCLPlusCollaboration", "FCCLPlusHparams"]
