"""FedFTG's label statistics and losses (fedhet.functional.data_free) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.functional import diversity_loss
from fedhet.functional.data_free import (
    class_ensemble_weights,
    ensemble_probabilities,
    label_sampling_distribution,
    soft_cross_entropy,
    weighted_fidelity,
    weighted_global_first_kl,
    weighted_logit_l1,
)

COUNTS = torch.tensor([[3.0, 0.0, 2.0], [1.0, 0.0, 0.0]])
# two teachers on one sample: softmax([0, 0]) = (1/2, 1/2), softmax([ln 3, 0]) = (3/4, 1/4)
TEACHERS = torch.tensor([[[0.0, 0.0]], [[math.log(3.0), 0.0]]])
WEIGHTS = torch.tensor([[0.25, 0.75]])  # A[j, k]


def test_label_sampling_is_proportional_to_the_active_clients_counts():
    """p_t(y) = n_S^y / sum n_S: (4, 0, 2) / 6; uniform for the -cls ablation; all-zero counts refused."""
    p = label_sampling_distribution(COUNTS)
    assert p.tolist() == pytest.approx([4 / 6, 0.0, 2 / 6])
    assert float(p.sum()) == pytest.approx(1.0)
    assert label_sampling_distribution(COUNTS, uniform=True).tolist() == pytest.approx([1 / 3] * 3)
    with pytest.raises(ValueError, match="all zero"):
        label_sampling_distribution(torch.zeros(2, 3))


def test_class_ensemble_weights_by_hand():
    """Alpha = n_k^y / n_S^y: (3/4, 1/4) for class 0, (1, 0) for a class one client holds, uniform if nobody does."""
    alpha = class_ensemble_weights(COUNTS)
    assert alpha[:, 0].tolist() == pytest.approx([0.75, 0.25], abs=1e-6)
    assert alpha[:, 2].tolist() == pytest.approx([1.0, 0.0], abs=1e-6)
    assert alpha[:, 1].tolist() == [0.5, 0.5]  # n_S^y = 0: uniform, never an all-zero target
    assert alpha.sum(0).tolist() == pytest.approx([1.0, 1.0, 1.0], abs=1e-6)
    assert class_ensemble_weights(COUNTS, uniform=True).tolist() == [[0.5] * 3, [0.5] * 3]


def test_ensemble_probabilities_combine_softmaxes_with_per_sample_weights():
    """0.25 (1/2, 1/2) + 0.75 (3/4, 1/4) = (11/16, 5/16)."""
    probs = ensemble_probabilities(TEACHERS, WEIGHTS)
    assert probs[0].tolist() == pytest.approx([11 / 16, 5 / 16])


def test_soft_cross_entropy_averages_over_batch_and_classes():
    """Student logits (0, 0): -(11/16 + 5/16) log(1/2) / 2 classes = ln 2 / 2."""
    loss = soft_cross_entropy(torch.zeros(1, 2), torch.tensor([[11 / 16, 5 / 16]]))
    assert loss.item() == pytest.approx(math.log(2) / 2)


def test_weighted_global_first_kl_is_the_papers_eq4():
    """KL((1/2,1/2) || (1/2,1/2)) = 0 and KL((1/2,1/2) || (3/4,1/4)) = ln(4/3) / 2, weighted 0.25 / 0.75."""
    loss = weighted_global_first_kl(torch.zeros(1, 2), TEACHERS, WEIGHTS)
    assert loss.item() == pytest.approx(0.75 * 0.5 * math.log(4 / 3))


def test_weighted_logit_l1_by_hand_and_teachers_get_no_gradient():
    """Student (1, 2): |1-0|,|2-0| -> 1.5 and |1-ln3|,|2-0| -> (ln3 - 1 + 2)/2, weighted 0.25 / 0.75."""
    student = torch.tensor([[1.0, 2.0]], requires_grad=True)
    teachers = TEACHERS.clone().requires_grad_(True)
    loss = weighted_logit_l1(student, teachers, WEIGHTS)
    expected = 0.25 * 1.5 + 0.75 * (math.log(3) - 1 + 2) / 2
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    assert teachers.grad is None and student.grad is not None


def test_weighted_fidelity_is_per_sample_weighted_cross_entropy():
    """Label 0: CE = ln 2 under the first teacher, -ln(3/4) under the second; 0.25 / 0.75."""
    loss = weighted_fidelity(TEACHERS, torch.tensor([0]), WEIGHTS)
    assert loss.item() == pytest.approx(0.25 * math.log(2) - 0.75 * math.log(0.75))
    # two samples with different weights: the mean of the per-sample weighted sums
    teachers = torch.cat([TEACHERS, TEACHERS], dim=1)
    weights = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    two = weighted_fidelity(teachers, torch.tensor([0, 0]), weights)
    assert two.item() == pytest.approx((math.log(2) - math.log(0.75)) / 2)


def test_diversity_loss_is_in_0_1_and_falls_when_outputs_spread():
    """L_dis = exp(-mean(noise_dist * output_dist)): 1 for identical outputs, smaller when they spread."""
    noise = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    same = diversity_loss(noise, torch.zeros(2, 4))
    spread = diversity_loss(noise, torch.tensor([[0.0] * 4, [2.0] * 4]))
    assert same.item() == 1.0
    # pairs (0,1) and (1,0): noise_dist 1, output_dist 2 -> mean over the 4 pairs = 1 -> exp(-1)
    assert spread.item() == pytest.approx(math.exp(-1.0))


def test_weighted_teacher_losses_match_a_per_sample_loop():
    """K = 2 teachers, B = 3 samples: each loss is mean_j sum_k A[j, k] loss_k(x_j), computed here sample by sample."""
    torch.manual_seed(0)
    student, teachers = torch.randn(3, 4), torch.randn(2, 3, 4)
    weights, labels = torch.rand(3, 2), torch.tensor([0, 3, 1])

    def per_sample_mean(loss_of):
        return sum(weights[j, k] * loss_of(k, j) for j in range(3) for k in range(2)) / 3

    def kl_student_first(k, j):
        p, q = student[j].softmax(0), teachers[k, j].softmax(0)
        return (p * (p.log() - q.log())).sum()

    expected_kl = per_sample_mean(kl_student_first)
    expected_l1 = per_sample_mean(lambda k, j: (student[j] - teachers[k, j]).abs().mean())
    expected_ce = per_sample_mean(lambda k, j: -teachers[k, j].log_softmax(0)[labels[j]])
    assert weighted_global_first_kl(student, teachers, weights).item() == pytest.approx(expected_kl.item(), rel=1e-5)
    assert weighted_logit_l1(student, teachers, weights).item() == pytest.approx(expected_l1.item(), rel=1e-5)
    assert weighted_fidelity(teachers, labels, weights).item() == pytest.approx(expected_ce.item(), rel=1e-5)


def test_class_ensemble_weights_add_eps_to_the_total():
    """A class held by one example: alpha = 1 / (1 + eps) exactly as float32 (not 1 / (1 - eps), not 1/K)."""
    alpha = class_ensemble_weights(torch.tensor([[1], [0]]))
    assert alpha[:, 0].tolist() == [torch.tensor(1 / (1 + 1e-6)).float().item(), 0.0]


def test_label_sampling_accepts_a_single_example_and_names_empty_counts():
    """One labelled example is enough; all-zero counts are refused with the reason."""
    assert label_sampling_distribution(torch.tensor([[0, 1]])).tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match=r"^label counts are all zero: the active clients hold no labelled data$"):
        label_sampling_distribution(torch.zeros(2, 3))
