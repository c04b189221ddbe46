"""FedGen, FML and FedKD: shared models in sync, generator training, payload sizes per FedKTL Table 5."""

from __future__ import annotations

import pytest
import torch

from fedhet.algorithms.base import ClientUpload
from fedhet.algorithms.fedgen import FedGen, FedGenDownload, FeatureGenerator, HeadCountsPayload
from fedhet.algorithms.fedkd import FedKD, FedKDClient, SVDStatePayload
from fedhet.algorithms.fml import FML
from fedhet.errors import TrainingError
from fedhet.federation import FederationLoop
from fedhet.models import create_model
from fedhet.seeding import derive_seed, seeded
from tests.conftest import tiny_label_skew


def _loop(algorithm, cpu_trainer, rounds=1, feature_dim=None, architectures=("cnn_tiny", "mlp_tiny", "cnn_tiny")):
    scenario = tiny_label_skew()
    scenario.setup()
    return FederationLoop(
        algorithm, scenario, list(architectures), cpu_trainer, rounds=rounds, seed=0, feature_dim=feature_dim
    )


def _shared_state(loop, client_id, prefix, receive):
    module = loop.runtime.module(loop.architectures[client_id])
    module.load_client_state(loop.store.get(client_id)["module"])
    if receive:
        module.on_receive(loop.server.download_for(client_id))
    return {k: v.clone() for k, v in module.state_dict().items() if k.startswith(prefix)}


@pytest.mark.parametrize(
    "algorithm,prefix",
    [(FML(meme_model="mlp_tiny", lr=0.05), "meme."), (FedKD(student_model="mlp_tiny", lr=0.05, student_lr=0.05), "student.")],
)
def test_shared_model_identical_across_clients_after_download(algorithm, prefix, cpu_trainer):
    loop = _loop(algorithm, cpu_trainer)
    loop.run()
    trained = [_shared_state(loop, c, prefix, receive=False) for c in range(3)]
    # local training moved the clients' copies apart ...
    assert any(not torch.equal(trained[0][k], trained[1][k]) for k in trained[0])
    received = [_shared_state(loop, c, prefix, receive=True) for c in range(3)]
    # ... and the download puts every client on the same shared model
    for other in received[1:]:
        assert other.keys() == received[0].keys()
        assert all(torch.equal(other[k], received[0][k]) for k in other)


def test_shared_model_initialisation_is_common_to_clients():
    algorithm = FML(meme_model="mlp_tiny")
    with seeded(1):
        first = algorithm.build_client(create_model("cnn_tiny", num_classes=10, seed=1), 10)
    with seeded(2):
        second = algorithm.build_client(create_model("mlp_tiny", num_classes=10, seed=2), 10)
    assert all(torch.equal(a, b) for a, b in zip(first.meme.state_dict().values(), second.meme.state_dict().values()))


def test_fml_upload_is_the_meme_model(cpu_trainer):
    # FedKTL Table 5: FML uploads the meme model's parameters. simple_cnn (width 16, 3 channels,
    # 10 classes): conv 3*16*9+16 = 448, conv 16*32*9+32 = 4640, fc 512*120+120 = 61560,
    # fc 120*84+84 = 10164, head 84*10+10 = 850 -> 77662 floats.
    loop = _loop(FML(meme_model="simple_cnn"), cpu_trainer)
    summary = loop.run()
    assert summary["comm"]["bytes_up"] == 3 * 77662 * 4
    assert summary["comm"]["bytes_down"] == 3 * 77662 * 4  # round 0 already downloads the meme


def test_fedkd_upload_counts_compressed_factor_sizes():
    student = create_model("mlp_tiny", num_classes=10, seed=0)  # fc.0 [32, 192], head [10, 32]
    client = FedKDClient(create_model("cnn_tiny", num_classes=10, seed=1), 10, student, t_start=0.95, t_end=0.95)
    client.on_receive(None)
    with torch.no_grad():  # a rank-1 update of each matrix, biases unchanged
        student.fc[0].weight += torch.outer(torch.ones(32), torch.linspace(-1, 1, 192))
        student.head.weight += torch.outer(torch.arange(10.0), torch.ones(32))
    upload = client.make_upload([])
    assert set(upload.low_rank) == {"fc.0.weight", "head.weight"}
    assert all(f["s"].numel() == 1 for f in upload.low_rank.values())
    # rank 1: 1*(32+192+1) = 225 and 1*(10+32+1) = 43 floats; dense biases 32 + 10 floats
    assert upload.nbytes() == (225 + 43 + 32 + 10) * 4
    full = sum(p.numel() for p in student.parameters()) * 4
    assert upload.nbytes() < full
    rebuilt = upload.decompressed(student.state_dict())
    assert torch.allclose(rebuilt["head.weight"], torch.outer(torch.arange(10.0), torch.ones(32)), atol=1e-4)


