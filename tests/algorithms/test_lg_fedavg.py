"""LG-FedAvg: hand-computed head averaging and client loss with the global head, one head up and down."""

from __future__ import annotations

import pytest
import torch

from fedhet.algorithms.lg_fedavg import LGFedAvg, LGFedAvgClient, LGFedAvgServer
from fedhet.core.payloads import WeightsPayload
from fedhet.errors import TrainingError
from tests.algorithms.helpers import (
    FEATURE_DIM,
    FLOAT_BYTES,
    TinyLinear,
    client_after_download,
    head_context,
    heterogeneous_run,
    upload,
)


@pytest.fixture(scope="module")
def lg_loop():
    """One LG-FedAvg round on two architectures with a 16-d feature neck."""
    return heterogeneous_run(LGFedAvg(lr=0.05))


def test_lg_fedavg_server_averages_heads_by_examples():
    """The global head is the example-weighted mean of the uploaded heads (0.75 / 0.25 by hand)."""
    server = LGFedAvgServer()
    server.setup_server(head_context(num_classes=2, feature_dim=1))
    assert server.download_for(0) is None  # nothing before the first aggregation (HtFLlib)
    head_a = {"weight": torch.tensor([[1.0], [2.0]]), "bias": torch.tensor([0.0, 4.0])}
    head_b = {"weight": torch.tensor([[5.0], [6.0]]), "bias": torch.tensor([8.0, 0.0])}
    server.aggregate(0, [
        upload(0, WeightsPayload(weights=head_a, num_examples=30)),
        upload(1, WeightsPayload(weights=head_b, num_examples=10)),
    ])
    # 0.75 * a + 0.25 * b: weight [[2], [3]], bias [2, 3]
    download = server.download_for(1)
    assert torch.allclose(download.weights["weight"], torch.tensor([[2.0], [3.0]]))
    assert torch.allclose(download.weights["bias"], torch.tensor([2.0, 3.0]))
    restored = LGFedAvgServer()
    restored.setup_server(head_context(num_classes=2, feature_dim=1))
    restored.load_server_state(server.server_state())
    assert torch.equal(restored.download_for(0).weights["weight"], download.weights["weight"])


def test_lg_fedavg_client_swaps_in_the_head_and_trains_on_it_by_hand():
    """The download replaces the head only; the loss is CE of the new head on the client's own features."""
    client = LGFedAvgClient(TinyLinear(body=torch.tensor([[2.0, 0.0], [0.0, 1.0]]), head_bias=torch.zeros(2)), 2)
    head = {"weight": torch.tensor([[0.0, 1.0], [1.0, 0.0]]), "bias": torch.tensor([0.5, 0.0])}
    client.on_receive(WeightsPayload(weights=head))
    assert torch.equal(client.model.body.weight, torch.tensor([[2.0, 0.0], [0.0, 1.0]]))  # body kept
    # features = [2, 0]; logits = [0, 2] + [0.5, 0] = [0.5, 2]; CE(class 0) = log(1 + e^1.5) = 1.701413
    loss = client.local_loss((torch.tensor([[1.0, 0.0]]), torch.tensor([0])))
    assert loss.item() == pytest.approx(1.701413, abs=1e-6)
    sent = client.make_upload([])
    assert set(sent.weights) == {"weight", "bias"} and torch.equal(sent.weights["bias"], torch.tensor([0.5, 0.0]))


def test_lg_fedavg_rejects_a_head_of_the_wrong_shape_or_nan():
    """A head of another shape, or with NaN, is refused."""
    server = LGFedAvgServer()
    server.setup_server(head_context(num_classes=2, feature_dim=1))
    wrong = {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}
    with pytest.raises(TrainingError, match="shape"):
        server.check_upload(upload(0, WeightsPayload(weights=wrong, num_examples=1)))
    nan = {"weight": torch.full((2, 1), float("nan")), "bias": torch.zeros(2)}
    with pytest.raises(TrainingError, match="non-finite"):
        server.check_upload(upload(0, WeightsPayload(weights=nan, num_examples=1)))


def test_lg_fedavg_heads_identical_after_download_while_backbones_differ(lg_loop):
    """After the download every client holds the same head while keeping its own feature extractor."""
    loop = lg_loop
    clients = [client_after_download(loop, c, slot=1 + c) for c in range(loop.scenario.num_clients)]
    global_head = loop.server.download_for(0).weights
    for module in clients:
        for key, value in module.model.head.state_dict().items():
            assert torch.equal(value, global_head[key]), key
    # clients 0 and 2 share an architecture but keep their own feature extractors
    body_0 = {k: v for k, v in clients[0].model.state_dict().items() if not k.startswith("head.")}
    body_2 = {k: v for k, v in clients[2].model.state_dict().items() if not k.startswith("head.")}
    assert any(not torch.equal(v, body_2[k]) for k, v in body_0.items())


def test_lg_fedavg_upload_and_download_are_one_head(lg_loop):
    """Each client uploads K'C + C floats, and the download is one head of the same size."""
    loop = lg_loop
    head_bytes = (FEATURE_DIM * loop.scenario.num_classes + loop.scenario.num_classes) * FLOAT_BYTES  # K'C + C floats
    clients = loop.scenario.num_clients
    assert loop.history[0]["comm/bytes_up"] == clients * head_bytes
    assert loop.server.download_for(0).nbytes() == head_bytes
