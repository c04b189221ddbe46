"""MOON: hand-computed model-contrastive client loss, the projection network, and mu = 0 is FedAvg."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedhet.algorithms.fedavg import FedAvgServer
from fedhet.algorithms.moon import MOON, MoonClient, ProjectedClassifier
from fedhet.core.payloads import WeightsPayload
from fedhet.errors import ConfigError
from tests.algorithms.helpers import SGD, TinyLinear, assert_same_global_model, label_skew_run

SWAP = torch.tensor([[0.0, 1.0], [1.0, 0.0]])


def test_moon_with_mu_zero_equals_fedavg_bit_for_bit(fedavg_run):
    """MOON with mu = 0 and no projection head reproduces FedAvg's run and global model exactly."""
    avg_loop, avg = fedavg_run
    moon_loop, moon = label_skew_run(MOON(mu=0.0, projection_dim=None, **SGD))
    assert avg["final"] == moon["final"]
    assert_same_global_model(avg_loop, moon_loop)


def test_moon_client_loss_by_hand_previous_model_negative_global_positive():
    """CE + mu * l_con with the global model as positive and the stored local model as negative (mu = 2)."""
    client = MoonClient(TinyLinear(), num_classes=2, mu=2.0, temperature=0.5)
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    download = WeightsPayload(weights={"body.weight": SWAP, "head.weight": torch.eye(2)})
    # first participation: no previous local model, so CE only. Global body swaps the inputs:
    # logits = [0, 1], CE = log(1 + e^1) = 1.313262
    client.on_receive(download)
    assert client.local_loss((x, y)).item() == pytest.approx(1.313262, abs=1e-5)
    # a trained client: its stored (identity) model becomes the negative before the download lands
    trained = {**client.client_state(), "model.body.weight": torch.eye(2), "has_previous_model": torch.tensor(True)}
    client.load_client_state(trained)
    client.on_receive(download)
    assert torch.equal(client.model.body.weight, SWAP)
    # z = z_glob = [0, 1] (cos 1), z_prev = [1, 0] (cos 0): l_con = log(1 + e^{(0 - 1)/0.5}) = 0.126928
    expected = 1.313262 + 2.0 * math.log1p(math.exp(-2.0))
    assert client.local_loss((x, y)).item() == pytest.approx(expected, abs=1e-5)


def test_moon_contrastive_gradient_reaches_only_the_local_model():
    """The positive and negative models are frozen copies: the loss trains the live model only."""
    client = MoonClient(TinyLinear(), num_classes=2, mu=1.0)
    client.load_client_state({**client.client_state(), "has_previous_model": torch.tensor(True)})
    client.on_receive(WeightsPayload(weights={"body.weight": SWAP, "head.weight": torch.eye(2)}))
    client.local_loss((torch.tensor([[1.0, 2.0]]), torch.tensor([0]))).backward()
    assert client.model.body.weight.grad is not None
    for anchor in client.anchor_models.values():
        assert all(p.grad is None and not p.requires_grad for p in anchor.parameters())


def test_moon_projection_head_and_state_after_a_round():
    """The paper network replaces the backbone head by a projection MLP; the stored state has the flag, no anchors."""
    network = ProjectedClassifier(TinyLinear(), num_classes=3, projection_dim=4)
    assert isinstance(network.backbone.head, nn.Identity)
    assert network.forward_features(torch.ones(5, 2)).shape == (5, 4) and network(torch.ones(5, 2)).shape == (5, 3)
    loop, _ = label_skew_run(MOON(projection_dim=8, **SGD), rounds=1)
    assert any(key.startswith("projection.") for key in loop.server.global_weights)
    assert not any(key.startswith("backbone.head") for key in loop.server.global_weights)
    assert bool(loop.store.get(0)["module"]["has_previous_model"])
    assert not any(key.startswith("anchor") for key in loop.store.get(0)["module"])


def test_moon_server_is_fedavgs_example_weighted_average():
    """MOON aggregates exactly as FedAvg (the server is FedAvg's, tested by hand in test_fedavg.py)."""
    assert type(MOON().build_server()) is FedAvgServer


def test_moon_rejects_an_empty_projection_and_a_zero_temperature_in_one_line():
    """projection_dim is an integer >= 1 or null (its Optional type is checked by MoonHparams.check); tau > 0."""
    with pytest.raises(ConfigError, match=r"^MOON: projection_dim=0 is not an integer >= 1 or null$"):
        MOON(projection_dim=0)
    with pytest.raises(ConfigError, match=r"^MOON: temperature=0.0 is not a number > 0$"):
        MOON(temperature=0.0)
    assert MOON(projection_dim=None).hp.projection_dim is None
    client = MOON(mu=2.0, projection_dim=3).build_client(TinyLinear(), num_classes=2)
    assert isinstance(client.model, ProjectedClassifier) and client.model.num_features == 3 and client.hp.mu == 2.0


def test_moon_contrasts_only_against_models_it_received_and_reads_its_knobs():
    """No download, or a new task without one: CE alone even with a stored local model; ``mu = 1`` still contrasts."""
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    ce = math.log1p(math.exp(-1.0))  # identity model: logits [1, 0]
    client = MoonClient(TinyLinear(), num_classes=2, mu=1.0, temperature=0.5)
    assert client.num_classes == 2 and MOON().build_client(TinyLinear(), 2).num_classes == 2
    client.on_train_end()  # a locally trained model exists, but no global model was ever received
    assert client.local_loss((x, y)).item() == pytest.approx(ce, abs=1e-6)
    client.on_receive(WeightsPayload(weights={"body.weight": SWAP, "head.weight": torch.eye(2)}))
    contrasted = client.local_loss((x, y)).item()
    assert contrasted != pytest.approx(1.313262, abs=1e-4)  # mu = 1 adds the contrastive term
    other = MoonClient(TinyLinear(), num_classes=2, mu=1.0, temperature=2.0)
    other.on_train_end()
    other.on_receive(WeightsPayload(weights={"body.weight": SWAP, "head.weight": torch.eye(2)}))
    assert other.local_loss((x, y)).item() != pytest.approx(contrasted, abs=1e-4)  # the temperature reaches it
    client.load_client_state(client.client_state())  # a new task: the received model is forgotten
    client.on_receive(None)
    assert client.local_loss((x, y)).item() == pytest.approx(1.313262, abs=1e-5)  # CE of the stored model


def test_moon_projection_head_defaults_to_the_papers_256():
    """MOON's projection head: ``Linear(p, p)``, ReLU, ``Linear(p, 256)``, then the classifier."""
    from fedhet.models import create_model

    network = ProjectedClassifier(create_model("cnn_tiny", num_classes=3), 3)
    assert network.num_classes == 3 and network.num_features == 256
    layers = [(type(m).__name__, getattr(m, "in_features", None), getattr(m, "out_features", None))
              for m in network.projection]  # fmt: skip
    assert layers == [("Linear", 16, 16), ("ReLU", None, None), ("Linear", 16, 256)]
    assert (network.head.in_features, network.head.out_features) == (256, 3)
