"""FedGen: hand-computed client and generator losses, head averaging with label-share ensemble weights, sizes."""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.algorithms.fedgen import (
    FeatureGenerator,
    FedGen,
    FedGenClient,
    FedGenDownload,
    FedGenServer,
    HeadCountsPayload,
)
from fedhet.errors import ConfigError, TrainingError
from fedhet.federation import FederationLoop
from fedhet.seeding import derive_seed, seeded
from tests.algorithms.helpers import TinyLinear, context, fit, upload
from tests.conftest import tiny_label_skew

INITIAL_HEAD = {"model.head.weight": torch.eye(2), "model.head.bias": torch.zeros(2)}


def _loop(algorithm, cpu_trainer, rounds=1):
    scenario = tiny_label_skew()
    scenario.setup()
    architectures = ["cnn_tiny", "mlp_tiny", "cnn_tiny"]
    return FederationLoop(algorithm, scenario, architectures, cpu_trainer, rounds=rounds, seed=0, feature_dim=16)


def _constant_generator(feature: list[float]) -> FeatureGenerator:
    """A generator whose output is ``feature`` whatever the noise and label (zero last weight, bias = feature)."""
    generator = FeatureGenerator(noise_dim=3, num_classes=2, hidden_dim=4, feature_dim=2)
    with torch.no_grad():
        generator.fc.weight.zero_()
        generator.fc.bias.copy_(torch.tensor(feature))
    return generator


def test_fedgen_client_loss_adds_the_generated_feature_cross_entropy_by_hand():
    """CE(f(x), y) + w * CE(head(G(z, y^)), y^): labels all class 1, generated feature [2, 0], w = 0.5."""
    client = FedGenClient(TinyLinear(), 2, FeatureGenerator(3, 2, 4, 2), generated_weight=0.5)
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    assert client.local_loss((x, y)).item() == pytest.approx(0.313262, abs=1e-6)  # no download: CE only
    generator = {k: v.detach().clone() for k, v in _constant_generator([2.0, 0.0]).named_parameters()}
    download = FedGenDownload(head={"weight": torch.eye(2)}, generator=generator, label_counts=torch.tensor([0, 5]))
    client.on_receive(download)
    # real: log(1 + e^-1); generated: logits [2, 0] for class 1, log(1 + e^2)
    expected = math.log1p(math.exp(-1.0)) + 0.5 * math.log1p(math.exp(2.0))
    assert client.local_loss((x, y)).item() == pytest.approx(expected, abs=1e-6)
    assert not any(k.startswith("generator.") for k in client.client_state())


def test_fedgen_client_latent_kl_term_by_hand():
    """Official FedGen's user_latent_loss: KL(softmax(head(G(z, y))/T) || softmax(f(x)/T)), batch mean.

    G outputs [2, 0] for every label, so the target is softmax([2, 0]) = [e^2, 1] / (1 + e^2); the
    students are softmax([1, 0]) and softmax([0, 1]); the generated CE is switched off (weight 0).
    """

    def kl(target: list[float], student: list[float]) -> float:
        return sum(t * math.log(t / s) for t, s in zip(target, student, strict=True))

    def softmax(logits: list[float], temperature: float) -> list[float]:
        exps = [math.exp(v / temperature) for v in logits]
        return [e / sum(exps) for e in exps]

    x, y = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
    ce = math.log1p(math.exp(-1.0))  # both rows: log(1 + e^-1) = 0.313262
    generator = {k: v.detach().clone() for k, v in _constant_generator([2.0, 0.0]).named_parameters()}
    download = FedGenDownload(head={"weight": torch.eye(2)}, generator=generator, label_counts=torch.tensor([5, 5]))
    for temperature in (1.0, 2.0):
        client = FedGenClient(
            TinyLinear(), 2, FeatureGenerator(3, 2, 4, 2), generated_weight=0.0,
            latent_kl_weight=0.5, latent_kl_temperature=temperature,
        )  # fmt: skip
        assert client.local_loss((x, y)).item() == pytest.approx(ce, abs=1e-6)  # no download yet: CE only
        client.on_receive(download)
        target = softmax([2.0, 0.0], temperature)
        students = (softmax([1.0, 0.0], temperature), softmax([0.0, 1.0], temperature))
        # T = 1: KL rows 0.067131 and 0.828725 -> 0.313262 + 0.5 * 0.447928 = 0.537226
        expected = ce + 0.5 * (kl(target, students[0]) + kl(target, students[1])) / 2
        assert client.local_loss((x, y)).item() == pytest.approx(expected, abs=1e-6)
        if temperature == 1.0:
            assert expected == pytest.approx(0.537226, abs=1e-6)
    built = FedGen(latent_kl_weight=1.0, latent_kl_temperature=10.0).build_client(TinyLinear(), 2)
    assert (built.hp.latent_kl_weight, built.hp.latent_kl_temperature) == (1.0, 10.0)


