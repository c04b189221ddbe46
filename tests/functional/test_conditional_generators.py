"""FedMD-CG / FedCG losses against values computed by hand (comments give the arithmetic)."""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.functional import (
    class_client_weights,
    crossed_distillation_loss,
    discriminator_loss,
    distillation_kl_loss,
    distribution_kl,
    ensemble_distillation_kl,
    generator_adversarial_loss,
    label_aware_diversity_loss,
    ramp_weight,
)

LN3 = math.log(3.0)
# softmax([ln 3, 0]) = [0.75, 0.25]; softmax([0, 0]) = [0.5, 0.5]
KL_P_U = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # KL([.75,.25] || [.5,.5]) = 0.130812
KL_U_P = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # KL([.5,.5] || [.75,.25]) = 0.143841


def test_ramp_is_zero_in_the_first_round_and_linear_or_cubic():
    """Paper: ((r-1)/R)^d with 1-based r; code: (step/(R-1))^3."""
    assert ramp_weight(0, 10) == 0.0 and ramp_weight(0, 10, "code") == 0.0
    assert ramp_weight(5, 10) == pytest.approx(0.5)
    assert ramp_weight(5, 10, power=2.0) == pytest.approx(0.25)
    assert ramp_weight(5, 11, "code") == pytest.approx(0.125)  # (5/10)^3
    assert ramp_weight(10, 11, "code") == pytest.approx(1.0)
    with pytest.raises(ValueError, match="ramp form"):
        ramp_weight(1, 10, "cosine")  # type: ignore[arg-type]


def test_distribution_kl_directions_reductions_and_temperature():
    """Teacher-first is KL(target || student), as printed is KL(student || target)."""
    student, target = torch.tensor([[0.0, 0.0]]), torch.tensor([[LN3, 0.0]])
    assert distribution_kl(student, target).item() == pytest.approx(KL_P_U, abs=1e-6)
    assert distribution_kl(student, target, direction="as_printed").item() == pytest.approx(KL_U_P, abs=1e-6)
    assert distribution_kl(student, target, reduction="mean_classes").item() == pytest.approx(KL_P_U / 2, abs=1e-6)
    # T = 2: target softmax([ln3/2, 0]) = [sqrt3, 1] / (1 + sqrt3)
    p = math.sqrt(3) / (1 + math.sqrt(3))
    expected = p * math.log(p / 0.5) + (1 - p) * math.log((1 - p) / 0.5)
    assert distribution_kl(student, target, temperature=2.0).item() == pytest.approx(expected, abs=1e-6)
    # batch mean of two rows: (KL_P_U + 0) / 2
    batch = distillation_kl_loss(torch.zeros(2, 2), torch.tensor([[LN3, 0.0], [0.0, 0.0]]))
    assert batch.item() == pytest.approx(KL_P_U / 2, abs=1e-6)


def test_distribution_kl_gradients_reach_the_student_only():
    """The target is a constant."""
    student = torch.zeros(1, 2, requires_grad=True)
    target = torch.tensor([[LN3, 0.0]], requires_grad=True)
    distribution_kl(student, target).sum().backward()
    assert target.grad is None and student.grad is not None
    # d KL / d z_s = softmax(z_s) - p_t = [0.5 - 0.75, 0.5 - 0.25]
    torch.testing.assert_close(student.grad, torch.tensor([[-0.25, 0.25]]))


def test_diversity_losses_by_hand():
    """Two samples, features [0,0] and [2,0], noises [0] and [1]."""
    features = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    noise = torch.tensor([[0.0], [1.0]])
    other = torch.nn.functional.one_hot(torch.tensor([0, 1]), 2)
    same = torch.nn.functional.one_hot(torch.tensor([0, 0]), 2)
    # mean form: d_f = (4 + 0)/2 = 2, d_z = 1, off-diagonal products 2 of 4 entries -> mean 1
    assert label_aware_diversity_loss(features, noise, other, "div0").item() == pytest.approx(math.exp(-1.0))
    # div2: d_y = mean |y_j - y_k| = 1 for different classes -> product 2e, mean e
    assert label_aware_diversity_loss(features, noise, other, "div2").item() == pytest.approx(math.exp(-math.e))
    assert label_aware_diversity_loss(features, noise, same, "div2").item() == pytest.approx(math.exp(-1.0))
    # div1, same class: [z; y] = [0,1,0] vs [1,1,0] -> d = 1/3, product 2/3, mean 1/3
    assert label_aware_diversity_loss(features, noise, same, "div1").item() == pytest.approx(math.exp(-1 / 3))
    # literal norms: ||f_j - f_k|| = 2, ||z_j - z_k|| = 1, ||y_j - y_k||_1 = 2 -> exp(-mean(2 e^2 * 2 / 4))
    paper = label_aware_diversity_loss(features, noise, other, "div2", "paper").item()
    assert paper == pytest.approx(math.exp(-math.exp(2.0)), rel=1e-5)
    assert label_aware_diversity_loss(features, noise, other, "div0", "paper").item() == pytest.approx(math.exp(-1.0))
    assert label_aware_diversity_loss(features, noise, other, "none").item() == 0.0


