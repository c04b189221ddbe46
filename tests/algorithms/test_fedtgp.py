"""FedTGP: hand-computed adaptive margin and server contrastive loss, client objective, prototype prediction."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedhet.algorithms.fedtgp import FedTGP, FedTGPClient, FedTGPServer
from fedhet.core.payloads import ClassStatsPayload
from tests.algorithms.helpers import (
    COUNT_BYTES,
    FEATURE_DIM,
    FLOAT_BYTES,
    class_stats,
    context,
    fit,
    head_context,
    held_classes,
    heterogeneous_run,
    separable_uploads,
    upload,
)


@pytest.fixture(scope="module")
def fedtgp_loop():
    """One FedTGP round on two architectures with a 16-d feature neck (2 server epochs)."""
    return heterogeneous_run(FedTGP(lr=0.05, server_epochs=2))


def _fit_server(server) -> None:
    fit(server, server.server_dataloader(0))


def test_fedtgp_server_margin_from_uploads_by_hand():
    """The margin is min(max_c min_c' ||Q^c - Q^c'||, tau) over the uniform class averages of the uploads."""
    server = FedTGPServer(margin_threshold=100.0, server_epochs=1)
    server.setup_server(head_context(num_classes=4, feature_dim=2))
    assert server.download_for(0) is None  # no global prototypes before the first server phase
    uploads = [
        upload(0, class_stats([[0.0, 0.0], [2.0, 4.0], [0.0, 0.0], [9.0, 9.0]], [3, 1, 0, 0])),
        upload(1, class_stats([[0.0, 0.0], [4.0, 4.0], [0.0, 2.0], [9.0, 9.0]], [0, 7, 2, 0])),
    ]
    server.aggregate(0, uploads)
    # uniform class averages: Q0 = (0, 0), Q1 = ((2,4) + (4,4)) / 2 = (3, 4), Q2 = (0, 2); class 3 absent
    # nearest other class: Q0 -> 2 (Q2), Q1 -> min(5, sqrt(9 + 4)) = 3.6056, Q2 -> 2; margin = 3.6056
    assert server.margin.item() == pytest.approx(math.sqrt(13.0), rel=1e-6)
    assert server.metrics()["margin"] == pytest.approx(math.sqrt(13.0), rel=1e-6)
    assert server.seen.tolist() == [True, True, True, False]
    assert server.round_labels.tolist() == [0, 1, 1, 2]
    capped = FedTGPServer(margin_threshold=1.5)
    capped.setup_server(head_context(num_classes=4, feature_dim=2))
    capped.aggregate(0, uploads)
    assert capped.margin.item() == pytest.approx(1.5)


def test_fedtgp_server_step_loss_by_hand():
    """Global prototypes G = relu(E) = (0, 0), (3, 4); margin 1 from the uploads; the first step's loss by hand."""
    server = FedTGPServer(margin_threshold=100.0, server_lr=0.01, server_epochs=1, server_batch_size=2)
    server.setup_server(head_context(num_classes=2, feature_dim=2))
    with torch.no_grad():  # G^c = fc(relu(middle(e^c))) with identity layers: G = relu(E)
        server.prototypes.embeddings.weight.copy_(torch.tensor([[0.0, 0.0], [3.0, 4.0]]))
        for layer in (server.prototypes.middle[0], server.prototypes.fc):
            layer.weight.copy_(torch.eye(2))
            nn.init.zeros_(layer.bias)
    server.aggregate(0, [upload(0, class_stats([[0.0, 0.0], [1.0, 0.0]], [5, 5]))])
    assert server.margin.item() == pytest.approx(1.0)  # ||Q0 - Q1|| = 1 < tau
    # P0 = (0, 0), class 0: distances (0, 5), logits (-(0 + 1), -5): CE = log(1 + e^-4)
    # P1 = (1, 0), class 1: distances (1, sqrt 20), logits (-1, -(sqrt 20 + 1)): CE = log(1 + e^sqrt(20))
    expected = (math.log1p(math.exp(-4.0)) + math.log1p(math.exp(math.sqrt(20.0)))) / 2
    labels = server.round_labels
    assert server.prototype_loss(server.round_prototypes, labels).item() == pytest.approx(expected, rel=1e-5)
    _fit_server(server)
    assert server.loss_steps == 1 and server.metrics()["loss"] == pytest.approx(expected, rel=1e-5)
    download = server.download_for(0)
    assert download.counts.tolist() == [1, 1]
    assert not torch.allclose(download.values, torch.tensor([[0.0, 0.0], [3.0, 4.0]]))  # the step moved them


def test_fedtgp_server_training_separates_global_prototypes():
    """Thirty server epochs lower the loss and put each uploaded prototype nearest its own class's prototype."""
    server = FedTGPServer(margin_threshold=100.0, server_lr=0.05, server_epochs=30, server_batch_size=4)
    server.setup_server(head_context(num_classes=3, feature_dim=4))
    server.aggregate(0, separable_uploads())
    prototypes, labels = server.round_prototypes, server.round_labels
    initial_loss = server.prototype_loss(prototypes, labels).item()
    _fit_server(server)
    assert server.prototype_loss(prototypes, labels).item() < initial_loss
    download = server.download_for(0)
    assert download.counts.tolist() == [1, 1, 1]
    # each uploaded prototype's nearest global prototype is its own class's
    nearest = torch.cdist(prototypes, download.values).argmin(1)
    assert torch.equal(nearest, labels)
    restored = FedTGPServer()
    restored.setup_server(head_context(num_classes=3, feature_dim=4))
    restored.load_server_state(server.server_state())
    assert torch.equal(restored.download_for(0).values, download.values)


