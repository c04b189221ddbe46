"""Server-side learning on uploaded class prototypes (FedGH, FedTGP) and prototype alignment.

FedGH (Yi et al., ACM MM 2023) trains a global classifier head on the clients' class prototypes;
FedTGP (Zhang et al., AAAI 2024) trains global prototypes against them with an
adaptive-margin-enhanced contrastive loss. Both treat every (client, class) prototype as one
labelled training example, which :func:`prototype_examples` builds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

AlignmentDistance = Literal["mse", "euclidean"]

# Squared distances are clamped here before the square root: d sqrt(x)/dx is infinite at 0, and a
# prototype equal to a global prototype (or a feature equal to its target) would give NaN gradients.
_SQRT_EPS = 1e-12


def prototype_examples(values: Sequence[Tensor], counts: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Flatten per-client class prototypes into one labelled set, one row per (client, held class).

    Args:
        values: per client, ``[C, K]`` class prototypes (rows of classes it does not hold ignored).
        counts: per client, ``[C]`` examples per class (``0``: class not held, row dropped).

    Returns:
        ``(prototypes [M, K], labels [M] int64)``, clients in order, classes ascending within a client.

    Example:
        >>> v = [torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0], [4.0]])]
        >>> prototype_examples(v, [torch.tensor([5, 0]), torch.tensor([1, 2])])
        (tensor([[1.],
                [3.],
                [4.]]), tensor([0, 0, 1]))
    """
    if not values or len(values) != len(counts):
        raise ValueError(
            f"prototype_examples needs one counts tensor per values tensor, got {len(values)} and {len(counts)}"
        )
    rows, labels = [], []
    for client_values, client_counts in zip(values, counts, strict=False):
        held = torch.nonzero(client_counts > 0).flatten()
        rows.append(client_values[held.to(client_values.device)])
        labels.append(held.to(torch.long))
    return torch.cat(rows), torch.cat(labels)


def pairwise_distances(a: Tensor, b: Tensor) -> Tensor:
    """Euclidean distances ``[N, M]`` between the rows of ``a [N, K]`` and ``b [M, K]``.

    Computed from the differences (not ``|a|^2 - 2ab + |b|^2`` as in HtFLlib, which can go
    slightly negative and give NaN after the square root), with finite gradients at distance 0.
    """
    squared = (a.unsqueeze(1) - b.unsqueeze(0)).pow(2).sum(-1)
    return squared.clamp_min(_SQRT_EPS).sqrt()


def adaptive_margin(class_prototypes: Tensor, present: Tensor, threshold: float) -> Tensor:
    """FedTGP's adaptive margin ``delta = min(max_c min_{c' != c} ||Q^c - Q^{c'}||_2, threshold)``.

    ``Q^c`` is the round's average of the client prototypes of class ``c`` (FedTGP Eq. 7); only
    classes some client uploaded take part. The margin grows with the separation the clients'
    features already have, and ``threshold`` (``tau``) caps it so that an outlying class cannot
    make the contrastive task impossible. With fewer than two classes there is no inter-class
    distance and the margin is ``threshold`` (what HtFLlib's ``1e9`` sentinel gives).

    Args:
        class_prototypes: ``[C, K]`` per-class averages of the uploaded prototypes.
        present: ``[C]`` bool, classes uploaded this round.
        threshold: ``tau``, the largest margin allowed.

    Returns:
        The margin, a 0-dim tensor.

    Example:
        >>> q = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
        >>> adaptive_margin(q, torch.tensor([True, True, True]), 100.0)  # max(1, 4.243, 1)
        tensor(4.2426)
    """
    held = class_prototypes[present.to(torch.bool)]
    cap = torch.tensor(float(threshold), dtype=class_prototypes.dtype, device=class_prototypes.device)
    if held.shape[0] < 2:
        return cap
    distances = pairwise_distances(held, held)
    distances.fill_diagonal_(float("inf"))
    nearest_other = distances.min(dim=1).values
    return torch.minimum(nearest_other.max(), cap)


def margin_contrastive_loss(
    prototypes: Tensor, labels: Tensor, global_prototypes: Tensor, margin: Tensor | float
) -> Tensor:
    """FedTGP's adaptive-margin-enhanced contrastive loss (Eq. 8), as in HtFLlib's ``update_Gen``.

    Each client prototype ``P`` of class ``y`` is classified among the global prototypes by
    negative Euclidean distance, with its own class handicapped by ``margin``::

        -log( exp(-(d(P, G^y) + margin)) / (exp(-(d(P, G^y) + margin)) + sum_{c != y} exp(-d(P, G^c))) )

    so the global prototype of ``y`` must be at least ``margin`` closer than any other class's.

    Args:
        prototypes: ``[N, K]`` client prototypes.
        labels: ``[N]`` their classes.
        global_prototypes: ``[C, K]`` the trainable global prototypes.
        margin: ``delta`` (see :func:`adaptive_margin`).

    Returns:
        The mean loss over the ``N`` prototypes.

    Example:
        >>> margin_contrastive_loss(torch.zeros(1, 2), torch.tensor([0]), torch.tensor([[0.0, 0.0], [3.0, 4.0]]), 1.0)
        tensor(0.0181)
    """
    distances = pairwise_distances(prototypes, global_prototypes)
    handicap = F.one_hot(labels, global_prototypes.shape[0]).to(distances.dtype) * margin
    return F.cross_entropy(-(distances + handicap), labels)


def prototype_alignment_loss(features: Tensor, targets: Tensor, distance: AlignmentDistance = "mse") -> Tensor:
    """Distance of each feature to its class's global prototype, averaged over samples.

    ``"mse"`` is the mean over all elements of the squared difference (FedProto's and FedTGP's
    official code, ``nn.MSELoss``); ``"euclidean"`` is the mean over samples of the L2 distance
    (FedTGP paper, Eq. 4). The two differ in scale by roughly ``||.|| * K``, which is why the
    authors' scripts use ``lambda = 10`` with MSE and the paper ``lambda = 0.1`` with the distance.

    Args:
        features: ``[N, K]``.
        targets: ``[N, K]`` the global prototype of each sample's class.
        distance: ``"mse"`` or ``"euclidean"``.

    Example:
        >>> f, t = torch.tensor([[3.0, 4.0], [0.0, 0.0]]), torch.zeros(2, 2)
        >>> prototype_alignment_loss(f, t, "mse"), prototype_alignment_loss(f, t, "euclidean")
        (tensor(6.2500), tensor(2.5000))
    """
    if distance == "mse":
        return F.mse_loss(features, targets)
    if distance == "euclidean":
        return (features - targets).pow(2).sum(-1).clamp_min(_SQRT_EPS).sqrt().mean()
    raise ValueError(f"unknown distance {distance!r}; use 'mse' or 'euclidean'")
