"""Hand-computed checks of the FCCL / FCCL+ losses (reference/fccl-plus.md sections 3 and 9.5)."""

import math

import pytest
import torch

from fedhet.functional import (
    batch_standardize,
    cross_correlation,
    dual_domain_distillation,
    fccm_loss,
    fisl_loss,
    fntd_loss,
    instance_similarity,
    kd_loss,
    linear_round_decay,
)

LAMBDA = 0.0051


def test_batch_standardize_uses_unbiased_std():
    """Batch standardisation divides by the unbiased std."""
    # column [1, 3]: mean 2, unbiased std sqrt(((-1)^2 + 1^2) / 1) = sqrt(2)
    out = batch_standardize(torch.tensor([[1.0], [3.0]]), eps=0.0)
    assert torch.allclose(out, torch.tensor([[-1 / math.sqrt(2)], [1 / math.sqrt(2)]]))


def test_fccm_of_identical_logits_matches_spec_value():
    """FCCM of identical uncorrelated logits has diagonal (B-1)/B and the spec's value."""
    # B = 4, C = 2, columns [1,-1,1,-1] and [1,1,-1,-1]: mean 0, uncorrelated, unbiased var 4/3.
    # M[u,u] = sum_b z^2 / var / B = (4 / (4/3)) / 4 = 3/4 = (B-1)/B; M[0,1] = M[1,0] = 0.
    # L = C * (1 - 3/4)^2 + lambda * 2 * (0 + 1)^2 = C / B^2 + 2 lambda = 0.125 + 0.0102
    z = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]])
    matrix = cross_correlation(z, z, eps=0.0)
    assert torch.allclose(torch.diagonal(matrix), torch.tensor([0.75, 0.75]))
    assert fccm_loss(z, z, LAMBDA, eps=0.0).item() == pytest.approx(2 / 16 + 2 * LAMBDA)
    # with the Barlow-Twins off-diagonal target 0 only the diagonal term remains
    assert fccm_loss(z, z, LAMBDA, off_diag_target=0.0, eps=0.0).item() == pytest.approx(0.125)


def test_fccm_two_by_two_by_hand():
    """FCCM of a 2 x 2 batch by hand, with the gradient on the client's logits only."""
    # B = 2: every standardised column is +-1/sqrt(2) (sign of the deviation from the mean).
    # Z columns [1,3] -> (-,+), [2,0] -> (+,-); Zbar columns [0,2] -> (-,+), [3,1] -> (+,-).
    # M[u,v] = (agreement of signs) * (1/2 + 1/2) / B = +-1/2: M = [[.5, -.5], [-.5, .5]].
    # L = 2 * (1 - .5)^2 + lambda * 2 * (1 - .5)^2 = 0.5 + 0.5 * lambda
    z = torch.tensor([[1.0, 2.0], [3.0, 0.0]], requires_grad=True)
    zbar = torch.tensor([[0.0, 3.0], [2.0, 1.0]], requires_grad=True)
    assert torch.allclose(cross_correlation(z, zbar, eps=0.0), torch.tensor([[0.5, -0.5], [-0.5, 0.5]]))
    loss = fccm_loss(z, zbar, LAMBDA, eps=0.0)
    assert loss.item() == pytest.approx(0.5 + 0.5 * LAMBDA)
    loss.backward()
    assert z.grad is not None and zbar.grad is None  # the averaged target is a constant


def test_instance_similarity_drops_the_diagonal():
    """Instance similarities are cosines over the temperature with the diagonal removed."""
    # rows normalise to [1,0], [0,1], [1,1]/sqrt(2); cosines: (0,1) = 0, (0,2) = (1,2) = 1/sqrt(2)
    features = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    s = instance_similarity(features, temperature=0.5)
    r = 1 / math.sqrt(2) / 0.5
    assert s.shape == (3, 2)
    assert torch.allclose(s, torch.tensor([[0.0, r], [0.0, r], [r, r]]))
    assert not torch.isclose(s, torch.tensor(2.0)).any()  # self-similarity 1/mu = 2 is gone


def test_instance_similarity_shape_for_different_feature_sizes():
    """Clients with different feature sizes give similarity matrices of one shape."""
    assert instance_similarity(torch.randn(5, 7)).shape == instance_similarity(torch.randn(5, 64)).shape == (5, 4)


