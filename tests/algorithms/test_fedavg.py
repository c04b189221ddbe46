"""FedAvg: example-weighted averaging (integer buffers rounded), clients that start from the global model."""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.algorithms.fedavg import FedAvg, FedAvgClient, FedAvgServer
from fedhet.core.payloads import WeightsPayload
from fedhet.errors import TrainingError
from tests.algorithms.helpers import TinyLinear, context, label_skew_run, upload

SWAP = torch.tensor([[0.0, 1.0], [1.0, 0.0]])


def test_fedavg_server_weighted_mean_by_examples():
    """The global model is the example-weighted mean of the uploaded weights (0.75 / 0.25 by hand)."""
    server = FedAvgServer()
    server.setup_server(context(initial={"model.w": torch.zeros(2), "model.b": torch.zeros(1)}))
    server.aggregate(0, [
        upload(0, WeightsPayload(weights={"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])}, num_examples=30)),
        upload(1, WeightsPayload(weights={"w": torch.tensor([5.0, 6.0]), "b": torch.tensor([4.0])}, num_examples=10)),
    ])
    # 0.75 * [1, 2] + 0.25 * [5, 6] = [2, 3]; 0.75 * 0 + 0.25 * 4 = 1
    download = server.download_for(1)
    assert torch.allclose(download.weights["w"], torch.tensor([2.0, 3.0]))
    assert torch.allclose(download.weights["b"], torch.tensor([1.0]))


def _with_counter(w: list[float], batches: int) -> dict[str, torch.Tensor]:
    """Weights ``w`` plus a BatchNorm ``num_batches_tracked`` counter (int64)."""
    return {"w": torch.tensor(w), "bn.num_batches_tracked": torch.tensor(batches)}


def test_fedavg_server_rounds_integer_buffers_to_the_nearest_integer():
    """``num_batches_tracked`` is averaged and rounded, not truncated: 0.25 * 1 + 0.75 * 2 = 1.75 -> 2."""
    initial = {"model.w": torch.zeros(1), "model.bn.num_batches_tracked": torch.tensor(0)}
    server = FedAvgServer()
    server.setup_server(context(initial=initial))
    server.aggregate(0, [
        upload(0, WeightsPayload(weights=_with_counter([4.0], 1), num_examples=10)),
        upload(1, WeightsPayload(weights=_with_counter([8.0], 2), num_examples=30)),
    ])
    weights = server.download_for(0).weights
    assert weights["bn.num_batches_tracked"].dtype == torch.long
    assert int(weights["bn.num_batches_tracked"]) == 2  # truncation would give 1
    assert weights["w"].item() == pytest.approx(7.0)  # 0.25 * 4 + 0.75 * 8
    # a buffer all clients agree on stays exactly that value
    server.aggregate(1, [
        upload(0, WeightsPayload(weights=_with_counter([1.0], 7), num_examples=3)),
        upload(1, WeightsPayload(weights=_with_counter([1.0], 7), num_examples=4)),
    ])
    assert int(server.download_for(0).weights["bn.num_batches_tracked"]) == 7


def test_fedavg_server_rejects_wrong_shapes_and_nan():
    """Uploads whose shapes differ from the global model, or that hold NaN, are refused naming the client."""
    server = FedAvgServer()
    server.setup_server(context(initial={"model.w": torch.zeros(2)}))
    with pytest.raises(TrainingError, match="shape"):
        server.check_upload(upload(0, WeightsPayload(weights={"w": torch.zeros(3)}, num_examples=1)))
    with pytest.raises(TrainingError, match="non-finite"):
        server.check_upload(upload(0, WeightsPayload(weights={"w": torch.tensor([math.nan, 0.0])}, num_examples=1)))


def test_fedavg_server_starts_from_client_zero_initialisation():
    """Before any upload the download is client 0's initial backbone (keys without ``model.``)."""
    server = FedAvgServer()
    server.setup_server(context(initial={"model.w": torch.tensor([3.0, 4.0]), "other": torch.ones(1)}))
    assert set(server.download_for(1).weights) == {"w"}
    assert torch.equal(server.download_for(1).weights["w"], torch.tensor([3.0, 4.0]))


def test_fedavg_client_loss_after_download_and_upload_by_hand():
    """The client takes the downloaded weights, trains on plain CE of them, and uploads its own model."""
    client = FedAvgClient(TinyLinear(), num_classes=2)
    client.on_receive(WeightsPayload(weights={"body.weight": SWAP, "head.weight": torch.eye(2)}))
    assert torch.equal(client.model.body.weight, SWAP)
    # features = swapped input [0, 1] = logits; CE for class 0 = log(1 + e^1) = 1.313262
    loss = client.local_loss((torch.tensor([[1.0, 0.0]]), torch.tensor([0])))
    assert loss.item() == pytest.approx(1.313262, abs=1e-6)
    sent = client.make_upload([])
    assert set(sent.weights) == {"body.weight", "head.weight"} and torch.equal(sent.weights["body.weight"], SWAP)
    with torch.no_grad():
        client.model.body.weight.add_(1.0)
    assert torch.equal(sent.weights["body.weight"], SWAP)  # the upload is a copy, not a view of the live model


@pytest.fixture(scope="module")
def one_round():
    """One real FedAvg round on the tiny label-skew scenario (3 ``cnn_tiny`` clients with BatchNorm)."""
    loop, _ = label_skew_run(FedAvg(lr=0.05), rounds=1)
    return loop


def test_fedavg_clients_start_from_the_global_model(one_round):
    """In a real run, a client that receives the download holds exactly the server's global weights."""
    loop = one_round
    global_weights = loop.server.global_weights
    module = loop.runtime.module("cnn_tiny")
    module.load_client_state(loop.store.get(2)["module"])
    module.on_receive(loop.server.download_for(2))
    for key, value in module.model.state_dict().items():
        assert torch.equal(value, global_weights[key])


def test_fedavg_round_global_model_is_the_example_weighted_mean_of_the_trained_clients(one_round):
    """After a real round the global model is sum n_k / n * w_k over the stored client models (BN buffers too)."""
    loop = one_round
    sizes = [len(loop.scenario.client_data(c).train) for c in range(loop.scenario.num_clients)]
    states = [loop.store.get(c)["module"] for c in range(loop.scenario.num_clients)]
    for key, value in loop.server.global_weights.items():
        stacked = torch.stack([s[f"model.{key}"].double() for s in states])
        mean = sum(n * w for n, w in zip(sizes, stacked, strict=True)) / sum(sizes)
        if value.is_floating_point():
            assert torch.allclose(value.double(), mean, atol=1e-6), key
        else:
            assert torch.equal(value, torch.round(mean).long()), key
