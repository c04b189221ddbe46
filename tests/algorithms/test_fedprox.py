"""FedProx: cross-entropy plus ``mu/2 * ||w - w_t||^2`` (hand-computed), and ``mu = 0`` is FedAvg bit for bit."""

from __future__ import annotations

import pytest
import torch

from fedhet.algorithms.fedavg import FedAvgServer
from fedhet.algorithms.fedprox import FedProx, FedProxClient
from fedhet.core.payloads import WeightsPayload
from tests.algorithms.helpers import SGD, TinyLinear, assert_same_global_model, label_skew_run

X, Y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])


def _moved_client(mu: float) -> FedProxClient:
    """A client that received the identity model, then moved body[0, 0] by 1 and head[1, 1] by 2."""
    client = FedProxClient(TinyLinear(), num_classes=2, mu=mu)
    client.on_receive(WeightsPayload(weights={"body.weight": torch.eye(2), "head.weight": torch.eye(2)}))
    with torch.no_grad():
        client.model.body.weight.copy_(torch.tensor([[2.0, 0.0], [0.0, 1.0]]))
        client.model.head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 3.0]]))
    return client


def test_fedprox_loss_is_cross_entropy_plus_half_mu_times_squared_distance_by_hand():
    """With mu = 0.5 and ||w - w_t||^2 = 1 + 4 = 5 the loss is CE + 0.25 * 5 (``mu`` for ``mu/2`` would add 2.5)."""
    client = _moved_client(mu=0.5)
    # features = body x = [2, 0] = logits (head row 0 is [1, 0]); CE(class 0) = log(1 + e^-2) = 0.126928
    loss = client.local_loss((X, Y))
    assert loss.item() == pytest.approx(0.126928 + 1.25, abs=1e-6)


def test_fedprox_gradient_adds_mu_times_the_distance_by_hand():
    """The proximal gradient on the head is mu * (w - w_t) on top of the CE gradient (p - onehot) f^T."""
    client = _moved_client(mu=0.5)
    client.local_loss((X, Y)).backward()
    # p = softmax([2, 0]) = [0.880797, 0.119203]; CE grad = (p - [1, 0]) [2, 0]^T; prox grad = 0.5 * [[0, 0], [0, 2]]
    expected = torch.tensor([[-0.238406, 0.0], [0.238406, 1.0]])
    assert torch.allclose(client.model.head.weight.grad, expected, atol=1e-6)


def test_fedprox_without_a_download_is_plain_cross_entropy():
    """Before any global model has arrived there is no reference and no proximal term."""
    client = FedProxClient(TinyLinear(), num_classes=2, mu=10.0)
    client.on_receive(None)
    assert client.local_loss((X, Y)).item() == pytest.approx(0.313262, abs=1e-6)  # log(1 + e^-1)


def test_fedprox_reference_is_the_download_not_the_previous_model():
    """The proximal reference is reset to each round's download (a detached copy)."""
    client = _moved_client(mu=2.0)
    client.on_receive(WeightsPayload(weights={"body.weight": torch.eye(2) * 2, "head.weight": torch.eye(2)}))
    # the download replaced the live model too: distance 0, so the loss is CE of logits [2, 0]
    assert client.local_loss((X, Y)).item() == pytest.approx(0.126928, abs=1e-6)
    assert all(not r.requires_grad for r in client.reference)


def test_fedprox_with_mu_zero_equals_fedavg_exactly(fedavg_run):
    """FedProx with mu = 0 reproduces FedAvg's run bit for bit, and mu = 1 changes it."""
    avg_loop, avg = fedavg_run
    prox_loop, prox = label_skew_run(FedProx(mu=0.0, **SGD))
    assert avg["final"] == prox["final"]
    assert_same_global_model(avg_loop, prox_loop)
    _, prox_mu = label_skew_run(FedProx(mu=1.0, **SGD))
    assert prox_mu["final"] != avg["final"]


def test_fedprox_server_is_fedavgs_example_weighted_average():
    """FedProx aggregates exactly as FedAvg (the server is FedAvg's, tested by hand in test_fedavg.py)."""
    assert type(FedProx().build_server()) is FedAvgServer


def test_a_client_without_a_download_drops_the_previous_clients_anchor():
    """The live module is shared by every client of an architecture: no download, no proximal term.

    After one client received weights and moved (loss CE + 1.25), a client that receives nothing
    trains on plain cross-entropy, 0.126928, not on a distance to the previous client's anchor.
    """
    client = _moved_client(mu=0.5)
    client.on_receive(None)
    assert client.local_loss((X, Y)).item() == pytest.approx(0.126928, abs=1e-6)


def test_no_download_means_no_proximal_anchor_before_or_after_a_receive():
    """Built, or after a round with nothing received, the loss is plain CE even once the weights moved."""
    import torch.nn.functional as F

    x, y = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([1, 0])
    client = FedProxClient(TinyLinear(), 3, mu=10.0)
    assert client.num_classes == 3
    client.on_fit_start()  # a fit before any receive (a plain Trainer) starts without an anchor
    for receives_nothing in (False, True):  # as built, then after a round that received nothing
        if receives_nothing:
            client.on_receive(None)
        with torch.no_grad():
            client.model.body.weight.add_(0.5)  # moved away from where it was when (not) received
        plain = F.cross_entropy(client.model(x), y)
        assert client.local_loss((x, y)).item() == pytest.approx(plain.item())
    client.on_receive(WeightsPayload(weights={k: v.clone() for k, v in client.model.state_dict().items()}))
    with torch.no_grad():
        client.model.body.weight.add_(1.0)  # ||w - w_t||^2 = 4 entries x 1
    plain = F.cross_entropy(client.model(x), y)
    assert client.local_loss((x, y)).item() == pytest.approx(plain.item() + 10.0 / 2 * 4.0)
