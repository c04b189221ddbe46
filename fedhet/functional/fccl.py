"""Losses of FCCL (Huang et al., CVPR 2022) and FCCL+ (Huang et al., TPAMI 2023).

Every function is pure: tensors in, a tensor out. Targets computed from other clients (the
averaged logits and similarities) are treated as constants: they are detached here, so that a
client's loss can never back-propagate into another client's graph. Equation numbers refer to
the FCCL+ paper; ``[C]`` marks behaviour taken from the authors' code (``WenkeHuang/FCCL``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def batch_standardize(logits: Tensor, eps: float = 1e-5) -> Tensor:
    """Z-score every logit dimension over the batch: ``(z - mean_b z) / (std_b z + eps)``.

    The std is the unbiased one (``/(B-1)``) as in the authors' code (and Barlow Twins'), so a
    perfectly matched pair gives a cross-correlation diagonal of ``(B-1)/B`` rather than 1.
    ``eps`` guards a constant logit column (a dead unit, a tiny last batch); the code has none.

    Example:
        >>> batch_standardize(torch.tensor([[1.0], [3.0]]), eps=0.0)
        tensor([[-0.7071],
                [ 0.7071]])
    """
    if logits.shape[0] < 2:
        raise ValueError(f"batch standardisation needs at least 2 samples, got {logits.shape[0]}")
    return (logits - logits.mean(0)) / (logits.std(0) + eps)


def cross_correlation(logits: Tensor, target_logits: Tensor, eps: float = 1e-5) -> Tensor:
    """The ``C x C`` cross-correlation matrix ``M = Phi(Z)^T Phi(Zbar) / B`` (Eq. 1, code form).

    ``target_logits`` is detached: the gradient flows only into ``logits``.
    """
    batch = logits.shape[0]
    return batch_standardize(logits, eps).t() @ batch_standardize(target_logits.detach(), eps) / batch


def fccm_loss(
    logits: Tensor,
    target_logits: Tensor,
    off_diag_weight: float = 0.0051,
    off_diag_target: float = -1.0,
    eps: float = 1e-5,
) -> Tensor:
    """Federated Cross-Correlation Matrix loss (FCCL+ Eq. 1-2; FCCL's collaborative loss).

    ``L = sum_u (1 - M[u,u])^2 + lambda * sum_{u != v} (M[u,v] - off_diag_target)^2`` with ``M``
    from :func:`cross_correlation`. The diagonal pulls each logit dimension towards the same
    dimension of the averaged logits (class invariance across clients); the off-diagonal term,
    target -1 as in the paper's Fig. 2 (``M_T = 2 I - 1``) and the code's ``(M + 1)^2``, pushes
    different classes apart. ``off_diag_target=0`` gives the Barlow-Twins "decorrelate" form.

    Args:
        logits: this client's logits on the public batch, ``[B, C]``.
        target_logits: the averaged logits of all participants ``Zbar``, ``[B, C]`` (detached).
        off_diag_weight: lambda (0.0051 in paper and code).
        off_diag_target: target of off-diagonal entries (-1 paper/code, 0 Barlow Twins).
        eps: added to the per-dimension std (numerical guard).
    """
    matrix = cross_correlation(logits, target_logits, eps)
    diagonal = torch.diagonal(matrix)
    on_diag = (1.0 - diagonal).pow(2).sum()
    off_mask = ~torch.eye(matrix.shape[0], dtype=torch.bool, device=matrix.device)
    off_diag = (matrix[off_mask] - off_diag_target).pow(2).sum()
    return on_diag + off_diag_weight * off_diag


def instance_similarity(features: Tensor, temperature: float = 0.02) -> Tensor:
    """Instance-similarity logits ``S`` of a batch (FCCL+ Eq. 3-4, code form), ``[B, B-1]``.

    Features are L2-normalised per row (so clients with different feature sizes produce
    comparable ``B x B`` matrices), their cosine similarities divided by ``temperature`` (mu),
    and each row's self-similarity is removed by masking and reshaping, not by zeroing: a
    zeroed entry would still enter the softmax of :func:`fisl_loss`.

    Args:
        features: pooled penultimate features ``[B, d]`` (``d`` may differ between clients).
        temperature: mu (0.02 in the paper text and code; Tab. VII's 0.002 is a typo).
    """
    batch = features.shape[0]
    if batch < 2:
        raise ValueError(f"instance similarity needs at least 2 samples, got {batch}")
    normalized = F.normalize(features, dim=1)
    similarity = normalized @ normalized.t() / temperature
    off_diagonal = ~torch.eye(batch, dtype=torch.bool, device=features.device)
    return similarity[off_diagonal].view(batch, batch - 1)


def fisl_loss(similarity: Tensor, target_similarity: Tensor) -> Tensor:
    """Federated Instance Similarity Learning loss (FCCL+ Eq. 5).

    ``KL(softmax(Sbar) || softmax(S))`` row by row, summed over the row and averaged over the
    batch (``batchmean``): each public image's distribution of similarity to the other images
    is aligned with the participants' average. ``target_similarity`` is detached.
    """
    return F.kl_div(
        F.log_softmax(similarity, dim=1), F.softmax(target_similarity.detach(), dim=1), reduction="batchmean"
    )


def kd_loss(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 3.0) -> Tensor:
    """Ordinary knowledge distillation ``tau^2 * KL(p_T^tau || p_S^tau)`` (FCCL+ Eq. 7-10).

    The ablation "x" of FCCL+'s Fig. 10 at the same temperature; at ``temperature=1`` it is
    the plain KL of FCCL's local objective. ``teacher_logits`` is detached.
    """
    teacher = F.softmax(teacher_logits.detach() / temperature, dim=1)
    student = F.log_softmax(student_logits / temperature, dim=1)
    return temperature**2 * F.kl_div(student, teacher, reduction="batchmean")


def fntd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    targets: Tensor,
    temperature: float = 3.0,
    renormalize: bool = False,
) -> Tensor:
    """Federated Non-Target Distillation, ``tau^2 * sum_{u != t} p_T^u log(p_T^u / p_S^u)`` (Eq. 13).

    The target-class term of KD is dropped because a teacher less (or more) confident than the
    student on the label would pull against the cross-entropy. As in the paper's Eq. 13 and the
    code, the probabilities are the temperature softmax over **all** classes with the target
    entry removed, not renormalised over the non-target classes, and the result is multiplied by
    ``tau^2`` (code). This form still has a gradient on the target logit,
    ``tau * (1 - p_T^t) * p_S^t`` per sample, a teacher-modulated confidence penalty;
    ``renormalize=True`` softmaxes the ``C-1`` non-target logits instead (DKD's NCKD form),
    whose target-logit gradient is exactly zero, as Eq. 12 states. ``teacher_logits`` is detached.

    Args:
        student_logits: ``[B, C]`` logits of the model being trained.
        teacher_logits: ``[B, C]`` logits of the teacher (the previous-round model).
        targets: ``[B]`` class labels.
        temperature: tau (3 on Digits and Office31).
        renormalize: softmax over the non-target classes only.
    """
    batch, classes = student_logits.shape
    non_target = ~F.one_hot(targets, classes).bool()
    teacher_logits = teacher_logits.detach() / temperature
    student_logits = student_logits / temperature
    if renormalize:
        teacher = F.softmax(teacher_logits[non_target].view(batch, classes - 1), dim=1)
        student = F.log_softmax(student_logits[non_target].view(batch, classes - 1), dim=1)
    else:
        teacher = F.softmax(teacher_logits, dim=1)[non_target].view(batch, classes - 1)
        student = F.log_softmax(student_logits, dim=1)[non_target].view(batch, classes - 1)
    return temperature**2 * F.kl_div(student, teacher, reduction="batchmean")


def dual_domain_distillation(student_logits: Tensor, previous_logits: Tensor, pretrained_logits: Tensor) -> Tensor:
    """FCCL's local distillation (CVPR 2022; FCCL+ Eq. 19 without the CE term).

    ``KL(p_prev || p_S) + KL(p_pre || p_S)`` at temperature 1 with unit weights: the
    previous-round model keeps the inter-domain knowledge gained by collaborating, the frozen
    locally pre-trained model keeps a confident intra-domain teacher.
    """
    return kd_loss(student_logits, previous_logits, 1.0) + kd_loss(student_logits, pretrained_logits, 1.0)


def linear_round_decay(round_idx: int, total_rounds: int, final_fraction: float = 0.1) -> float:
    """The authors' per-round learning-rate factor ``1 - (1 - final_fraction) * max(e - 1, 0) / E``.

    The code sets ``lr = lr0 * (1 - 0.9 * e / E)`` *after* round ``e`` (0-indexed) has used it, so
    rounds 0 and 1 both train at ``lr0`` and the last round at ``lr0 * (1 - 0.9 (E - 2) / E)``.

    Example:
        >>> linear_round_decay(0, 10), linear_round_decay(1, 10), linear_round_decay(6, 10)
        (1.0, 1.0, 0.55)
    """
    if total_rounds < 1:
        raise ValueError(f"total_rounds must be >= 1, got {total_rounds}")
    return 1.0 - (1.0 - final_fraction) * max(round_idx - 1, 0) / total_rounds
