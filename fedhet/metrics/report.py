"""Turn accuracy matrices into the flat per-round metrics, and track best-on-validation values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from fedhet.metrics.functional import intra_inter_accuracy, local_accuracy

#: Headline metrics per scenario kind; "best" is chosen per metric on its validation value.
HEADLINE = {
    "domain_shift": ("acc_intra", "acc_inter", "acc_intra_top5", "acc_inter_top5"),
    "label_skew": ("acc_local", "acc_global", "acc_local_top5", "acc_global_top5"),
}

#: Top-1 accuracy (percent) of the server-side models on the global sets, for methods that have them.
SERVER_KEY = "acc_server"


def _pct(value: Tensor | float) -> float:
    return round(100.0 * float(value), 4)


def domain_shift_metrics(
    result: dict[str, Tensor], own_domain: Tensor, domain_names: Sequence[str], client_ids: Sequence[int] | None = None
) -> dict[str, float]:
    """Intra/inter metrics (top-1 and top-5), per client and per domain, in percent.

    Row ``i`` of the matrices is client ``client_ids[i]`` (default: client ``i``).
    """
    metrics: dict[str, float] = {}
    for suffix, key in (("", "top1"), ("_top5", "top5")):
        intra, inter = intra_inter_accuracy(result[key], own_domain)
        metrics[f"acc_intra{suffix}"] = _pct(intra.mean())
        metrics[f"acc_inter{suffix}"] = _pct(inter.mean())
        if suffix:
            continue
        ids = list(client_ids) if client_ids is not None else list(range(len(intra)))
        for client, a, b in zip(ids, intra.tolist(), inter.tolist(), strict=True):
            metrics[f"client/{client}/acc_intra"] = _pct(a)
            metrics[f"client/{client}/acc_inter"] = _pct(b)
        for index, name in enumerate(domain_names):
            members = own_domain == index
            if bool(members.any()):
                metrics[f"domain/{name}/acc_intra"] = _pct(intra[members].mean())
                metrics[f"domain/{name}/acc_inter"] = _pct(inter[members].mean())
            # accuracy of all clients on this domain's test set (the matrix column mean)
            metrics[f"domain/{name}/acc"] = _pct(result[key][:, index].mean())
    return metrics


def label_skew_metrics(result: dict[str, Tensor], client_ids: Sequence[int] | None = None) -> dict[str, float]:
    """Local (column 0: own test split) and global (column 1: global test set) accuracy, in percent.

    Row ``i`` of the matrices is client ``client_ids[i]`` (default: client ``i``).
    """
    metrics: dict[str, float] = {}
    total = result["total"][:, 0]
    for suffix, key in (("", "top1"), ("_top5", "top5")):
        correct = result[key][:, 0] * total
        local = local_accuracy(correct, total)
        metrics[f"acc_local{suffix}"] = _pct(local["pooled"])
        metrics[f"acc_local_mean{suffix}"] = _pct(local["mean"])
        metrics[f"acc_local_std{suffix}"] = _pct(local["std"])
        global_acc = result[key][:, 1]
        metrics[f"acc_global{suffix}"] = _pct(global_acc.mean())
        metrics[f"acc_global_std{suffix}"] = _pct(global_acc.std(unbiased=False) if global_acc.numel() > 1 else 0.0)
    ids = list(client_ids) if client_ids is not None else list(range(result["top1"].shape[0]))
    for row, client in enumerate(ids):
        metrics[f"client/{client}/acc_local"] = _pct(result["top1"][row, 0])
        metrics[f"client/{client}/acc_global"] = _pct(result["top1"][row, 1])
    return metrics


def empty_validation(kind: str, val: dict[str, Tensor]) -> set[str]:
    """Headline metrics whose validation sets hold no example (a scenario without local validation).

    They are left out rather than reported as 0 %, so that nothing (a tuning stage, a best-round
    selection) mistakes an empty set for a score.
    """
    totals = val["total"].sum(dim=0)
    if kind == "label_skew":
        empty = {"acc_local", "acc_local_top5"} if float(totals[0]) == 0.0 else set()
        return empty | ({"acc_global", "acc_global_top5"} if float(totals[1]) == 0.0 else set())
    return set(HEADLINE[kind]) if float(totals.sum()) == 0.0 else set()


def round_metrics(
    kind: str,
    test: dict[str, Tensor] | None,
    val: dict[str, Tensor] | None,
    own_domain: Tensor,
    domain_names: Sequence[str],
    client_ids: Sequence[int] | None = None,
) -> dict[str, float]:
    """All accuracy metrics of one round: test values unprefixed, validation values under ``val/``.

    ``client_ids`` names the clients of the matrices' rows when only some were evaluated.
    ``test`` is ``None`` when the test splits are sealed (a tuning trial): validation values only.
    """

    def compute(result: dict[str, Tensor]) -> dict[str, float]:
        if kind == "domain_shift":
            return domain_shift_metrics(result, own_domain, domain_names, client_ids)
        return label_skew_metrics(result, client_ids)

    metrics = compute(test) if test is not None else {}
    if val is not None:
        empty = empty_validation(kind, val)
        metrics.update({f"val/{k}": v for k, v in compute(val).items() if k in HEADLINE[kind] and k not in empty})
    return metrics


class BestTracker:
    """For each headline metric, the test value at the round with the best validation value.

    Ties keep the earliest round. Without validation values nothing is selected (we never pick
    "best" on test).
    """

    def __init__(self, kind: str, with_server: bool = False) -> None:
        self.keys = HEADLINE[kind] + ((SERVER_KEY,) if with_server else ())
        self.best: dict[str, dict[str, float]] = {}

    def update(self, round_idx: int, metrics: dict[str, float]) -> None:
        for key in self.keys:
            val = metrics.get(f"val/{key}")
            if val is None or key not in metrics:
                continue
            current = self.best.get(key)
            if current is None or val > current["val"]:
                self.best[key] = {"val": val, "test": metrics[key], "round": round_idx}

    def summary(self) -> dict[str, Any]:
        """``{metric: test value at best round, metric_round: that round, ...}``."""
        out: dict[str, Any] = {}
        for key, entry in self.best.items():
            out[key] = entry["test"]
            out[f"{key}_round"] = int(entry["round"])
            out[f"val/{key}"] = entry["val"]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"best": {k: dict(v) for k, v in self.best.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = {k: dict(v) for k, v in state["best"].items()}


def mean_last(history: Sequence[dict[str, float]], keys: Sequence[str], last: int) -> dict[str, float]:
    """Mean of each key over the last ``last`` evaluated rounds (FCCL+ reports the last 3)."""
    rows = [row for row in history if all(k in row for k in keys)][-last:]
    if not rows:
        return {}
    return {k: round(sum(r[k] for r in rows) / len(rows), 4) for k in keys}


def as_matrix_list(matrix: Tensor) -> list[list[float]]:
    """A matrix of fractions as nested lists of percentages (for JSON)."""
    return [[_pct(v) for v in row] for row in matrix.tolist()]


__all__ = ["HEADLINE", "SERVER_KEY", "BestTracker", "as_matrix_list", "mean_last", "round_metrics"]
