"""GAN losses of the generator pretraining (:mod:`fedhet.functional.gan`) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedhet.functional.gan import discriminator_logistic_loss, ema_update, generator_nonsaturating_loss, r1_penalty


def test_discriminator_logistic_loss_hand_computed():
    """The discriminator's logistic loss by hand from softplus values."""
    # softplus(0) = ln 2; softplus(-ln 3) = ln(1 + 1/3) = ln(4/3).
    # real logits [0, ln 3]: mean(softplus(-0), softplus(-ln 3)) = (ln 2 + ln 4/3) / 2 = ln(8/3) / 2
    # fake logits [0, -ln 3]: mean(softplus(0), softplus(-ln 3)) = ln(8/3) / 2
    real = torch.tensor([0.0, math.log(3.0)])
    fake = torch.tensor([0.0, -math.log(3.0)])
    assert discriminator_logistic_loss(real, fake).item() == pytest.approx(math.log(8 / 3))


def test_generator_nonsaturating_loss_hand_computed():
    """The generator's non-saturating loss by hand."""
    # softplus(-ln 3) = ln(4/3), softplus(-0) = ln 2 -> mean = ln(8/3) / 2
    fake = torch.tensor([math.log(3.0), 0.0])
    assert generator_nonsaturating_loss(fake).item() == pytest.approx(math.log(8 / 3) / 2)


def test_r1_penalty_hand_computed():
    """The R1 penalty is the mean squared gradient norm, and it is differentiable."""
    # D(x) = sum x^2 per sample -> grad = 2x; x = [[1,0,0],[0,1,1]] -> ||2x||^2 = 4 and 8 -> mean 6
    x = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]], requires_grad=True)
    penalty = r1_penalty(x.square().sum(dim=1), x)
    assert penalty.item() == pytest.approx(6.0)
    penalty.backward()  # differentiable: d/dx mean(4 ||x||^2) = 4x
    torch.testing.assert_close(x.grad, 4 * x.detach())


def test_ema_update_hand_computed():
    """The EMA update is decay * average + (1 - decay) * current."""
    average, current = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        average.weight.fill_(2.0)
        current.weight.fill_(6.0)
    ema_update(average, current, decay=0.75)  # 0.75 * 2 + 0.25 * 6 = 3
    assert average.weight.item() == pytest.approx(3.0)