def test_fedkd_round_uploads_less_than_the_dense_student(cpu_trainer):
    loop = _loop(FedKD(student_model="mlp_tiny", t_start=0.5, t_end=0.5), cpu_trainer)
    summary = loop.run()
    dense = sum(v.numel() * v.element_size() for v in loop.server.global_student.values())
    assert 0 < summary["comm"]["bytes_up"] < 3 * dense


def test_fedkd_server_rejects_malformed_factors(cpu_trainer):
    loop = _loop(FedKD(student_model="mlp_tiny"), cpu_trainer)
    reference = loop.server.global_student
    good = {k: torch.zeros_like(v) for k, v in reference.items()}
    payload = SVDStatePayload(dense=good, num_examples=1)
    loop.server.aggregate(0, [ClientUpload(0, "cnn_tiny", payload)])  # accepted
    bad = dict(good)
    bad["head.weight"] = torch.zeros(3, 3)
    with pytest.raises(TrainingError, match="shape"):
        loop.server.aggregate(0, [ClientUpload(0, "cnn_tiny", SVDStatePayload(dense=bad, num_examples=1))])
    factors = {"u": torch.zeros(10, 2), "s": torch.zeros(2), "v": torch.zeros(3, 32)}
    low = SVDStatePayload(low_rank={"head.weight": factors}, dense={k: v for k, v in good.items() if k != "head.weight"})
    with pytest.raises(TrainingError, match="low_rank.head.weight.v"):
        loop.server.aggregate(0, [ClientUpload(0, "cnn_tiny", low)])


def test_fedgen_generator_training_lowers_its_loss(cpu_trainer):
    loop = _loop(FedGen(generator_steps=60, generator_batch_size=16), cpu_trainer, feature_dim=16)
    loop.run()
    server = loop.server
    with seeded(derive_seed(0, "fedgen", "generator")):  # the generator as it was before round 0's fit
        untrained = FeatureGenerator(32, 10, 16, 16)
    labels = torch.multinomial(server.round_counts, 64, replacement=True, generator=torch.Generator().manual_seed(0))
    trained_generator = server.generator
    with seeded(5), torch.no_grad():
        trained = float(server.generator_loss(labels))
    server.generator = untrained
    with seeded(5), torch.no_grad():
        before = float(server.generator_loss(labels))
    server.generator = trained_generator
    assert trained < before
    assert loop.history[0]["server/generator_loss"] < loop.history[0]["server/generator_loss_first"]


def test_fedgen_payload_sizes_match_table5_formula(cpu_trainer):
    loop = _loop(FedGen(generator_steps=5), cpu_trainer, feature_dim=16)
    summary = loop.run()
    feature, classes, noise, hidden = 16, 10, 32, 16
    head = feature * classes + classes  # K'C + C = 170
    generator = (noise + classes) * hidden + hidden + 2 * hidden + hidden * feature + feature  # 688 + 32 + 272
    assert summary["comm"]["bytes_up"] == 3 * (head * 4 + classes * 8)  # + the int64 label counts
    download = loop.server.download_for(0)
    assert isinstance(download, FedGenDownload)
    assert download.nbytes() == (head + generator) * 4 + classes * 8
    assert summary["comm"]["bytes_down"] == 0  # nothing to download before the first generator


def test_fedgen_clients_take_the_global_head_and_use_the_generator(cpu_trainer):
    loop = _loop(FedGen(generator_steps=5), cpu_trainer, feature_dim=16)
    loop.run()
    module = loop.runtime.module("cnn_tiny")
    module.load_client_state(loop.store.get(0)["module"])
    module.on_receive(loop.server.download_for(0))
    assert torch.equal(module.model.head.weight, loop.server.global_head.weight)
    assert module.label_distribution is not None and not any(k.startswith("generator.") for k in module.client_state())
    x, y = next(iter(loop.scenario.train_loader(0, 0)))
    with seeded(0):
        regularised = float(module.local_loss((x, y)))
    module.label_distribution = None
    plain = float(module.local_loss((x, y)))
    assert regularised > plain  # the generated-feature cross-entropy is added


def test_fedgen_server_rejects_bad_label_counts(cpu_trainer):
    loop = _loop(FedGen(generator_steps=5), cpu_trainer, feature_dim=16)
    head = {k: v.clone() for k, v in loop.server.global_head.state_dict().items()}
    bad = HeadCountsPayload(weights=head, label_counts=-torch.ones(10, dtype=torch.long), num_examples=4)
    with pytest.raises(TrainingError, match="label counts"):
        loop.server.aggregate(0, [ClientUpload(0, "cnn_tiny", bad)])
