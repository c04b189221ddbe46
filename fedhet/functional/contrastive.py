"""Local objectives of the homogeneous contrastive / restricted-softmax baselines (FCCL+ Tab. XV).

* :func:`model_contrastive_loss`: MOON (Li et al., CVPR 2021, Eq. 3);
* :func:`prototypical_contrastive_loss`: FedProc (Mu et al., FGCS 2023), InfoNCE of a feature
  against the global class prototypes, weighted per round by :func:`fedproc_alpha`;
* :func:`restricted_softmax_scale` / :func:`restricted_logits`: FedRS (Li & Zhan, KDD 2021).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

RestrictionMode = Literal["missing", "proportional"]


def model_contrastive_loss(
    features: Tensor, global_features: Tensor, previous_features: Tensor, temperature: float = 0.5
) -> Tensor:
    """MOON's model-contrastive loss, averaged over the batch.

    ``l_con = -log( exp(cos(z, z_glob)/tau) / (exp(cos(z, z_glob)/tau) + exp(cos(z, z_prev)/tau)) )``
    pulls the local representation ``z`` towards the global model's ``z_glob`` (positive) and
    away from the client's previous local model's ``z_prev`` (negative). It is computed as a
    two-way cross-entropy with the positive at index 0, as the official code does, which is
    stable for small ``tau``. The caller detaches the global and previous representations.

    Args:
        features: ``[B, D]`` representations of the model being trained.
        global_features: ``[B, D]`` representations of the global model (positive pair).
        previous_features: ``[B, D]`` representations of the previous local model (negative pair).
        temperature: ``tau``.

    Example:
        >>> z, zg, zp = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 1.0]])
        >>> round(model_contrastive_loss(z, zg, zp, 0.5).item(), 4)  # log(1 + e^-2)
        0.1269
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    positive = F.cosine_similarity(features, global_features, dim=-1)
    negative = F.cosine_similarity(features, previous_features, dim=-1)
    logits = torch.stack([positive, negative], dim=1) / temperature
    return F.cross_entropy(logits, torch.zeros(features.shape[0], dtype=torch.long, device=features.device))


def prototypical_contrastive_loss(
    features: Tensor,
    labels: Tensor,
    prototypes: Tensor,
    available: Tensor | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """FedProc's prototypical contrastive loss (InfoNCE against the global class prototypes).

    For a sample of class ``y``: ``-log( exp(cos(z, c_y)/tau) / sum_j exp(cos(z, c_j)/tau) )``,
    the positive being its own class prototype and the negatives every other available
    prototype. Samples whose class has no prototype, and prototypes of classes no client holds,
    take no part. The FedProc authors' code uses cosine similarity with ``tau = 1``.

    Args:
        features: ``[B, D]`` features of the model being trained.
        labels: ``[B]`` class labels.
        prototypes: ``[C, D]`` global class prototypes (carry no gradient).
        available: ``[C]`` bool, which prototypes exist (``None``: all of them).
        temperature: ``tau``.

    Returns:
        The mean over the samples whose class has a prototype; ``0`` (on the graph) when none has.

    Example:
        >>> z, y, c = torch.tensor([[1.0, 0.0]]), torch.tensor([0]), torch.tensor([[1.0, 0.0], [0.0, 1.0]])
        >>> round(prototypical_contrastive_loss(z, y, c).item(), 4)  # log(1 + e^-1)
        0.3133
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if available is None:
        available = torch.ones(prototypes.shape[0], dtype=torch.bool, device=prototypes.device)
    available = available.to(features.device)
    unit_prototypes = F.normalize(prototypes.detach().to(features.dtype), dim=1)
    similarity = F.normalize(features, dim=1) @ unit_prototypes.T / temperature
    similarity = similarity.masked_fill(~available.unsqueeze(0), float("-inf"))
    known = available[labels]
    if not bool(known.any()):
        return features.sum() * 0.0
    return F.cross_entropy(similarity[known], labels[known])


def fedproc_alpha(round_idx: int, total_rounds: int) -> float:
    """FedProc's round-dependent weight of the prototype loss, ``alpha_t = 1 - t / (T - 1)``.

    The local loss is ``alpha_t * L_proto + (1 - alpha_t) * CE``: early rounds shape the feature
    space around the global prototypes, later rounds train the classifier (1 in round 0, 0 in
    the last round; the FCCL+ authors' FedProc code, which FCCL+ Tab. XV ran). Rounds past the
    planned ``T`` (an extra step after a finished run) keep ``alpha = 0``.

    Example:
        >>> fedproc_alpha(0, 5), fedproc_alpha(1, 5), fedproc_alpha(4, 5)
        (1.0, 0.75, 0.0)
    """
    if total_rounds < 1 or round_idx < 0:
        raise ValueError(f"need round_idx >= 0 and total_rounds >= 1, got {round_idx} and {total_rounds}")
    return max(0.0, 1.0 - round_idx / max(total_rounds - 1, 1))


def restricted_softmax_scale(class_counts: Tensor, alpha: float = 0.5, mode: RestrictionMode = "missing") -> Tensor:
    """FedRS's per-class logit scale ``alpha_c`` from a client's local class counts.

    ``"missing"`` is the paper's rule: ``alpha_c = 1`` for classes the client holds and
    ``alpha`` for classes it lacks. ``"proportional"`` is the official code's (and the FCCL+
    authors' port's) smooth version: ``alpha_c = alpha + (1 - alpha) * n_c / max_c n_c``, which
    equals the paper's rule when every held class has the same count.

    Args:
        class_counts: ``[C]`` number of local training examples per class.
        alpha: scale of missing classes, in ``[0, 1]`` (1 gives the plain softmax).
        mode: ``"missing"`` or ``"proportional"``.

    Example:
        >>> restricted_softmax_scale(torch.tensor([4, 0, 2]), 0.5)
        tensor([1.0000, 0.5000, 1.0000])
        >>> restricted_softmax_scale(torch.tensor([4, 0, 2]), 0.5, "proportional")
        tensor([1.0000, 0.5000, 0.7500])
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    counts = class_counts.to(torch.float32)
    if mode == "missing":
        return torch.where(counts > 0, torch.ones_like(counts), torch.full_like(counts, alpha))
    if mode == "proportional":
        return counts / counts.max().clamp_min(1.0) * (1.0 - alpha) + alpha
    raise ValueError(f"mode must be 'missing' or 'proportional', got {mode!r}")


def restricted_logits(logits: Tensor, scale: Tensor) -> Tensor:
    """FedRS's restricted logits ``alpha_c * o_c``: a softmax over them is the restricted softmax.

    The paper scales ``w_c^T h`` of a bias-free output layer; here the whole logit of class ``c``
    is scaled (bias included), so that ``scale == 1`` leaves the logits bit-for-bit unchanged.

    Example:
        >>> restricted_logits(torch.tensor([[2.0, 4.0]]), torch.tensor([1.0, 0.5]))
        tensor([[2., 2.]])
    """
    return logits * scale.to(logits.dtype)
