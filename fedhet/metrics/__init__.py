"""Metrics of the papers' tables: client x domain accuracy, intra/inter, local/global accuracy."""

from fedhet.metrics.accuracy import ClientSetAccuracy
from fedhet.metrics.functional import intra_inter_accuracy, local_accuracy, topk_correct
from fedhet.metrics.report import BestTracker, round_metrics

__all__ = [
    "BestTracker",
    "ClientSetAccuracy",
    "intra_inter_accuracy",
    "local_accuracy",
    "round_metrics",
    "topk_correct",
]
