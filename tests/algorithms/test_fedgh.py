"""FedGH: a hand-computed server SGD step on the uploaded prototypes, client loss with the global head, sizes."""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.algorithms.fedgh import FedGH, FedGHServer
from fedhet.core.payloads import ClassStatsPayload, WeightsPayload
from fedhet.errors import TrainingError
from tests.algorithms.helpers import (
    COUNT_BYTES,
    FEATURE_DIM,
    FLOAT_BYTES,
    TinyLinear,
    class_stats,
    client_after_download,
    fit,
    head_context,
    held_classes,
    heterogeneous_run,
    separable_uploads,
    upload,
)


@pytest.fixture(scope="module")
def fedgh_loop():
    """One FedGH round on two architectures with a 16-d feature neck (2 server epochs)."""
    return heterogeneous_run(FedGH(lr=0.05, server_epochs=2))


def _fit_server(server) -> None:
    fit(server, server.server_dataloader(0))


def test_fedgh_server_sgd_step_on_prototypes_by_hand():
    """From a zero head, one SGD step (lr 0.1) on prototypes [1, 0] (class 0) and [0, 2] (class 1), worked by hand."""
    server = FedGHServer(server_lr=0.1, server_epochs=1, server_batch_size=2)
    server.setup_server(head_context(num_classes=2, feature_dim=2))
    server.aggregate(0, [upload(0, class_stats([[1.0, 0.0], [0.0, 2.0]], [4, 1]))])
    assert server.round_prototypes.tolist() == [[1.0, 0.0], [0.0, 2.0]] and server.round_labels.tolist() == [0, 1]
    _fit_server(server)
    # zero head: p = [1/2, 1/2] for both, CE = log 2. dW = mean_b (p - onehot) P_b^T:
    # ([-0.5, 0.5] x [1, 0] + [0.5, -0.5] x [0, 2]) / 2 = [[-0.25, 0.5], [0.25, -0.5]]; db = 0
    assert server.loss_steps == 1 and server.metrics()["loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert torch.allclose(server.head.weight, torch.tensor([[0.025, -0.05], [-0.025, 0.05]]), atol=1e-7)
    assert torch.allclose(server.head.bias, torch.zeros(2), atol=1e-7)
    assert torch.allclose(server.download_for(0).weights["weight"], server.head.weight.detach())


def test_fedgh_server_trains_one_prototype_per_held_class_and_client():
    """Each (client, held class) pair is one training example; classes a client lacks are left out."""
    server = FedGHServer()
    server.setup_server(head_context(num_classes=3, feature_dim=2))
    server.aggregate(0, [
        upload(0, class_stats([[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]], [3, 0, 1])),
        upload(1, class_stats([[5.0, 5.0], [6.0, 6.0], [0.0, 0.0]], [0, 2, 0])),
    ])
    assert server.round_labels.tolist() == [0, 2, 1]
    assert server.round_prototypes.tolist() == [[1.0, 1.0], [2.0, 2.0], [6.0, 6.0]]


def test_fedgh_client_takes_the_global_head_and_trains_with_cross_entropy_only_by_hand():
    """The download replaces the head; the local loss is CE (no prototype term); the upload is class-mean features."""
    client = FedGH().build_client(TinyLinear(head_bias=torch.zeros(2)), 2)
    swapped = {"weight": torch.tensor([[0.0, 1.0], [1.0, 0.0]]), "bias": torch.zeros(2)}
    client.on_receive(WeightsPayload(weights=swapped))
    x, y = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])
    # logits = swapped features: [0, 1] (class 0: log(1 + e)) and [2, 0] (class 1: log(1 + e^2))
    assert client.local_loss((x, y)).item() == pytest.approx((1.313262 + 2.126928) / 2, abs=1e-6)
    client.on_receive(ClassStatsPayload(values=torch.full((2, 2), 9.0), counts=torch.ones(2, dtype=torch.long)))
    assert client.local_loss((x, y)).item() == pytest.approx((1.313262 + 2.126928) / 2, abs=1e-6)
    sent = client.make_upload([(x, y), (torch.tensor([[3.0, 0.0]]), torch.tensor([0]))])
    assert torch.allclose(sent.values, torch.tensor([[2.0, 0.0], [0.0, 2.0]])) and sent.counts.tolist() == [2, 1]


def test_fedgh_server_head_learns_to_classify_the_uploaded_prototypes():
    """Twenty server epochs on separable prototypes reach full accuracy, in one Lightning fit of 20 x 2 steps."""
    generator = torch.Generator().manual_seed(1)
    server = FedGHServer(server_lr=0.1, server_epochs=20, server_batch_size=4)
    server.setup_server(head_context(3, 4, head_weight=torch.randn(3, 4, generator=generator)))
    server.aggregate(0, separable_uploads())
    prototypes, labels = server.round_prototypes, server.round_labels
    assert prototypes.shape == (8, 4)  # 4 clients x 2 held classes
    before = server.accuracy_on(prototypes, labels)
    _fit_server(server)
    after = server.accuracy_on(prototypes, labels)
    assert after == 1.0 and after > before
    # all server epochs ran in one fit: 20 epochs x ceil(8 / 4) batches
    assert server.loss_steps == 40
    assert math.isfinite(server.metrics()["loss"])


def test_fedgh_server_starts_from_client_zero_head_and_validates():
    """Round 0's download is client 0's initial head; bad shapes, non-finite values and counts are refused."""
    weight = torch.arange(6.0).reshape(3, 2)
    server = FedGHServer()
    server.setup_server(head_context(3, 2, head_weight=weight))
    assert torch.equal(server.download_for(0).weights["weight"], weight)  # sent before round 0 (HtFLlib)
    with pytest.raises(TrainingError, match="shape"):
        server.check_upload(upload(0, class_stats([[1.0, 2.0, 3.0]] * 3, [1, 1, 1])))
    with pytest.raises(TrainingError, match="non-finite"):
        server.check_upload(upload(0, class_stats([[float("inf"), 0.0]] * 3, [1, 1, 1])))
    with pytest.raises(TrainingError, match="counts"):
        server.check_upload(upload(0, class_stats([[0.0, 0.0]] * 3, [1, -1, 1])))


def test_fedgh_round_sizes_and_clients_take_the_global_head(fedgh_loop):
    """Table 5 sizes (|C_i| K' floats up, one head down) and clients hold the server's head after download."""
    loop = fedgh_loop
    num_classes = loop.scenario.num_classes
    head_bytes = (FEATURE_DIM * num_classes + num_classes) * FLOAT_BYTES
    # Table 5: upload |C_i| * K' floats per client (+ one int64 class count each), download one head
    row = FEATURE_DIM * FLOAT_BYTES + COUNT_BYTES
    expected_up = sum(held_classes(loop, c) * row for c in range(loop.scenario.num_clients))
    assert loop.history[0]["comm/bytes_up"] == expected_up
    assert loop.history[0]["comm/bytes_down"] == loop.scenario.num_clients * head_bytes
    module = client_after_download(loop, 1, slot=2)
    for key, value in module.model.head.state_dict().items():
        assert torch.equal(value, loop.server.head.state_dict()[key])