def _server_after_two_uploads(diversity_weight: float = 0.5) -> FedGenServer:
    server = FedGenServer(noise_dim=3, generator_hidden_dim=4, diversity_weight=diversity_weight)
    server.setup_server(context(num_classes=2, initial=INITIAL_HEAD))
    head_a = {"weight": torch.tensor([[3.0, 0.0], [0.0, 3.0]]), "bias": torch.zeros(2)}
    head_b = {"weight": torch.tensor([[0.0, 3.0], [3.0, 0.0]]), "bias": torch.zeros(2)}
    server.aggregate(0, [
        upload(0, HeadCountsPayload(weights=head_a, label_counts=torch.tensor([3, 1]), num_examples=4)),
        upload(1, HeadCountsPayload(weights=head_b, label_counts=torch.tensor([1, 1]), num_examples=2)),
    ])
    return server


def test_fedgen_server_averages_heads_and_weighs_the_ensemble_by_label_shares_by_hand():
    """Global head = 2/3 A + 1/3 B (examples); ensemble weights per class = each client's share of the label."""
    server = _server_after_two_uploads()
    assert torch.allclose(server.global_head.weight, torch.tensor([[2.0, 1.0], [1.0, 2.0]]))
    # class 0 counts (3, 1) -> (0.75, 0.25); class 1 counts (1, 1) -> (0.5, 0.5)
    assert torch.allclose(server.round_ensemble_weights, torch.tensor([[0.75, 0.5], [0.25, 0.5]]))
    assert server.round_counts.tolist() == [4.0, 2.0]
    samples = FedGenServer(noise_dim=3, generator_hidden_dim=4, ensemble_weighting="samples")
    samples.setup_server(context(num_classes=2, initial=INITIAL_HEAD))
    head = {"weight": torch.eye(2), "bias": torch.zeros(2)}
    samples.aggregate(0, [
        upload(0, HeadCountsPayload(weights=head, label_counts=torch.tensor([3, 1]), num_examples=4)),
        upload(1, HeadCountsPayload(weights=head, label_counts=torch.tensor([1, 1]), num_examples=2)),
    ])
    assert torch.allclose(samples.round_ensemble_weights, torch.tensor([[2 / 3, 2 / 3], [1 / 3, 1 / 3]]))


def test_fedgen_generator_loss_by_hand():
    """Ensemble CE of a constant generated feature [1, 0] plus 0.5 * diversity (= 0.5 * e^0 for identical outputs)."""
    server = _server_after_two_uploads(diversity_weight=0.5)
    server.generator = _constant_generator([1.0, 0.0])
    # head A gives [3, 0], head B gives [0, 3]; class 0: 0.75 A + 0.25 B = [2.25, 0.75] -> log(1 + e^-1.5)
    # class 1: 0.5 A + 0.5 B = [1.5, 1.5] -> log 2
    expected = (math.log1p(math.exp(-1.5)) + math.log(2.0)) / 2 + 0.5 * 1.0
    assert server.generator_loss(torch.tensor([0, 1])).item() == pytest.approx(expected, abs=1e-6)


def test_fedgen_download_after_training_holds_head_generator_and_global_counts():
    """After a fitted round the download is the averaged head, the generator's parameters and summed counts."""
    server = _server_after_two_uploads()
    assert server.download_for(0) is None  # never trained yet
    with seeded(0):
        fit(server, server.server_dataloader(0), max_steps=2)
    download = server.download_for(1)
    assert download.label_counts.tolist() == [4, 2]
    assert torch.equal(download.head["weight"], torch.tensor([[2.0, 1.0], [1.0, 2.0]]))
    assert set(download.generator) == {k for k, _ in server.generator.named_parameters()}
    assert server.steps_done == 2 and math.isfinite(server.metrics()["generator_loss"])


