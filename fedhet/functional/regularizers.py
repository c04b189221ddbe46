"""Regularisers added to a client's local objective."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def proximal_term(params: Iterable[Tensor], reference: Iterable[Tensor]) -> Tensor:
    """FedProx's proximal term ``||w - w_t||^2`` summed over parameters (Li et al., MLSys 2020, Eq. 2).

    The caller multiplies by ``mu / 2``. ``reference`` is the global model received this round and
    carries no gradient.

    Example:
        >>> proximal_term([torch.tensor([1.0, 2.0])], [torch.tensor([0.0, 0.0])])
        tensor(5.)
    """
    terms = [(p - r.detach()).pow(2).sum() for p, r in zip(params, reference, strict=True)]
    return torch.stack(terms).sum() if terms else torch.tensor(0.0)


def linear_term(params: Iterable[Tensor], coefficients: Iterable[Tensor]) -> Tensor:
    """The inner product ``<g, w>`` summed over parameters (FedDyn's linear penalty, Acar et al., ICLR 2021).

    FedDyn's client objective is ``L_k(w) - <g_k, w> + alpha/2 ||w - w_t||^2`` with ``g_k`` the
    client's gradient state; the caller subtracts this term. ``coefficients`` carry no gradient.

    Example:
        >>> linear_term([torch.tensor([1.0, 2.0])], [torch.tensor([3.0, -1.0])])
        tensor(1.)
    """
    terms = [(p * g.detach()).sum() for p, g in zip(params, coefficients, strict=True)]
    return torch.stack(terms).sum() if terms else torch.tensor(0.0)
