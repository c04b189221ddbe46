"""Hand-computed numerics of each core method (Prepare / Execute / Assert)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms.base import ClientUpload, ServerContext
from fedhet.algorithms.fd import FD, FDClient
from fedhet.algorithms.fedavg import FedAvg, FedAvgServer
from fedhet.algorithms.fedprox import FedProx
from fedhet.algorithms.fedproto import ClassMeanServer, FedProtoClient
from fedhet.errors import TrainingError
from fedhet.federation import FederationLoop
from fedhet.federation.payloads import ClassStatsPayload, WeightsPayload
from tests.conftest import tiny_label_skew


def _context(initial):
    return ServerContext(num_clients=2, num_classes=3, architectures=("x", "x"), seed=0, initial_client_state=lambda c: initial)


def test_fedavg_server_weighted_mean_by_examples():
    server = FedAvgServer()
    server.setup(_context({"model.w": torch.zeros(2), "model.b": torch.zeros(1)}))
    uploads = [
        ClientUpload(0, "x", WeightsPayload(weights={"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])}, num_examples=30)),
        ClientUpload(1, "x", WeightsPayload(weights={"w": torch.tensor([5.0, 6.0]), "b": torch.tensor([4.0])}, num_examples=10)),
    ]
    server.aggregate(0, uploads)
    # 0.75 * [1, 2] + 0.25 * [5, 6] = [2, 3]; 0.75 * 0 + 0.25 * 4 = 1
    download = server.download_for(1)
    assert torch.allclose(download.weights["w"], torch.tensor([2.0, 3.0]))
    assert torch.allclose(download.weights["b"], torch.tensor([1.0]))


def test_fedavg_server_rejects_wrong_shapes_and_nan():
    server = FedAvgServer()
    server.setup(_context({"model.w": torch.zeros(2)}))
    with pytest.raises(TrainingError, match="shape"):
        server.aggregate(0, [ClientUpload(0, "x", WeightsPayload(weights={"w": torch.zeros(3)}, num_examples=1))])


def _run(algorithm, seed=0, rounds=2):
    from fedhet.federation.trainer import TrainerTemplate

    scenario = tiny_label_skew()
    scenario.setup()
    loop = FederationLoop(algorithm, scenario, ["cnn_tiny"] * scenario.num_clients, TrainerTemplate(max_epochs=1, accelerator="cpu"), rounds=rounds, seed=seed)
    summary = loop.run()
    return loop, summary


def test_fedprox_with_mu_zero_equals_fedavg_exactly():
    kwargs = dict(optimizer="sgd", lr=0.05, momentum=0.9)
    avg_loop, avg = _run(FedAvg(**kwargs))
    prox_loop, prox = _run(FedProx(mu=0.0, **kwargs))
    assert avg["final"] == prox["final"]
    for key, value in avg_loop.server.global_weights.items():
        assert torch.equal(value, prox_loop.server.global_weights[key]), key
    # and a positive mu changes the result
    _, prox_mu = _run(FedProx(mu=1.0, **kwargs))
    assert prox_mu["final"] != avg["final"]


def test_fedavg_clients_start_from_the_global_model():
    loop, _ = _run(FedAvg(lr=0.05), rounds=1)
    global_weights = loop.server.global_weights
    module = loop.runtime.module("cnn_tiny")
    module.load_client_state(loop.store.get(2)["module"])
    module.on_receive(loop.server.download_for(2))
    for key, value in module.model.state_dict().items():
        assert torch.equal(value, global_weights[key])


def test_fedproto_server_with_classes_missing_on_some_clients():
    server = ClassMeanServer("count")
    server.setup(_context({}))
    p0 = ClassStatsPayload(values=torch.tensor([[2.0, 0.0], [0.0, 0.0], [1.0, 1.0]]), counts=torch.tensor([1, 0, 3]))
    p1 = ClassStatsPayload(values=torch.tensor([[4.0, 2.0], [9.0, 9.0], [0.0, 0.0]]), counts=torch.tensor([3, 2, 0]))
    server.aggregate(0, [ClientUpload(0, "a", p0), ClientUpload(1, "b", p1)])
    download = server.download_for(0)
    # class 0: (1*[2,0] + 3*[4,2]) / 4 = [3.5, 1.5]; class 1 only client 1; class 2 only client 0
    assert torch.allclose(download.values, torch.tensor([[3.5, 1.5], [9.0, 9.0], [1.0, 1.0]]))
    assert download.counts.tolist() == [1, 1, 1]
    uniform = ClassMeanServer("uniform")
    uniform.setup(_context({}))
    uniform.aggregate(0, [ClientUpload(0, "a", p0), ClientUpload(1, "b", p1)])
    assert torch.allclose(uniform.download_for(0).values[0], torch.tensor([3.0, 1.0]))


class _Linear(nn.Module):
    """A two-feature backbone with an identity-initialised head, for hand computation."""

    num_features = 2

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(2, 2, bias=False)
        self.head = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.body.weight.copy_(torch.eye(2))
            self.head.weight.copy_(torch.eye(2))

    def forward_features(self, x):
        return self.body(x)

    def forward_head(self, z):
        return self.head(z)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))


def test_fedproto_client_loss_and_upload_by_hand():
    client = FedProtoClient(_Linear(), num_classes=2, lam=0.5)
    x = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    y = torch.tensor([0, 1])
    # global prototype only for class 0
    client.on_receive(ClassStatsPayload(values=torch.tensor([[0.0, 0.0], [0.0, 0.0]]), counts=torch.tensor([1, 0])))
    loss = client.local_loss((x, y))
    ce = F.cross_entropy(x, y)
    # MSE over the class-0 sample only: ([1, 0] - [0, 0])^2 averaged over 2 elements = 0.5
    assert loss.item() == pytest.approx(ce.item() + 0.5 * 0.5, rel=1e-6)
    upload = client.make_upload([(x, y), (torch.tensor([[3.0, 0.0]]), torch.tensor([0]))])
    assert torch.allclose(upload.values, torch.tensor([[2.0, 0.0], [0.0, 3.0]]))
    assert upload.counts.tolist() == [2, 1]


def test_fd_client_regularises_logits_towards_global_class_logits():
    client = FDClient(_Linear(), num_classes=2, lam=1.0)
    x = torch.tensor([[1.0, 0.0]])
    y = torch.tensor([0])
    client.on_receive(ClassStatsPayload(values=torch.tensor([[3.0, 0.0], [0.0, 0.0]]), counts=torch.tensor([2, 2])))
    # logits = x; MSE([1,0], [3,0]) = (4 + 0) / 2 = 2
    assert client.local_loss((x, y)).item() == pytest.approx(F.cross_entropy(x, y).item() + 2.0, rel=1e-6)
    assert FD().build_server().weighting == "uniform"