def test_diversity_loss_falls_when_outputs_spread():
    """Spreading generated features apart lowers the loss (its gradient pushes them apart)."""
    noise = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    labels = torch.nn.functional.one_hot(torch.arange(8) % 3, 3)
    features = torch.randn(8, 5, generator=torch.Generator().manual_seed(1), requires_grad=True)
    loss = label_aware_diversity_loss(features, noise, labels)
    loss.backward()
    stepped = (features - 0.5 * features.grad).detach()
    assert label_aware_diversity_loss(stepped, noise, labels) < loss


def test_class_client_weights_sum_to_one_per_held_class():
    """tau[i, y] = n_i^y / sum_j n_j^y; a class nobody holds gets 0, not 0/0."""
    tau = class_client_weights(torch.tensor([[3, 0, 1], [1, 0, 1]]))
    torch.testing.assert_close(tau, torch.tensor([[0.75, 0.0, 0.5], [0.25, 0.0, 0.5]]))
    torch.testing.assert_close(tau.sum(0), torch.tensor([1.0, 0.0, 1.0]))


def test_crossed_distillation_by_hand():
    """Two clients, one sample, two classes (targets [.75,.25] and uniform), tau = [0.75, 0.25]."""
    global_on_global = torch.tensor([[0.0, 0.0]])
    local_on_local = torch.tensor([[[LN3, 0.0]], [[0.0, 0.0]]])
    global_on_local = torch.tensor([[[0.0, 0.0]], [[LN3, 0.0]]])
    local_on_global = torch.tensor([[[LN3, 0.0]], [[0.0, 0.0]]])
    tau = torch.tensor([[0.75], [0.25]])
    args = (global_on_global, local_on_local, global_on_local, local_on_global, tau)
    # L1 = 0.75 KL(p||u) + 0.25 * 0 ; L2 = 0.75 KL(p||u) + 0.25 KL(u||p) ; L3 = 0 + 0
    l1, l2 = 0.75 * KL_P_U, 0.75 * KL_P_U + 0.25 * KL_U_P
    assert crossed_distillation_loss(*args).item() == pytest.approx(l1 + l2, abs=1e-6)
    assert crossed_distillation_loss(*args, terms=(True, False, False)).item() == pytest.approx(l1, abs=1e-6)
    assert crossed_distillation_loss(*args, terms=(False, True, False)).item() == pytest.approx(l2, abs=1e-6)
    assert crossed_distillation_loss(*args, terms=(False, False, True)).item() == pytest.approx(0.0, abs=1e-7)
    halved = crossed_distillation_loss(*args, reduction="mean_classes").item()
    assert halved == pytest.approx((l1 + l2) / 2, abs=1e-6)


def test_ensemble_distillation_averages_logits_before_the_softmax():
    """Teachers [2 ln3, 0] and [0, 0] at weights 1/2 average to [ln3, 0] -> target [.75, .25]."""
    teachers = torch.tensor([[[2 * LN3, 0.0]], [[0.0, 0.0]]])
    weights = torch.tensor([0.5, 0.5])
    loss = ensemble_distillation_kl(torch.zeros(1, 2), teachers, weights)
    assert loss.item() == pytest.approx(KL_P_U, abs=1e-6)  # averaging probabilities would give [.7, .3]
    mean = ensemble_distillation_kl(torch.zeros(1, 2), teachers, weights, reduction="mean")
    assert mean.item() == pytest.approx(KL_P_U / 2, abs=1e-6)


def test_ensemble_distillation_hinton_scales_by_t_squared():
    """T = 2: teacher logits [2 ln3, 0] / 2 = [ln3, 0] -> [.75, .25]; Hinton's loss is T^2 KL = 4 * KL_P_U."""
    teachers = torch.tensor([[[2 * LN3, 0.0]]])
    loss = ensemble_distillation_kl(torch.zeros(1, 2), teachers, torch.ones(1), 2.0, reduction="hinton")
    assert loss.item() == pytest.approx(4 * KL_P_U, abs=1e-6)  # 0.523248
    plain = ensemble_distillation_kl(torch.zeros(1, 2), teachers, torch.ones(1), 2.0)
    assert plain.item() == pytest.approx(KL_P_U, abs=1e-6)
    with pytest.raises(ValueError, match="reduction"):
        ensemble_distillation_kl(torch.zeros(1, 2), teachers, torch.ones(1), reduction="sum")  # type: ignore[arg-type]


def test_cgan_losses_by_hand():
    """-log 0.8 - log(1 - 0.4) for the discriminator, -log 0.4 for the generator."""
    real, fake = torch.tensor([0.8]), torch.tensor([0.4])
    assert discriminator_loss(real, fake).item() == pytest.approx(-math.log(0.8) - math.log(0.6), abs=1e-6)
    assert generator_adversarial_loss(fake).item() == pytest.approx(-math.log(0.4), abs=1e-6)


