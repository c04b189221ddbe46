"""Image distances of the class-image diagnostics, against hand values."""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.functional import mean_pairwise_rms, mean_rms_change


def test_mean_pairwise_rms_hand_values():
    """Three 2-pixel images: pairs (a,b) and (b,c) are sqrt((9+16)/2) apart, (a,c) 0; mean over 6 ordered pairs."""
    images = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 0.0]])
    assert float(mean_pairwise_rms(images)) == pytest.approx(4 * math.sqrt(12.5) / 6, rel=1e-12)


def test_mean_pairwise_rms_is_per_pixel_and_exact_for_close_images():
    """Repeating every pixel leaves the RMS distance as it is; images 1e-6 apart are 1e-6 apart (no mm shortcut)."""
    images = torch.tensor([[1.0, 2.0], [2.0, 4.0]])
    assert float(mean_pairwise_rms(images.repeat(1, 50))) == pytest.approx(float(mean_pairwise_rms(images)), rel=1e-12)
    close = torch.full((2, 3, 8, 8), 100.0, dtype=torch.float64)
    close[1] += 1e-6
    assert float(mean_pairwise_rms(close)) == pytest.approx(1e-6, rel=1e-6)
    # 30 images (cdist's matrix-product shortcut starts above 25): image i is 100 + i * 1e-6 everywhere, so the
    # mean distance over ordered pairs is 1e-6 * mean |i - j| = 1e-6 * 31 / 3
    many = 100.0 + 1e-6 * torch.arange(30, dtype=torch.float64).view(30, 1, 1, 1).expand(30, 3, 8, 8)
    assert float(mean_pairwise_rms(many)) == pytest.approx(1e-6 * 31 / 3, rel=1e-6)


def test_mean_rms_change_hand_values_and_errors():
    """Mean over images of the RMS change; one image or mismatched shapes are refused."""
    before = torch.tensor([[1.0, 1.0], [2.0, 0.0]])
    after = torch.tensor([[4.0, 5.0], [3.0, 1.0]])  # changes (3, 4) and (1, 1)
    assert float(mean_rms_change(before, after)) == pytest.approx((math.sqrt(12.5) + 1.0) / 2, rel=1e-12)
    with pytest.raises(ValueError, match="at least two images, got 1$"):
        mean_pairwise_rms(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"one shape, got \(2, 2\) and \(3, 2\)"):
        mean_rms_change(torch.zeros(2, 2), torch.zeros(3, 2))
