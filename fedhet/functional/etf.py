"""Simplex-ETF geometry and the kernels FedKTL trains with (pure functions, no state).

FedKTL (Zhang et al., CVPR 2024) replaces every client's classifier by one fixed simplex
equiangular tight frame, trains with an ArcFace-style margin against it, uploads unit class
prototypes in the ETF space, and aligns mapped prototypes with a generator's latent
distribution through a multi-bandwidth RBF MMD. Each piece is here so that it can be checked
against hand-computed numbers (``tests/functional/test_etf.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from fedhet.functional.prototypes import class_means

#: Bandwidths ``a_k`` of the official FedKTL MMD kernel (tuned to StyleGAN W-space scale).
FEDKTL_MMD_BANDWIDTHS: tuple[float, ...] = (10.0, 15.0, 20.0, 50.0)


def _orthonormal_columns(rows: int, cols: int, generator: torch.Generator | None) -> Tensor:
    """``[rows, cols]`` with orthonormal columns: Q of a ``Uniform[0, 1)`` matrix (FedKTL's recipe)."""
    random = torch.rand(rows, cols, generator=generator, dtype=torch.float64)
    q, _ = torch.linalg.qr(random, mode="reduced")
    return q


def simplex_etf(num_classes: int, dim: int, generator: torch.Generator | None = None) -> Tensor:
    """A simplex equiangular tight frame: ``num_classes`` unit vectors in ``R^dim``, columns of ``V``.

    Every column has norm 1 and every pair has cosine ``-1/(C-1)``, the largest possible
    separation of ``C`` directions; that is why FedKTL fixes it as the shared classifier.

    For ``dim >= C`` this is the official construction ``V = sqrt(C/(C-1)) U (I - 11^T/C)`` with
    ``U`` the Q factor of a uniform random ``[dim, C]`` matrix. The paper allows ``dim = C - 1``,
    where no ``[dim, C]`` orthonormal ``U`` exists; there ``V = sqrt(C/(C-1)) W B^T`` with ``B`` an
    orthonormal basis of the complement of ``1`` (``B B^T = I - 11^T/C``) and ``W`` a random
    ``[dim, C-1]`` orthonormal matrix, which has the same Gram matrix.

    Args:
        num_classes: ``C >= 2``.
        dim: ``K >= C - 1``.
        generator: source of the random rotation (the frame's geometry does not depend on it).

    Returns:
        ``V`` of shape ``[dim, num_classes]`` (float32).

    Raises:
        ValueError: ``C < 2`` or ``K < C - 1`` (a simplex of ``C`` points needs ``C - 1`` dimensions).
    """
    if num_classes < 2:
        raise ValueError(f"a simplex ETF needs at least 2 classes, got {num_classes}")
    if dim < num_classes - 1:
        raise ValueError(f"a simplex ETF of {num_classes} classes needs dim >= {num_classes - 1}, got {dim}")
    c = num_classes
    centering = torch.eye(c, dtype=torch.float64) - torch.full((c, c), 1.0 / c, dtype=torch.float64)
    if dim >= c:
        frame = _orthonormal_columns(dim, c, generator) @ centering
    else:
        # The first C-1 columns of the centering matrix span the complement of 1.
        basis, _ = torch.linalg.qr(centering[:, : c - 1], mode="reduced")
        frame = _orthonormal_columns(dim, c - 1, generator) @ basis.T
    return (math.sqrt(c / (c - 1)) * frame).float()


def etf_cosines(embeddings: Tensor, etf: Tensor) -> Tensor:
    """``cos(theta_c)`` between each embedding and each ETF column: ``[B, K] x [K, C] -> [B, C]``.

    Both sides are L2-normalised (the official code normalises ``V^T`` row-wise), so the scale of
    the embedding never matters; this is also FedKTL's prediction score (argmax, no margin).
    """
    return F.normalize(embeddings, dim=1) @ F.normalize(etf, dim=0)


def arcface_logits(cosines: Tensor, labels: Tensor, scale: float = 64.0, margin: float = 0.5) -> Tensor:
    """Additive angular margin logits: ``s * cos(theta_y + m)`` for the target, ``s * cos(theta_c)`` else.

    ``cos(theta + m) = cos(theta) cos(m) - sin(theta) sin(m)`` with ``sin(theta) = sqrt(1 - cos^2)``,
    which equals the official ``cos(acos(c) + m)`` (``theta`` is in ``[0, pi]``, so the sine is
    non-negative) but has no infinite ``acos`` gradient at ``cos = +-1``. Like the official code it
    keeps the non-monotonic region ``theta > pi - m`` (no "easy margin" fallback).

    Args:
        cosines: ``[B, C]`` cosines to the class vectors.
        labels: ``[B]`` target classes.
        scale: ``s``, the logit scale (64 in FedKTL).
        margin: ``m``, the additive angle in radians (0.5 in FedKTL).

    Returns:
        ``[B, C]`` logits for a cross-entropy.
    """
    cos_y = cosines.gather(1, labels.unsqueeze(1))
    sin_y = torch.sqrt(torch.clamp(1.0 - cos_y * cos_y, min=1e-12))
    target = cos_y * math.cos(margin) - sin_y * math.sin(margin)
    return scale * cosines.scatter(1, labels.unsqueeze(1), target)


def unit_class_prototypes(embeddings: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """FedKTL's uploaded prototypes: ``normalize(mean_{x in class c} normalize(g(x)))``.

    The official code normalises each embedding, averages per class, and re-normalises, so every
    prototype is a unit vector: on the cosine/ETF geometry only directions carry meaning, and
    unit prototypes from architectures with very different feature scales stay comparable.

    Args:
        embeddings: ``[N, K]``.
        labels: ``[N]`` in ``[0, num_classes)``.
        num_classes: ``C``.

    Returns:
        ``(prototypes [C, K], counts [C] int64)``; rows of absent classes are zero.
    """
    means, counts = class_means(F.normalize(embeddings, dim=1), labels, num_classes)
    return F.normalize(means, dim=1), counts


def rbf_mmd2(x: Tensor, y: Tensor, bandwidths: Sequence[float] = FEDKTL_MMD_BANDWIDTHS) -> Tensor:
    """Biased (V-statistic) squared MMD with the kernel ``k(a, b) = sum_k exp(-||a - b||^2 / (2 a_k))``.

    ``MMD^2 = mean k(x_i, x_j) + mean k(y_i, y_j) - 2 mean k(x_i, y_j)``, diagonal terms included,
    exactly FedKTL's estimator; it is zero for identical sets and differentiable everywhere.

    Args:
        x: ``[n, H]`` samples of the first distribution.
        y: ``[m, H]`` samples of the second.
        bandwidths: the ``a_k`` (each plays the role of ``sigma^2``).

    Returns:
        A scalar tensor.
    """
    if not bandwidths:
        raise ValueError("rbf_mmd2 needs at least one bandwidth")
    joint = torch.cat([x, y], dim=0)
    squared_norms = (joint * joint).sum(dim=1)
    distances = (squared_norms[:, None] + squared_norms[None, :] - 2.0 * joint @ joint.T).clamp_min(0.0)
    kernel = sum(torch.exp(-distances / (2.0 * a)) for a in bandwidths)
    n = x.shape[0]
    assert isinstance(kernel, Tensor)
    return kernel[:n, :n].mean() + kernel[n:, n:].mean() - 2.0 * kernel[:n, n:].mean()