def test_ramp_edges_and_refusals():
    """One round: both forms give 0; the code form reaches 1 at R - 1 and stays there; bad rounds are refused."""
    assert ramp_weight(0, 1) == 0.0 and ramp_weight(0, 1, "code") == 0.0
    assert ramp_weight(1, 2, "code") == 1.0 and ramp_weight(20, 11, "code") == 1.0
    with pytest.raises(ValueError, match=r"^round_idx=-1 must be >= 0 and total_rounds=5 >= 1$"):
        ramp_weight(-1, 5)
    with pytest.raises(ValueError, match=r"^round_idx=0 must be >= 0 and total_rounds=0 >= 1$"):
        ramp_weight(0, 0)


def test_distribution_kl_divides_the_student_by_the_temperature():
    """T = 2 on both sides: student [2 ln 3, 0] / 2 -> [.75, .25] equals the target, so the KL is 0."""
    student = target = torch.tensor([[2 * LN3, 0.0]])
    assert distribution_kl(student, target.clone(), temperature=2.0).item() == pytest.approx(0.0, abs=1e-7)
    # and against a uniform target at T = 2: KL([.5, .5] || [.75, .25]) = KL_U_P
    assert distribution_kl(student, torch.zeros(1, 2), temperature=2.0).item() == pytest.approx(KL_U_P, abs=1e-6)


def test_distillation_kl_loss_passes_its_direction_on():
    """The batch-mean loss in the printed direction is KL(student || target)."""
    loss = distillation_kl_loss(torch.zeros(1, 2), torch.tensor([[LN3, 0.0]]), direction="as_printed")
    assert loss.item() == pytest.approx(KL_U_P, abs=1e-6)


def test_unknown_kl_settings_are_refused_by_name():
    """A misspelt direction, reduction or diversity setting is an error naming the accepted values."""
    student, target = torch.zeros(1, 2), torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"^unknown KL direction 'forward'; use 'teacher_first' or 'as_printed'$"):
        distribution_kl(student, target, direction="forward")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^unknown KL reduction 'sum'; use 'sum_classes' or 'mean_classes'$"):
        distribution_kl(student, target, reduction="sum")  # type: ignore[arg-type]
    features, noise, labels = torch.zeros(2, 2), torch.zeros(2, 1), torch.eye(2)
    with pytest.raises(ValueError, match=r"^unknown diversity loss 'div3'; use div0, div1, div2 or none$"):
        label_aware_diversity_loss(features, noise, labels, "div3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^unknown diversity norm 'l1'; use 'mean' or 'paper'$"):
        label_aware_diversity_loss(features, noise, labels, "div0", "l1")  # type: ignore[arg-type]


def test_literal_diversity_norm_below_one():
    """Paper norm with distances under 1: ||f_j - f_k|| = 0.5, ||z_j - z_k|| = 0.25 -> exp(-2 * 0.125 / 4)."""
    features, noise = torch.tensor([[0.0], [0.5]]), torch.tensor([[0.0], [0.25]])
    loss = label_aware_diversity_loss(features, noise, torch.eye(2), "div0", "paper")
    assert loss.item() == pytest.approx(math.exp(-0.0625), rel=1e-6)


def test_class_client_weights_of_a_class_held_by_one_example():
    """A class with one example in all gets weight 1 at its holder."""
    torch.testing.assert_close(class_client_weights(torch.tensor([[1, 0], [0, 0]])), torch.tensor([[1.0, 0.0],
                                                                                                [0.0, 0.0]]))


def test_crossed_distillation_broadcasts_the_global_student_over_clients_not_samples():
    """Two clients, two different samples: client i compares every sample b with D(G(z_b, y_b))."""
    global_on_global = torch.tensor([[LN3, 0.0], [0.0, 0.0]])  # sample 0 -> [.75, .25], sample 1 uniform
    local_on_local = torch.zeros(2, 2, 2)  # every target uniform
    zeros = torch.zeros(2, 2, 2)
    tau = torch.tensor([[1.0, 1.0], [0.0, 0.0]])  # client 0 holds both labels
    # L1 = mean_b tau[0, b] KL(u || s_b) = (KL_U_P + 0) / 2 (broadcasting over clients would give KL_U_P)
    loss = crossed_distillation_loss(global_on_global, local_on_local, zeros, zeros, tau, terms=(True, False, False))
    assert loss.item() == pytest.approx(KL_U_P / 2, abs=1e-6)
    with pytest.raises(ValueError):
        crossed_distillation_loss(global_on_global, local_on_local, zeros, zeros, tau, terms=(True, False))


def test_ensemble_distillation_weights_clients_not_samples_and_keeps_the_logits_dtype():
    """Weights [.75, .25] over two clients and two samples; float64 weights do not change a float32 loss."""
    teachers = torch.tensor([[[0.0, 0.0], [0.0, 0.0]], [[4 * LN3, 0.0], [0.0, 0.0]]])  # sample 0: .25 * 4 ln 3
    weights = torch.tensor([0.75, 0.25], dtype=torch.float64)
    loss = ensemble_distillation_kl(torch.zeros(2, 2), teachers, weights)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(KL_P_U / 2, abs=1e-6)  # sample 0 KL_P_U, sample 1 zero
