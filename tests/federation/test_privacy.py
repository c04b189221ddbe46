"""Upload/download perturbation (FedKTL App. Tab. 10, FedPCL's Gaussian noise): a loop option."""

from __future__ import annotations

import pytest
import torch

from fedhet.algorithms.fedproto import FedProto
from fedhet.core.payloads import ClassStatsPayload
from fedhet.errors import ConfigError
from fedhet.federation import FederationLoop, FederationSettings
from fedhet.federation.privacy import PayloadNoise
from fedhet.federation.trainer import TrainerTemplate
from tests.conftest import tiny_label_skew


def test_noise_std_is_p_times_s_per_tensor_kind_and_counts_are_untouched():
    """Noise std is coefficient x scale (images have their own), seeded, and integer counts stay exact."""
    noise = PayloadNoise(scale=0.05, coefficient=0.2, image_scale=0.2, image_coefficient=0.5)
    values = torch.zeros(200, 100)
    counts = torch.arange(200)
    noisy = noise.perturb(ClassStatsPayload(values=values, counts=counts), seed=3)
    assert noisy.values.std().item() == pytest.approx(0.2 * 0.05, rel=0.03)
    assert torch.equal(noisy.counts, counts)  # integers are never perturbed
    images = noise.perturb(ClassStatsPayload(values=torch.zeros(40, 3, 16, 16), counts=counts), seed=3)
    assert images.values.std().item() == pytest.approx(0.5 * 0.2, rel=0.03)  # images: image_scale x image_coefficient
    again = noise.perturb(ClassStatsPayload(values=values, counts=counts), seed=3)
    other = noise.perturb(ClassStatsPayload(values=values, counts=counts), seed=4)
    assert torch.equal(again.values, noisy.values) and not torch.equal(other.values, noisy.values)
    assert noisy.nbytes() == ClassStatsPayload(values=values, counts=counts).nbytes()


def test_zero_noise_is_the_identity_and_negative_settings_are_rejected():
    """Zero noise leaves a payload unchanged; a negative scale is a configuration error."""
    payload = ClassStatsPayload(values=torch.randn(3, 4), counts=torch.tensor([1, 0, 2]))
    assert torch.equal(PayloadNoise(0.0, 0.0, 0.0, 0.0).perturb(payload, 0).values, payload.values)
    with pytest.raises(ConfigError, match="scale"):
        PayloadNoise(scale=-1.0)


def _fedproto_loop(**noise):
    scenario = tiny_label_skew()
    scenario.setup()
    return FederationLoop(
        FedProto(lr=0.05),
        scenario,
        ["cnn_tiny", "mlp_tiny", "cnn_tiny"],
        TrainerTemplate(max_epochs=1, accelerator="cpu"),
        rounds=2,
        feature_dim=16,
        settings=FederationSettings(**noise),
    )


def _prototypes(loop):
    return next(v for v in loop.server.server_state().values() if isinstance(v, torch.Tensor) and v.is_floating_point())


def test_loop_perturbs_uploads_and_downloads_reproducibly():
    """Upload and download noise change what the server aggregates, reproducibly for a seed."""
    clean = _fedproto_loop()
    clean_summary = clean.run()
    silent = _fedproto_loop(upload_noise=PayloadNoise(0, 0, 0, 0), download_noise=PayloadNoise(0, 0, 0, 0))
    assert silent.run()["final"] == clean_summary["final"]  # zero noise changes nothing
    noisy = _fedproto_loop(upload_noise=PayloadNoise(scale=1.0, coefficient=1.0), download_noise=PayloadNoise())
    noisy_summary = noisy.run()
    difference = (_prototypes(noisy) - _prototypes(clean)).abs().max().item()
    assert difference > 0.05  # the server aggregated perturbed prototypes
    again = _fedproto_loop(upload_noise=PayloadNoise(scale=1.0, coefficient=1.0), download_noise=PayloadNoise())
    assert again.run()["final"] == noisy_summary["final"]
    assert torch.equal(_prototypes(again), _prototypes(noisy))
