"""FedRS: FedAvg with a restricted softmax that damps the logits of classes a client lacks.

Paper: Li and Zhan, "FedRS: Federated Learning with Restricted Softmax for Label Distribution
Non-IID Data", KDD 2021 (Sec. 4: ``o_c = alpha_c * w_c^T h``, ``alpha_c = 1`` for local classes,
``alpha`` otherwise). Official code: github.com/lxcnju/FedRepo (``algorithms/fedrs.py``).
Default ``alpha = 0.5``: FCCL+ Tab. VII (the FedRS paper sweeps 0.1 to 0.9).

Upload: the client's model weights (``WeightsPayload``) and its number of examples.
Download: the global model weights.
Server phase: FedAvg's closed-form example-weighted average (:class:`FedAvgServer`).
Client state kept across rounds: its local class counts (computed from its training labels at
its first local fit, a persistent buffer) and its optimizer state; the weights are overwritten
by each download.
Local objective: ``CE(alpha ⊙ f(x), y)``, the restricted softmax
(:func:`fedhet.functional.restricted_logits`); evaluation uses the plain logits.

Deviations from paper/official code:

* ``restriction="missing"`` (default) is the paper's binary rule; the official code (and the
  FCCL+ authors' port) uses ``alpha_c = alpha + (1 - alpha) n_c / max n``, available as
  ``restriction="proportional"``.
* The paper's output layer has no bias and the official code drops it (``h @ W^T``); fedhet heads
  have one, and the whole logit ``w_c^T h + b_c`` is scaled, so ``alpha = 1`` is FedAvg bit for
  bit (tested). Under domain shift every client holds every class and FedRS is FedAvg.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms.base import Batch
from fedhet.algorithms.shared.common import FedAvgClient, WeightAveraging
from fedhet.functional import restricted_logits, restricted_softmax_scale
from fedhet.functional.contrastive import RestrictionMode
from fedhet.hparams import LocalOptimizer, UnitInterval, knob, uniform


@dataclass(frozen=True)
class FedRSHparams(LocalOptimizer):
    """FedRS's hyperparameters."""

    alpha: UnitInterval = knob(
        0.5, "logit scale of the classes a client lacks (0.5, FCCL+ Tab. VII; 1 gives FedAvg)", uniform(0.0, 1.0)
    )
    restriction: RestrictionMode = knob(
        "missing",
        "missing (paper: scale only absent classes) or proportional (official code: alpha + (1 - alpha) n_c / max n)",
    )


def label_counts(loader: Iterable[Any], num_classes: int) -> Tensor:
    """Examples per class in a training loader: from its labels when it exposes them, else one pass.

    fedhet's :class:`~fedhet.data.TensorBatchLoader` holds its data (``loader.data.y``), which is
    read without drawing a batch, so the loader's shuffling and augmentation streams are untouched.
    """
    data = getattr(loader, "data", None)
    labels = getattr(data, "y", None)
    if isinstance(labels, Tensor):
        labels = labels[labels >= 0]
        return torch.bincount(labels.cpu(), minlength=num_classes)[:num_classes]
    counts = torch.zeros(num_classes, dtype=torch.long)
    for _, y in loader:
        counts += torch.bincount(y.cpu(), minlength=num_classes)[:num_classes]
    return counts


class FedRSClient(FedAvgClient):
    """Cross-entropy on restricted logits; the restriction comes from the client's class counts."""

    Hparams = FedRSHparams

    def __init__(self, model: nn.Module, num_classes: int, hp: Any = None, **overrides: Any) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        # Persisted in client_state: all zeros until the first local fit counts the labels.
        self.register_buffer("class_counts", torch.zeros(num_classes, dtype=torch.long))

    def on_train_start(self) -> None:
        if int(self.class_counts.sum()) == 0:
            loader = self.trainer.train_dataloader
            if loader is not None:
                self.class_counts.copy_(label_counts(loader, self.num_classes))

    def logit_scale(self) -> Tensor:
        """``alpha_c`` per class (all ones while the class counts are unknown)."""
        if int(self.class_counts.sum()) == 0:
            return torch.ones(self.num_classes, device=self.class_counts.device)
        return restricted_softmax_scale(self.class_counts, self.hp.alpha, self.hp.restriction)

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        return F.cross_entropy(restricted_logits(self.model(x), self.logit_scale().to(x.device)), y)


class FedRS(WeightAveraging):
    """FedRS (homogeneous models only)."""

    Hparams = FedRSHparams
    client_type = FedRSClient


__all__ = ["FedRS", "FedRSClient", "FedRSHparams", "label_counts"]
