"""The metric definitions of design.md section 4, as pure functions of accuracy matrices.

``A[i, d]`` is the accuracy of client ``i``'s model on evaluation set ``d``. Accuracies are
fractions in ``[0, 1]`` here; the loop reports percentages.
"""

from __future__ import annotations

import torch
from torch import Tensor


def topk_correct(logits: Tensor, target: Tensor, ks: tuple[int, ...] = (1, 5)) -> Tensor:
    """Number of examples whose target is among the top-k scores, for each k (``[len(ks)]``).

    ``k`` larger than the number of classes counts every example as correct, as torchmetrics does.
    """
    largest = min(max(ks), logits.shape[1])
    top = logits.topk(largest, dim=1).indices
    hits = top.eq(target.unsqueeze(1))
    return torch.stack([hits[:, : min(k, largest)].any(dim=1).sum() for k in ks])


def intra_inter_accuracy(matrix: Tensor, own_domain: Tensor) -> tuple[Tensor, Tensor]:
    """Per-client intra- and inter-domain accuracy (FCCL+, TPAMI 2023, Eq. 21-22).

    Intra-domain accuracy of client ``i`` is ``A[i, own(i)]``; inter-domain accuracy is the mean
    of ``A[i, d]`` over the other domains ``d != own(i)`` (a macro-average over domains). The
    tables report the mean over clients of each.

    Args:
        matrix: ``[N, D]`` accuracies.
        own_domain: ``[N]`` index of each client's own domain.

    Returns:
        ``(intra [N], inter [N])``; inter is ``nan`` when there is a single domain.

    Example:
        >>> A = torch.tensor([[0.9, 0.2, 0.4], [0.3, 0.8, 0.1]])
        >>> intra_inter_accuracy(A, torch.tensor([0, 1]))
        (tensor([0.9000, 0.8000]), tensor([0.3000, 0.2000]))
    """
    rows = torch.arange(matrix.shape[0])
    intra = matrix[rows, own_domain]
    others = matrix.shape[1] - 1
    inter = (matrix.sum(dim=1) - intra) / others if others > 0 else torch.full_like(intra, float("nan"))
    return intra, inter


def local_accuracy(correct: Tensor, total: Tensor) -> dict[str, float]:
    """Local accuracy over clients evaluated on their own test splits.

    ``pooled`` sums correct predictions over clients and divides by the summed test sizes
    (HtFLlib / FedKTL convention: a test-size-weighted mean); ``mean`` and ``std`` are the
    unweighted mean and population std of per-client accuracies.

    Example:
        >>> local_accuracy(torch.tensor([9.0, 1.0]), torch.tensor([10.0, 10.0]))
        {'pooled': 0.5, 'mean': 0.5, 'std': 0.4}
    """
    per_client = correct / total.clamp_min(1)
    return {
        "pooled": float(correct.sum() / total.sum().clamp_min(1)),
        "mean": float(per_client.mean()),
        "std": float(per_client.std(unbiased=False)) if per_client.numel() > 1 else 0.0,
    }
