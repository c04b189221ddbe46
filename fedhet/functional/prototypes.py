"""Per-class statistics of features or logits."""

from __future__ import annotations

import torch
from torch import Tensor


def class_means(values: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """Mean of ``values`` per class label, with the number of examples per class.

    Args:
        values: ``[N, D]`` features or logits.
        labels: ``[N]`` integer labels in ``[0, num_classes)``.
        num_classes: ``C``.

    Returns:
        ``(means [C, D], counts [C] int64)``; rows of classes absent from ``labels`` are zero.

    Example:
        >>> class_means(torch.tensor([[1.0], [3.0], [5.0]]), torch.tensor([0, 0, 2]), 3)
        (tensor([[2.],
                [0.],
                [5.]]), tensor([2, 0, 1]))
    """
    sums = torch.zeros(num_classes, values.shape[1], dtype=values.dtype, device=values.device)
    sums.index_add_(0, labels, values)
    counts = torch.bincount(labels, minlength=num_classes)
    means = sums / counts.clamp_min(1).unsqueeze(1).to(values.dtype)
    return means, counts
