"""FML: hand-computed deep-mutual-learning loss, meme averaging by hand, shared meme in sync, Table 5 size."""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.algorithms.fml import FML, FMLClient, SharedModelServer
from fedhet.core.payloads import WeightsPayload
from fedhet.federation import FederationLoop
from fedhet.models import create_model
from fedhet.seeding import seeded
from tests.algorithms.helpers import TinyLinear, context, upload
from tests.conftest import tiny_label_skew

SWAP = torch.tensor([[0.0, 1.0], [1.0, 0.0]])


def _loop(algorithm, cpu_trainer, rounds=1):
    scenario = tiny_label_skew()
    scenario.setup()
    return FederationLoop(algorithm, scenario, ["cnn_tiny", "mlp_tiny", "cnn_tiny"], cpu_trainer, rounds=rounds, seed=0)


def shared_state(loop, client_id, prefix, receive):
    """The shared sub-module's state a client holds after its last round, optionally after the download."""
    module = loop.runtime.module(loop.architectures[client_id])
    module.load_client_state(loop.store.get(client_id)["module"])
    if receive:
        module.on_receive(loop.server.download_for(client_id))
    return {k: v.clone() for k, v in module.state_dict().items() if k.startswith(prefix)}


def test_fml_mutual_learning_loss_by_hand():
    """The loss is a CE_p + (1 - a) KL(p_m || p_p) + b CE_m + (1 - b) KL(p_p || p_m), with a = 0.5, b = 0.25."""
    client = FMLClient(TinyLinear(), 2, meme=TinyLinear(head=SWAP), alpha=0.5, beta=0.25)
    # private logits [1, 0], meme logits [0, 1]: CE_p = log(1 + e^-1), CE_m = log(1 + e)
    # p_p = (s, 1 - s), p_m = (1 - s, s) with s = e / (1 + e); both KLs = (2s - 1) * log(s / (1 - s)) = 2s - 1
    s = math.e / (1 + math.e)
    kl = (2 * s - 1) * 1.0
    expected = 0.5 * math.log1p(math.exp(-1)) + 0.5 * kl + 0.25 * math.log1p(math.e) + 0.75 * kl
    loss = client.local_loss((torch.tensor([[1.0, 0.0]]), torch.tensor([0])))
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_fml_each_model_learns_from_a_detached_peer():
    """The private model's gradient comes from its own CE and KL only: with alpha = 1 the meme does not move it."""
    client = FMLClient(TinyLinear(), 2, meme=TinyLinear(head=SWAP), alpha=1.0, beta=0.0)
    client.local_loss((torch.tensor([[1.0, 0.0]]), torch.tensor([0]))).backward()
    # private: d CE / d head = (p - onehot) x^T = [[-(1 - s), 0], [1 - s, 0]] with s = e / (1 + e)
    s = math.e / (1 + math.e)
    expected = torch.tensor([[-(1 - s), 0.0], [1 - s, 0.0]])
    assert torch.allclose(client.model.head.weight.grad, expected, atol=1e-6)


def test_fml_client_receives_and_uploads_the_meme_only():
    """The download overwrites the meme (not the private model); the upload is a copy of the meme."""
    client = FMLClient(TinyLinear(), 2, meme=TinyLinear())
    client.on_receive(WeightsPayload(weights={"body.weight": SWAP, "head.weight": 2 * torch.eye(2)}))
    assert torch.equal(client.meme.body.weight, SWAP) and torch.equal(client.model.body.weight, torch.eye(2))
    sent = client.make_upload([])
    assert torch.equal(sent.weights["head.weight"], 2 * torch.eye(2))


def test_fml_server_averages_memes_by_samples_or_uniformly_by_hand():
    """Samples: 0.75 [1, 2] + 0.25 [5, 6] = [2, 3]; uniform (HtFLlib): [3, 4]; starts from client 0's meme."""
    for weighting, expected in (("samples", [2.0, 3.0]), ("uniform", [3.0, 4.0])):
        server = SharedModelServer(meme_weighting=weighting)
        server.setup_server(context(initial={"meme.w": torch.zeros(2), "model.w": torch.ones(3)}))
        assert set(server.download_for(0).weights) == {"w"}
        server.aggregate(0, [
            upload(0, WeightsPayload(weights={"w": torch.tensor([1.0, 2.0])}, num_examples=30)),
            upload(1, WeightsPayload(weights={"w": torch.tensor([5.0, 6.0])}, num_examples=10)),
        ])
        assert torch.allclose(server.download_for(1).weights["w"], torch.tensor(expected)), weighting


