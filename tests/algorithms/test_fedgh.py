"""LG-FedAvg, FedGH and FedTGP: hand-computed server numerics, client objectives, Table 5 sizes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedhet.algorithms.base import ClientUpload, ServerContext
from fedhet.algorithms.fedgh import FedGH, FedGHServer
from fedhet.algorithms.fedtgp import FedTGP, FedTGPClient, FedTGPServer
from fedhet.algorithms.lg_fedavg import LGFedAvg, LGFedAvgServer
from fedhet.errors import TrainingError
from fedhet.federation import FederationLoop
from fedhet.federation.payloads import ClassStatsPayload, WeightsPayload
from fedhet.federation.trainer import TrainerTemplate
from tests.conftest import tiny_label_skew

FEATURE_DIM = 16
FLOAT_BYTES = 4
COUNT_BYTES = 8  # the int64 count (class id) sent with every held class's prototype


def _context(num_classes: int, feature_dim: int, head_weight: torch.Tensor | None = None) -> ServerContext:
    weight = head_weight if head_weight is not None else torch.zeros(num_classes, feature_dim)
    state = {"model.body.w": torch.zeros(1), "model.head.weight": weight, "model.head.bias": torch.zeros(num_classes)}
    return ServerContext(
        num_clients=2, num_classes=num_classes, architectures=("x", "y"), seed=0, initial_client_state=lambda c: state
    )


def _stats(values, counts, num_examples=10) -> ClassStatsPayload:
    return ClassStatsPayload(values=torch.tensor(values), counts=torch.tensor(counts), num_examples=num_examples)


def _fit_server(server, cpu_trainer) -> None:
    cpu_trainer.build().fit(server, train_dataloaders=server.server_dataloader(None, 0))


def _run(algorithm, rounds=1, family=("cnn_tiny", "mlp_tiny")):
    scenario = tiny_label_skew()
    scenario.setup()
    architectures = [family[c % len(family)] for c in range(scenario.num_clients)]
    loop = FederationLoop(
        algorithm, scenario, architectures, TrainerTemplate(max_epochs=1, accelerator="cpu"), rounds=rounds, seed=0,
        feature_dim=FEATURE_DIM,
    )
    loop.run()
    return loop


@pytest.fixture(scope="module")
def lg_loop():
    return _run(LGFedAvg(lr=0.05))


@pytest.fixture(scope="module")
def fedgh_loop():
    return _run(FedGH(lr=0.05, server_epochs=2))


@pytest.fixture(scope="module")
def fedtgp_loop():
    return _run(FedTGP(lr=0.05, server_epochs=2))


def _held_classes(loop, client_id: int) -> int:
    return int(loop.scenario.client_data(client_id).train.y.unique().numel())


def _client_after_download(loop, client_id: int, slot: int):
    """The live model client ``client_id`` holds at the start of the next round."""
    module = loop.runtime.module(loop.architectures[client_id], slot=slot)
    module.load_client_state(loop.store.get(client_id)["module"])
    module.on_receive(loop.server.download_for(client_id))
    return module


# --------------------------------------------------------------- LG-FedAvg
def test_lg_fedavg_server_averages_heads_by_examples():
    server = LGFedAvgServer()
    server.setup(_context(num_classes=2, feature_dim=1))
    assert server.download_for(0) is None  # nothing before the first aggregation (HtFLlib)
    head_a = {"weight": torch.tensor([[1.0], [2.0]]), "bias": torch.tensor([0.0, 4.0])}
    head_b = {"weight": torch.tensor([[5.0], [6.0]]), "bias": torch.tensor([8.0, 0.0])}
    server.aggregate(0, [
        ClientUpload(0, "x", WeightsPayload(weights=head_a, num_examples=30)),
        ClientUpload(1, "y", WeightsPayload(weights=head_b, num_examples=10)),
    ])
    # 0.75 * a + 0.25 * b: weight [[2], [3]], bias [2, 3]
    download = server.download_for(1)
    assert torch.allclose(download.weights["weight"], torch.tensor([[2.0], [3.0]]))
    assert torch.allclose(download.weights["bias"], torch.tensor([2.0, 3.0]))
    restored = LGFedAvgServer()
    restored.setup(_context(num_classes=2, feature_dim=1))
    restored.load_state_dict(server.state_dict())
    assert torch.equal(restored.download_for(0).weights["weight"], download.weights["weight"])


def test_lg_fedavg_rejects_a_head_of_the_wrong_shape_or_nan():
    server = LGFedAvgServer()
    server.setup(_context(num_classes=2, feature_dim=1))
    wrong = {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}
    with pytest.raises(TrainingError, match="shape"):
        server.aggregate(0, [ClientUpload(0, "x", WeightsPayload(weights=wrong, num_examples=1))])
    nan = {"weight": torch.full((2, 1), float("nan")), "bias": torch.zeros(2)}
    with pytest.raises(TrainingError, match="non-finite"):
        server.aggregate(0, [ClientUpload(0, "x", WeightsPayload(weights=nan, num_examples=1))])


def test_lg_fedavg_heads_identical_after_download_while_backbones_differ(lg_loop):
    loop = lg_loop
    clients = [_client_after_download(loop, c, slot=1 + c) for c in range(loop.scenario.num_clients)]
    global_head = loop.server.download_for(0).weights
    for module in clients:
        for key, value in module.model.head.state_dict().items():
            assert torch.equal(value, global_head[key]), key
    # clients 0 and 2 share an architecture but keep their own feature extractors
    body_0 = {k: v for k, v in clients[0].model.state_dict().items() if not k.startswith("head.")}
    body_2 = {k: v for k, v in clients[2].model.state_dict().items() if not k.startswith("head.")}
    assert any(not torch.equal(v, body_2[k]) for k, v in body_0.items())


def test_lg_fedavg_upload_and_download_are_one_head(lg_loop):
    loop = lg_loop
    head_bytes = (FEATURE_DIM * loop.scenario.num_classes + loop.scenario.num_classes) * FLOAT_BYTES  # K'C + C floats
    clients = loop.scenario.num_clients
    assert loop.history[0]["comm/bytes_up"] == clients * head_bytes
    assert loop.server.download_for(0).nbytes() == head_bytes


# --------------------------------------------------------------- FedGH
def _separable_uploads(num_classes=3, feature_dim=4, clients=4):
    """Noisy copies of one well-separated centre per class, every client holding every class but its last."""
    generator = torch.Generator().manual_seed(0)
    centres = 3.0 * torch.eye(num_classes, feature_dim)
    uploads = []
    for client in range(clients):
        values = centres + 0.3 * torch.randn(num_classes, feature_dim, generator=generator)
        counts = torch.tensor([5] * num_classes)
        counts[(client + 1) % num_classes] = 0
        uploads.append(ClientUpload(client, "x", ClassStatsPayload(values=values, counts=counts, num_examples=10)))
    return uploads


def test_fedgh_server_head_learns_to_classify_the_uploaded_prototypes(cpu_trainer):
    generator = torch.Generator().manual_seed(1)
    server = FedGHServer(server_lr=0.1, server_epochs=20, server_batch_size=4)
    server.setup(_context(3, 4, head_weight=torch.randn(3, 4, generator=generator)))
    uploads = _separable_uploads()
    server.aggregate(0, uploads)
    prototypes, labels = server.round_prototypes, server.round_labels
    assert prototypes.shape == (8, 4)  # 4 clients x 2 held classes
    before = server.accuracy_on(prototypes, labels)
    _fit_server(server, cpu_trainer)
    after = server.accuracy_on(prototypes, labels)
    assert after == 1.0 and after > before
    # all server epochs ran in one fit: 20 epochs x ceil(8 / 4) batches
    assert server.loss_steps == 40
    assert math.isfinite(server.metrics()["loss"])


def test_fedgh_server_starts_from_client_zero_head_and_validates():
    weight = torch.arange(6.0).reshape(3, 2)
    server = FedGHServer()
    server.setup(_context(3, 2, head_weight=weight))
    assert torch.equal(server.download_for(0).weights["weight"], weight)  # sent before round 0 (HtFLlib)
    with pytest.raises(TrainingError, match="shape"):
        server.aggregate(0, [ClientUpload(0, "x", _stats([[1.0, 2.0, 3.0]] * 3, [1, 1, 1]))])
    with pytest.raises(TrainingError, match="non-finite"):
        server.aggregate(0, [ClientUpload(0, "x", _stats([[float("inf"), 0.0]] * 3, [1, 1, 1]))])
    with pytest.raises(TrainingError, match="counts"):
        server.aggregate(0, [ClientUpload(0, "x", _stats([[0.0, 0.0]] * 3, [1, -1, 1]))])


def test_fedgh_round_sizes_and_clients_take_the_global_head(fedgh_loop):
    loop = fedgh_loop
    num_classes = loop.scenario.num_classes
    head_bytes = (FEATURE_DIM * num_classes + num_classes) * FLOAT_BYTES
    # Table 5: upload |C_i| * K' floats per client (+ one int64 class count each), download one head
    row = FEATURE_DIM * FLOAT_BYTES + COUNT_BYTES
    expected_up = sum(_held_classes(loop, c) * row for c in range(loop.scenario.num_clients))
    assert loop.history[0]["comm/bytes_up"] == expected_up
    assert loop.history[0]["comm/bytes_down"] == loop.scenario.num_clients * head_bytes
    module = _client_after_download(loop, 1, slot=2)
    for key, value in module.model.head.state_dict().items():
        assert torch.equal(value, loop.server.head.state_dict()[key])


# --------------------------------------------------------------- FedTGP
def test_fedtgp_server_margin_from_uploads_by_hand():
    server = FedTGPServer(margin_threshold=100.0, server_epochs=1)
    server.setup(_context(num_classes=4, feature_dim=2))
    assert server.download_for(0) is None  # no global prototypes before the first server phase
    uploads = [
        ClientUpload(0, "x", _stats([[0.0, 0.0], [2.0, 4.0], [0.0, 0.0], [9.0, 9.0]], [3, 1, 0, 0])),
        ClientUpload(1, "y", _stats([[0.0, 0.0], [4.0, 4.0], [0.0, 2.0], [9.0, 9.0]], [0, 7, 2, 0])),
    ]
    server.aggregate(0, uploads)
    # uniform class averages: Q0 = (0, 0), Q1 = ((2,4) + (4,4)) / 2 = (3, 4), Q2 = (0, 2); class 3 absent
    # nearest other class: Q0 -> 2 (Q2), Q1 -> min(5, sqrt(9 + 4)) = 3.6056, Q2 -> 2; margin = 3.6056
    assert server.margin.item() == pytest.approx(math.sqrt(13.0), rel=1e-6)
    assert server.metrics()["margin"] == pytest.approx(math.sqrt(13.0), rel=1e-6)
    assert server.seen.tolist() == [True, True, True, False]
    assert server.round_labels.tolist() == [0, 1, 1, 2]
    capped = FedTGPServer(margin_threshold=1.5)
    capped.setup(_context(num_classes=4, feature_dim=2))
    capped.aggregate(0, uploads)
    assert capped.margin.item() == pytest.approx(1.5)


def test_fedtgp_server_training_separates_global_prototypes(cpu_trainer):
    server = FedTGPServer(margin_threshold=100.0, server_lr=0.05, server_epochs=30, server_batch_size=4)
    server.setup(_context(num_classes=3, feature_dim=4))
    uploads = _separable_uploads()
    server.aggregate(0, uploads)
    prototypes, labels = server.round_prototypes, server.round_labels
    initial_loss = server.prototype_loss(prototypes, labels).item()
    _fit_server(server, cpu_trainer)
    assert server.prototype_loss(prototypes, labels).item() < initial_loss
    download = server.download_for(0)
    assert download.counts.tolist() == [1, 1, 1]
    # each uploaded prototype's nearest global prototype is its own class's
    nearest = torch.cdist(prototypes, download.values).argmin(1)
    assert torch.equal(nearest, labels)
    restored = FedTGPServer()
    restored.setup(_context(num_classes=3, feature_dim=4))
    restored.load_state_dict(server.state_dict())
    assert torch.equal(restored.download_for(0).values, download.values)


class _IdentityFeatures(nn.Module):
    """Features = inputs (2-d); a zero head, so the cross-entropy is log(2) whatever the input."""

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
    batch = (torch.tensor([[3.0, 4.0], [7.0, 7.0]]), torch.tensor([0, 1]))
    # CE = log 2 per sample; only sample 0's class has a global prototype (0, 0)
    # MSE: (9 + 16) / 2 = 12.5; Euclidean: 5
    mse = _tgp_client(lam=2.0).local_loss(batch).item()
    euclidean = _tgp_client(lam=2.0, prototype_distance="euclidean").local_loss(batch).item()
    assert mse == pytest.approx(math.log(2.0) + 2.0 * 12.5, rel=1e-6)
    assert euclidean == pytest.approx(math.log(2.0) + 2.0 * 5.0, rel=1e-6)


def test_fedtgp_nearest_prototype_prediction_ignores_classes_without_prototypes():
    x = torch.tensor([[0.9, 0.0]])
    client = _tgp_client(prediction="prototype")
    assert client(x).argmax(1).tolist() == [0]  # class 1's prototype (1, 0) is closer but absent
    client.on_receive(ClassStatsPayload(values=torch.tensor([[0.0, 0.0], [1.0, 0.0]]), counts=torch.tensor([1, 1])))
    scores = client(x)
    assert scores.argmax(1).tolist() == [1]
    assert torch.allclose(scores, torch.tensor([[-0.81, -0.01]]), atol=1e-5)  # minus squared distances


def test_fedtgp_round_sizes(fedtgp_loop):
    loop = fedtgp_loop
    row = FEATURE_DIM * FLOAT_BYTES + COUNT_BYTES
    clients = range(loop.scenario.num_clients)
    expected_up = sum(_held_classes(loop, c) * row for c in clients)
    assert loop.history[0]["comm/bytes_up"] == expected_up
    assert loop.history[0]["comm/bytes_down"] == 0  # round 0: no global prototypes yet
    # the next download holds the global prototype of every class some client holds
    held_anywhere = torch.cat([loop.scenario.client_data(c).train.y for c in clients]).unique().numel()
    assert loop.server.download_for(0).nbytes() == held_anywhere * row
    assert math.isfinite(loop.history[0]["server/loss"]) and loop.history[0]["server/margin"] > 0