def test_fedgen_generator_training_lowers_its_loss(cpu_trainer):
    """Sixty generator steps in a real round lower the generator loss against the untrained generator."""
    loop = _loop(FedGen(generator_steps=60, generator_batch_size=16), cpu_trainer)
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
    """Upload = head + int64 label counts; download = head + generator parameters + counts; nothing in round 0."""
    loop = _loop(FedGen(generator_steps=5), cpu_trainer)
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
    """In a real run the client takes the global head and its loss grows by the generated-feature term."""
    loop = _loop(FedGen(generator_steps=5), cpu_trainer)
    loop.run()
    module = loop.runtime.module("cnn_tiny")
    module.load_client_state(loop.store.get(0)["module"])
    module.on_receive(loop.server.download_for(0))
    assert torch.equal(module.model.head.weight, loop.server.global_head.weight)
    assert module.label_distribution is not None and not any(k.startswith("generator.") for k in module.client_state())
    x, y = next(iter(loop.scenario.train_loader(0, 0)))
    with seeded(0), torch.no_grad():
        regularised = float(module.local_loss((x, y)))
    module.label_distribution = None
    with torch.no_grad():
        plain = float(module.local_loss((x, y)))
    assert regularised > plain  # the generated-feature cross-entropy is added


def test_fedgen_server_rejects_bad_label_counts(cpu_trainer):
    """Negative label counts are refused."""
    loop = _loop(FedGen(generator_steps=5), cpu_trainer)
    head = {k: v.clone() for k, v in loop.server.global_head.state_dict().items()}
    bad = HeadCountsPayload(weights=head, label_counts=-torch.ones(10, dtype=torch.long), num_examples=4)
    with pytest.raises(TrainingError, match="label counts"):
        loop.server.check_upload(upload(0, bad))


def test_fedgen_client_never_trains_the_received_generator_and_counts_every_batch():
    """The generator is frozen on the client; the upload's counts cover all the batches."""
    client = FedGenClient(TinyLinear(), 2, FeatureGenerator(3, 2, 4, 2))
    assert not any(p.requires_grad for p in client.generator.parameters())
    sent = client.make_upload([(torch.zeros(2, 2), torch.tensor([0, 1])), (torch.zeros(1, 2), torch.tensor([1]))])
    assert sent.label_counts.tolist() == [1, 2] and sent.label_counts.dtype == torch.long


def test_fedgen_client_with_a_batch_of_one_draws_two_generated_labels_and_skips_the_latent_kl():
    """BatchNorm in the generator needs two samples: a single example draws two labels and has no latent KL."""
    generator = FeatureGenerator(3, 2, 4, 2)
    client = FedGenClient(TinyLinear(), 2, generator, generated_weight=0.5, latent_kl_weight=1.0)
    parameters = {k: v.detach().clone() for k, v in generator.named_parameters()}
    client.on_receive(FedGenDownload(head={"weight": torch.eye(2)}, generator=parameters,
                                     label_counts=torch.tensor([1, 3])))  # fmt: skip
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    torch.manual_seed(4)
    loss = client.local_loss((x, y))
    torch.manual_seed(4)
    labels = torch.multinomial(torch.tensor([1.0, 3.0], dtype=torch.float64), 2, replacement=True)
    client.generator.train()
    with torch.no_grad():
        features, _ = client.generator(labels)
    expected = math.log1p(math.exp(-1.0)) + 0.5 * torch.nn.functional.cross_entropy(features, labels).item()
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_fedgen_diversity_enters_at_weight_one_too():
    """At the paper's weight 1 the diversity term (1 for identical outputs) is added like at any other weight."""
    server = _server_after_two_uploads(diversity_weight=1.0)
    server.generator = _constant_generator([1.0, 0.0])
    expected = (math.log1p(math.exp(-1.5)) + math.log(2.0)) / 2 + 1.0
    assert server.generator_loss(torch.tensor([0, 1])).item() == pytest.approx(expected, abs=1e-6)


def test_fedgen_server_before_any_round_reports_no_loss_and_cannot_be_fitted():
    """No generator loss yet (NaN), and a fit before the first upload says so."""
    server = FedGenServer()
    server.setup_server(context(num_classes=2, initial=INITIAL_HEAD))
    assert all(math.isnan(value) for value in server.metrics().values())
    with pytest.raises(TrainingError) as error:
        server.server_dataloader(seed=0)
    assert str(error.value) == "FedGen's server was fitted before any upload arrived"


