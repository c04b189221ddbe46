"""Server-side aggregation rules."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


def weighted_average(states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]:
    """Weighted mean of state dicts (FedAvg, McMahan et al. 2017, Algorithm 1).

    Floating tensors are averaged with weights normalised to sum to one; the sum is accumulated
    in float64 so the result does not depend on client order beyond float rounding. Integer
    tensors (BatchNorm's ``num_batches_tracked``) are not meaningful to average: the weighted
    mean is rounded, which keeps them equal to the common value when clients agree.

    Args:
        states: one state dict per client, all with the same keys and shapes.
        weights: one non-negative weight per client (usually its number of training examples).

    Example:
        >>> a, b = {"w": torch.tensor([0.0, 2.0])}, {"w": torch.tensor([4.0, 6.0])}
        >>> weighted_average([a, b], [1, 3])["w"]
        tensor([3., 5.])
    """
    if not states or len(states) != len(weights):
        raise ValueError(
            f"weighted_average needs one weight per state, got {len(states)} states, {len(weights)} weights"
        )
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weighted_average needs a positive total weight")
    coefficients = torch.tensor([float(w) / total for w in weights], dtype=torch.float64)
    averaged: dict[str, Tensor] = {}
    for key, first in states[0].items():
        stacked = torch.stack([state[key] for state in states]).to(torch.float64)  # one op per key, not per client
        mean = torch.tensordot(coefficients.to(stacked.device), stacked, dims=1)
        averaged[key] = mean.to(first.dtype) if first.is_floating_point() else mean.round().to(first.dtype)
    return averaged


def aggregate_class_means(
    values: Sequence[Tensor], counts: Sequence[Tensor], weighting: str = "count"
) -> tuple[Tensor, Tensor]:
    """Aggregate per-class means from several clients, ignoring classes a client does not hold.

    FedProto (Tan et al., AAAI 2022, Eq. 6) weights client ``i``'s prototype of class ``c`` by
    ``|D_{i,c}| / N_c``, i.e. ``weighting="count"``; HtFLlib takes a plain mean over the clients
    holding the class, ``weighting="uniform"``. FD (Jeong et al. 2018) averages per-class logits
    the same way.

    Args:
        values: per client, a ``[C, D]`` tensor of class means (rows of absent classes ignored).
        counts: per client, a ``[C]`` integer tensor of examples per class.
        weighting: ``"count"`` (example-weighted) or ``"uniform"`` (each holding client counts once).

    Returns:
        ``(global_values [C, D], present [C] bool)``; rows of classes no client holds are zero.

    Example:
        >>> v1, v2 = torch.tensor([[1.0], [5.0]]), torch.tensor([[3.0], [0.0]])
        >>> c1, c2 = torch.tensor([1, 2]), torch.tensor([3, 0])
        >>> aggregate_class_means([v1, v2], [c1, c2])
        (tensor([[2.5000],
                [5.0000]]), tensor([True, True]))
    """
    if weighting not in ("count", "uniform"):
        raise ValueError(f"weighting must be 'count' or 'uniform', got {weighting!r}")
    stacked = torch.stack([v.to(torch.float64) for v in values])  # [N, C, D]
    held = torch.stack(list(counts)).to(torch.float64)  # [N, C]
    coefficient = held if weighting == "count" else (held > 0).to(torch.float64)
    total = coefficient.sum(dim=0)  # [C]
    present = total > 0
    summed = (stacked * coefficient.unsqueeze(-1)).sum(dim=0)
    result = torch.where(present.unsqueeze(-1), summed / total.clamp_min(1e-12).unsqueeze(-1), torch.zeros_like(summed))
    return result.to(values[0].dtype), present
