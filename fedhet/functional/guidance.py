"""Learned per-class guidance (FedL2G): the pull towards it, and the server's update of it.

Zhang et al., "Adaptive Guidance for Local Training in Heterogeneous Federated Learning"
(FedL2G, arXiv 2410.06490): the server keeps one guidance vector per class (features or logits);
clients add ``MSE(s(x), g[y])`` to their cross-entropy and send the gradient of their quiz-set
cross-entropy after one virtual step with respect to ``g``; the server averages those gradients
per class over the clients that sent one and takes a clipped SGD step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch  # noqa: F401 (the examples use it)
import torch.nn.functional as F
from torch import Tensor

from fedhet.functional.aggregation import aggregate_class_means


def guidance_loss(statistic: Tensor, guide: Tensor, labels: Tensor) -> Tensor:
    """``MSE(s, g[y])``, the mean over samples and elements (HtFLlib's ``nn.MSELoss()``).

    Example:
        >>> s = torch.tensor([[1.0, 1.0], [0.0, 2.0]])
        >>> g = torch.tensor([[0.0, 0.0], [0.0, 1.0]])
        >>> guidance_loss(s, g, torch.tensor([0, 1])).item()  # (1 + 1 + 0 + 1) / 4
        0.75
    """
    return F.mse_loss(statistic, guide[labels])


def clip_by_norm(grad: Tensor, max_norm: float | None) -> Tensor:
    """``grad * min(1, max_norm / (||grad|| + 1e-6))`` (``torch.nn.utils.clip_grad_norm_``'s rule); ``None``: unchanged.

    Example:
        >>> clip_by_norm(torch.tensor([3.0, 4.0]), 1.0)  # norm 5 -> scaled by 1 / (5 + 1e-6)
        tensor([0.6000, 0.8000])
    """
    if max_norm is None:
        return grad
    coefficient = max_norm / (grad.norm() + 1e-6)
    return grad * coefficient.clamp(max=1.0)


def guidance_update(
    guide: Tensor, grads: Sequence[Tensor], counts: Sequence[Tensor], lr: float, max_norm: float | None
) -> tuple[Tensor, Tensor]:
    """One server step on the guidance: per class the mean gradient of the clients that sent it, clipped, SGD.

    Args:
        guide: ``[C, D]`` current guidance.
        grads: per client, ``[C, D]`` gradients of its quiz loss w.r.t. the guidance.
        counts: per client, ``[C]`` integers; a class with count 0 was not in that client's study
            batches, so its row is no gradient and is ignored (HtFLlib keeps the non-zero rows).
        lr: the server's SGD learning rate.
        max_norm: the clipping norm of the whole ``[C, D]`` gradient (``None``: no clipping).

    Returns:
        ``(new guide, present)``: ``guide - lr * clip(mean gradient)``; classes nobody sent keep
        a zero gradient (their rows do not move); ``present[c]`` says whether class ``c`` had one.

    Example:
        >>> g = torch.zeros(2, 1)
        >>> grads = [torch.tensor([[2.0], [9.0]]), torch.tensor([[4.0], [0.0]])]
        >>> counts = [torch.tensor([1, 0]), torch.tensor([3, 0])]
        >>> new, present = guidance_update(g, grads, counts, lr=0.5, max_norm=None)
        >>> new.tolist(), present.tolist()  # class 0: -0.5 * (2 + 4) / 2; class 1: nobody
        ([[-1.5], [0.0]], [True, False])
    """
    mean, present = aggregate_class_means(list(grads), list(counts), "uniform")
    step = clip_by_norm(mean.to(guide.dtype), max_norm)
    return guide - lr * step, present


__all__ = ["clip_by_norm", "guidance_loss", "guidance_update"]