def test_fisl_zero_for_equal_and_hand_value():
    """FISL is zero for equal similarities and matches a batchmean KL by hand."""
    s = torch.randn(4, 3)
    assert fisl_loss(s, s.clone()).item() == pytest.approx(0.0, abs=1e-7)
    # S_i = 0 (uniform [.5, .5] rows); Sbar row 0 = [ln 3, 0] -> softmax [3/4, 1/4], rows 1-2 uniform.
    # row 0: 3/4 ln(1.5) + 1/4 ln(0.5) = 0.130812; batchmean over 3 rows -> 0.043604
    student = torch.zeros(3, 2, requires_grad=True)
    target = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0], [0.0, 0.0]], requires_grad=True)
    loss = fisl_loss(student, target)
    assert loss.item() == pytest.approx((0.75 * math.log(1.5) + 0.25 * math.log(0.5)) / 3)
    loss.backward()
    assert target.grad is None


# A 3-class example at tau = 2: student logits 0 -> p_S = [1/3, 1/3, 1/3];
# teacher logits [2 ln 2, 0, 0] -> z/tau = [ln 2, 0, 0] -> p_T = [1/2, 1/4, 1/4].
TAU = 2.0
STUDENT = [0.0, 0.0, 0.0]
TEACHER = [2 * math.log(2.0), 0.0, 0.0]


def test_fntd_zero_when_student_equals_teacher():
    """FNTD is zero when the student equals the teacher."""
    logits = torch.randn(5, 4)
    assert fntd_loss(logits, logits.clone(), torch.tensor([0, 1, 2, 3, 0]), 3.0).item() == pytest.approx(0.0, abs=1e-6)


def test_fntd_hand_values_unnormalised():
    """FNTD over all-class softmaxes with the target removed, times tau^2, by hand."""
    student, teacher = torch.tensor([STUDENT, STUDENT]), torch.tensor([TEACHER, TEACHER])
    # target 0: non-target terms 2 * 1/4 ln((1/4)/(1/3)) = 0.5 ln 0.75 (negative: the rows are not
    # distributions); target 1: 1/2 ln(1.5) + 1/4 ln(0.75). times tau^2 = 4, batchmean over 2 rows.
    row_t0 = 4 * 0.5 * math.log(0.75)
    row_t1 = 4 * (0.5 * math.log(1.5) + 0.25 * math.log(0.75))
    loss = fntd_loss(student, teacher, torch.tensor([0, 1]), TAU)
    assert loss.item() == pytest.approx((row_t0 + row_t1) / 2, abs=1e-6)  # float32 cancellation


def test_fntd_hand_values_renormalised():
    """FNTD with the non-target classes renormalised, by hand."""
    student, teacher = torch.tensor([STUDENT, STUDENT]), torch.tensor([TEACHER, TEACHER])
    # target 0: non-target teacher [1/4, 1/4] -> [1/2, 1/2] = student -> 0.
    # target 1: teacher [1/2, 1/4] -> [2/3, 1/3], student [1/2, 1/2]: 2/3 ln(4/3) + 1/3 ln(2/3).
    row_t1 = 4 * (2 / 3 * math.log(4 / 3) + 1 / 3 * math.log(2 / 3))
    loss = fntd_loss(student, teacher, torch.tensor([0, 1]), TAU, renormalize=True)
    assert loss.item() == pytest.approx(row_t1 / 2)


def test_fntd_target_logit_gradient():
    """FNTD's target-logit gradient is tau (1 - p_T) p_S, and zero when renormalised."""
    # spec 3.3: d(tau^2 FNTD)/dz_S^t = tau (1 - p_T^t) p_S^t = 2 * 1/2 * 1/3 = 1/3 (one sample)
    student = torch.tensor([STUDENT], requires_grad=True)
    fntd_loss(student, torch.tensor([TEACHER]), torch.tensor([0]), TAU).backward()
    assert student.grad[0, 0].item() == pytest.approx(1 / 3)
    renormalised = torch.tensor([STUDENT], requires_grad=True)
    fntd_loss(renormalised, torch.tensor([TEACHER]), torch.tensor([0]), TAU, renormalize=True).backward()
    assert renormalised.grad[0, 0].item() == 0.0


def test_kd_hand_value():
    """KD is tau^2 KL(p_T || p_S) over all classes, by hand."""
    # KL([1/2, 1/4, 1/4] || [1/3]*3) = 1/2 ln 1.5 + 2 * 1/4 ln 0.75, times tau^2 = 4
    loss = kd_loss(torch.tensor([STUDENT]), torch.tensor([TEACHER]), TAU)
    assert loss.item() == pytest.approx(4 * (0.5 * math.log(1.5) + 0.5 * math.log(0.75)))


def test_dual_domain_distillation_hand_value():
    """FCCL's dual distillation sums the two teachers' KLs at temperature 1, by hand."""
    # temperature 1: previous teacher [ln 2, 0, 0] -> [1/2, 1/4, 1/4] against uniform student;
    # pre-trained teacher equal to the student contributes 0.
    student = torch.tensor([STUDENT], requires_grad=True)
    previous = torch.tensor([[math.log(2.0), 0.0, 0.0]])
    loss = dual_domain_distillation(student, previous, torch.tensor([STUDENT]))
    assert loss.item() == pytest.approx(0.5 * math.log(1.5) + 0.5 * math.log(0.75))


