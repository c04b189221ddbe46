"""Hand-computed checks of FML's mutual learning, FedKD's distillation and SVD compression, FedGen's diversity."""

import math

import pytest
import torch
import torch.nn.functional as F

from fedhet.functional import (
    adaptive_distillation_weight,
    adaptive_mutual_distillation,
    compress_state,
    decompress_state,
    distillation_kl,
    diversity_loss,
    energy_rank,
    energy_schedule,
    mutual_learning_losses,
    svd_compress,
    svd_decompress,
)

# A 2-class example: model a is undecided (p_a = [1/2, 1/2]); model b has logits [ln 3, 0],
# so p_b = [3/4, 1/4]. The label is class 0.
LOGITS_A = torch.tensor([[0.0, 0.0]])
LOGITS_B = torch.tensor([[math.log(3.0), 0.0]])
LABEL = torch.tensor([0])
KL_B_TO_A = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # KL(p_b || p_a) = 0.130812
KL_A_TO_B = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # KL(p_a || p_b) = 0.143841
CE_A = math.log(2.0)  # -ln(1/2)
CE_B = -math.log(0.75)


def test_distillation_kl_two_class_hand_values():
    """The distillation KL by hand in both directions, and HtFLlib's class-averaged form."""
    assert distillation_kl(LOGITS_A, LOGITS_B).item() == pytest.approx(0.130812, abs=1e-6)
    assert distillation_kl(LOGITS_B, LOGITS_A).item() == pytest.approx(0.143841, abs=1e-6)
    # HtFLlib's nn.KLDivLoss() default averages over the 2 classes as well
    assert distillation_kl(LOGITS_A, LOGITS_B, "mean").item() == pytest.approx(0.130812 / 2, abs=1e-6)


def test_distillation_kl_target_carries_no_gradient():
    """The KL target gets no gradient; the student's is p_student - p_target."""
    student = LOGITS_A.clone().requires_grad_(True)
    target = LOGITS_B.clone().requires_grad_(True)
    distillation_kl(student, target).backward()
    assert target.grad is None
    # d KL / d logits = p_student - p_target = [0.5 - 0.75, 0.5 - 0.25]
    assert torch.allclose(student.grad, torch.tensor([[-0.25, 0.25]]))


def test_mutual_learning_losses_hand_values():
    """FML's two mutual-learning losses by hand, and their alpha / beta limits."""
    loss_a, loss_b = mutual_learning_losses(LOGITS_A, LOGITS_B, LABEL, alpha=0.5, beta=0.5)
    assert loss_a.item() == pytest.approx(0.5 * CE_A + 0.5 * KL_B_TO_A, abs=1e-6)  # 0.411980
    assert loss_b.item() == pytest.approx(0.5 * CE_B + 0.5 * KL_A_TO_B, abs=1e-6)  # 0.215762
    loss_a, loss_b = mutual_learning_losses(LOGITS_A, LOGITS_B, LABEL, alpha=1.0, beta=0.0)
    assert loss_a.item() == pytest.approx(CE_A, abs=1e-6)
    assert loss_b.item() == pytest.approx(KL_A_TO_B, abs=1e-6)


def test_mutual_learning_sends_each_loss_to_its_own_model():
    """Each mutual-learning loss back-propagates into its own model only."""
    a = LOGITS_A.clone().requires_grad_(True)
    b = LOGITS_B.clone().requires_grad_(True)
    loss_a, _ = mutual_learning_losses(a, b, LABEL)
    loss_a.backward()
    assert b.grad is None and a.grad is not None


def test_adaptive_weight_hand_values():
    """FedKD's adaptive weight is 1 / (CE_t + CE_s)."""
    assert adaptive_distillation_weight(torch.tensor(0.5), torch.tensor(1.5)).item() == pytest.approx(0.5)
    # both models confident and right: small losses, strong distillation
    assert adaptive_distillation_weight(torch.tensor(0.05), torch.tensor(0.05)).item() == pytest.approx(10.0)


def test_adaptive_mutual_distillation_hand_values():
    """FedKD's teacher and student losses by hand (CE, weighted KL and hidden MSE)."""
    teacher_hidden = torch.tensor([[1.0, 2.0]])
    mapped_student_hidden = torch.tensor([[0.0, 0.0]])
    teacher_loss, student_loss = adaptive_mutual_distillation(
        LOGITS_A, LOGITS_B, teacher_hidden, mapped_student_hidden, LABEL
    )
    weight = 1.0 / (CE_A + CE_B)  # 1 / 0.980829 = 1.019545
    hidden = (1.0 + 4.0) / 2  # MSE([1, 2], [0, 0])
    assert teacher_loss.item() == pytest.approx(CE_A + weight * (KL_B_TO_A + hidden), abs=1e-5)
    assert student_loss.item() == pytest.approx(CE_B + weight * (KL_A_TO_B + hidden), abs=1e-5)


