"""The gradient-inversion attack: PSNR and TV by hand, what each upload reveals, and the leakage ordering."""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.algorithms.fedmdcg import ConditionalFeatureGenerator
from fedhet.privacy import psnr, total_variation, uploaded_gradients
from fedhet.privacy.gradient_inversion import DLGLeNet, denormalizer, invert_gradients


def test_psnr_and_total_variation_by_hand():
    """MSE 0.01 on a [0, 1] range is 20 dB; TV of a 2x2 image [[0, 1], [0, 1]] is 0 + 1."""
    assert psnr(torch.full((1, 1, 4, 4), 0.1), torch.zeros(1, 1, 4, 4)) == pytest.approx(20.0)
    assert psnr(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2)) == 100.0
    image = torch.tensor([[[[0.0, 1.0], [0.0, 1.0]]]])
    assert total_variation(image).item() == pytest.approx(1.0)


def test_each_method_reveals_exactly_its_upload():
    """FedAvg: everything; FedPer: the extractor; LG-FedAvg: the head; FedMD-CG: head and generator."""
    model = DLGLeNet(seed=0)
    generator = ConditionalFeatureGenerator(4, 10, model.num_features, (8, 8)).eval()
    x, y, noise = torch.rand(1, 3, 32, 32), torch.tensor([3]), torch.randn(1, 4)
    head = {f"model.{n}" for n, _ in model.named_parameters() if n.startswith("head.")}
    every = {f"model.{n}" for n, _ in model.named_parameters()}
    gen = {f"generator.{n}" for n, _ in generator.named_parameters()}
    assert set(uploaded_gradients(model, x, y, "fedavg")) == every
    assert set(uploaded_gradients(model, x, y, "fedper")) == every - head
    assert set(uploaded_gradients(model, x, y, "lg_fedavg")) == head
    assert set(uploaded_gradients(model, x, y, "fedmdcg", generator, noise)) == head | gen
    with pytest.raises(ValueError, match="generator"):
        uploaded_gradients(model, x, y, "fedcg")


def test_fedavg_gradient_leaks_a_single_image_far_more_than_the_decoupled_upload():
    """Inverting gradients on one MNIST digit: FedAvg's full gradient gives a PSNR well above FedMD-CG's upload."""
    from fedhet.data.embedded import load_mnist_all

    splits = load_mnist_all(0)
    image = splits.train.x[:1].float() / 255.0  # uint8 digits, 3 x 32 x 32
    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    x = (image - 0.5) / 0.5
    y = splits.train.y[:1].long()
    victim = DLGLeNet(seed=1)
    generator = ConditionalFeatureGenerator(16, 10, victim.num_features, (32, 32)).eval()
    noise = torch.randn(1, 16, generator=torch.Generator().manual_seed(0))
    restore = denormalizer(mean, std)
    fedavg = invert_gradients(victim, x, y, "fedavg", restore, steps=500)
    decoupled = invert_gradients(victim, x, y, "fedmdcg", restore, generator=generator, noise=noise, steps=500)
    assert math.isfinite(fedavg.psnr) and fedavg.psnr > 11.0
    assert fedavg.psnr > decoupled.psnr + 4.0, (fedavg.psnr, decoupled.psnr)


def test_reference_rows_by_hand_on_a_tiny_image():
    """The three reference rows of a 2x2 image [[0, 1], [0, 1]], by hand.

    All black has MSE 1/2 (3.01 dB), a 0.25 mean image 5/16 (5.05 dB); the untouched dummy is the
    attack's start, the same PSNR as ``invert_gradients(steps=0)``.
    """
    from fedhet.privacy import initial_dummy, reference_psnrs

    image = torch.tensor([[[[0.0, 1.0], [0.0, 1.0]]]])
    restore = denormalizer((0.5,), (0.5,))
    x = (image - 0.5) / 0.5
    rows = reference_psnrs(x, restore, torch.full((1, 2, 2), 0.25), seed=3)
    assert rows["all_black"] == pytest.approx(10 * math.log10(2.0))
    assert rows["dataset_mean"] == pytest.approx(10 * math.log10(1 / (5 / 16)))
    dummy = (initial_dummy((1, 1, 2, 2), 3) * 0.5 + 0.5).clamp(0, 1)
    assert rows["untouched_dummy"] == pytest.approx(10 * math.log10(1 / float(((dummy - image) ** 2).mean())))
    victim = DLGLeNet(num_classes=2, in_channels=1, input_size=2, seed=0)
    untouched = invert_gradients(victim, x, torch.tensor([1]), "fedavg", restore, steps=0, seed=3)
    assert untouched.psnr == pytest.approx(rows["untouched_dummy"])