def test_fedgen_server_generator_follows_the_run_seed_and_client_zeros_head():
    """The generator's initialisation comes from the run seed; the head from client 0's initial state (frozen)."""
    def server(seed, clients=2):
        built = FedGenServer(noise_dim=3)
        built.setup_server(context(num_classes=2, num_clients=clients, seed=seed,
                                   initial=lambda cid: INITIAL_HEAD if cid == 0 else {}))  # fmt: skip
        return built

    a, b, c = server(0, clients=1), server(0), server(1)
    assert torch.equal(a.global_head.weight, torch.eye(2))
    assert not any(p.requires_grad for p in a.global_head.parameters())
    first, again, other = (dict(s.generator.named_parameters()) for s in (a, b, c))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_fedgen_server_builds_a_multilayer_head_from_the_first_architecture():
    """A head that is not one linear layer is copied from the factory's network of architecture 0."""
    from fedhet.models import create_model

    built = []

    def factory(architecture, seed):
        built.append((architecture, seed))
        network = create_model("lenet5", num_classes=3, in_channels=1, seed=0)
        factory.network = network
        return network

    shapes = create_model("lenet5", num_classes=3).state_dict()
    initial = {f"model.{k}": torch.full_like(v, 0.5) for k, v in shapes.items()}
    server = FedGenServer(noise_dim=3)
    server.setup_server(context(num_classes=3, seed=7, initial=initial, architectures=("lenet5", "other"),
                                model_factory=factory))  # fmt: skip
    assert built == [("lenet5", 7)]
    assert isinstance(server.global_head, torch.nn.Sequential) and server.global_head[0] is not factory.network.head[0]
    assert torch.equal(server.global_head[0].weight, torch.full((120, 400), 0.5))
    assert not torch.equal(factory.network.head[0].weight, torch.full((120, 400), 0.5))  # the factory's net untouched
    assert server.generator(torch.tensor([0, 1]))[0].shape == (2, 400)
    with pytest.raises(ConfigError) as error:
        FedGenServer().setup_server(context(num_classes=3, initial=initial))
    assert str(error.value) == ("FedGen needs the server context's model_factory to build a head that is not one "
                                "nn.Linear; build the ServerContext with model_factory=...")


def test_fedgen_server_refuses_uploads_by_name():
    """Wrong payloads, heads and label counts are refused naming the client; counts stay within what it holds."""
    from fedhet.core.payloads import ClassStatsPayload

    server = FedGenServer()
    server.setup_server(context(num_classes=2, initial=INITIAL_HEAD, label_counts=torch.tensor([[2, 2], [1, 0]])))
    head = {"weight": torch.eye(2), "bias": torch.zeros(2)}

    def refusal(client_id, payload):
        with pytest.raises(TrainingError) as error:
            server.check_upload(upload(client_id, payload))
        return str(error.value)

    server.check_upload(upload(0, HeadCountsPayload(weights=head, label_counts=torch.tensor([2, 2]))))
    wrong = ClassStatsPayload(values=torch.zeros(2, 2), counts=torch.tensor([1, 1]))
    assert refusal(0, wrong) == "client 0 sent ClassStatsPayload, expected a head with label counts (HeadCountsPayload)"
    assert refusal(1, HeadCountsPayload(weights=head, label_counts=torch.tensor([2, 0]))) == (
        "client 1 sent label counts inconsistent with its data (class 0: 2 examples, it holds 1)"
    )
    assert refusal(1, HeadCountsPayload(weights=head, label_counts=torch.tensor([1, 0, 0]))).startswith(
        "client 1 sent 'label_counts' of shape (3,), expected (2,)"
    )
    assert refusal(1, HeadCountsPayload(weights=head, label_counts=torch.tensor([1.0, 0.0]))) == (
        "client 1 sent invalid label counts (must be non-negative integers, int64)"
    )
    headless = HeadCountsPayload(weights={"weight": torch.eye(2)}, label_counts=torch.tensor([1, 0]))
    assert refusal(1, headless).startswith(
        "client 1 sent weights whose keys differ"
    )
    free = FedGenServer()
    free.setup_server(context(num_classes=2, initial=INITIAL_HEAD))  # no label counts known: any counts
    free.check_upload(upload(1, HeadCountsPayload(weights=head, label_counts=torch.tensor([9, 9]))))
