"""FedVTC's loss terms against hand-computed values (Eq. 2-6)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from fedhet.functional.vtc import (
    class_mean_sum,
    distribution_matching_error,
    gaussian_kl_to_prior,
    prototype_geometry,
    reconstruction_error,
    reparameterize,
)


def test_kl_to_the_class_prior_by_hand():
    """With z = (1, 2), sigma = (1, 2), c = (0, 1): 0.5 * [(1 + 1) + (4 - 1 - log 4)] = 0.5 * (5 - log 4)."""
    z = torch.tensor([[1.0, 2.0]])
    log_sigma = torch.log(torch.tensor([1.0, 2.0]))
    prior = torch.tensor([[0.0, 1.0]])
    expected = 0.5 * (2.0 + 3.0 - math.log(4.0))
    assert gaussian_kl_to_prior(z, log_sigma, prior).item() == pytest.approx(expected, abs=1e-6)


def test_kl_equals_torch_distributions():
    """The closed form is KL(N(z, diag sigma^2) || N(c, I)) summed over dimensions (spec check 1)."""
    generator = torch.Generator().manual_seed(0)
    z, prior = torch.randn(5, 7, generator=generator), torch.randn(5, 7, generator=generator)
    log_sigma = 0.3 * torch.randn(7, generator=generator)
    reference = kl_divergence(Normal(z, log_sigma.exp().expand_as(z)), Normal(prior, torch.ones_like(prior))).sum(-1)
    torch.testing.assert_close(gaussian_kl_to_prior(z, log_sigma, prior), reference, atol=1e-5, rtol=1e-5)


def test_kl_is_zero_at_the_prior():
    """Features on the prototype and sigma = 1: no divergence."""
    assert gaussian_kl_to_prior(torch.ones(2, 3), torch.zeros(3), torch.ones(2, 3)).abs().max().item() == 0.0


def test_reconstruction_is_the_summed_squared_error_by_hand():
    """(0.5-0)^2 + (0.5-1)^2 + (1-1)^2 + (0-1)^2 = 0.25 + 0.25 + 0 + 1 = 1.5 per image."""
    reconstruction = torch.tensor([[[[0.5, 0.5], [1.0, 0.0]]]])
    target = torch.tensor([[[[0.0, 1.0], [1.0, 1.0]]]])
    assert reconstruction_error(reconstruction, target).tolist() == [1.5]


def test_distribution_matching_by_hand():
    """||(1, 2) - (1, 0)||^2 = 4 and ||(0, 0) - (3, 4)||^2 = 25."""
    features = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    prototypes = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    assert distribution_matching_error(features, prototypes).tolist() == [4.0, 25.0]


def test_class_mean_sum_by_hand():
    """Classes 0 (values 1, 3, 5) and 2 (value 10): mean 3 + mean 10 = 13; batch mean = 19 / 4."""
    values = torch.tensor([1.0, 3.0, 10.0, 5.0])
    labels = torch.tensor([0, 0, 2, 0])
    assert class_mean_sum(values, labels).item() == pytest.approx(13.0)
    assert class_mean_sum(values, labels, "batch_mean").item() == pytest.approx(19.0 / 4.0)


def test_reparameterize_by_hand():
    """The latent is z + sigma * eps = (1 + 0.5 * 2, -1 + 3 * 1)."""
    v = reparameterize(torch.tensor([[1.0, -1.0]]), torch.log(torch.tensor([0.5, 3.0])), torch.tensor([[2.0, 1.0]]))
    torch.testing.assert_close(v, torch.tensor([[2.0, 2.0]]))


def test_prototype_geometry_by_hand():
    """Norms 5, 0, 1 (mean 2); distances 5, sqrt(18) ~ 4.24, 1: the smallest is 1, the diagonal's zeros excluded."""
    norm, separation = prototype_geometry(torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, 1.0]]))
    assert norm.item() == pytest.approx(2.0)
    assert separation.item() == pytest.approx(1.0)


def test_element_means_divide_each_per_sample_sum_by_its_size():
    """elements='mean': the KL, reconstruction and matching errors averaged over the p (or pixel) elements."""
    z, prior = torch.tensor([[1.0, 0.0], [3.0, 4.0]]), torch.zeros(2, 2)
    kl_sum = gaussian_kl_to_prior(z, torch.zeros(2), prior)
    torch.testing.assert_close(gaussian_kl_to_prior(z, torch.zeros(2), prior, "mean"), kl_sum / 2)
    assert kl_sum.tolist() == [0.5, 12.5]  # 0.5 ||z||^2 at sigma = 1
    images = torch.ones(2, 1, 2, 3)
    assert reconstruction_error(images, torch.zeros(2, 1, 2, 3), "mean").tolist() == [1.0, 1.0]
    assert distribution_matching_error(z, prior, "mean").tolist() == [0.5, 12.5]


def test_unknown_reductions_are_refused_by_name():
    """A misspelt element reduction or class reduction is an error naming the accepted ones."""
    with pytest.raises(ValueError, match=r"^unknown element reduction 'avg'; use 'sum' or 'mean'$"):
        reconstruction_error(torch.ones(1, 2), torch.zeros(1, 2), "avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^unknown reduction 'sum'; use 'class_mean_sum' or 'batch_mean'$"):
        class_mean_sum(torch.ones(2), torch.tensor([0, 1]), "sum")  # type: ignore[arg-type]


def test_class_mean_sum_keeps_float64():
    """float64 values are summed per class in float64: 0.1 + 0.2 over one class of two is 0.15000000000000002."""
    out = class_mean_sum(torch.tensor([0.1, 0.2], dtype=torch.float64), torch.tensor([0, 0]))
    assert out.dtype == torch.float64 and out.item() == (0.1 + 0.2) / 2
