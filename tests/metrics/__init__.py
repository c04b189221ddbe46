"""Tests of the metrics: per-client accuracies, round summaries and best/last trackers."""
