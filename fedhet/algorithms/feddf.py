"""FedDF, heterogeneous form: every client distils towards the ensemble average on public data.

Paper: Lin, Kong, Stich & Jaggi, "Ensemble Distillation for Robust Model Fusion in Federated
Learning", NeurIPS 2020 (Section 3, Algorithm 1), in the model-heterogeneous form of FCCL+'s
benchmark (Huang et al., TPAMI 2023, Tab. VIII-IX; ``fccl+/models/feddf.py`` of WenkeHuang/FCCL).

Upload: nothing after local training. During the collaborative phase, per public batch, each
participant's logits on that batch (``|B0| x C`` float32, validated as a
``PublicLogitsPayload``).
Download: per public batch, the ensemble's averaged logits (``|B0| x C`` float32).
Server phase: none persistent; the per-batch ensemble average is computed inside the lock-step
:class:`FedDFPhase`. The ledger counts ``|B0| * C * 4`` bytes up and down per participant and
public batch.
Client state kept across rounds: the local model and its optimizer state.
Round: distillation (one SGD step per participant per public batch on
``T^2 * KL(softmax(z_ens / T) || softmax(z_i / T))``, the ensemble including the participant
itself), then local cross-entropy for the trainer's ``max_epochs``.
Deviations from paper/official code:
* The paper fuses the clients into *server* models (one per architecture prototype) by
  distilling the ensemble on unlabelled data; with one model per client and no shared
  architecture there is no server model: as in the benchmark code, each client is the student
  of the ensemble average and distils on its own side, in lock-step per public batch.
* Optimizer of the distillation steps per the benchmark code: SGD, lr 1e-3, weight decay 1e-5,
  a new optimizer every step (plain SGD keeps no state, so this only matters for other choices;
  ``reset_public_optimizer`` keeps the code's behaviour). [P Tab. XII] reports that FedDF
  diverges with Tiny-ImageNet public data; that is the method, not the harness.
* The code runs a second forward pass for the student after computing the targets (BatchNorm
  statistics update twice); here one train-mode forward gives both.
* ``temperature`` scales the KL by ``T^2`` (Hinton); the benchmark's ``T = 1`` is the code's
  plain KL.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from fedhet.algorithms.shared.common import (
    PublicDistillationAlgorithm,
    PublicDistillationHparams,
    PublicDistillationPhase,
)
from fedhet.functional.distillation import ensemble_distillation_loss, logit_consensus
from fedhet.hparams import NonNegativeFloat, OptimizerName, PositiveFloat, knob, log_uniform


@dataclass(frozen=True)
class FedDFHparams(PublicDistillationHparams):
    """FedDF's hyperparameters (FCCL+'s benchmark code: distillation by SGD 1e-3, weight decay 1e-5)."""

    public_optimizer: OptimizerName = knob("sgd", "optimizer of the distillation steps (benchmark code: SGD)")
    public_weight_decay: NonNegativeFloat = knob(1e-5, "L2 weight decay of the distillation steps")
    temperature: PositiveFloat = knob(1.0, "distillation temperature T (benchmark: 1)", log_uniform(0.5, 10.0))


class FedDFPhase(PublicDistillationPhase):
    """Each participant distils the averaged logits of all participants (itself included)."""

    Hparams = FedDFHparams

    def distillation_losses(self, logits: list[Tensor], x: Tensor) -> list[Tensor]:
        ensemble = logit_consensus(logits)
        return [ensemble_distillation_loss(z, ensemble, self.hp.temperature) for z in logits]


class FedDF(PublicDistillationAlgorithm):
    """FedDF in its heterogeneous form (every client a student of the ensemble)."""

    Hparams = FedDFHparams
    phase_type = FedDFPhase


__all__ = ["FedDF", "FedDFHparams", "FedDFPhase"]
