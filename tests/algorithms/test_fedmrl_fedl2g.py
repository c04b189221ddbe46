"""FedMRL's and FedL2G's servers refuse uploads they do not expect, and FedMRL refuses impossible widths."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedhet.algorithms import FedL2GFeat, FedL2GLogit, FedMRL
from fedhet.algorithms.base import ClientUpload, ServerContext
from fedhet.core.payloads import ClassStatsPayload, WeightsPayload
from fedhet.errors import ConfigError, TrainingError
from fedhet.models import create_model

M = 4


def l2g_server(method, label_counts):
    """A FedL2G server over ``cnn_tiny`` clients (16 features) with the given label counts."""
    algorithm = method()
    state = algorithm.build_client(create_model("cnn_tiny", num_classes=M, seed=0), M).client_state()
    server = algorithm.build_server()
    server.setup_server(
        ServerContext(
            num_clients=2,
            num_classes=M,
            architectures=("cnn_tiny",) * 2,
            seed=0,
            initial_client_state=lambda cid: state,
            label_counts=label_counts,
        )
    )
    return server


def test_fedl2g_guidance_shapes_and_the_uploads_it_refuses():
    """Feature guidance is [C, 16], logit guidance [C, C]; wrong widths, marks above 1 or on absent classes fail."""
    counts = torch.tensor([[3, 3, 0, 3], [1, 1, 1, 1]])
    feat, logit = l2g_server(FedL2GFeat, counts), l2g_server(FedL2GLogit, counts)
    assert feat.download_for(0).values.shape == (M, 16)
    assert logit.download_for(0).values.shape == (M, M)
    good = ClassStatsPayload(values=torch.zeros(M, 16), counts=torch.tensor([1, 0, 0, 1]))
    feat.check_upload(ClientUpload(0, "cnn_tiny", good))
    with pytest.raises(TrainingError, match="client 1"):  # logit guidance is [C, C], not [C, 16]
        logit.check_upload(ClientUpload(1, "cnn_tiny", good))
    with pytest.raises(TrainingError, match="client 0 sent guidance row marks"):  # it holds 3 of class 0
        feat.check_upload(ClientUpload(0, "cnn_tiny", dataclasses.replace(good, counts=torch.tensor([2, 0, 0, 0]))))
    with pytest.raises(TrainingError, match="class 2"):  # client 0 holds no example of class 2
        feat.check_upload(ClientUpload(0, "cnn_tiny", dataclasses.replace(good, counts=torch.tensor([0, 0, 1, 0]))))
    with pytest.raises(TrainingError, match="expected guidance gradients"):
        feat.check_upload(ClientUpload(0, "cnn_tiny", WeightsPayload(weights={"w": torch.zeros(1)})))


def test_fedl2g_server_state_round_trips():
    """A round's guidance survives server_state / load_server_state (checkpoints resume exactly)."""
    server = l2g_server(FedL2GFeat, torch.ones(2, M, dtype=torch.long))
    grad = ClassStatsPayload(values=torch.ones(M, 16), counts=torch.tensor([1, 1, 0, 0]))
    server.aggregate(0, [ClientUpload(0, "cnn_tiny", grad)])
    # rows 0 and 1 move by lr * clip(1) = 0.01 (norm sqrt(32) < 100: no clipping); rows 2 and 3 stay
    moved = server.download_for(0).values
    restored = l2g_server(FedL2GFeat, torch.ones(2, M, dtype=torch.long))
    restored.load_server_state(server.server_state())
    assert torch.equal(restored.download_for(1).values, moved)
    assert server.metrics() == {"guided_classes": 2.0}


