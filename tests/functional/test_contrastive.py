"""Hand-computed values of MOON's, FedProc's and FedRS's local-objective functions."""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.functional import (
    fedproc_alpha,
    model_contrastive_loss,
    prototypical_contrastive_loss,
    restricted_logits,
    restricted_softmax_scale,
)


def test_model_contrastive_loss_on_2d_vectors_by_hand():
    """MOON's loss on two 2-d samples, worked by hand from their cosines."""
    # sample 1: z=[3,4], z_glob=[4,3] -> cos = 24/25 = 0.96; z_prev=[-3,-4] -> cos = -1
    # sample 2: z=[1,0], z_glob=[0,2] -> cos = 0;            z_prev=[5,0]  -> cos = 1
    z = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    z_glob = torch.tensor([[4.0, 3.0], [0.0, 2.0]])
    z_prev = torch.tensor([[-3.0, -4.0], [5.0, 0.0]])
    # tau = 0.5: l = -log(e^{p/tau} / (e^{p/tau} + e^{n/tau})) = log(1 + e^{(n - p)/tau})
    # sample 1: log(1 + e^{(-1 - 0.96)/0.5}) = log(1 + e^{-3.92}) = log(1.019841) = 0.019647
    # sample 2: log(1 + e^{(1 - 0)/0.5})    = log(1 + e^{2})     = log(8.389056) = 2.126928
    expected = (0.019647 + 2.126928) / 2
    assert model_contrastive_loss(z, z_glob, z_prev, temperature=0.5).item() == pytest.approx(expected, abs=1e-5)


def test_model_contrastive_loss_is_log2_when_positive_and_negative_agree():
    """Identical positive and negative representations give log 2 for any temperature."""
    z = torch.tensor([[1.0, 2.0]])
    # global and previous representation identical: the two logits tie, l = log 2 for any tau
    assert model_contrastive_loss(z, z * 3, z * 3, temperature=0.1).item() == pytest.approx(math.log(2.0), abs=1e-6)


def test_model_contrastive_loss_gradient_reaches_only_the_local_features():
    """The gradient reaches the local features, not the (detached) global ones."""
    z = torch.tensor([[1.0, 0.0]], requires_grad=True)
    z_glob = torch.tensor([[0.0, 1.0]], requires_grad=True)
    z_prev = torch.tensor([[1.0, 1.0]])
    model_contrastive_loss(z, z_glob.detach(), z_prev, 0.5).backward()
    assert z.grad is not None and z.grad.abs().sum() > 0 and z_glob.grad is None


def test_prototypical_contrastive_loss_two_classes_by_hand():
    """FedProc's InfoNCE against two prototypes, worked by hand from cosines."""
    features = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    labels = torch.tensor([0, 1])
    prototypes = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    # sample 0 (class 0): cos to c0 = 1, to c1 = 1/sqrt(2) = 0.707107 -> log(1 + e^{0.707107 - 1})
    #   = log(1 + e^{-0.292893}) = log(1.746102) = 0.557386
    # sample 1 (class 1): cos to c0 = 0, to c1 = 0.707107     -> log(1 + e^{0 - 0.707107})
    #   = log(1 + e^{-0.707107}) = log(1.493069) = 0.400834
    expected = (0.557386 + 0.400834) / 2
    assert prototypical_contrastive_loss(features, labels, prototypes).item() == pytest.approx(expected, abs=1e-5)
    # tau = 0.5 doubles the similarity gap: log(1 + e^{-0.585786}) = log(1.556668) = 0.442548,
    # log(1 + e^{-1.414214}) = log(1.243117) = 0.217622
    halved = prototypical_contrastive_loss(features, labels, prototypes, temperature=0.5).item()
    assert halved == pytest.approx((0.442548 + 0.217622) / 2, abs=1e-5)


def test_prototypical_contrastive_loss_ignores_missing_prototypes():
    """A class without a prototype drops its samples and is no negative."""
    features = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    labels = torch.tensor([0, 1, 2])
    # class 2 has no prototype: sample 2 is dropped and c2 (garbage) is not a negative,
    # so the value is the two-class one of the previous test
    prototypes = torch.tensor([[1.0, 0.0], [1.0, 1.0], [-50.0, 7.0]])
    available = torch.tensor([True, True, False])
    value = prototypical_contrastive_loss(features, labels, prototypes, available).item()
    assert value == pytest.approx((0.557386 + 0.400834) / 2, abs=1e-5)
    none = prototypical_contrastive_loss(features[2:], labels[2:], prototypes, available)
    assert none.item() == 0.0


