"""Hand-computed checks of fedhet.functional.prototype_learning (FedGH, FedTGP)."""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.functional import (
    adaptive_margin,
    margin_contrastive_loss,
    pairwise_distances,
    prototype_alignment_loss,
    prototype_examples,
)


def test_prototype_examples_keeps_held_classes_in_client_then_class_order():
    """Prototype examples keep held classes only, client by client, classes ascending."""
    client_a = torch.tensor([[1.0, 1.0], [9.0, 9.0], [2.0, 2.0]])
    client_b = torch.tensor([[3.0, 3.0], [4.0, 4.0], [7.0, 7.0]])
    prototypes, labels = prototype_examples([client_a, client_b], [torch.tensor([4, 0, 1]), torch.tensor([0, 2, 0])])
    # a holds classes 0 and 2 (class 1's row 9,9 is junk), b holds class 1 only
    assert torch.equal(prototypes, torch.tensor([[1.0, 1.0], [2.0, 2.0], [4.0, 4.0]]))
    assert torch.equal(labels, torch.tensor([0, 2, 1]))
    assert labels.dtype == torch.long


def test_pairwise_distances_and_finite_gradient_at_zero():
    """Pairwise distances by hand, with a finite gradient at distance 0."""
    a = torch.tensor([[0.0, 0.0], [1.0, 1.0]], requires_grad=True)
    b = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    distances = pairwise_distances(a, b)
    # |(0,0)-(3,4)| = 5, |(0,0)-(0,0)| = 0, |(1,1)-(3,4)| = sqrt(4+9), |(1,1)-(0,0)| = sqrt(2)
    expected = torch.tensor([[5.0, 0.0], [math.sqrt(13.0), math.sqrt(2.0)]])
    assert torch.allclose(distances, expected, atol=1e-5)
    distances.sum().backward()
    assert torch.isfinite(a.grad).all()


def test_adaptive_margin_is_the_largest_nearest_neighbour_distance():
    """The margin is the largest nearest-other-class distance over uploaded classes, capped at tau."""
    # pairwise: d(0,1) = 5, d(0,2) = 1, d(1,2) = sqrt(9 + 9) = 4.2426
    # nearest other class: c0 -> 1, c1 -> 4.2426, c2 -> 1; the max is 4.2426
    q = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0], [100.0, 100.0]])
    present = torch.tensor([True, True, True, False])  # the far class 3 was not uploaded: ignored
    assert adaptive_margin(q, present, 100.0).item() == pytest.approx(math.sqrt(18.0), rel=1e-6)
    # the threshold tau caps it
    assert adaptive_margin(q, present, 2.0).item() == pytest.approx(2.0)
    # with class 3 present its nearest neighbour is class 1 at sqrt(97^2 + 96^2) = 136.47
    everything = torch.ones(4, dtype=torch.bool)
    assert adaptive_margin(q, everything, 1000.0).item() == pytest.approx(math.sqrt(97**2 + 96**2), rel=1e-6)


def test_adaptive_margin_with_a_single_class_is_the_threshold():
    """With one class uploaded the margin is the threshold."""
    q = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    assert adaptive_margin(q, torch.tensor([True, False]), 7.5).item() == pytest.approx(7.5)


def test_margin_contrastive_loss_by_hand():
    """FedTGP's margin contrastive loss by hand."""
    global_prototypes = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    prototypes = torch.tensor([[0.0, 0.0], [3.0, 0.0]])
    labels = torch.tensor([0, 1])
    # sample 0 (class 0): distances (0, 5); logits -(0 + 1), -5 -> CE = log(1 + e^{-4}) = 0.0181499
    # sample 1 (class 1): distances (3, 4); logits -3, -(4 + 1) -> CE = log(1 + e^{2}) = 2.1269280
    expected = (math.log(1 + math.exp(-4.0)) + math.log(1 + math.exp(2.0))) / 2
    loss = margin_contrastive_loss(prototypes, labels, global_prototypes, 1.0)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    # margin 0 is the plain distance-softmax: sample 1 -> log(1 + e^{1}) = 1.3132617
    plain = margin_contrastive_loss(prototypes, labels, global_prototypes, 0.0)
    assert plain.item() == pytest.approx((math.log(1 + math.exp(-5.0)) + math.log(1 + math.exp(1.0))) / 2, rel=1e-5)


def test_margin_contrastive_loss_pulls_own_prototype_and_pushes_others():
    """A step on the loss pulls the own class's prototype in and pushes the other away."""
    global_prototypes = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    loss = margin_contrastive_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([0]), global_prototypes, 0.5)
    loss.backward()
    # descending the gradient moves G^0 towards the client prototype (0, 0) and G^1 away from it
    assert global_prototypes.grad[0, 0] > 0 and global_prototypes.grad[1, 1] < 0


def test_prototype_alignment_loss_mse_and_euclidean_by_hand():
    """The alignment loss as MSE and as mean Euclidean distance by hand."""
    features = torch.tensor([[3.0, 4.0], [1.0, 1.0]])
    targets = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    # squared differences: (9, 16) and (0, 1): MSE = 26 / 4 = 6.5; distances 5 and 1: mean 3
    assert prototype_alignment_loss(features, targets, "mse").item() == pytest.approx(6.5)
    assert prototype_alignment_loss(features, targets, "euclidean").item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="unknown distance"):
        prototype_alignment_loss(features, targets, "cosine")  # type: ignore[arg-type]


def test_adaptive_margin_with_two_classes_one_dimension_and_an_integer_mask():
    """Two classes at distance 5 give 5; 1-D prototypes work; a 0/1 integer mask selects like a boolean one."""
    assert adaptive_margin(torch.tensor([[0.0, 0.0], [3.0, 4.0]]), torch.tensor([True, True]), 100.0).item() == 5.0
    line = torch.tensor([[0.0], [3.0], [1.0]])  # nearest others: 1, 2, 1 -> 2
    assert adaptive_margin(line, torch.tensor([True, True, True]), 100.0).item() == pytest.approx(2.0)
    assert adaptive_margin(line, torch.tensor([1, 0, 1]), 100.0).item() == pytest.approx(1.0)


def test_adaptive_margin_keeps_the_prototypes_dtype():
    """The threshold comes back in the prototypes' dtype, also when one class gives no distance."""
    single = adaptive_margin(torch.zeros(2, 3, dtype=torch.float64), torch.tensor([True, False]), 0.3)
    assert single.dtype == torch.float64 and single.item() == 0.3


def test_margin_contrastive_loss_with_more_classes_than_dimensions():
    """Three global prototypes in 2-D; only the own class is handicapped by the margin."""
    global_prototypes = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
    loss = margin_contrastive_loss(torch.zeros(1, 2), torch.tensor([0]), global_prototypes, 1.0)
    # logits -(d + handicap): -(0 + 1), -5, -1 -> -log(e^-1 / (e^-1 + e^-5 + e^-1))
    expected = -math.log(math.exp(-1) / (2 * math.exp(-1) + math.exp(-5)))
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_alignment_default_and_examples_refusal():
    """The default distance is MSE; values and counts of different lengths are refused with both lengths."""
    torch.manual_seed(0)
    features, targets = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(prototype_alignment_loss(features, targets), prototype_alignment_loss(features, targets, "mse"))
    message = r"^prototype_examples needs one counts tensor per values tensor, got 2 and 1$"
    with pytest.raises(ValueError, match=message):
        prototype_examples([torch.zeros(1, 1)] * 2, [torch.ones(1)])
