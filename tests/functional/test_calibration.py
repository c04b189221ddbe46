"""CCVR's pooled class statistics and FedType's conformal quantities against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from fedhet.functional.calibration import (
    class_gaussian_stats,
    conformal_scores,
    conformal_threshold,
    pool_class_gaussians,
    prediction_set_sizes,
)


def test_class_stats_by_hand():
    """Class 0: (0, 0), (2, 2) -> mean (1, 1), covariance [[2, 2], [2, 2]]; class 1: one sample, zero covariance."""
    features = torch.tensor([[0.0, 0.0], [2.0, 2.0], [5.0, -1.0]])
    means, covariances, counts = class_gaussian_stats(features, torch.tensor([0, 0, 1]), 3)
    assert counts.tolist() == [2, 1, 0]
    torch.testing.assert_close(means, torch.tensor([[1.0, 1.0], [5.0, -1.0], [0.0, 0.0]]))
    torch.testing.assert_close(covariances[0], torch.tensor([[2.0, 2.0], [2.0, 2.0]]))
    assert covariances[1].abs().sum() == 0 and covariances[2].abs().sum() == 0


def test_pooled_statistics_by_hand():
    """Client A: {0, 2} (mean 1, var 2); client B: {4} (mean 4). Pooled {0, 2, 4}: mean 2, var 4.

    CCVR Eq. 4: (1 * 2 + 0) / 2 + (2 * 1 + 1 * 16) / 2 - 3 / 2 * 4 = 1 + 9 - 6 = 4.
    """
    mu, sigma, total = pool_class_gaussians(
        torch.tensor([[1.0], [4.0]]), torch.tensor([[[2.0]], [[0.0]]]), torch.tensor([2, 1])
    )
    assert mu.item() == pytest.approx(2.0) and sigma.item() == pytest.approx(4.0) and int(total) == 3


def test_pooled_statistics_equal_those_of_the_pooled_features():
    """Random split of random features: Eq. 3-4 recover torch.cov of the union exactly."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(23, 4, generator=generator, dtype=torch.float64)
    parts = [features[:5], features[5:6], features[6:], features[:0]]
    means, covariances, counts = [], [], []
    for part in parts:
        m, c, n = class_gaussian_stats(part, torch.zeros(len(part), dtype=torch.long), 1)
        means.append(m[0])
        covariances.append(c[0])
        counts.append(n[0])
    mu, sigma, total = pool_class_gaussians(torch.stack(means), torch.stack(covariances), torch.stack(counts))
    torch.testing.assert_close(mu, features.mean(0))
    torch.testing.assert_close(sigma, torch.cov(features.T))
    assert int(total) == 23


def test_conformal_score_threshold_and_sets_by_hand():
    """Scores 1 - p_y: (0.1, 0.5, 0.3, 0.2); alpha = 0.25 -> rank ceil(5 * 0.75) = 4 -> threshold 0.5."""
    probabilities = torch.tensor([[0.9, 0.1], [0.5, 0.5], [0.3, 0.7], [0.2, 0.8]])
    scores = conformal_scores(probabilities, torch.tensor([0, 1, 1, 1]))
    torch.testing.assert_close(scores, torch.tensor([0.1, 0.5, 0.3, 0.2]))
    threshold = conformal_threshold(scores, alpha=0.25)
    assert threshold.item() == pytest.approx(0.5)
    # sets {y : 1 - p_y <= 0.5}: {0}, {0, 1}, {1}, {1}
    assert prediction_set_sizes(probabilities, threshold).tolist() == [1, 2, 1, 1]


def test_conformal_threshold_is_one_when_the_rank_exceeds_the_calibration_set():
    """With n = 2, alpha = 0.1: rank ceil(3 * 0.9) = 3 > 2, so every class is in every set."""
    assert conformal_threshold(torch.tensor([0.2, 0.4]), alpha=0.1).item() == 1.0


def test_statistics_keep_the_features_dtype():
    """float64 features give float64 means and covariances; an empty calibration set a float64 threshold."""
    features = torch.tensor([[0.0, 1.0], [2.0, 5.0]], dtype=torch.float64)
    means, covariances, _ = class_gaussian_stats(features, torch.tensor([0, 0]), 2)
    assert means.dtype == covariances.dtype == torch.float64
    assert conformal_threshold(torch.zeros(0, dtype=torch.float64), 0.1).dtype == torch.float64


def test_conformal_threshold_of_one_score():
    """One score at alpha 0.5: rank ceil(2 * 0.5) = 1, so the threshold is that score (not the fallback 1)."""
    assert conformal_threshold(torch.tensor([0.25]), 0.5).item() == 0.25


def test_pooling_without_samples_or_with_one():
    """No sample: zero mean and covariance; one sample (one client): its mean and a zero covariance."""
    mu, sigma, n = pool_class_gaussians(torch.tensor([[3.0, 4.0]]), torch.ones(1, 2, 2), torch.tensor([0]))
    assert mu.tolist() == [0.0, 0.0] and sigma.tolist() == [[0.0, 0.0], [0.0, 0.0]] and int(n) == 0
    mu, sigma, n = pool_class_gaussians(torch.tensor([[3.0, 4.0]]), torch.ones(1, 2, 2), torch.tensor([1]))
    assert mu.tolist() == [3.0, 4.0] and sigma.tolist() == [[0.0, 0.0], [0.0, 0.0]] and int(n) == 1


def test_clients_without_the_class_drop_out_of_the_pooled_covariance():
    """A client with count 0 adds nothing, whatever covariance it sends."""
    means = torch.tensor([[0.0], [2.0], [100.0]])
    covariances = torch.tensor([[[0.0]], [[0.0]], [[7.0]]])
    mu, sigma, n = pool_class_gaussians(means, covariances, torch.tensor([1, 1, 0]))
    assert mu.tolist() == [1.0] and sigma.tolist() == [[2.0]] and int(n) == 2
