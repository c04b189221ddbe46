"""Hand-computed values of the public-data distillation functionals (FedMD, FedDF, RHFL, FedMatch)."""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.functional import (
    client_confidence_weights,
    confident_pseudo_labels,
    digest_loss,
    ensemble_distillation_loss,
    kl_to_target,
    logit_consensus,
    logit_cross_entropy,
    masked_pseudo_label_loss,
    symmetric_cross_entropy,
    weighted_peer_kl,
)

LN2 = math.log(2.0)


def test_logit_consensus_is_the_mean_and_carries_no_gradient():
    """The consensus is the mean of the logits and carries no gradient."""
    a = torch.tensor([[1.0, 3.0], [0.0, 2.0]], requires_grad=True)
    b = torch.tensor([[3.0, -1.0], [4.0, 0.0]], requires_grad=True)
    c = torch.tensor([[2.0, 1.0], [-1.0, 1.0]], requires_grad=True)
    consensus = logit_consensus([a, b, c])
    # (1 + 3 + 2) / 3 = 2, (3 - 1 + 1) / 3 = 1, (0 + 4 - 1) / 3 = 1, (2 + 0 + 1) / 3 = 1
    assert torch.equal(consensus, torch.tensor([[2.0, 1.0], [1.0, 1.0]]))
    assert not consensus.requires_grad and consensus.grad_fn is None


def test_digest_loss_l1_and_mse_by_hand():
    """FedMD's L1 and MSE digest losses by hand; an unknown kind is a ValueError."""
    logits = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    target = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    # differences 1, 2, 2, -2: L1 = (1 + 2 + 2 + 2) / 4 = 1.75, MSE = (1 + 4 + 4 + 4) / 4 = 3.25
    assert digest_loss(logits, target, "l1").item() == pytest.approx(1.75)
    assert digest_loss(logits, target, "mse").item() == pytest.approx(3.25)
    with pytest.raises(ValueError, match="l1"):
        digest_loss(logits, target, "huber")  # type: ignore[arg-type]


def test_digest_gradient_reaches_only_the_student():
    """The digest gradient is sign(z - t) / n on the student only."""
    student = torch.tensor([[1.0, 2.0]], requires_grad=True)
    other = torch.tensor([[3.0, 0.0]], requires_grad=True)
    digest_loss(student, logit_consensus([student, other]), "l1").backward()
    # consensus (2, 1) is a constant: d/dz mean|z - t| = sign(z - t) / 2 = (-0.5, 0.5)
    assert torch.allclose(student.grad, torch.tensor([[-0.5, 0.5]]))
    assert other.grad is None


def test_kl_to_target_batchmean_by_hand():
    """The KL to a target is summed over classes and averaged over samples (batchmean)."""
    # student softmax of (0, 0) is (1/2, 1/2); target (1, 0): KL = 1 * ln(1 / 0.5) = ln 2 per row;
    # target (1/2, 1/2): KL = 0. batchmean over 2 rows: ln 2 / 2
    student = torch.zeros(2, 2)
    target = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    assert kl_to_target(student, target).item() == pytest.approx(LN2 / 2)


def test_ensemble_distillation_loss_by_hand_with_temperature():
    """FedDF's loss by hand at T = 1, and T^2 times the same KL at T = 2."""
    # ensemble logits (ln 3, 0): softmax = (3/4, 1/4); student (0, 0): (1/2, 1/2)
    # KL = 3/4 ln(3/2) + 1/4 ln(1/2) = 0.75 * 0.405465 - 0.25 * 0.693147 = 0.130812
    ensemble = torch.tensor([[math.log(3.0), 0.0]])
    student = torch.zeros(1, 2)
    assert ensemble_distillation_loss(student, ensemble).item() == pytest.approx(0.130812, abs=1e-6)
    # T = 2 on doubled logits gives the same distributions, times T^2 = 4
    scaled = ensemble_distillation_loss(student, 2 * ensemble, temperature=2.0)
    assert scaled.item() == pytest.approx(0.523248, abs=1e-5)