def test_adaptive_mutual_distillation_gradients_stay_on_their_side():
    """The teacher's loss sends no gradient to the student's logits or features."""
    t_logits = LOGITS_A.clone().requires_grad_(True)
    s_logits = LOGITS_B.clone().requires_grad_(True)
    t_hidden = torch.tensor([[1.0, 2.0]], requires_grad=True)
    s_hidden = torch.tensor([[0.0, 0.0]], requires_grad=True)
    teacher_loss, _ = adaptive_mutual_distillation(t_logits, s_logits, t_hidden, s_hidden, LABEL)
    teacher_loss.backward()
    assert s_logits.grad is None and s_hidden.grad is None
    assert t_logits.grad is not None and t_hidden.grad is not None


def test_energy_rank_hand_values():
    """The energy rank is the smallest k keeping the energy; a zero matrix has rank 0."""
    sigma = torch.tensor([3.0, 2.0, 1.0])  # squares 9, 4, 1; total 14; cumulative 9, 13, 14
    assert energy_rank(sigma, 0.5) == 1  # 9 >= 7
    assert energy_rank(sigma, 0.9) == 2  # 13 >= 12.6
    assert energy_rank(sigma, 0.95) == 3  # 13 < 13.3
    assert energy_rank(sigma, 1.0) == 3
    assert energy_rank(torch.zeros(3), 0.95) == 0
    with pytest.raises(ValueError):
        energy_rank(sigma, 0.0)


def test_svd_compress_keeps_energy_and_reconstructs():
    """Truncated SVD keeps the energy and rebuilds the best rank-k matrix."""
    # diag(3, 2, 1) rotated by orthogonal matrices: singular values 3, 2, 1 by construction
    q1, _ = torch.linalg.qr(torch.tensor([[1.0, 2.0, 0.0], [0.0, 1.0, 3.0], [1.0, 0.0, 1.0], [2.0, 1.0, 1.0]]))
    q2, _ = torch.linalg.qr(torch.tensor([[2.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 2.0]]))
    matrix = q1 @ torch.diag(torch.tensor([3.0, 2.0, 1.0])) @ q2.T
    u, s, v = svd_compress(matrix, 0.9)
    assert (u.shape, s.shape, v.shape) == ((4, 2), (2,), (2, 3))
    assert torch.allclose(s, torch.tensor([3.0, 2.0]), atol=1e-5)
    kept = float(s.pow(2).sum()) / 14.0
    assert kept == pytest.approx(13.0 / 14.0, abs=1e-5) and kept >= 0.9
    error = (matrix - svd_decompress(u, s, v)).pow(2).sum().item()
    assert error == pytest.approx(1.0, abs=1e-4)  # the dropped sigma_3^2
    u, s, v = svd_compress(matrix, 1.0)
    assert torch.allclose(svd_decompress(u, s, v), matrix, atol=1e-5)


def test_compress_state_sends_factors_only_when_smaller():
    """Only matrices whose factors are smaller are factorised; the rest stays dense."""
    rank_one = torch.outer(torch.arange(1.0, 9.0), torch.ones(6))  # 8x6, rank 1: 1*(8+6+1)=15 < 48
    conv = torch.ones(4, 2, 3, 3)  # rank 1 as 4 x 18: 1*(4+18+1)=23 < 72
    full_rank = torch.eye(2)  # rank 2: 2*(2+2+1)=10 >= 4, stays dense
    state = {"fc": rank_one, "conv": conv, "eye": full_rank, "bias": torch.ones(3), "count": torch.tensor(5)}
    low_rank, dense = compress_state(state, 0.95)
    assert set(low_rank) == {"fc", "conv"} and set(dense) == {"eye", "bias", "count"}
    assert low_rank["fc"]["s"].numel() == 1 and low_rank["conv"]["u"].shape == (4, 1)
    rebuilt = decompress_state(low_rank, dense, {k: v.shape for k, v in state.items()})
    for key, tensor in state.items():
        assert rebuilt[key].shape == tensor.shape
        assert torch.allclose(rebuilt[key].float(), tensor.float(), atol=1e-4)


def test_compress_state_zero_update_costs_nothing():
    """A zero update is sent as rank 0 and rebuilds to zeros."""
    low_rank, dense = compress_state({"fc": torch.zeros(5, 4)}, 0.95)
    assert low_rank["fc"]["s"].numel() == 0 and not dense
    rebuilt = decompress_state(low_rank, dense, {"fc": torch.Size([5, 4])})
    assert torch.equal(rebuilt["fc"], torch.zeros(5, 4))


def test_diversity_loss_two_samples_hand_value():
    """FedGen's diversity loss by hand; collapsed outputs give the maximum, 1."""
    noise = torch.tensor([[0.0, 0.0], [1.0, 1.0]])  # mean squared distance 1 between the two
    outputs = torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0]])  # mean absolute distance 2
    # off-diagonal products 1 * 2 = 2, diagonal 0: mean over the 4 pairs = 1
    assert diversity_loss(noise, outputs).item() == pytest.approx(math.exp(-1.0), abs=1e-6)
    # identical outputs for different noises (mode collapse) give the maximum loss, 1
    assert diversity_loss(noise, torch.zeros(2, 3)).item() == pytest.approx(1.0)