def test_restricted_softmax_scale_missing_and_proportional():
    """FedRS's class scales under the paper's and the official code's rule; alpha is validated."""
    counts = torch.tensor([10, 0, 5, 0])
    assert restricted_softmax_scale(counts, 0.5).tolist() == [1.0, 0.5, 1.0, 0.5]
    # proportional: 0.25 + 0.75 * n / 10 -> [1, 0.25, 0.625, 0.25]
    assert restricted_softmax_scale(counts, 0.25, "proportional").tolist() == [1.0, 0.25, 0.625, 0.25]
    assert restricted_softmax_scale(counts, 1.0).tolist() == [1.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="alpha"):
        restricted_softmax_scale(counts, 1.5)


def test_restricted_logits_scale_missing_classes_and_change_the_softmax():
    """Restricted logits scale the missing classes and change the softmax as computed by hand."""
    logits = torch.tensor([[2.0, 4.0, -1.0]])
    scale = restricted_softmax_scale(torch.tensor([3, 0, 1]), 0.5)
    restricted = restricted_logits(logits, scale)
    assert restricted.tolist() == [[2.0, 2.0, -1.0]]
    # restricted softmax of class 0: e^2 / (e^2 + e^2 + e^-1) = 7.389056 / 15.145992 = 0.487856
    assert torch.softmax(restricted, dim=1)[0, 0].item() == pytest.approx(0.487856, abs=1e-5)
    assert torch.equal(restricted_logits(logits, torch.ones(3)), logits)


def test_fedproc_alpha_decays_linearly_from_one_to_zero():
    """FedProc's alpha goes 1, 0.75, ..., 0 over the rounds and stays 0 after them."""
    assert [fedproc_alpha(t, 5) for t in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert fedproc_alpha(0, 1) == 1.0
    assert fedproc_alpha(7, 5) == 0.0


def test_defaults_are_the_papers_values():
    """MOON's tau 0.5 and FedRS's alpha 0.5 when the knobs are not given."""
    torch.manual_seed(0)
    z, zg, zp = torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 3)
    assert torch.equal(model_contrastive_loss(z, zg, zp), model_contrastive_loss(z, zg, zp, 0.5))
    counts = torch.tensor([3, 0, 1])
    assert torch.equal(restricted_softmax_scale(counts), restricted_softmax_scale(counts, 0.5, "missing"))


def test_settings_are_checked_at_their_edges_with_named_errors():
    """Temperature 0 and alpha outside [0, 1] are refused by name; alpha 0 is allowed."""
    z = torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"^temperature must be positive, got 0.0$"):
        model_contrastive_loss(z, z, z, 0.0)
    with pytest.raises(ValueError, match=r"^temperature must be positive, got 0.0$"):
        prototypical_contrastive_loss(z, torch.tensor([0]), torch.eye(2), temperature=0.0)
    assert restricted_softmax_scale(torch.tensor([2, 0]), 0.0).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"^mode must be 'missing' or 'proportional', got 'soft'$"):
        restricted_softmax_scale(torch.tensor([2, 0]), 0.5, "soft")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^need round_idx >= 0 and total_rounds >= 1, got -1 and 5$"):
        fedproc_alpha(-1, 5)
    with pytest.raises(ValueError, match=r"^need round_idx >= 0 and total_rounds >= 1, got 0 and 0$"):
        fedproc_alpha(0, 0)


def test_fedproc_alpha_of_two_rounds_and_proportional_scale_of_single_examples():
    """Two rounds: alpha 1 then 0. Proportional scale with one example at most: held classes get 1."""
    assert fedproc_alpha(0, 2) == 1.0 and fedproc_alpha(1, 2) == 0.0
    assert restricted_softmax_scale(torch.tensor([1, 0]), 0.5, "proportional").tolist() == [1.0, 0.5]


def test_prototypical_loss_with_more_classes_than_dimensions_and_float64_prototypes():
    """Three class prototypes in 2-D, sent as float64: the loss is computed in the features' dtype."""
    features, labels = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    prototypes = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)
    loss = prototypical_contrastive_loss(features, labels, prototypes)
    # cosines 1, 0, -1 at tau 1: -log(e / (e + 1 + 1/e))
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(-math.log(math.e / (math.e + 1 + 1 / math.e)), rel=1e-6)


def test_restricted_logits_keep_a_low_precision_dtype():
    """bfloat16 logits scaled by a float32 scale stay bfloat16."""
    scaled = restricted_logits(torch.ones(1, 2, dtype=torch.bfloat16), restricted_softmax_scale(torch.tensor([1, 0])))
    assert scaled.dtype == torch.bfloat16 and scaled.tolist() == [[1.0, 0.5]]