def test_fedmrl_uploads_only_the_small_model_and_the_server_refuses_other_weights():
    """The upload is the small model's state; the client's own weights are refused naming the sender."""
    algorithm = FedMRL(small_model="cnn_tiny", small_feature_dim=8)
    client = algorithm.build_client(create_model("mlp_tiny", num_classes=M, seed=0), M)
    upload = client.make_upload([])
    assert set(upload.weights) == set(client.small.state_dict())
    server = algorithm.build_server()
    state = client.client_state()
    server.setup_server(
        ServerContext(
            num_clients=1, num_classes=M, architectures=("mlp_tiny",), seed=0, initial_client_state=lambda cid: state
        )
    )
    server.check_upload(ClientUpload(0, "mlp_tiny", upload))
    with pytest.raises(TrainingError, match="client 0 sent weights whose keys differ"):
        server.check_upload(ClientUpload(0, "mlp_tiny", WeightsPayload(weights=client.model.state_dict())))


def test_fedmrl_refuses_a_coarse_granularity_wider_than_the_client_features():
    """small_feature_dim above a client's feature width cannot be a prefix of its representation."""
    with pytest.raises(ConfigError, match="lower small_feature_dim or raise feature_dim"):
        FedMRL(small_model="cnn_tiny", small_feature_dim=32).build_client(create_model("cnn_tiny", num_classes=M), M)


def _fedmrl_client(**hp):
    return FedMRL(small_model="cnn_tiny", small_feature_dim=8, **hp).build_client(
        create_model("cnn_tiny", num_classes=M, seed=1), M
    )


def test_fedmrl_small_model_is_the_same_on_every_client_and_follows_its_seed():
    """Every client starts from one small model drawn from ``shared_init_seed``; another seed, another model."""
    first, again, other = (_fedmrl_client(shared_init_seed=s) for s in (0, 0, 1))
    assert first.num_classes == M
    a, b, c = (client.small.state_dict() for client in (first, again, other))
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert not all(torch.equal(a[key], c[key]) for key in a)


def test_fedmrl_accepts_a_coarse_granularity_as_wide_as_the_client_features():
    """``d_2 = d_1`` (16 features of ``cnn_tiny``) nests trivially: the client is built."""
    algorithm = FedMRL(small_model="cnn_tiny", small_feature_dim=16)
    client = algorithm.build_client(create_model("cnn_tiny", num_classes=M), M)
    assert client.projector.out_features == 16


def test_fedmrl_client_keeps_its_overrides_and_predicts_by_its_rule():
    """``prediction="fine"`` answers with the client's head, ``"sum"`` with both heads' logits added."""
    from fedhet.algorithms.fedmrl import FedMRLClient

    small = create_model("cnn_tiny", num_classes=M, seed=2, feature_dim=8)
    client = FedMRLClient(create_model("cnn_tiny", num_classes=M, seed=1), M, small, coarse_weight=0.5)
    assert client.hp.coarse_weight == 0.5 and client.num_classes == M
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    for prediction in ("fine", "sum"):
        client = _fedmrl_client(prediction=prediction).eval()
        with torch.no_grad():
            coarse, fine = client.granularity_logits(x)
            expected = fine if prediction == "fine" else coarse + fine
            assert torch.equal(client(x), expected), prediction


@pytest.mark.parametrize(("weighting", "expected"), [("samples", 0.75 * 1.0 + 0.25 * 5.0), ("uniform", 3.0)])
def test_fedmrl_server_averages_small_models_over_architectures_by_its_weighting(weighting, expected):
    """One small model for all: clients of two architectures are averaged together (by examples or uniformly)."""
    server = FedMRL(small_weighting=weighting).build_server()
    initial = {"small.w": torch.zeros(1), "model.v": torch.zeros(1)}
    server.setup_server(
        ServerContext(
            num_clients=2, num_classes=M, architectures=("a", "b"), seed=0, initial_client_state=lambda cid: initial
        )
    )
    server.aggregate(
        0,
        [
            ClientUpload(0, "a", WeightsPayload(weights={"w": torch.tensor([1.0])}, num_examples=30)),
            ClientUpload(1, "b", WeightsPayload(weights={"w": torch.tensor([5.0])}, num_examples=10)),
        ],
    )
    for client_id in (0, 1):
        assert server.download_for(client_id).weights["w"].item() == pytest.approx(expected)
