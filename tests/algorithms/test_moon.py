"""MOON, FedProc and FedRS: hand-computed client losses, server aggregation, and FedAvg limits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedhet.algorithms.base import ClientUpload, ServerContext
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.fedproc import FedProcClient, FedProcServer, WeightsAndPrototypesPayload
from fedhet.algorithms.fedrs import FedRS, FedRSClient, label_counts
from fedhet.algorithms.moon import MOON, MoonClient, ProjectedClassifier
from fedhet.errors import TrainingError
from fedhet.federation import FederationLoop
from fedhet.federation.payloads import WeightsPayload
from fedhet.federation.trainer import TrainerTemplate
from tests.conftest import tiny_label_skew

SWAP = torch.tensor([[0.0, 1.0], [1.0, 0.0]])


class _Linear(nn.Module):
    """Two features, identity body and head, no biases: every number below is worked by hand."""

    num_features = 2

    def __init__(self) -> None:
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


def _run(algorithm, rounds=2, seed=0):
    scenario = tiny_label_skew()
    scenario.setup()
    trainer = TrainerTemplate(max_epochs=1, accelerator="cpu")
    loop = FederationLoop(algorithm, scenario, ["cnn_tiny"] * scenario.num_clients, trainer, rounds=rounds, seed=seed)
    return loop, loop.run()


def _assert_same_global_model(loop_a, loop_b):
    assert loop_a.server.global_weights.keys() == loop_b.server.global_weights.keys()
    for key, value in loop_a.server.global_weights.items():
        assert torch.equal(value, loop_b.server.global_weights[key]), key


SGD = dict(optimizer="sgd", lr=0.05, momentum=0.9)


@pytest.fixture(scope="module")
def fedavg_run():
    """The FedAvg reference run (two rounds) the bit-for-bit limits are compared with."""
    return _run(FedAvg(**SGD))


# ---------------------------------------------------------------------------------------- MOON
def test_moon_with_mu_zero_equals_fedavg_bit_for_bit(fedavg_run):
    avg_loop, avg = fedavg_run
    moon_loop, moon = _run(MOON(mu=0.0, projection_dim=None, **SGD))
    assert avg["final"] == moon["final"]
    _assert_same_global_model(avg_loop, moon_loop)


def test_moon_client_loss_by_hand_previous_model_negative_global_positive():
    client = MoonClient(_Linear(), num_classes=2, mu=1.0, temperature=0.5)
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
    assert client.local_loss((x, y)).item() == pytest.approx(1.313262 + 0.126928, abs=1e-5)


def test_moon_projection_head_and_state_after_a_round():
    network = ProjectedClassifier(_Linear(), num_classes=3, projection_dim=4)
    assert isinstance(network.backbone.head, nn.Identity)
    assert network.forward_features(torch.ones(5, 2)).shape == (5, 4) and network(torch.ones(5, 2)).shape == (5, 3)
    loop, _ = _run(MOON(projection_dim=8, **SGD), rounds=1)
    assert any(key.startswith("projection.") for key in loop.server.global_weights)
    assert not any(key.startswith("backbone.head") for key in loop.server.global_weights)
    assert bool(loop.store.get(0)["module"]["has_previous_model"])
    assert not any(key.startswith("anchor") for key in loop.store.get(0)["module"])


# ------------------------------------------------------------------------------------- FedProc
def test_fedproc_client_loss_by_hand_with_round_schedule():
    client = FedProcClient(_Linear(), num_classes=2)
    x, y = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])
    weights = {"body.weight": torch.eye(2), "head.weight": torch.eye(2)}
    # round 0, no prototypes yet: CE of logits x = (log(1 + e^-1) + log(1 + e^-2)) / 2 = 0.220095
    empty, no_counts = torch.zeros(2, 0), torch.zeros(2, dtype=torch.long)
    client.on_receive(WeightsAndPrototypesPayload(weights=weights, prototypes=empty, counts=no_counts))
    assert client.local_loss((x, y)).item() == pytest.approx(0.220095, abs=1e-5)
    # round 1 of 5: alpha = 0.75; prototype loss with c0 = [1, 0], c1 = [1, 1] is 0.479110
    # (tests/functional/test_contrastive.py): 0.75 * 0.479110 + 0.25 * 0.220095 = 0.414356
    prototypes = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    client.on_receive(WeightsAndPrototypesPayload(weights=weights, prototypes=prototypes, counts=torch.tensor([1, 1])))
    client.round_idx, client.total_rounds = 1, 5
    assert client.local_loss((x, y)).item() == pytest.approx(0.414356, abs=1e-5)
    upload = client.make_upload([(x, y), (torch.tensor([[3.0, 0.0]]), torch.tensor([0]))])
    assert torch.allclose(upload.prototypes, torch.tensor([[2.0, 0.0], [0.0, 2.0]]))
    assert upload.counts.tolist() == [2, 1] and torch.equal(upload.weights["body.weight"], torch.eye(2))


def _server_with_two_uploads(weighting):
    server = FedProcServer(weighting)
    server.setup(ServerContext(2, 3, ("x", "x"), 0, lambda c: {"model.w": torch.zeros(2)}))
    p0 = WeightsAndPrototypesPayload(
        weights={"w": torch.tensor([1.0, 2.0])},
        prototypes=torch.tensor([[2.0, 0.0], [0.0, 0.0], [1.0, 1.0]]),
        counts=torch.tensor([1, 0, 3]),
        num_examples=30,
    )
    p1 = WeightsAndPrototypesPayload(
        weights={"w": torch.tensor([5.0, 6.0])},
        prototypes=torch.tensor([[4.0, 2.0], [9.0, 9.0], [0.0, 0.0]]),
        counts=torch.tensor([3, 2, 0]),
        num_examples=10,
    )
    server.aggregate(0, [ClientUpload(0, "x", p0), ClientUpload(1, "x", p1)])
    return server, p0


def test_fedproc_server_averages_weights_and_prototypes_by_hand():
    server, upload = _server_with_two_uploads("count")
    download = server.download_for(0)
    # weights: 0.75 * [1, 2] + 0.25 * [5, 6] = [2, 3]
    assert torch.allclose(download.weights["w"], torch.tensor([2.0, 3.0]))
    # class 0: (1 * [2, 0] + 3 * [4, 2]) / 4 = [3.5, 1.5]; classes 1 and 2 held by one client each
    assert torch.allclose(download.prototypes, torch.tensor([[3.5, 1.5], [9.0, 9.0], [1.0, 1.0]]))
    assert download.counts.tolist() == [1, 1, 1]
    uniform, _ = _server_with_two_uploads("uniform")
    assert torch.allclose(uniform.download_for(0).prototypes[0], torch.tensor([3.0, 1.0]))  # ([2,0] + [4,2]) / 2
    # bytes: 2 float32 weights (8) + 2 held rows of 2 float32 (16) + 2 int64 counts (16) = 40
    assert upload.nbytes() == 40
    restored = FedProcServer()
    restored.setup(ServerContext(2, 3, ("x", "x"), 0, lambda c: {"model.w": torch.zeros(2)}))
    restored.load_state_dict(server.state_dict())
    assert torch.equal(restored.download_for(1).prototypes, download.prototypes)


def test_fedproc_first_download_has_weights_and_no_prototypes():
    server = FedProcServer()
    server.setup(ServerContext(2, 3, ("x", "x"), 0, lambda c: {"model.w": torch.ones(2)}))
    download = server.download_for(0)
    assert download.prototypes.shape == (3, 0) and int(download.counts.sum()) == 0
    assert download.nbytes() == 8


def test_fedproc_server_rejects_bad_prototypes():
    server, _ = _server_with_two_uploads("count")
    counts = torch.ones(3, dtype=torch.long)
    weights = {"w": torch.zeros(2)}
    wrong_shape = WeightsAndPrototypesPayload(weights=weights, prototypes=torch.zeros(3, 5), counts=counts)
    with pytest.raises(TrainingError, match="shape"):
        server.aggregate(1, [ClientUpload(0, "x", wrong_shape)])
    not_finite = WeightsAndPrototypesPayload(
        weights={"w": torch.zeros(2)}, prototypes=torch.tensor([[float("nan"), 0.0]] * 3), counts=counts
    )
    with pytest.raises(TrainingError, match="non-finite"):
        server.aggregate(1, [ClientUpload(0, "x", not_finite)])
    with pytest.raises(TrainingError, match="expected weights and prototypes"):
        server.aggregate(1, [ClientUpload(0, "x", WeightsPayload(weights={"w": torch.zeros(2)}))])


# --------------------------------------------------------------------------------------- FedRS
def test_fedrs_with_alpha_one_equals_fedavg_bit_for_bit(fedavg_run):
    avg_loop, avg = fedavg_run
    rs_loop, rs = _run(FedRS(alpha=1.0, **SGD))
    assert avg["final"] == rs["final"]
    _assert_same_global_model(avg_loop, rs_loop)
    # every client counted its own training labels at its first fit and kept them in its state
    for client in range(rs_loop.scenario.num_clients):
        expected = torch.bincount(rs_loop.scenario.client_data(client).train.y, minlength=10)
        assert torch.equal(rs_loop.store.get(client)["module"]["class_counts"], expected)


def test_fedrs_client_loss_by_hand():
    client = FedRSClient(_Linear(), num_classes=2, alpha=0.5)
    client.class_counts.copy_(torch.tensor([3, 0]))
    # logits [2, 4] -> restricted [2, 2]: CE = log 2 = 0.693147 (plain CE would be 2.126928)
    loss = client.local_loss((torch.tensor([[2.0, 4.0]]), torch.tensor([0])))
    assert loss.item() == pytest.approx(0.693147, abs=1e-6)
    # evaluation uses the unrestricted logits
    assert torch.equal(client(torch.tensor([[2.0, 4.0]])), torch.tensor([[2.0, 4.0]]))


def test_label_counts_from_loader_data_or_batches():
    class _Data:
        y = torch.tensor([0, 2, 2, -1])

    class _Loader:
        data = _Data()

        def __iter__(self):
            raise AssertionError("labels must be read without drawing batches")

    assert label_counts(_Loader(), 3).tolist() == [1, 0, 2]
    batches = [(torch.zeros(2, 1), torch.tensor([1, 1])), (torch.zeros(1, 1), torch.tensor([0]))]
    assert label_counts(batches, 3).tolist() == [1, 2, 0]
