"""Losses and weights of the public-data distillation baselines (FedMD, FedDF, RHFL, FedMatch).

Every method here exchanges logits on a shared public batch: each participant's target is built
from the *detached* outputs of the others (:func:`logit_consensus` detaches), so a participant's
loss back-propagates into its own model only. Conventions follow the code that produced the
FCCL+ benchmark numbers (``reference/fccl-plus.md`` section 5): KL divergences are
``KL(target || student)`` with ``reduction="batchmean"`` (a sum over classes, a mean over
samples), never ``"mean"``, which would silently divide by the number of classes as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

DigestLoss = Literal["l1", "mse"]


def logit_consensus(logits: Sequence[Tensor]) -> Tensor:
    """The detached mean of several participants' logits on the same batch (FedMD, FedDF).

    Detaching is what keeps each participant's update its own: without it, the mean would
    carry every participant's graph and one loss would update all models.

    Args:
        logits: one ``[B, C]`` tensor per participant, rows aligned (same public images).

    Returns:
        ``[B, C]`` mean logits without gradient.

    Example:
        >>> logit_consensus([torch.tensor([[1.0, 3.0]]), torch.tensor([[3.0, -1.0]])])
        tensor([[2., 1.]])
    """
    if not logits:
        raise ValueError("logit_consensus needs the logits of at least one participant")
    return torch.stack([z.detach() for z in logits]).mean(dim=0)


def digest_loss(logits: Tensor, consensus: Tensor, kind: DigestLoss = "l1") -> Tensor:
    """FedMD's "digest" loss: distance of a participant's logits to the consensus.

    The FedMD paper (Li & Wang 2019) regresses on the consensus with the mean squared error
    (``"mse"``); the code behind FCCL+'s FedMD numbers (``fccl/Idea/Counterpart/fedmd.py``,
    MarsFL) uses the mean absolute error (``"l1"``, ``nn.L1Loss(reduction="mean")``). Both
    average over all ``B * C`` entries.

    Args:
        logits: ``[B, C]`` the participant's logits (with gradient).
        consensus: ``[B, C]`` the target (detached).
        kind: ``"l1"`` or ``"mse"``.
    """
    if kind == "l1":
        return F.l1_loss(logits, consensus.detach())
    if kind == "mse":
        return F.mse_loss(logits, consensus.detach())
    raise ValueError(f"digest loss must be 'l1' or 'mse', got {kind!r}")


def kl_to_target(student_logits: Tensor, target_probs: Tensor) -> Tensor:
    """``KL(target || softmax(student))`` summed over classes, averaged over samples.

    Args:
        student_logits: ``[B, C]`` logits of the model being trained.
        target_probs: ``[B, C]`` target distributions (rows sum to one; treated as constants).
    """
    return F.kl_div(F.log_softmax(student_logits, dim=1), target_probs.detach(), reduction="batchmean")


def logit_cross_entropy(student_logits: Tensor, target_logits: Tensor) -> Tensor:
    """``-sum_c softmax(target)_c log softmax(student)_c``, averaged over samples (FD's regulariser).

    Jeong et al.'s federated distillation (2018, Alg. 1) adds ``beta * phi(F(w, x), Fhat_y)``
    with ``phi`` the cross-entropy and ``Fhat_y`` the global average logit of the sample's label.
    Unlike an MSE to raw logits, its gradient ``softmax(student) - softmax(target)`` is bounded
    (each row sums to at most 2 in absolute value), whatever the scale the targets drift to.

    Args:
        student_logits: ``[B, C]`` logits of the model being trained.
        target_logits: ``[B, C]`` teacher logits (detached; softmaxed here).
    """
    target = F.softmax(target_logits.detach(), dim=1)
    return -(target * F.log_softmax(student_logits, dim=1)).sum(dim=1).mean()


def ensemble_distillation_loss(student_logits: Tensor, ensemble_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """FedDF's distillation towards the ensemble: ``T^2 * KL(softmax(z_ens/T) || softmax(z/T))``.

    FedDF (Lin et al., NeurIPS 2020) distils the averaged logits of the ensemble into
    each model. The ``T^2`` factor (Hinton et al. 2015) keeps gradient magnitudes comparable
    across temperatures; at ``T = 1``, the FCCL+ benchmark's setting, it is the plain KL of
    ``fccl+/models/feddf.py``.

    Args:
        student_logits: ``[B, C]`` logits of the model being trained.
        ensemble_logits: ``[B, C]`` averaged logits of the participants (detached).
        temperature: softmax temperature ``T > 0``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    target = F.softmax(ensemble_logits.detach() / temperature, dim=1)
    return temperature**2 * kl_to_target(student_logits / temperature, target)


def symmetric_cross_entropy(
    logits: Tensor, labels: Tensor, alpha: float = 0.1, beta: float = 1.0, label_clamp: float = 1e-4
) -> Tensor:
    """Symmetric cross-entropy, RHFL's noise-robust local loss: ``alpha * CE + beta * RCE``.

    Wang et al. (ICCV 2019), as used by RHFL (Fang & Ye, CVPR 2022; ``loss.py`` of
    FangXiuwen/Robust_FL). The reverse cross-entropy swaps the roles of prediction and label,
    ``RCE = -sum_k p_k log q_k`` with ``q`` the one-hot label clamped to ``[1e-4, 1]`` so that
    ``log 0`` becomes the finite ``log 1e-4``; predictions are clamped to ``[1e-7, 1]`` as in
    the code. RCE is bounded, so a wrong (noisy) label cannot dominate the gradient.

    Args:
        logits: ``[B, C]`` logits.
        labels: ``[B]`` integer labels.
        alpha: weight of the cross-entropy (RHFL: 0.1).
        beta: weight of the reverse cross-entropy (RHFL: 1.0).
        label_clamp: floor of the one-hot label inside the logarithm (``1e-4``, i.e. ``A = log 1e-4``).
    """
    cross_entropy = F.cross_entropy(logits, labels)
    probs = F.softmax(logits, dim=1).clamp(min=1e-7, max=1.0)
    one_hot = F.one_hot(labels, logits.shape[1]).to(probs.dtype).clamp(min=label_clamp, max=1.0)
    reverse = -(probs * one_hot.log()).sum(dim=1).mean()
    return alpha * cross_entropy + beta * reverse


def weighted_peer_kl(student_logits: Tensor, peer_logits: Sequence[Tensor], peer_weights: Tensor) -> Tensor:
    """RHFL's collaborative loss: ``sum_j w_j KL(softmax(z_j) || softmax(z))`` over the peers ``j``.

    Each peer's distribution is a separate KL target (not one averaged target), weighted by
    that peer's confidence ``w_j`` (:func:`client_confidence_weights`). Peers are detached.

    Args:
        student_logits: ``[B, C]`` logits of the participant being trained.
        peer_logits: one ``[B, C]`` tensor per *other* participant.
        peer_weights: ``[len(peer_logits)]`` weights ``w_j``.
    """
    if len(peer_logits) != peer_weights.numel():
        raise ValueError(
            f"weighted_peer_kl needs one weight per peer, got {len(peer_logits)} peers, {peer_weights.numel()} weights"
        )
    weights = peer_weights.to(student_logits.device, student_logits.dtype)
    losses = torch.stack([kl_to_target(student_logits, F.softmax(z.detach(), dim=1)) for z in peer_logits])
    return (weights * losses).sum()


def client_confidence_weights(previous_losses: Tensor, current_losses: Tensor, beta: float = 0.5) -> Tensor:
    """RHFL's client confidence re-weighting (CCR) from the decrease of each client's private loss.

    Fang & Ye (CVPR 2022), exactly as ``HHF/HHF.py`` of FangXiuwen/Robust_FL computes
    it from each client's mean SCE loss on its private data in two consecutive rounds::

        q_i = (previous_i - current_i) / current_i          # learning efficiency ("quality")
        a_i = 1 / (K - 1) + beta * q_i / sum_j q_j
        w_i = exp(a_i) / sum_j exp(a_j)

    A client whose loss fell more (cleaner labels, a model that is learning) gets a larger
    weight as a teacher. The constant ``1 / (K - 1)`` cancels in the softmax; it is kept to
    match the published form. When ``sum_j q_j`` is zero (no client changed) the quality term
    is undefined and dropped, giving uniform weights ``1 / K``.

    Args:
        previous_losses: ``[K]`` mean private losses of the previous round.
        current_losses: ``[K]`` mean private losses of this round (positive).
        beta: weight of the quality term (RHFL hard-codes 0.5).

    Returns:
        ``[K]`` weights summing to one (float64).
    """
    previous = previous_losses.to(torch.float64)
    current = current_losses.to(torch.float64)
    if previous.shape != current.shape or previous.dim() != 1 or previous.numel() < 2:
        raise ValueError(
            "client_confidence_weights needs two [K] loss vectors with K >= 2, "
            f"got {tuple(previous.shape)} and {tuple(current.shape)}"
        )
    quality = (previous - current) / current.clamp_min(1e-12)
    total = quality.sum()
    share = quality / total if bool(total.abs() > 1e-12) else torch.zeros_like(quality)
    amount = 1.0 / (previous.numel() - 1) + beta * share
    return torch.softmax(amount, dim=0)


def confident_pseudo_labels(probs: Tensor, threshold: float = 0.85) -> tuple[Tensor, Tensor]:
    """Hard pseudo-labels where a predictive distribution is confident enough (FedMatch, FixMatch).

    Args:
        probs: ``[B, C]`` class probabilities (here: the mean of the helpers' softmax outputs).
        threshold: a sample gets a pseudo-label when its top probability exceeds this (FedMatch: 0.85).

    Returns:
        ``(labels [B] long, mask [B] bool)``: the argmax class and whether it passes the threshold.
    """
    confidence, labels = probs.detach().max(dim=1)
    return labels, confidence > threshold


def masked_pseudo_label_loss(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Cross-entropy on the pseudo-labelled samples, divided by the *whole* batch size.

    Dividing by ``B`` rather than by the number of confident samples is FixMatch's convention
    (which FedMatch builds on): the loss weight grows with the share of confident samples, so
    a batch with one confident sample does not take a full-size step towards its label.

    Args:
        logits: ``[B, C]`` logits of the model being trained (on the strongly augmented view).
        labels: ``[B]`` pseudo-labels.
        mask: ``[B]`` bool, which samples carry a pseudo-label.
    """
    per_sample = F.cross_entropy(logits, labels, reduction="none")
    return (per_sample * mask.to(per_sample.dtype)).sum() / max(logits.shape[0], 1)