def test_linear_round_decay_lags_one_round():
    """The authors' learning-rate decay keeps rounds 0 and 1 at lr0 and ends at 0.145 lr0 in 40 rounds."""
    # lr used in round e = lr0 (1 - 0.9 max(e-1, 0) / E); spec 2.4: round 39 of 40 uses 0.145 lr0
    assert linear_round_decay(0, 40) == 1.0
    assert linear_round_decay(1, 40) == 1.0
    assert linear_round_decay(39, 40) == pytest.approx(0.145)


def test_defaults_are_the_papers_values():
    """Called without the knobs, each loss uses FCCL+'s values: lambda 0.0051, mu 0.02, tau 3, eps 1e-5."""
    torch.manual_seed(0)
    z, zbar, features = torch.randn(6, 4), torch.randn(6, 4), torch.randn(6, 5)
    labels = torch.tensor([0, 1, 2, 3, 0, 1])
    assert torch.equal(batch_standardize(z), batch_standardize(z, eps=1e-5))
    assert torch.equal(cross_correlation(z, zbar), cross_correlation(z, zbar, eps=1e-5))
    assert torch.equal(fccm_loss(z, zbar), fccm_loss(z, zbar, 0.0051, -1.0, 1e-5))
    assert torch.equal(instance_similarity(features), instance_similarity(features, 0.02))
    assert torch.equal(kd_loss(z, zbar), kd_loss(z, zbar, 3.0))
    assert torch.equal(fntd_loss(z, zbar, labels), fntd_loss(z, zbar, labels, 3.0))
    assert linear_round_decay(6, 10) == linear_round_decay(6, 10, 0.1)


def test_batch_standardize_eps_is_added_to_the_std():
    """Eps is added to the unbiased std: column [1, 3] with eps 1 -> +-1 / (sqrt 2 + 1)."""
    out = batch_standardize(torch.tensor([[1.0], [3.0]]), eps=1.0)
    assert torch.allclose(out, torch.tensor([[-1.0], [1.0]]) / (math.sqrt(2) + 1))


def test_kd_hand_value_at_tau_three_with_a_non_uniform_student():
    """KD at tau = 3 scales both sides' logits by 1/tau and the KL by tau^2 (not 2 tau), by hand."""
    # student logits [3 ln 2, 0] -> /3 -> softmax [2/3, 1/3]; teacher [0, 3 ln 2] -> [1/3, 2/3]
    # KL(p_T || p_S) = 1/3 ln(1/2) + 2/3 ln 2 = 1/3 ln 2; times tau^2 = 9 -> 3 ln 2
    student, teacher = torch.tensor([[3 * math.log(2.0), 0.0]]), torch.tensor([[0.0, 3 * math.log(2.0)]])
    assert kd_loss(student, teacher, 3.0).item() == pytest.approx(3 * math.log(2.0), rel=1e-5)


def test_fntd_is_scaled_by_tau_squared():
    """FNTD at tau = 3 is tau^2 = 9 times the KL of the temperature softmaxes (2 tau = 6 would be wrong)."""
    # 3 classes, target 0; student logits 0 -> p_S = 1/3 each; teacher [0, 3 ln 2, 0] / 3 -> [1, 2, 1] / 4.
    # non-target terms (unnormalised): 1/2 ln(3/2) + 1/4 ln(3/4); times 9
    student, teacher = torch.zeros(1, 3), torch.tensor([[0.0, 3 * math.log(2.0), 0.0]])
    expected = 9 * (0.5 * math.log(1.5) + 0.25 * math.log(0.75))
    assert fntd_loss(student, teacher, torch.tensor([0]), 3.0).item() == pytest.approx(expected, rel=1e-5)


def test_too_small_batches_and_budgets_are_refused_with_their_size():
    """One sample cannot be standardised or compared with others; the errors name the size given."""
    with pytest.raises(ValueError, match="at least 2 samples, got 1$"):
        batch_standardize(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="at least 2 samples, got 1$"):
        instance_similarity(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="total_rounds must be >= 1, got 0"):
        linear_round_decay(0, 0)


def test_smallest_valid_batch_and_budget_are_accepted():
    """Two samples are enough for the similarity matrix and one round for the decay."""
    assert instance_similarity(torch.tensor([[1.0, 0.0], [0.0, 1.0]])).shape == (2, 1)
    assert linear_round_decay(0, 1) == 1.0