class _IdentityFeatures(nn.Module):
    """Features = inputs (2-d); a zero head, so the cross-entropy is log(2) whatever the input."""

    num_features = 2

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 2)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward_features(self, x):
        return x

    def forward_head(self, z):
        return self.head(z)

    def forward(self, x):
        return self.head(x)


def _tgp_client(**kwargs) -> FedTGPClient:
    client = FedTGPClient(_IdentityFeatures(), num_classes=2, **kwargs)
    client.on_receive(ClassStatsPayload(values=torch.tensor([[0.0, 0.0], [1.0, 0.0]]), counts=torch.tensor([1, 0])))
    return client


def test_fedtgp_client_objective_by_hand():
    """CE + lam * d(feature, G^y) over samples whose class has a prototype, MSE (code) or Euclidean (paper)."""
    batch = (torch.tensor([[3.0, 4.0], [7.0, 7.0]]), torch.tensor([0, 1]))
    # CE = log 2 per sample; only sample 0's class has a global prototype (0, 0)
    # MSE: (9 + 16) / 2 = 12.5; Euclidean: 5
    mse = _tgp_client(lam=2.0).local_loss(batch).item()
    euclidean = _tgp_client(lam=2.0, prototype_distance="euclidean").local_loss(batch).item()
    assert mse == pytest.approx(math.log(2.0) + 2.0 * 12.5, rel=1e-6)
    assert euclidean == pytest.approx(math.log(2.0) + 2.0 * 5.0, rel=1e-6)


def test_fedtgp_nearest_prototype_prediction_ignores_classes_without_prototypes():
    """Prototype prediction scores minus squared distances to the global prototypes, absent classes excluded."""
    x = torch.tensor([[0.9, 0.0]])
    client = _tgp_client(prediction="prototype")
    assert client(x).argmax(1).tolist() == [0]  # class 1's prototype (1, 0) is closer but absent
    client.on_receive(ClassStatsPayload(values=torch.tensor([[0.0, 0.0], [1.0, 0.0]]), counts=torch.tensor([1, 1])))
    scores = client(x)
    assert scores.argmax(1).tolist() == [1]
    assert torch.allclose(scores, torch.tensor([[-0.81, -0.01]]), atol=1e-5)  # minus squared distances


def test_fedtgp_head_prediction_uses_the_classifier_even_with_global_prototypes():
    """prediction="head" (the default) scores with the client's head whether or not prototypes arrived."""
    x = torch.tensor([[0.9, 0.0]])
    client = _tgp_client()  # prototypes received in _tgp_client
    client.on_receive(ClassStatsPayload(values=torch.tensor([[0.0, 0.0], [1.0, 0.0]]), counts=torch.tensor([1, 1])))
    assert torch.equal(client(x), torch.zeros(1, 2))  # the zero head, not minus squared distances


def test_fedtgp_server_remembers_every_class_ever_uploaded():
    """A class uploaded in an earlier round keeps its global prototype when a later round lacks it."""
    server = FedTGPServer(server_epochs=1)
    server.setup_server(head_context(num_classes=3, feature_dim=2))
    server.aggregate(0, [upload(0, class_stats([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], [2, 1, 0]))])
    server.aggregate(1, [upload(0, class_stats([[1.0, 0.0], [0.0, 0.0], [2.0, 2.0]], [2, 0, 3]))])
    assert server.seen.tolist() == [True, True, True]
    assert server.download_for(0).counts.tolist() == [1, 1, 1]


def test_fedtgp_global_prototypes_start_from_the_run_seed():
    """The trainable prototypes are initialised under the run seed's own stream (same seed, same start)."""
    from fedhet.algorithms.fedtgp import TrainablePrototypes
    from fedhet.seeding import derive_seed, seeded

    def built(seed: int) -> FedTGPServer:
        server = FedTGPServer()
        server.setup_server(context(num_classes=3, seed=seed, initial=head_context(3, 2).initial_client_state(0)))
        return server

    with seeded(derive_seed(5, "fedtgp-prototypes")):
        expected = TrainablePrototypes(3, 2, 2)
    assert torch.equal(built(5).prototypes(), expected())
    assert not torch.equal(built(6).prototypes(), expected())


def test_fedtgp_round_sizes(fedtgp_loop):
    """Table 5 sizes: |C_i| K' floats up; round 0 downloads nothing; then every class some client holds."""
    loop = fedtgp_loop
    row = FEATURE_DIM * FLOAT_BYTES + COUNT_BYTES
    clients = range(loop.scenario.num_clients)
    expected_up = sum(held_classes(loop, c) * row for c in clients)
    assert loop.history[0]["comm/bytes_up"] == expected_up
    assert loop.history[0]["comm/bytes_down"] == 0  # round 0: no global prototypes yet
    # the next download holds the global prototype of every class some client holds
    held_anywhere = torch.cat([loop.scenario.client_data(c).train.y for c in clients]).unique().numel()
    assert loop.server.download_for(0).nbytes() == held_anywhere * row
    assert math.isfinite(loop.history[0]["server/loss"]) and loop.history[0]["server/margin"] > 0
