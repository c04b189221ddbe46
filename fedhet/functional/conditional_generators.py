"""Losses of feature-space conditional generators distilled against classifiers (FedMD-CG, FedCG).

FedMD-CG: Luo et al., "Privacy-Preserving Federated Learning with Consistency via Knowledge
Distillation Using Conditional Generator" (Eq. 1-12); spec ``reference/fedmdcg.md`` section 3.
FedCG: Wu et al., IJCAI 2022 (the server's ``KD_agg`` and the client's latent cGAN).

Conventions shared by every function here:

* ``direction="teacher_first"`` is standard distillation, ``KL(target || student)`` (the
  authors' code, spec B1); ``"as_printed"`` is the paper's ``KL(student || target)``.
* ``temperature`` divides every logit; no ``T^2`` rescaling (the code, spec B2).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

KLDirection = Literal["teacher_first", "as_printed"]
DiversityKind = Literal["div0", "div1", "div2", "none"]
DiversityNorm = Literal["mean", "paper"]
RampForm = Literal["paper", "code"]


def ramp_weight(round_idx: int, total_rounds: int, form: RampForm = "paper", power: float = 1.0) -> float:
    """The ramp-up factor of FedMD-CG's stage-1 weights lambda_1..3 in round ``round_idx`` (0-based).

    ``"paper"`` (App. C): ``((r - 1) / R) ** power`` for the 1-based round ``r``, i.e.
    ``(round_idx / total_rounds) ** power``; ``"code"``: ``(round_idx / (R - 1)) ** 3``
    (reaching 1 in the last round). Both are 0 in the first round, so stage 1 is plain CE then.

    Example:
        >>> ramp_weight(5, 10)
        0.5
    """
    if total_rounds < 1 or round_idx < 0:
        raise ValueError(f"round_idx={round_idx} must be >= 0 and total_rounds={total_rounds} >= 1")
    if form == "paper":
        return (round_idx / total_rounds) ** power
    if form == "code":
        return 0.0 if total_rounds == 1 else min(1.0, round_idx / (total_rounds - 1)) ** 3
    raise ValueError(f"unknown ramp form {form!r}; use 'paper' or 'code'")


def distribution_kl(
    student_logits: Tensor,
    target_logits: Tensor,
    temperature: float = 1.0,
    direction: KLDirection = "teacher_first",
    reduction: Literal["sum_classes", "mean_classes"] = "sum_classes",
) -> Tensor:
    """Per-sample KL between the softmaxes of ``target_logits`` (constant) and ``student_logits``.

    Returns ``[B]``: ``KL(p_t || p_s)`` (``"teacher_first"``) or ``KL(p_s || p_t)``
    (``"as_printed"``), summed over classes, or averaged over them (``"mean_classes"``, the
    FedMD-CG server's ``KLDivLoss(reduce=False)`` followed by a mean, spec B11). Gradients flow
    into ``student_logits`` only.
    """
    log_student = F.log_softmax(student_logits / temperature, dim=1)
    log_target = F.log_softmax(target_logits.detach() / temperature, dim=1)
    if direction == "teacher_first":
        per_class = log_target.exp() * (log_target - log_student)
    elif direction == "as_printed":
        per_class = log_student.exp() * (log_student - log_target)
    else:
        raise ValueError(f"unknown KL direction {direction!r}; use 'teacher_first' or 'as_printed'")
    if reduction not in ("sum_classes", "mean_classes"):
        raise ValueError(f"unknown KL reduction {reduction!r}; use 'sum_classes' or 'mean_classes'")
    return per_class.mean(dim=1) if reduction == "mean_classes" else per_class.sum(dim=1)


def distillation_kl_loss(
    student_logits: Tensor, target_logits: Tensor, temperature: float = 1.0, direction: KLDirection = "teacher_first"
) -> Tensor:
    """The batch mean of :func:`distribution_kl` (PyTorch's ``KLDivLoss(reduction="batchmean")``).

    FedMD-CG's ``L->kl`` (student ``D_i(F_i(x))``, target ``D_i(G(z, y))``) and ``L<-kl`` (student
    ``D_i(G_i(z, y))``, target ``D_i(F_i(x))``).
    """
    return distribution_kl(student_logits, target_logits, temperature, direction).mean()


def label_aware_diversity_loss(
    features: Tensor,
    noise: Tensor,
    labels_onehot: Tensor,
    kind: DiversityKind = "div2",
    norm: DiversityNorm = "mean",
) -> Tensor:
    """FedMD-CG's diversity constraints ``L_div^0``, ``L_div^1`` and ``L_div^2`` (Eq. 7, 8 and text).

    With ``d_f[j,k]`` the distance of generated features, ``d_z[j,k]`` of the noises and
    ``d_y[j,k]`` of the one-hot labels:

    * ``div0``: ``exp(-mean_{j,k} d_f * d_z)`` (FedGen's loss);
    * ``div1``: as ``div0`` with the noise replaced by ``[z; y]``;
    * ``div2``: ``exp(-mean_{j,k} d_f * d_z * exp(d_y))``: pairs of different classes count more.

    ``norm="paper"`` uses the literal L2 norms (and the L1 norm for ``d_y``); ``"mean"`` the
    authors' code (FedGen's ``DiversityLoss('l2')``): mean squared differences over dimensions,
    and the mean absolute difference over classes for ``d_y`` (``2/C`` between two classes).
    The literal form underflows ``exp`` for realistic sizes (spec pitfall 5), hence the default.
    """
    if kind == "none":
        return features.new_zeros(())
    flat = features.reshape(features.shape[0], -1)
    source = torch.cat([noise, labels_onehot.to(noise.dtype)], dim=1) if kind == "div1" else noise

    def distance(values: Tensor, squared_mean: bool = True) -> Tensor:
        diff = values.unsqueeze(1) - values.unsqueeze(0)
        if norm == "mean":
            return diff.pow(2).mean(dim=2) if squared_mean else diff.abs().mean(dim=2)
        if squared_mean:  # literal L2 norm, with a zero-safe square root on the diagonal
            return diff.pow(2).sum(dim=2).clamp_min(1e-12).sqrt() * (1 - torch.eye(len(values), device=values.device))
        return diff.abs().sum(dim=2)

    product = distance(flat) * distance(source)
    if kind == "div2":
        product = product * torch.exp(distance(labels_onehot.to(flat.dtype), squared_mean=False))
    elif kind not in ("div0", "div1"):
        raise ValueError(f"unknown diversity loss {kind!r}; use div0, div1, div2 or none")
    if norm not in ("mean", "paper"):
        raise ValueError(f"unknown diversity norm {norm!r}; use 'mean' or 'paper'")
    return torch.exp(-product.mean())


def class_client_weights(label_counts: Tensor) -> Tensor:
    """``tau[i, y] = n_i^y / sum_j n_j^y`` from ``[N, C]`` counts (0 for classes nobody holds).

    Example:
        >>> class_client_weights(torch.tensor([[3, 0], [1, 0]]))
        tensor([[0.7500, 0.0000],
                [0.2500, 0.0000]])
    """
    counts = label_counts.to(torch.float32)
    return counts / counts.sum(dim=0, keepdim=True).clamp_min(1.0)


def crossed_distillation_loss(
    global_on_global: Tensor,
    local_on_local: Tensor,
    global_on_local: Tensor,
    local_on_global: Tensor,
    tau: Tensor,
    temperature: float = 1.0,
    direction: KLDirection = "teacher_first",
    reduction: Literal["sum_classes", "mean_classes"] = "sum_classes",
    terms: tuple[bool, bool, bool] = (True, True, True),
) -> Tensor:
    """FedMD-CG's crossed data-free distillation, ``L_kl,1 + L_kl,2 + L_kl,3`` (Eq. 10-12).

    Every term is ``sum_i mean_b tau[i, b] * KL(rho_i || student)`` with the target
    ``rho_i = softmax(D_i(G_i(z, y)))`` (constant) and the student:

    * ``L_kl,1``: ``D(G(z, y))`` (``global_on_global``, ``[B, C]``), training ``G`` and ``D``;
    * ``L_kl,2``: ``D(G_i(z, y))`` (``global_on_local``, ``[N, B, C]``), training ``D`` only;
    * ``L_kl,3``: ``D_i(G(z, y))`` (``local_on_global``, ``[N, B, C]``), training ``G`` only.

    Args:
        global_on_global: ``[B, C]`` logits.
        local_on_local: ``[N, B, C]`` target logits.
        global_on_local: ``[N, B, C]`` logits.
        local_on_global: ``[N, B, C]`` logits.
        tau: ``[N, B]``, client ``i``'s share of the sampled label of row ``b``.
        temperature: softmax temperature.
        direction: see the module docstring.
        reduction: ``"sum_classes"`` (a KL) or ``"mean_classes"`` (the code, spec B11).
        terms: which of the three terms to include (the ``L_kl,1``-only form is plain KD).
    """
    total = global_on_global.new_zeros(())
    students = (global_on_global.unsqueeze(0).expand_as(local_on_local), global_on_local, local_on_global)
    for use, student in zip(terms, students, strict=True):
        if not use:
            continue
        per_sample = torch.stack(
            [
                distribution_kl(student[i], local_on_local[i], temperature, direction, reduction)
                for i in range(local_on_local.shape[0])
            ]
        )  # [N, B]
        total = total + (tau * per_sample).mean(dim=1).sum()
    return total


def ensemble_distillation_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    client_weights: Tensor,
    temperature: float = 1.0,
    reduction: Literal["batchmean", "mean", "hinton"] = "batchmean",
) -> Tensor:
    """FedCG's server ``KD_agg``: ``KL(softmax(sum_i w_i z_i / T) || softmax(z / T))``.

    ``teacher_logits`` is ``[N, B, C]`` (``D_i(G_i(z, y))``), ``client_weights`` ``[N]`` the sample
    shares ``n_i / n``: the teacher averages the logits before the softmax. ``reduction``:
    ``"batchmean"`` is the batch mean of the per-sample KL; ``"mean"`` is PyTorch's default
    element mean of the FedMD-CG authors' ``KLDivLoss()`` (the batch mean divided by C, no
    ``T^2``); ``"hinton"`` is Hinton et al.'s distillation loss, the batch mean times ``T^2``, so
    the gradient keeps its size as ``T`` grows (FedCG aggregates "using knowledge distillation
    (Hinton, Vinyals, and Dean 2015)").

    Example:
        >>> teachers = torch.tensor([[[1.0986123, 0.0]]])  # ln 3: one client, target [0.75, 0.25]
        >>> round(ensemble_distillation_kl(torch.zeros(1, 2), teachers, torch.ones(1), 1.0, "hinton").item(), 4)
        0.1308
    """
    if reduction not in ("batchmean", "mean", "hinton"):
        raise ValueError(f"unknown reduction {reduction!r}; use 'batchmean', 'mean' or 'hinton'")
    teacher = (client_weights.view(-1, 1, 1).to(teacher_logits) * teacher_logits.detach()).sum(dim=0)
    per_sample = distribution_kl(student_logits, teacher, temperature, "teacher_first")
    loss = per_sample.mean()
    if reduction == "hinton":
        return loss * temperature**2
    return loss / student_logits.shape[1] if reduction == "mean" else loss


def discriminator_loss(real_scores: Tensor, fake_scores: Tensor) -> Tensor:
    """FedCG's latent discriminator: ``-mean[log s(real) + log(1 - s(fake))]`` on sigmoid scores."""
    return F.binary_cross_entropy(real_scores, torch.ones_like(real_scores)) + F.binary_cross_entropy(
        fake_scores, torch.zeros_like(fake_scores)
    )


def generator_adversarial_loss(fake_scores: Tensor) -> Tensor:
    """FedCG's latent generator (non-saturating): ``-mean log s(fake)``."""
    return F.binary_cross_entropy(fake_scores, torch.ones_like(fake_scores))