def test_symmetric_cross_entropy_on_a_three_class_example():
    """SCE = 0.1 CE + RCE with log(1e-4) for the clamped zeros, by hand."""
    # softmax = (1/2, 1/4, 1/4), label 0
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    labels = torch.tensor([0])
    # CE = -ln(1/2) = 0.693147
    # RCE = -(1/2 ln 1 + 1/4 ln 1e-4 + 1/4 ln 1e-4) = -(1/2) ln 1e-4 = 4.605170
    # SCE = 0.1 * 0.693147 + 1.0 * 4.605170 = 4.674485
    assert symmetric_cross_entropy(logits, labels).item() == pytest.approx(4.674485, abs=1e-5)
    # alpha = 1, beta = 0 is plain cross-entropy
    assert symmetric_cross_entropy(logits, labels, alpha=1.0, beta=0.0).item() == pytest.approx(0.693147, abs=1e-6)
    # a confident correct prediction: p = (~1, 2e-9, 2e-9), the small ones clamped up to 1e-7,
    # so RCE = 2 * 1e-7 * (-ln 1e-4) = 2e-7 * 9.210340 = 1.842068e-6
    confident = torch.tensor([[20.0, 0.0, 0.0]])
    reverse_only = symmetric_cross_entropy(confident, labels, alpha=0.0, beta=1.0)
    assert reverse_only.item() == pytest.approx(1.842068e-6, rel=1e-4)


def test_weighted_peer_kl_sums_each_peer_separately():
    """RHFL's loss sums each peer's KL times its weight; weights must match the peers."""
    student = torch.zeros(1, 2)  # (1/2, 1/2)
    peer_a = torch.tensor([[math.log(3.0), 0.0]])  # (3/4, 1/4): KL = 0.130812
    peer_b = torch.zeros(1, 2)  # (1/2, 1/2): KL = 0
    loss = weighted_peer_kl(student, [peer_a, peer_b], torch.tensor([0.6, 0.4]))
    # 0.6 * 0.130812 + 0.4 * 0 = 0.078487
    assert loss.item() == pytest.approx(0.078487, abs=1e-6)
    with pytest.raises(ValueError, match="one weight per peer"):
        weighted_peer_kl(student, [peer_a], torch.tensor([0.5, 0.5]))


def test_weighted_peer_kl_gradient_stays_with_the_student():
    """The peer KL's gradient reaches the student, not the peer."""
    student = torch.zeros(1, 2, requires_grad=True)
    peer = torch.tensor([[1.0, 0.0]], requires_grad=True)
    weighted_peer_kl(student, [peer], torch.tensor([1.0])).backward()
    assert student.grad is not None and peer.grad is None


def test_client_confidence_weights_from_given_loss_decreases():
    """CCR weights from two rounds of losses, worked by hand."""
    previous = torch.tensor([2.0, 3.0, 1.0])
    current = torch.tensor([1.0, 2.0, 1.0])
    # q = ((2-1)/1, (3-2)/2, 0/1) = (1, 0.5, 0); sum = 1.5
    # a = 1/2 + 0.5 * (2/3, 1/3, 0) = (0.833333, 0.666667, 0.5)
    # exp(a) = (2.300976, 1.947734, 1.648721); sum = 5.897431
    # w = (0.390166, 0.330268, 0.279566)
    weights = client_confidence_weights(previous, current, beta=0.5)
    assert torch.allclose(weights, torch.tensor([0.390166, 0.330268, 0.279566], dtype=torch.float64), atol=1e-6)
    assert weights.sum().item() == pytest.approx(1.0)


def test_client_confidence_weights_without_any_change_are_uniform():
    """Unchanged losses give uniform weights; fewer than two clients is a ValueError."""
    losses = torch.tensor([1.0, 2.0, 4.0, 8.0])
    assert torch.allclose(client_confidence_weights(losses, losses), torch.full((4,), 0.25, dtype=torch.float64))
    with pytest.raises(ValueError, match="K >= 2"):
        client_confidence_weights(torch.ones(1), torch.ones(1))


def test_confident_pseudo_labels_and_masked_loss_by_hand():
    """Pseudo-labels above the threshold, and their CE divided by the whole batch size, by hand."""
    probs = torch.tensor([[0.9, 0.05, 0.05], [0.5, 0.4, 0.1], [0.02, 0.08, 0.9]])
    labels, mask = confident_pseudo_labels(probs, threshold=0.85)
    assert labels.tolist() == [0, 0, 2] and mask.tolist() == [True, False, True]
    # student softmax (1/2, 1/4, 1/4) on every row: CE(label 0) = ln 2, CE(label 2) = ln 4
    # masked sum over the whole batch of 3: (ln 2 + ln 4) / 3 = 3 ln 2 / 3 = ln 2
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]])).repeat(3, 1)
    assert masked_pseudo_label_loss(logits, labels, mask).item() == pytest.approx(LN2, abs=1e-6)


