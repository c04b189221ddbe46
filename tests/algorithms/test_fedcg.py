"""FedCG's own parts: the cubic feature-distillation ramp, the latent discriminator's layers, the two stages.

The one-step oracle (``test_oracle_fedcg.py``) pins both client stages and the server round at the
defaults and the documented switches; these tests pin what a three-round oracle does not reach: the
ramp's ends, a discriminator built from a deeper classifier, the stage schedule, the last round's
full feature MSE and the loss the cGAN stage reports.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms import fedcg as fedcg_module
from fedhet.algorithms.base import LocalStage
from fedhet.algorithms.fedcg import FedCG, FedCGClient, LatentDiscriminator, cubic_ramp
from tests.algorithms.helpers import fit, one_batch_loader
from tests.algorithms.oracle import TinyBNNet
from tests.algorithms.test_oracle_fedmdcg import CHANNELS, FORMAT, SIZE, M

pytestmark = pytest.mark.usefixtures("one_thread")


def test_cubic_ramp_is_zero_first_one_last_and_cubic_between():
    """``(r / (R - 1))^3``, clamped at 1 past the last round; a one-round run never distils."""
    assert cubic_ramp(0, 1) == 0.0 and cubic_ramp(3, 1) == 0.0
    assert cubic_ramp(1, 2) == 1.0
    assert cubic_ramp(1, 3) == pytest.approx(0.125)
    assert cubic_ramp(5, 3) == 1.0


def test_latent_discriminator_of_a_linear_head_is_one_conditional_layer():
    """A linear classifier becomes ``Linear(p + C, 1)`` (conditional by default), or ``Linear(p, 1)``."""
    head = nn.Linear(5, M)
    disc = LatentDiscriminator(head, M)
    assert disc.conditional and [(m.in_features, m.out_features) for m in disc.body] == [(5 + M, 1)]
    plain = LatentDiscriminator(head, M, conditional=False)
    assert [(m.in_features, m.out_features) for m in plain.body] == [(5, 1)]


def test_latent_discriminator_keeps_a_deeper_classifiers_layers_freshly_initialised():
    """First layer widened by ``C``, last narrowed to 1, the middle copied and re-initialised; the head untouched."""
    torch.manual_seed(0)
    classifier = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 7), nn.Linear(7, M))
    before = {k: v.clone() for k, v in classifier.state_dict().items()}
    disc = LatentDiscriminator(classifier, M)
    shapes = [(m.in_features, m.out_features) if isinstance(m, nn.Linear) else type(m).__name__ for m in disc.body]
    assert shapes == [(5 + M, 6), "ReLU", (6, 7), (7, 1)]
    assert all(torch.equal(v, classifier.state_dict()[k]) for k, v in before.items())  # the client's head is kept
    assert disc.body[2] is not classifier[2] and not torch.equal(disc.body[2].weight, classifier[2].weight)
    two = LatentDiscriminator(nn.Sequential(nn.Linear(5, 6), nn.Linear(6, M)), M, conditional=False)
    assert [(m.in_features, m.out_features) for m in two.body] == [(5, 6), (6, 1)]


@pytest.mark.parametrize(
    "classifier",
    [nn.Sequential(), nn.Sequential(nn.ReLU(), nn.Linear(5, M)), nn.Sequential(nn.Linear(5, M), nn.ReLU())],
    ids=["empty", "starts_otherwise", "ends_otherwise"],
)
def test_latent_discriminator_refuses_a_classifier_not_framed_by_linear_layers(classifier):
    """The first layer is widened and the last narrowed: both must be linear."""
    with pytest.raises(TypeError) as error:
        LatentDiscriminator(classifier, M)
    assert str(error.value) == f"FedCG needs a classifier that starts and ends with nn.Linear, got {classifier}"


def test_conditional_discriminator_needs_the_labels():
    """A conditional discriminator scores ``[h, onehot(y)]``: without labels it says so."""
    disc = LatentDiscriminator(nn.Linear(5, M), M)
    with pytest.raises(ValueError) as error:
        disc(torch.zeros(2, 5))
    assert str(error.value) == "a conditional discriminator needs the labels"


def _client(**hp) -> FedCGClient:
    algorithm = FedCG(noise_dim=3, generator_hidden=(6, 5), **hp)
    algorithm.configure(FORMAT)
    torch.manual_seed(0)
    return algorithm.build_client(TinyBNNet(CHANNELS, M, seed=3), M)


def _batch():
    generator = torch.Generator().manual_seed(0)
    return torch.rand(6, CHANNELS, SIZE, SIZE, generator=generator), torch.tensor([0, 1, 2, 3, 0, 1])


def test_fedcg_client_runs_both_stages_for_local_steps_and_keeps_its_overrides():
    """``local_steps`` steps of the extractor, then as many manual cGAN steps; overrides reach the client."""
    client = _client(local_steps=7)
    assert tuple(client.local_stages()) == (LocalStage("model", steps=7), LocalStage("generator", steps=7, manual=True))
    alone = FedCGClient(TinyBNNet(CHANNELS, M, seed=3), M, client.generator, lr=0.3)
    assert alone.hp.lr == 0.3


def test_fedcg_feature_mse_needs_a_global_generator_and_is_whole_in_the_last_round():
    """Without a download: CE alone, whatever the round; in the last round: CE + 1 x MSE(F(x), G(z, y))."""
    client = _client()
    client.model.eval()
    x, y = _batch()
    features = client.model.forward_features(x)
    ce = F.cross_entropy(client.model.forward_head(features), y)
    client.round_idx, client.total_rounds = 1, 3
    assert torch.equal(client.model_update_loss(x, y), ce)
    client.has_global = True
    with torch.no_grad():
        for parameter in client.global_generator.parameters():
            parameter.add_(0.1)
    client.round_idx = 2
    torch.manual_seed(5)
    loss = client.model_update_loss(x, y)
    torch.manual_seed(5)
    client.global_generator.eval()
    generated, _ = client.global_generator(y)
    torch.testing.assert_close(loss, ce + F.mse_loss(features, generated.detach()), rtol=0, atol=1e-6)


def test_fedcg_cgan_stage_reports_the_sum_of_its_two_losses_and_frees_the_discriminator(tmp_path, monkeypatch):
    """The generator stage logs ``L_D + L_G`` of its step; after either stage the discriminator trains again."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from fedhet.federation.trainer import silence_lightning

    silence_lightning()
    recorded = []
    for name in ("discriminator_loss", "generator_adversarial_loss"):
        original = getattr(fedcg_module, name)

        def spy(*args, _original=original):
            value = _original(*args)
            recorded.append(float(value.detach()))
            return value

        monkeypatch.setattr(fedcg_module, name, spy)
    client = _client()
    client.stage = "generator"
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=CSVLogger(tmp_path), enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(client, one_batch_loader(*_batch()))
    assert len(recorded) == 2
    assert float(trainer.logged_metrics["train/loss_step"]) == pytest.approx(sum(recorded), rel=1e-6)
    assert all(p.requires_grad for p in client.discriminator.parameters())
    client.stage = "model"
    fit(client, one_batch_loader(*_batch()))
    assert all(p.requires_grad for p in client.discriminator.parameters())
