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


# ------------------------------------------------------------------ Byzantine-robust rules
def _stacked(states: Sequence[Mapping[str, Tensor]], key: str) -> Tensor:
    return torch.stack([state[key] for state in states]).to(torch.float64)


def _cast_like(value: Tensor, like: Tensor) -> Tensor:
    return value.to(like.dtype) if like.is_floating_point() else value.round().to(like.dtype)


def coordinate_median(states: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Coordinate-wise median of state dicts (Yin et al., ICML 2018; Flower's ``FedMedian``).

    Each coordinate is the median of the clients' values, the mean of the two middle values for
    an even count (``numpy.median``, as Flower computes it), so up to half of the clients minus
    one can send anything without moving a coordinate outside the honest values' range. Sample
    counts are ignored (one vote per client), as in Flower. Integer tensors are rounded back.

    Example:
        >>> rows = ([1.0, 10.0], [2.0, -4.0], [9.0, 0.0])
        >>> coordinate_median([{"w": torch.tensor(r)} for r in rows])["w"]
        tensor([2., 0.])
    """
    if not states:
        raise ValueError("coordinate_median needs at least one state")
    out: dict[str, Tensor] = {}
    for key, first in states[0].items():
        ordered = _stacked(states, key).sort(dim=0).values
        n = ordered.shape[0]
        median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
        out[key] = _cast_like(median, first)
    return out


def trimmed_mean(states: Sequence[Mapping[str, Tensor]], beta: float) -> dict[str, Tensor]:
    """Coordinate-wise trimmed mean (Yin et al., ICML 2018; Flower's ``FedTrimmedAvg``).

    For each coordinate the ``k = int(beta * n)`` largest and ``k`` smallest of the ``n`` client
    values are removed and the rest averaged (``scipy.stats.trim_mean``, as Flower computes it),
    so ``k`` clients sending anything are cut at every coordinate. Unweighted, as in Flower.

    Args:
        states: one state dict per client, same keys and shapes.
        beta: fraction cut at each end, in ``[0, 0.5)``.

    Example:
        >>> states = [{"w": torch.tensor([v])} for v in (1.0, 2.0, 3.0, 4.0, 100.0)]
        >>> trimmed_mean(states, 0.2)["w"]  # k = 1: drop 1.0 and 100.0, mean of 2, 3, 4
        tensor([3.])
    """
    if not states:
        raise ValueError("trimmed_mean needs at least one state")
    if not 0.0 <= beta < 0.5:
        raise ValueError(f"trimmed_mean needs beta in [0, 0.5), got {beta}")
    n = len(states)
    cut = int(beta * n)
    out: dict[str, Tensor] = {}
    for key, first in states[0].items():
        kept = _stacked(states, key).sort(dim=0).values[cut : n - cut]
        out[key] = _cast_like(kept.mean(dim=0), first)
    return out


def krum_scores(states: Sequence[Mapping[str, Tensor]], num_byzantine: int) -> Tensor:
    """Krum scores (Blanchard et al., NeurIPS 2017): per client, the summed squared distance to its closest peers.

    Each client's floating tensors are flattened into one vector; its score is the sum of the
    squared Euclidean distances to its ``max(1, n - f - 2)`` nearest other clients (Flower's
    ``aggregate_krum``). A low score means the client sits inside a dense cluster.

    Example:
        >>> states = [{"w": torch.tensor([0.0])}, {"w": torch.tensor([1.0])}, {"w": torch.tensor([3.0])}]
        >>> krum_scores(states, 0)  # one nearest peer each: 1, 1, 4
        tensor([1., 1., 4.], dtype=torch.float64)
    """
    n = len(states)
    if n == 0:
        raise ValueError("krum needs at least one state")
    keys = [k for k, v in states[0].items() if v.is_floating_point()]
    flat = torch.stack([torch.cat([s[k].reshape(-1).to(torch.float64) for k in keys]) for s in states])
    distances = torch.cdist(flat, flat).pow(2)
    closest = max(1, n - num_byzantine - 2)
    scores = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        others = torch.cat([distances[i, :i], distances[i, i + 1 :]])
        scores[i] = others.sort().values[:closest].sum() if others.numel() else 0.0
    return scores


def krum(
    states: Sequence[Mapping[str, Tensor]], weights: Sequence[float], num_byzantine: int, keep: int = 1
) -> tuple[dict[str, Tensor], list[int]]:
    """Krum (``keep=1``: the lowest-scored client's state) or Multi-Krum (the weighted mean of the ``keep`` lowest).

    As Flower's ``aggregate_krum``: Multi-Krum averages the selected states weighted by
    ``weights`` (the clients' example counts), ties broken by client order.

    Returns:
        ``(aggregate, selected indices in score order)``.

    Example:
        >>> states = [{"w": torch.tensor([0.0])}, {"w": torch.tensor([1.0])}, {"w": torch.tensor([50.0])}]
        >>> krum(states, [1, 1, 1], num_byzantine=1, keep=2)
        ({'w': tensor([0.5000])}, [0, 1])
    """
    n = len(states)
    if not 1 <= keep <= n:
        raise ValueError(f"krum keeps 1 to {n} clients, got keep={keep}")
    if num_byzantine < 0:
        raise ValueError(f"krum needs num_byzantine >= 0, got {num_byzantine}")
    scores = krum_scores(states, num_byzantine)
    order = sorted(range(n), key=lambda i: (float(scores[i]), i))[:keep]
    if keep == 1:
        return {k: v.clone() for k, v in states[order[0]].items()}, order
    return weighted_average([states[i] for i in order], [weights[i] for i in order]), order