def test_fml_shared_model_identical_across_clients_after_download(cpu_trainer):
    """Local training moves the clients' memes apart; the download puts them all on the same meme."""
    loop = _loop(FML(meme_model="mlp_tiny", lr=0.05), cpu_trainer)
    loop.run()
    trained = [shared_state(loop, c, "meme.", receive=False) for c in range(3)]
    assert any(not torch.equal(trained[0][k], trained[1][k]) for k in trained[0])
    received = [shared_state(loop, c, "meme.", receive=True) for c in range(3)]
    for other in received[1:]:
        assert other.keys() == received[0].keys()
        assert all(torch.equal(other[k], received[0][k]) for k in other)


def test_shared_model_initialisation_is_common_to_clients():
    """Clients built under different seeds and architectures start from the same meme."""
    algorithm = FML(meme_model="mlp_tiny")
    with seeded(1):
        first = algorithm.build_client(create_model("cnn_tiny", num_classes=10, seed=1), 10)
    with seeded(2):
        second = algorithm.build_client(create_model("mlp_tiny", num_classes=10, seed=2), 10)
    pairs = zip(first.meme.state_dict().values(), second.meme.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_fml_upload_is_the_meme_model(cpu_trainer):
    """FedKTL Table 5: FML uploads (and downloads, from round 0) exactly the meme's 77662 parameters per client."""
    # simple_cnn (width 16, 3 channels, 10 classes): conv 3*16*9+16 = 448, conv 16*32*9+32 = 4640,
    # fc 512*120+120 = 61560, fc 120*84+84 = 10164, head 84*10+10 = 850 -> 77662 floats.
    loop = _loop(FML(meme_model="simple_cnn"), cpu_trainer)
    summary = loop.run()
    assert summary["comm"]["bytes_up"] == 3 * 77662 * 4
    assert summary["comm"]["bytes_down"] == 3 * 77662 * 4  # round 0 already downloads the meme


def test_fml_builds_memes_from_its_seed_and_averages_them_by_its_weighting():
    """Every client's meme starts from ``shared_init_seed``; the server averages memes as the method declares."""
    def meme(seed):
        algorithm = FML(meme_model="mlp_tiny", shared_init_seed=seed)
        client = algorithm.build_client(create_model("cnn_tiny", num_classes=3), 3)
        assert client.num_classes == 3
        return client.meme.state_dict()

    a, b, c = meme(0), meme(0), meme(1)
    assert all(torch.equal(a[k], b[k]) for k in a) and not all(torch.equal(a[k], c[k]) for k in a)
    assert FML(meme_weighting="uniform").build_server().weighting == "uniform"
    assert FML(meme_weighting="samples").build_server().weighting == "samples"


def test_fml_kl_reduction_reaches_the_mutual_losses():
    """``kl_reduction="mean"`` (HtFLlib's element mean) is what the client's loss uses."""
    from fedhet.functional import mutual_learning_losses

    client = FMLClient(TinyLinear(), 2, TinyLinear(head=torch.tensor([[0.0, 1.0], [1.0, 0.0]])), kl_reduction="mean")
    assert client.num_classes == 2
    x, y = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])
    private, meme = mutual_learning_losses(client.model(x), client.meme(x), y, client.hp.alpha, client.hp.beta, "mean")
    assert client.local_loss((x, y)).item() == pytest.approx((private + meme).item(), abs=1e-7)
    batchmean = mutual_learning_losses(client.model(x), client.meme(x), y, client.hp.alpha, client.hp.beta, "batchmean")
    assert sum(batchmean).item() != pytest.approx((private + meme).item(), abs=1e-7)
