"""Matryoshka representation learning: one cross-entropy per nested prefix of a representation.

Kusupati et al., "Matryoshka Representation Learning", NeurIPS 2022: the first ``d_1 < d_2 < ...``
dimensions of one representation are each trained as a representation of their own, every prefix
with its own classifier, so coarse and fine granularities live in one vector. FedMRL (Yi et al.,
NeurIPS 2024) applies it to the fused representation of a shared small model and a client's own
model: the coarse prefix feeds the shared homogeneous head, the whole vector the client's head.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def nested_prefixes(representation: Tensor, dims: Sequence[int]) -> list[Tensor]:
    """The prefixes ``representation[:, :d]`` for every ``d`` in ``dims`` (each ``1 <= d <= width``).

    Args:
        representation: ``[B, D]`` representations.
        dims: prefix widths, each in ``[1, D]``.

    Returns:
        One ``[B, d]`` view per width, in the order given.

    Example:
        >>> r = torch.tensor([[1.0, 2.0, 3.0]])
        >>> [p.tolist() for p in nested_prefixes(r, [1, 3])]
        [[[1.0]], [[1.0, 2.0, 3.0]]]
    """
    width = representation.shape[-1]
    for d in dims:
        if not 1 <= d <= width:
            raise ValueError(f"a nested prefix needs 1 <= d <= {width} (the representation width), got {d}")
    return [representation[:, :d] for d in dims]


def matryoshka_loss(logits: Sequence[Tensor], targets: Tensor, weights: Sequence[float]) -> Tensor:
    """``sum_k w_k CE(logits_k, y)``: the Matryoshka objective over the granularities' logits.

    Args:
        logits: per granularity, ``[B, C]`` class scores of that prefix's head.
        targets: ``[B]`` class indices.
        weights: per granularity, its weight ``m_k`` (FedMRL: ``m_1 = m_2 = 1``).

    Returns:
        The weighted sum of the mean cross-entropies (a scalar).

    Example:
        >>> zero = torch.zeros(1, 2)  # uniform over 2 classes: CE = log 2
        >>> round(matryoshka_loss([zero, zero], torch.tensor([0]), [1.0, 0.5]).item(), 6)
        1.039721
    """
    if len(logits) != len(weights) or not logits:
        raise ValueError(f"one weight per granularity: {len(logits)} logits, {len(weights)} weights")
    return torch.stack([w * F.cross_entropy(z, targets) for z, w in zip(logits, weights, strict=True)]).sum()


__all__ = ["matryoshka_loss", "nested_prefixes"]