def test_defaults_are_the_papers_values():
    """FedMD's L1 digest, RHFL's beta 0.5 and FedMatch's threshold 0.85 when the knobs are not given."""
    torch.manual_seed(0)
    logits, consensus = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(digest_loss(logits, consensus), digest_loss(logits, consensus, "l1"))
    previous, current = torch.tensor([2.0, 3.0, 1.0]), torch.tensor([1.0, 2.0, 1.0])
    assert torch.equal(client_confidence_weights(previous, current), client_confidence_weights(previous, current, 0.5))
    probs = torch.tensor([[0.86, 0.14], [0.84, 0.16]])
    assert confident_pseudo_labels(probs)[1].tolist() == [True, False]


def test_a_pseudo_label_needs_more_than_the_threshold():
    """A top probability equal to the threshold is not confident (strictly above)."""
    assert confident_pseudo_labels(torch.tensor([[0.85, 0.15]]), 0.85)[1].tolist() == [False]


def test_masked_pseudo_label_loss_of_one_sample():
    """One confident sample in a batch of one: its CE divided by 1."""
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    loss = masked_pseudo_label_loss(logits, torch.tensor([0]), torch.tensor([True]))
    assert loss.item() == pytest.approx(LN2, abs=1e-6)


def test_logit_cross_entropy_by_hand():
    """-sum softmax(target) log softmax(student), batch mean: target [ln 3, 0] -> [.75, .25], student uniform."""
    student = torch.zeros(2, 2, requires_grad=True)
    target = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]])
    loss = logit_cross_entropy(student, target)
    assert loss.item() == pytest.approx(LN2, abs=1e-6)  # each row: -(p log 1/2 summed) = ln 2
    loss.backward()
    # d/dz_s = (softmax(student) - softmax(target)) / B = ([.5-.75, .5-.25], [0, 0]) / 2
    torch.testing.assert_close(student.grad, torch.tensor([[-0.125, 0.125], [0.0, 0.0]]))
    skewed = logit_cross_entropy(torch.tensor([[math.log(3.0), 0.0]]), torch.zeros(1, 2))
    assert skewed.item() == pytest.approx(-(0.5 * math.log(0.75) + 0.5 * math.log(0.25)), abs=1e-6)


def test_client_confidence_weights_of_two_clients_with_small_losses():
    """K = 2 (the constant 1/(K-1) = 1), losses below 1, qualities summing below 1; float64 from float32 inputs."""
    previous, current = torch.tensor([0.5, 0.4]), torch.tensor([0.4, 0.4])
    # q = (0.1 / 0.4, 0) = (0.25, 0); share (1, 0); a = (1 + 0.5, 1); w = softmax = (e^.5, 1) / (e^.5 + 1)
    weights = client_confidence_weights(previous, current, beta=0.5)
    assert weights.dtype == torch.float64
    expected = torch.tensor([math.exp(0.5), 1.0], dtype=torch.float64) / (math.exp(0.5) + 1)
    torch.testing.assert_close(weights, expected)


def test_distillation_refusals_name_the_problem():
    """Each refusal says what is wrong and what it got."""
    with pytest.raises(ValueError, match=r"^logit_consensus needs the logits of at least one participant$"):
        logit_consensus([])
    with pytest.raises(ValueError, match=r"^temperature must be > 0, got 0.0$"):
        ensemble_distillation_loss(torch.zeros(1, 2), torch.zeros(1, 2), 0.0)
    with pytest.raises(ValueError, match=r"^client_confidence_weights needs two \[K\] loss vectors with K >= 2, "
                                         r"got \(2,\) and \(3,\)$"):
        client_confidence_weights(torch.ones(2), torch.ones(3))


def test_weighted_peer_kl_is_in_the_students_dtype():
    """float64 peer weights do not turn a float32 loss into float64."""
    loss = weighted_peer_kl(torch.zeros(1, 2), [torch.zeros(1, 2)], torch.ones(1, dtype=torch.float64))
    assert loss.dtype == torch.float32


def test_client_confidence_weights_divide_by_losses_below_one():
    """Qualities (0.1 / 0.4, 0.3 / 0.6, 0) = (0.25, 0.5, 0): shares (1/3, 2/3, 0), the losses used as they are."""
    weights = client_confidence_weights(torch.tensor([0.5, 0.9, 0.4]), torch.tensor([0.4, 0.6, 0.4]), beta=0.5)
    amounts = torch.tensor([0.5 + 0.5 / 3, 0.5 + 1.0 / 3, 0.5], dtype=torch.float64)
    torch.testing.assert_close(weights, torch.softmax(amounts, dim=0))
