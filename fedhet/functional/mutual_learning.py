"""Mutual distillation, SVD update compression and generator diversity: FML, FedKD and FedGen math.

* :func:`distillation_kl` and :func:`mutual_learning_losses`: deep mutual learning (Zhang et al.,
  CVPR 2018), as FML (Shen et al., 2020) trains a private and a shared "meme" model together.
* :func:`adaptive_distillation_weight` and :func:`adaptive_mutual_distillation`: FedKD's
  (Wu et al., Nature Communications 2022, Eq. 1-4) mutual distillation whose strength grows when
  both models predict the labels well.
* :func:`energy_rank`, :func:`svd_compress`, :func:`compress_state`, :func:`decompress_state`:
  FedKD's dynamic-rank SVD compression of what crosses the network (its Eq. 5-6).
* :func:`diversity_loss`: FedGen's (Zhu et al., ICML 2021, Eq. 7) generator diversity term in
  the form of its official ``DiversityLoss(metric='l1')``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

KLReduction = Literal["batchmean", "mean"]


def distillation_kl(logits: Tensor, target_logits: Tensor, reduction: KLReduction = "batchmean") -> Tensor:
    """``KL(softmax(target) || softmax(logits))`` with the target treated as a constant.

    ``reduction="batchmean"`` is the KL divergence averaged over samples (the papers' formula);
    ``"mean"`` averages over samples *and* classes, which is what HtFLlib's ``nn.KLDivLoss()``
    (default reduction) computes, i.e. the KL divided by the number of classes.

    Example:
        >>> distillation_kl(torch.zeros(1, 2), torch.zeros(1, 2))
        tensor(0.)
    """
    if reduction not in ("batchmean", "mean"):
        raise ValueError(f"unknown KL reduction {reduction!r}; use 'batchmean' or 'mean'")
    log_probs = F.log_softmax(logits, dim=1)
    target = F.softmax(target_logits.detach(), dim=1)
    kl = F.kl_div(log_probs, target, reduction="batchmean")
    return kl / logits.shape[1] if reduction == "mean" else kl


def mutual_learning_losses(
    logits_a: Tensor,
    logits_b: Tensor,
    targets: Tensor,
    alpha: float = 0.5,
    beta: float = 0.5,
    reduction: KLReduction = "batchmean",
) -> tuple[Tensor, Tensor]:
    """FML's deep-mutual-learning objectives of two models trained on the same batch.

    ``loss_a = alpha * CE(a, y) + (1 - alpha) * KL(p_b || p_a)`` and
    ``loss_b = beta * CE(b, y) + (1 - beta) * KL(p_a || p_b)`` (FML Eq. 3-4). Each peer's
    prediction is a constant in the other's loss, so ``loss_a + loss_b`` back-propagates each loss
    into its own model only.

    Args:
        logits_a: logits of the first (private) model ``[B, C]``.
        logits_b: logits of the second (shared meme) model ``[B, C]``.
        targets: labels ``[B]``.
        alpha: weight of the label loss of model a (1 - alpha weighs its KL term).
        beta: weight of the label loss of model b.
        reduction: KL reduction, see :func:`distillation_kl`.
    """
    loss_a = alpha * F.cross_entropy(logits_a, targets) + (1 - alpha) * distillation_kl(logits_a, logits_b, reduction)
    loss_b = beta * F.cross_entropy(logits_b, targets) + (1 - beta) * distillation_kl(logits_b, logits_a, reduction)
    return loss_a, loss_b


def adaptive_distillation_weight(teacher_task_loss: Tensor, student_task_loss: Tensor) -> Tensor:
    """FedKD's distillation strength ``1 / (L_t^task + L_s^task)``, a constant for back-propagation.

    When both models fit the labels (small cross-entropies) their predictions are trustworthy and
    distillation is strong; when either is wrong it is damped (FedKD Eq. 1-4). The weight is
    detached: it scales the distillation terms and is not itself a quantity to optimise.

    Example:
        >>> adaptive_distillation_weight(torch.tensor(0.5), torch.tensor(1.5))
        tensor(0.5000)
    """
    return 1.0 / (teacher_task_loss.detach() + student_task_loss.detach())


def adaptive_mutual_distillation(
    teacher_logits: Tensor,
    student_logits: Tensor,
    teacher_hidden: Tensor,
    student_hidden_mapped: Tensor,
    targets: Tensor,
    reduction: KLReduction = "batchmean",
) -> tuple[Tensor, Tensor]:
    """FedKD's teacher and student objectives (Eq. 1-4) on one batch.

    ``w = 1 / (CE_t + CE_s)``;
    ``L_t = CE_t + w * KL(p_s || p_t) + w * MSE(H_t, W_h H_s)`` and
    ``L_s = CE_s + w * KL(p_t || p_s) + w * MSE(H_t, W_h H_s)``. The peer's output is a constant in
    each loss, so ``L_t + L_s`` sends each loss's gradient to its own side only (the student side
    includes the hidden-state map ``W_h``).

    Args:
        teacher_logits: private teacher's logits ``[B, C]``.
        student_logits: shared student's logits ``[B, C]``.
        teacher_hidden: teacher features ``[B, D_t]``.
        student_hidden_mapped: student features mapped to the teacher's space, ``W_h H_s`` ``[B, D_t]``.
        targets: labels ``[B]``.
        reduction: KL reduction, see :func:`distillation_kl`.
    """
    ce_teacher = F.cross_entropy(teacher_logits, targets)
    ce_student = F.cross_entropy(student_logits, targets)
    weight = adaptive_distillation_weight(ce_teacher, ce_student)
    hidden_teacher = F.mse_loss(teacher_hidden, student_hidden_mapped.detach())
    hidden_student = F.mse_loss(teacher_hidden.detach(), student_hidden_mapped)
    teacher_loss = ce_teacher + weight * (distillation_kl(teacher_logits, student_logits, reduction) + hidden_teacher)
    student_loss = ce_student + weight * (distillation_kl(student_logits, teacher_logits, reduction) + hidden_student)
    return teacher_loss, student_loss


def energy_rank(singular_values: Tensor, energy: float) -> int:
    """Smallest ``k`` whose top-``k`` singular values keep at least ``energy`` of ``sum(sigma^2)``.

    FedKD Eq. 6. A zero matrix has rank 0 (nothing needs to be sent).

    Example:
        >>> energy_rank(torch.tensor([3.0, 2.0, 1.0]), 0.9)  # 9 + 4 = 13 >= 0.9 * 14
        2
    """
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    squares = singular_values.double().pow(2)
    total = float(squares.sum())
    if total == 0.0:
        return 0
    below = int((squares.cumsum(0) < energy * total).sum())
    return min(below + 1, singular_values.numel())


def svd_compress(matrix: Tensor, energy: float) -> tuple[Tensor, Tensor, Tensor]:
    """Truncated SVD ``(U_k [m,k], sigma_k [k], V_k^T [k,n])`` of a 2-D matrix keeping ``energy``.

    ``U_k diag(sigma_k) V_k^T`` is the best rank-``k`` approximation (Eckart-Young), so its squared
    Frobenius error is ``sum(sigma^2) - sum(sigma_k^2) <= (1 - energy) * ||matrix||_F^2``.
    """
    if matrix.dim() != 2:
        raise ValueError(f"svd_compress needs a 2-D matrix, got shape {tuple(matrix.shape)}")
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    k = energy_rank(s, energy)
    return u[:, :k].contiguous(), s[:k].contiguous(), vh[:k].contiguous()


def svd_decompress(u: Tensor, s: Tensor, vh: Tensor) -> Tensor:
    """``U diag(sigma) V^T``, the matrix the factors of :func:`svd_compress` stand for."""
    return (u * s.unsqueeze(0)) @ vh


def compress_state(
    state: Mapping[str, Tensor], energy: float
) -> tuple[dict[str, dict[str, Tensor]], dict[str, Tensor]]:
    """Split a state dict into SVD factors (for matrices where they are smaller) and dense tensors.

    Floating tensors with at least two dimensions and more than one row are flattened to
    ``[shape[0], -1]`` (a conv kernel becomes out_channels x (in_channels * kh * kw)) and
    factorised with :func:`svd_compress`; the factors replace the tensor only when
    ``k * (m + n + 1) < m * n``, i.e. when they are actually fewer numbers. Everything else
    (biases, BatchNorm statistics, integer counters) stays dense.

    Returns:
        ``(low_rank, dense)``: ``low_rank[name] = {"u", "s", "v"}``; ``dense[name]`` the tensor.
    """
    low_rank: dict[str, dict[str, Tensor]] = {}
    dense: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.dim() >= 2 and tensor.shape[0] > 1:
            matrix = tensor.detach().reshape(tensor.shape[0], -1)
            u, s, vh = svd_compress(matrix, energy)
            rows, cols = matrix.shape
            if s.numel() * (rows + cols + 1) < rows * cols:
                low_rank[name] = {"u": u, "s": s, "v": vh}
                continue
        dense[name] = tensor.detach().clone()
    return low_rank, dense


def decompress_state(
    low_rank: Mapping[str, Mapping[str, Tensor]], dense: Mapping[str, Tensor], shapes: Mapping[str, torch.Size]
) -> dict[str, Tensor]:
    """Rebuild the state dict that :func:`compress_state` split, reshaping factors to ``shapes``."""
    out = {name: tensor for name, tensor in dense.items()}
    for name, factors in low_rank.items():
        out[name] = svd_decompress(factors["u"], factors["s"], factors["v"]).reshape(shapes[name])
    return out


def diversity_loss(noise: Tensor, outputs: Tensor) -> Tensor:
    """FedGen's generator diversity loss, as its official ``DiversityLoss(metric='l1')``.

    ``exp(-mean_{i,j}(noise_dist[i,j] * output_dist[i,j]))`` with
    ``noise_dist = mean_dims (z_i - z_j)^2`` and ``output_dist = mean_dims |g_i - g_j|``: small when
    distant noises give distant outputs, so minimising it counters mode collapse (FedGen Eq. 7
    writes L2 norms; the per-dimension means keep the exponent of order one, see
    ``reference/fedftg.md`` section 3.4).

    Example:
        >>> diversity_loss(torch.zeros(2, 3), torch.zeros(2, 4))
        tensor(1.)
    """
    flat = outputs.reshape(outputs.shape[0], -1)
    output_dist = (flat.unsqueeze(1) - flat.unsqueeze(0)).abs().mean(dim=2)
    noise_dist = (noise.unsqueeze(1) - noise.unsqueeze(0)).pow(2).mean(dim=2)
    return torch.exp(-(noise_dist * output_dist).mean())


def energy_schedule(round_idx: int, total_rounds: int, t_start: float, t_end: float) -> float:
    """FedKD's energy threshold of round ``round_idx``: linear from ``t_start`` towards ``t_end``.

    The official code (``wuch15/FedKD`` ``run.py``) compresses round ``t``'s updates with
    ``T_start + (t + 1) / R * (T_end - T_start)``, reaching ``T_end`` in the last round.

    Example:
        >>> energy_schedule(0, 4, 0.9, 0.98), energy_schedule(3, 4, 0.9, 0.98)
        (0.92, 0.98)
    """
    if total_rounds < 1:
        raise ValueError(f"total_rounds must be >= 1, got {total_rounds}")
    progress = min(round_idx + 1, total_rounds) / total_rounds
    return t_start + progress * (t_end - t_start)