def test_energy_schedule_hand_values():
    """FedKD's energy goes linearly from T_start towards T_end and stays there."""
    # T_start + (t + 1) / R * (T_end - T_start): 0.9 + 1/4 * 0.08 = 0.92 ... 0.9 + 4/4 * 0.08 = 0.98
    assert energy_schedule(0, 4, 0.9, 0.98) == pytest.approx(0.92)
    assert energy_schedule(1, 4, 0.9, 0.98) == pytest.approx(0.94)
    assert energy_schedule(3, 4, 0.9, 0.98) == pytest.approx(0.98)
    assert energy_schedule(7, 4, 0.9, 0.98) == pytest.approx(0.98)  # past the last round: T_end
    assert energy_schedule(0, 10, 0.95, 0.95) == pytest.approx(0.95)  # FedKTL's constant default


def test_defaults_and_reductions_reach_every_kl():
    """Alpha and beta default to 0.5; 'mean' divides every KL term by C; an unknown reduction is refused."""
    torch.manual_seed(0)
    a, b, y = torch.randn(3, 4), torch.randn(3, 4), torch.tensor([0, 1, 3])
    defaults, explicit = mutual_learning_losses(a, b, y), mutual_learning_losses(a, b, y, 0.5, 0.5, "batchmean")
    assert torch.equal(defaults[0], explicit[0]) and torch.equal(defaults[1], explicit[1])
    loss_a, loss_b = mutual_learning_losses(a, b, y, 0.5, 0.5, "mean")
    ce_a, ce_b = F.cross_entropy(a, y), F.cross_entropy(b, y)
    torch.testing.assert_close(loss_a, 0.5 * ce_a + 0.5 * distillation_kl(a, b) / 4)
    torch.testing.assert_close(loss_b, 0.5 * ce_b + 0.5 * distillation_kl(b, a) / 4)
    hidden = torch.zeros(3, 2)  # equal hidden states: no MSE term
    teacher, student = adaptive_mutual_distillation(a, b, hidden, hidden, y, reduction="mean")
    weight = adaptive_distillation_weight(ce_a, ce_b)
    torch.testing.assert_close(teacher, ce_a + weight * distillation_kl(a, b) / 4)
    torch.testing.assert_close(student, ce_b + weight * distillation_kl(b, a) / 4)
    with pytest.raises(ValueError, match=r"^unknown KL reduction 'sum'; use 'batchmean' or 'mean'$"):
        distillation_kl(a, b, "sum")  # type: ignore[arg-type]


def test_compress_state_size_test_is_strict_and_integer_matrices_stay_dense():
    """A rank-1 2 x 4 matrix: 1 * (2 + 4 + 1) = 7 < 8, factorised; rank-1 2 x 3: 6 = 6, dense; integers dense."""
    state = {"wide": torch.outer(torch.ones(2), torch.arange(1.0, 5.0)),
             "tie": torch.outer(torch.ones(2), torch.arange(1.0, 4.0)),
             "counts": torch.ones(4, 4, dtype=torch.int64)}
    low_rank, dense = compress_state(state, 0.95)
    assert set(low_rank) == {"wide"} and set(dense) == {"tie", "counts"}


def test_energy_rank_stops_at_exactly_the_energy_and_refuses_more_than_all():
    """Singular values (1, 1): half the energy is reached by the first one; energy above 1 is refused."""
    assert energy_rank(torch.tensor([1.0, 1.0]), 0.5) == 1
    with pytest.raises(ValueError, match=r"^energy must be in \(0, 1\], got 1.5$"):
        energy_rank(torch.tensor([1.0]), 1.5)


def test_svd_compress_and_schedule_refusals_and_one_round():
    """A vector is not a matrix; zero rounds are refused; one round is enough."""
    with pytest.raises(ValueError, match=r"^svd_compress needs a 2-D matrix, got shape \(3,\)$"):
        svd_compress(torch.ones(3), 0.9)
    with pytest.raises(ValueError, match=r"^total_rounds must be >= 1, got 0$"):
        energy_schedule(0, 0, 0.9, 0.98)
    assert energy_schedule(0, 1, 0.9, 0.98) == pytest.approx(0.98)


def test_diversity_loss_uses_differences_not_sums():
    """Noise (1), (2) and outputs (1), (3): distances 1 and 2 off the diagonal -> exp(-(2 + 2) / 4)."""
    loss = diversity_loss(torch.tensor([[1.0], [2.0]]), torch.tensor([[1.0], [3.0]]))
    assert loss.item() == pytest.approx(math.exp(-1.0), abs=1e-6)
