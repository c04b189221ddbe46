"""FedVTC's variational transposed-convolution losses (Niu, Dong, Qin; Eq. 2-6).

The VTC is a VAE whose encoder mean is the classifier's feature extractor ``z = g(x)`` and whose
posterior SD ``sigma`` is one learned vector shared by all samples; the prior of class ``y`` is
``N(c^y, I)`` around the global prototype. Every function returns one value per sample, so the
class-normalised sums of Eq. 4-5 are one :func:`class_mean_sum` away.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

Reduction = Literal["class_mean_sum", "batch_mean"]
ElementReduction = Literal["sum", "mean"]


def _reduce_elements(squared: Tensor, elements: ElementReduction) -> Tensor:
    """Per sample, the sum (``"sum"``) or the mean (``"mean"``) of ``[B, p]`` elements; another name is refused."""
    if elements == "sum":
        return squared.sum(1)
    if elements == "mean":
        return squared.mean(1)
    raise ValueError(f"unknown element reduction {elements!r}; use 'sum' or 'mean'")


def reparameterize(z: Tensor, log_sigma: Tensor, noise: Tensor) -> Tensor:
    """``v = z + sigma * eps`` with ``sigma = exp(log_sigma)`` (one SD per latent dimension).

    Example:
        >>> reparameterize(torch.zeros(1, 2), torch.log(torch.tensor([1.0, 2.0])), torch.ones(1, 2))
        tensor([[1., 2.]])
    """
    return z + log_sigma.exp() * noise


def gaussian_kl_to_prior(
    z: Tensor,
    log_sigma: Tensor,
    prior_mean: Tensor,
    elements: ElementReduction = "sum",
    prior_sd: float = 1.0,
) -> Tensor:
    """``KL(N(z, diag sigma^2) || N(c, tau^2 I))`` per sample (Eq. 3 for ``tau = 1``), in closed form.

    ``0.5 * (||z - c||^2 / tau^2 + sum_j (sigma_j^2 / tau^2 - 1 - log(sigma_j^2 / tau^2)))``.

    Args:
        z: ``[B, p]`` posterior means (the features ``g(x)``).
        log_sigma: ``[p]`` log posterior SDs, shared by all samples.
        prior_mean: ``[B, p]`` the prototype of each sample's class.
        elements: ``"sum"`` over the ``p`` dimensions (Eq. 3) or their ``"mean"`` (spec 9.1 opt-in).
        prior_sd: ``tau``, the prior's SD per dimension (1 in the paper: ``N(c^y, I)``). A value
            matched to the features' scale keeps the sampling noise from swamping them.

    Returns:
        ``[B]`` KL divergences.

    Example:
        >>> gaussian_kl_to_prior(torch.tensor([[1.0, 0.0]]), torch.zeros(2), torch.zeros(1, 2))
        tensor([0.5000])
        >>> half = torch.log(torch.full((2,), 0.5))
        >>> gaussian_kl_to_prior(torch.tensor([[1.0, 0.0]]), half, torch.zeros(1, 2), prior_sd=0.5)
        tensor([2.])
    """
    log_ratio = 2.0 * (log_sigma - math.log(prior_sd))  # log(sigma^2 / tau^2)
    variance_term = torch.exp(log_ratio) - 1.0 - log_ratio  # [p], the same for every sample
    per_element = 0.5 * ((z - prior_mean).pow(2) / prior_sd**2 + variance_term)
    return _reduce_elements(per_element, elements)


def reconstruction_error(reconstruction: Tensor, target: Tensor, elements: ElementReduction = "sum") -> Tensor:
    """``||x' - x||_2^2`` per sample, summed over every pixel (Eq. 4's ``L_rc``; ``"mean"``: averaged).

    Example:
        >>> reconstruction_error(torch.ones(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
        tensor([4.])
    """
    return _reduce_elements((reconstruction - target).pow(2).flatten(1), elements)


def distribution_matching_error(
    generated_features: Tensor, prior_mean: Tensor, elements: ElementReduction = "sum"
) -> Tensor:
    """``||g(psi(v)) - c^y||_2^2`` per sample (Eq. 5): features of generated images against the prototype.

    Example:
        >>> distribution_matching_error(torch.tensor([[3.0, 4.0]]), torch.zeros(1, 2))
        tensor([25.])
    """
    return _reduce_elements((generated_features - prior_mean).pow(2), elements)


def class_mean_sum(values: Tensor, labels: Tensor, reduction: Reduction = "class_mean_sum") -> Tensor:
    """Sum over the classes present of the mean of ``values`` over that class's samples (Eq. 4-5).

    ``"class_mean_sum"`` is the mini-batch analogue of ``sum_y 1/|D^y| sum_{i in D^y}``;
    ``"batch_mean"`` is a plain mean over the batch.

    Example:
        >>> class_mean_sum(torch.tensor([1.0, 3.0, 10.0]), torch.tensor([0, 0, 2]))
        tensor(12.)
    """
    if reduction == "batch_mean":
        return values.mean()
    if reduction != "class_mean_sum":
        raise ValueError(f"unknown reduction {reduction!r}; use 'class_mean_sum' or 'batch_mean'")
    classes, inverse, counts = torch.unique(labels, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(classes), dtype=values.dtype, device=values.device).index_add_(0, inverse, values)
    return (sums / counts.to(values.dtype)).sum()


def prototype_geometry(prototypes: Tensor) -> tuple[Tensor, Tensor]:
    """Mean norm of the class prototypes and the smallest distance between two of them.

    FedVTC's prior ``N(c^y, tau^2 I)`` follows the prototypes, which are the clients' own feature
    means: nothing fixes their scale, and when they drift outward round after round the averaged
    VTC stops decoding classes. The two numbers make that drift visible next to ``sigma``: a noise
    norm ``||sigma||`` far below the smallest distance means the prior's classes do not overlap.

    Example:
        >>> prototype_geometry(torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, 1.0]]))
        (tensor(2.), tensor(1.))
    """
    norms = prototypes.norm(dim=1)
    distances = torch.cdist(prototypes, prototypes)
    distances.fill_diagonal_(float("inf"))
    return norms.mean(), distances.min()
