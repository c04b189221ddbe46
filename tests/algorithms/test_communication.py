"""Measured communication equals the paper's formulas (FedKTL Tab. 5 and section 2.4).

FedKTL's Table 5 counts floats per round: prototypes ``sum_i |C_i| * K`` up, generated pairs
``N * C * (ch*h*w + H)`` down for FedKTL; heads ``K'C + C``; prototypes ``|C_i| * K'``;
logits ``|C_i| * C``; whole shared models. The round loop measures bytes from the payloads it
really sends (``Payload.nbytes``), so this test runs one real round per method and compares
the ledger with the formula, computed independently from the scenario and the models.
Per-class payloads also carry one int64 class count per class sent (8 bytes), which the paper's
float counts leave out; the formulas below add it explicitly.
"""

from __future__ import annotations

import pytest

from fedhet.algorithms import ALGORITHMS
from fedhet.federation import FederationLoop
from fedhet.federation.trainer import TrainerTemplate
from fedhet.models import create_model
from tests.conftest import tiny_label_skew

FLOAT, COUNT = 4, 8
FEATURE_DIM = 16  # K'
ARCHITECTURES = ["cnn_tiny", "mlp_tiny", "cnn_tiny"]


@pytest.fixture(scope="module")
def scenario():
    """The tiny label-skew scenario (3 clients), set up once for the module."""
    scenario = tiny_label_skew()
    scenario.setup()
    return scenario


def _second_round(name, scenario, **kwargs):
    """The comm record of round 1 (round 0 has no download yet for most methods)."""
    loop = FederationLoop(
        ALGORITHMS[name](**kwargs),
        scenario,
        ARCHITECTURES,
        TrainerTemplate(max_epochs=1, accelerator="cpu", limit_train_batches=2),
        rounds=2,
        feature_dim=FEATURE_DIM,
    )
    loop.run()
    return loop, loop.history[1]


def _held_classes(scenario):
    return [len(set(scenario.client_data(c).train.labels_numpy().tolist())) for c in range(scenario.num_clients)]


def _all_classes(scenario):
    labels = (scenario.client_data(c).train.labels_numpy().tolist() for c in range(scenario.num_clients))
    return len(set().union(*labels))


def _params(module) -> int:
    return sum(t.numel() for t in module.state_dict().values() if t.is_floating_point())


def test_prototype_and_logit_methods(scenario):
    """FD, FedProto, FedGH and FedTGP measure |C_i| rows up and the paper's download size per client."""
    held, classes, clients = _held_classes(scenario), scenario.num_classes, scenario.num_clients
    present = _all_classes(scenario)
    head = FEATURE_DIM * classes + classes
    expected = {
        # name: (up floats per held class, down bytes per client)
        "fd": (classes, present * (classes * FLOAT + COUNT)),
        "fedproto": (FEATURE_DIM, present * (FEATURE_DIM * FLOAT + COUNT)),
        "fedgh": (FEATURE_DIM, head * FLOAT),
        "fedtgp": (FEATURE_DIM, present * (FEATURE_DIM * FLOAT + COUNT)),
    }
    fast = {"fedgh": {"server_epochs": 2}, "fedtgp": {"server_epochs": 2}}
    for name, (row, down_per_client) in expected.items():
        _, record = _second_round(name, scenario, **fast.get(name, {}))
        assert record["comm/bytes_up"] == sum(h * (row * FLOAT + COUNT) for h in held), name
        assert record["comm/bytes_down"] == clients * down_per_client, name


def test_head_sharing(scenario):
    """LG-FedAvg sends one K'C + C head up and one down per client."""
    head = FEATURE_DIM * scenario.num_classes + scenario.num_classes
    _, record = _second_round("lg_fedavg", scenario)
    assert record["comm/bytes_up"] == record["comm/bytes_down"] == scenario.num_clients * head * FLOAT


def test_fedktl_matches_table_5(scenario):
    """FedKTL sends |C_i| K floats up and C (ch*h*w + H) floats down per client (Table 5)."""
    loop, record = _second_round("fedktl", scenario, server_epochs=1)
    classes, clients = scenario.num_classes, scenario.num_clients
    prototype_dim = classes  # K = C
    latent = loop.server.generator.latent_dim  # H
    pixels = scenario.in_channels * scenario.image_size**2
    assert record["comm/bytes_up"] == sum(h * (prototype_dim * FLOAT + COUNT) for h in _held_classes(scenario))
    assert record["comm/bytes_down"] == clients * classes * (pixels + latent) * FLOAT


def test_shared_model_methods(scenario):
    """FML sends the whole meme both ways; FedKD's SVD factors are smaller than the dense student."""
    meme = create_model("simple_cnn", num_classes=scenario.num_classes, in_channels=scenario.in_channels, seed=0)
    _, record = _second_round("fml", scenario, meme_model="simple_cnn")
    floats = _params(meme)
    assert record["comm/bytes_up"] == record["comm/bytes_down"] == scenario.num_clients * floats * FLOAT
    # FedKD sends SVD factors of the student: never more than the dense student, and less here
    _, record = _second_round("fedkd", scenario, student_model="simple_cnn")
    assert 0 < record["comm/bytes_up"] < scenario.num_clients * floats * FLOAT
