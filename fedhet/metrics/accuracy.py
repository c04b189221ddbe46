"""Client x evaluation-set accuracy as a torchmetrics ``Metric``."""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric


class ClientSetAccuracy(Metric):
    """Accumulates top-1 and top-5 correct counts per (client, evaluation set).

    Evaluation sets are the domains' test sets in domain-shift scenarios, and each client's own
    test split plus the global test set in label-skew ones. States are sums, so the metric
    reduces correctly across processes.

    Args:
        num_clients: rows of the matrix.
        num_sets: columns of the matrix.
    """

    full_state_update = False
    correct_top1: Tensor
    correct_top5: Tensor
    total: Tensor

    def __init__(self, num_clients: int, num_sets: int) -> None:
        super().__init__()
        shape = (num_clients, num_sets)
        self.add_state("correct_top1", torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("correct_top5", torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, correct: Tensor, total: float, client: int, eval_set: int) -> None:  # type: ignore[override]
        """Add ``correct = [top-1, top-5]`` counts over ``total`` examples of one (client, set) pair.

        Counts rather than logits are the update so that a worker can evaluate remotely and send
        three numbers back; :func:`fedhet.metrics.topk_correct` turns logits into counts.
        """
        self.correct_top1[client, eval_set] += correct[0].to(self.total)
        self.correct_top5[client, eval_set] += correct[1].to(self.total)
        self.total[client, eval_set] += float(total)

    def compute(self) -> dict[str, Tensor]:
        """``{"top1": A, "top5": A5, "correct": counts, "total": counts}`` (accuracies as fractions)."""
        denominator = self.total.clamp_min(1)
        return {
            "top1": self.correct_top1 / denominator,
            "top5": self.correct_top5 / denominator,
            "correct": self.correct_top1.clone(),
            "total": self.total.clone(),
        }
