"""FedMatch, adapted to heterogeneous models with unlabelled public data (an APPROXIMATION).

Paper: Jeong, Yoon, Yang & Hwang, "Federated Semi-Supervised Learning with Inter-Client
Consistency & Disjoint Learning", ICLR 2021. FCCL+'s benchmark (Huang et al., TPAMI 2023,
Tab. VIII-IX) reports it as a baseline, but neither the FCCL+ authors' code nor MarsFL holds an
implementation; this adaptation follows ``reference/fccl-plus.md`` section 5 and is labelled
an approximation wherever its numbers are reported.

Upload: nothing after local training. During the collaborative phase, per public batch, each
participant's logits on the (weakly augmented) batch (``|B0| x C`` float32, validated).
Download: per public batch, for each participant, the mean softmax prediction of its helpers
(``|B0| x C`` float32); the pseudo-labels follow from it on the client.
Server phase: none persistent; the per-batch helper averages are formed inside the lock-step
:class:`FedMatchPhase`.
Client state kept across rounds: the local model and its optimizer state.
Collaborative loss of participant ``i`` on public batch ``x`` (helpers = every other
participant, ``p_H`` the mean of their softmax outputs on ``x``, detached)::

    pseudo_label_weight * sum_b [max p_H(b) > threshold] CE(z_i(strong(x))_b, argmax p_H(b)) / B
    + consistency_weight * KL(p_H || softmax(z_i(x)))

then local cross-entropy on private data for the trainer's ``max_epochs``.
What is kept from FedMatch: inter-client consistency (KL of the local prediction to the
helpers' predictions on unlabelled data) and confidence-thresholded pseudo-labels (0.85)
trained on a strongly augmented view (FixMatch-style, its ``B``-normalised masked CE).
What is dropped, and why:
* Parameter decomposition into supervised ``sigma`` and unsupervised ``psi`` weights, with its
  sparsity/L2 regularisers and sparse communication: it needs one architecture to add and
  exchange the parameter sets, impossible across heterogeneous models.
* Helper selection by model similarity (top-H nearest models on a random input): helpers are
  all other participants, since logits are the only thing the clients share here.
* The local model's own vote in the pseudo-label agreement: pseudo-labels come from the
  helpers' mean prediction, as the reference adaptation prescribes.
* RandAugment as the strong augmentation: the strong view is the public batch with an extra
  random flip, random crop (padding ``H // 8``) and a ``H // 2`` cutout filled with the
  dataset mean (zero after normalisation), drawn from the loop's seeded global RNG. The cutout
  square spans ``H // 4`` pixels on each side of its centre, so for an even ``H // 2`` its side
  is ``H // 2 + 1`` (15 pixels at ``H = 28``), one more than DeVries & Taylor's.
* FedMatch's labels-at-server / labels-at-client scenarios: here private data are labelled and
  the unlabelled data are the shared public set, like the other public-data baselines.
Optimizers follow the benchmark's common frame: Adam 1e-3 re-created every public step, local
Adam 1e-3 with weight decay 1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from fedhet.algorithms.shared.common import (
    PublicDistillationAlgorithm,
    PublicDistillationHparams,
    PublicDistillationPhase,
)
from fedhet.data.augment import Compose, RandomCropPad, RandomHorizontalFlip
from fedhet.errors import ConfigError
from fedhet.functional.distillation import confident_pseudo_labels, kl_to_target, masked_pseudo_label_loss
from fedhet.hparams import NonNegativeFloat, UnitInterval, knob, log_uniform, uniform


class Cutout:
    """Fill one random square per image with zero (the mean, after normalisation).

    The square is centred on a uniformly drawn pixel and spans ``size // 2`` pixels on each side
    (side ``size`` when odd, ``size + 1`` when even), clipped where it extends past the border
    (DeVries & Taylor 2017 clip the same way; their side is ``size`` for even sizes).

    Args:
        size: the square's nominal side (0: no cut).
    """

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"cutout size must be >= 0, got {size}")
        self.size = size

    def __call__(self, images: Tensor, generator: torch.Generator) -> Tensor:
        """Return ``images`` with one square per sample set to zero."""
        if self.size == 0:
            return images
        batch, _, height, width = images.shape
        centre_y = torch.randint(0, height, (batch,), generator=generator).to(images.device)
        centre_x = torch.randint(0, width, (batch,), generator=generator).to(images.device)
        rows = torch.arange(height, device=images.device)[None, :]
        cols = torch.arange(width, device=images.device)[None, :]
        inside_y = (rows - centre_y[:, None]).abs() <= self.size // 2  # [B, H]
        inside_x = (cols - centre_x[:, None]).abs() <= self.size // 2  # [B, W]
        cut = (inside_y[:, :, None] & inside_x[:, None, :])[:, None]  # [B, 1, H, W]
        return images.masked_fill(cut, 0.0)

    def __repr__(self) -> str:
        return f"Cutout(size={self.size})"


def strong_augment(image_size: int) -> Compose:
    """The strong view of FedMatch's pseudo-label loss (stand-in for RandAugment, see module docstring)."""
    return Compose([RandomHorizontalFlip(), RandomCropPad(max(1, image_size // 8)), Cutout(image_size // 2)])


@dataclass(frozen=True)
class FedMatchHparams(PublicDistillationHparams):
    """FedMatch's hyperparameters (the paper's threshold; the benchmark frame's optimizers)."""

    threshold: UnitInterval = knob(
        0.85, "helper confidence above which a public sample gets a pseudo-label (paper: 0.85)", uniform(0.5, 0.99)
    )
    pseudo_label_weight: NonNegativeFloat = knob(
        1.0, "weight of the pseudo-label cross-entropy on the strong view", log_uniform(0.1, 10.0)
    )
    consistency_weight: NonNegativeFloat = knob(
        1.0, "weight of the inter-client consistency KL", log_uniform(0.1, 10.0)
    )

    def check(self) -> None:
        if not self.threshold < 1.0:
            raise ConfigError(f"threshold={self.threshold} is not a number in [0, 1) (1 would never pseudo-label)")


class FedMatchPhase(PublicDistillationPhase):
    """Helpers' consistency plus their confident pseudo-labels on a strongly augmented view."""

    Hparams = FedMatchHparams

    def strong_view(self, x: Tensor) -> Tensor:
        """A strongly augmented copy of public batch ``x``, from the loop's seeded global RNG."""
        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
        return strong_augment(x.shape[-1])(x, generator)

    def distillation_losses(self, logits: list[Tensor], x: Tensor) -> list[Tensor]:
        if len(logits) < 2:  # no helper this round
            return [z.sum() * 0.0 for z in logits]
        probs = torch.stack([F.softmax(z.detach(), dim=1) for z in logits])  # [K, B, C]
        strong = self.strong_view(x) if self.hp.pseudo_label_weight > 0 else None
        losses = []
        exchanging = [self.clients[index] for index in self.exchanging]
        for i, (client, z) in enumerate(zip(exchanging, logits, strict=True)):
            helpers = (probs.sum(dim=0) - probs[i]) / (len(logits) - 1)
            loss = self.hp.consistency_weight * kl_to_target(z, helpers)
            if strong is not None:
                labels, mask = confident_pseudo_labels(helpers, self.hp.threshold)
                loss = loss + self.hp.pseudo_label_weight * masked_pseudo_label_loss(client(strong), labels, mask)
            losses.append(loss)
        return losses


class FedMatch(PublicDistillationAlgorithm):
    """FedMatch adapted to heterogeneous models with public data (approximation; see module docstring)."""

    Hparams = FedMatchHparams
    phase_type = FedMatchPhase


__all__ = ["Cutout", "FedMatch", "FedMatchHparams", "FedMatchPhase", "strong_augment"]
