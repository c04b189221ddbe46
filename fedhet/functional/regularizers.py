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
    terms = [(p - r.detach()).pow(2).sum() for p, r in zip(params, reference, strict=False)]
    return torch.stack(terms).sum() if terms else torch.tensor(0.0)