def _fedcg_parts(seed: int = 0):
    from fedhet.algorithms.fedcg import LatentDiscriminator

    model = DLGLeNet(num_classes=10, in_channels=1, input_size=8, seed=seed)
    generator = ConditionalFeatureGenerator(4, 10, model.num_features, (8, 8)).eval()
    torch.manual_seed(seed)
    discriminator = LatentDiscriminator(model.head, 10, conditional=True).eval()
    return model, generator, discriminator


def test_fedcg_row_is_fedcgs_own_adversarial_upload():
    """FedCG reveals the head and its generator's adversarial gradient, not FedMD-CG's mimicry gradient.

    The image reaches it only through the discriminator's step: with a zero step it is x-independent.
    """
    from fedhet.privacy import fedcg_generator_gradients

    model, generator, discriminator = _fedcg_parts()
    x, x2, y, noise = torch.rand(1, 1, 8, 8), torch.rand(1, 1, 8, 8), torch.tensor([3]), torch.randn(1, 4)
    fedcg = uploaded_gradients(model, x, y, "fedcg", generator, noise, discriminator=discriminator)
    fedmdcg = uploaded_gradients(model, x, y, "fedmdcg", generator, noise)
    assert set(fedcg) == set(fedmdcg)
    generator_keys = [k for k in fedcg if k.startswith("generator.")]
    assert all(torch.equal(fedcg[k], fedmdcg[k]) for k in fedcg if k.startswith("model."))  # same CE gradient
    assert not all(torch.allclose(fedcg[k], fedmdcg[k]) for k in generator_keys)
    other = uploaded_gradients(model, x2, y, "fedcg", generator, noise, discriminator=discriminator)
    assert not all(torch.equal(fedcg[k], other[k]) for k in generator_keys)  # x leaks through s's step
    # no discriminator step: the gradient is that of BCE(s(G(z, y), y), 1), whatever x
    frozen = [fedcg_generator_gradients(generator, discriminator, model.forward_features(image), y, noise, 0.0)
              for image in (x, x2)]
    generated, _ = generator(y, noise)
    score = discriminator(generated, y)
    direct = torch.autograd.grad(-torch.log(score).mean(), list(generator.parameters()))
    for key, expected in zip(generator_keys, direct, strict=True):
        torch.testing.assert_close(frozen[0][key], expected)
        torch.testing.assert_close(frozen[1][key], expected)
    with pytest.raises(ValueError, match="discriminator"):
        uploaded_gradients(model, x, y, "fedcg", generator, noise)


def test_fedcg_attack_runs_with_the_attackers_own_discriminator():
    """Uploads only: the attacker holds a guessed extractor and discriminator; the attack runs to a finite PSNR."""
    model, generator, discriminator = _fedcg_parts(0)
    guess, _, guess_discriminator = _fedcg_parts(1)
    x, y, noise = torch.rand(1, 1, 8, 8) * 2 - 1, torch.tensor([3]), torch.randn(1, 4)
    restore = denormalizer((0.5,), (0.5,))
    result = invert_gradients(model, x, y, "fedcg", restore, guess, generator, noise, steps=3,
                              discriminator=discriminator, guess_discriminator=guess_discriminator)
    assert math.isfinite(result.psnr) and math.isfinite(result.matching_loss)
