"""FedMD-CG, FedCG, FedPer and the paper's evaluation protocol (L.acc, G.acc) on tiny runs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import FedAvg, FedCG, FedMDCG, FedPer, PaperProtocol
from fedhet.algorithms.fedmdcg import FedMDCGClient, GeneratorClassifierPayload
from fedhet.errors import ConfigError, DataError, TrainingError
from fedhet.federation import FederationLoop
from fedhet.federation.trainer import TrainerTemplate
from fedhet.seeding import seeded
from tests.algorithms.helpers import state_digests
from tests.conftest import tiny_label_skew

SMALL = {"local_steps": 2, "server_steps": 3, "noise_dim": 8, "generator_hidden": (16, 16), "server_batch_size": 16}


def _scenario(**overrides):
    from fedhet.data import BalancedDirichletPartitioner

    kwargs = dict(
        partitioner=BalancedDirichletPartitioner(omega=0.5),
        pool_train_test=False,
        global_test_size=90,
        local_test="test_shards",
        local_test_fraction=0.0,
    )
    kwargs.update(overrides)
    return tiny_label_skew(**kwargs)


def _loop(algorithm, rounds=2, architectures=None, **kwargs):
    scenario = _scenario()
    scenario.setup()
    return FederationLoop(
        algorithm,
        scenario,
        architectures or ["cnn_tiny"] * scenario.num_clients,
        TrainerTemplate(max_epochs=1, accelerator="cpu"),
        rounds=rounds,
        **kwargs,
    )


def _client(algorithm=None, round_idx=0, total_rounds=10):
    """A FedMD-CG client module around cnn_tiny (16 features, 10 classes)."""
    from fedhet.models import create_model

    algorithm = algorithm or FedMDCG(**SMALL)
    client = algorithm.build_client(create_model("cnn_tiny", 10, seed=0), 10)
    client.round_idx, client.total_rounds = round_idx, total_rounds
    return algorithm, client


def _download(client: FedMDCGClient, seed=3):
    with seeded(seed):
        generator = {k: v + 0.1 * torch.randn_like(v) if v.is_floating_point() else v
                     for k, v in client.generator.state_dict().items()}
        classifier = {k: torch.randn_like(v) for k, v in client.model.head.state_dict().items()}
    counts = torch.tensor([5, 0, 3, 1, 0, 0, 2, 0, 0, 4])
    return GeneratorClassifierPayload(generator=generator, classifier=classifier, label_counts=counts)


# ------------------------------------------------------------------ client losses
def test_stage_one_is_plain_cross_entropy_in_the_first_round_and_without_a_download():
    """lambda_k(r=1) = 0 and nothing received: exactly CE (Algorithm 1, App. C)."""
    _, client = _client(round_idx=0)
    client.on_receive(_download(client))
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 2, 3, 9])
    expected = F.cross_entropy(client.model(x), y)
    torch.testing.assert_close(client.model_update_loss(x, y), expected)
    _, later = _client(round_idx=5)
    later.on_receive(None)
    torch.testing.assert_close(later.model_update_loss(x, y), F.cross_entropy(later.model(x), y))


def test_stage_one_loss_recomposed_from_its_terms():
    """Eq. 4 at round 6 of 10 (ramp 0.5) with lambda_1,2,3 = 1, 0.5, 2: CE + r(l1 CE_gen + l2 MSE + l3 KL)."""
    algorithm = FedMDCG(**SMALL, lambda_generated_ce=1.0, lambda_feature_mse=0.5, lambda_logit_kl=2.0)
    _, client = _client(algorithm, round_idx=5, total_rounds=10)
    client.on_receive(_download(client))
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 2, 3, 9])
    with seeded(7):
        got = client.model_update_loss(x, y)
    with seeded(7):
        features = client.model.forward_features(x)
        logits = client.model.forward_head(features)
        client.global_generator.eval()
        generated, _ = client.global_generator(y)
        target = F.softmax(client.model.forward_head(generated), 1)
        kl = (target * (target.log() - F.log_softmax(logits, 1))).sum(1).mean()
        mse = ((features - generated) ** 2).mean()
        labels = torch.multinomial(torch.tensor([5, 0, 3, 1, 0, 0, 2, 0, 0, 4]).double(), 64, replacement=True)
        sampled, _ = client.global_generator(labels)
        ce_gen = F.cross_entropy(client.model.forward_head(sampled), labels)
        assert set(labels.tolist()) <= {0, 2, 3, 6, 9}  # only labels some client holds
    expected = F.cross_entropy(logits, y) + 0.5 * (1.0 * ce_gen + 0.5 * mse + 2.0 * kl)
    torch.testing.assert_close(got, expected)


def test_stage_two_loss_recomposed_and_gradients_reach_only_the_local_generator():
    """Eq. 9: KL + l4 MSE + l5 CE + l6 div2; F_i and D_i frozen, gradient flows through D_i into G_i."""
    _, client = _client()
    client.stage = "generator"
    client.on_train_start()
    x, y = torch.randn(6, 3, 16, 16), torch.tensor([0, 1, 1, 2, 3, 3])
    with seeded(2):
        loss = client.generator_update_loss(x, y)
    parts = client.last_parts
    assert loss.item() == pytest.approx(parts["kl"] + parts["mse"] + parts["ce"] + parts["div"], rel=1e-5)
    loss.backward()
    assert all(p.grad is None for p in client.model.parameters())
    assert all(p.grad is not None for p in client.generator.parameters())
    assert all(p.grad is None for p in client.global_generator.parameters())
    client.on_train_end()
    assert all(p.requires_grad for p in client.model.parameters())


def test_stage_one_gradients_never_reach_the_global_generator():
    """G is a frozen target in stage 1."""
    _, client = _client(round_idx=5)
    client.on_receive(_download(client))
    client.stage = "model"
    client.on_train_start()
    client.model_update_loss(torch.randn(4, 3, 16, 16), torch.tensor([0, 2, 3, 9])).backward()
    assert all(p.grad is None for p in client.global_generator.parameters())
    assert all(p.grad is None for p in client.generator.parameters())
    assert all(p.grad is not None for p in client.model.parameters())


def test_download_overwrites_the_classifier_exactly_and_leaves_the_local_generator():
    """D_i <- D; G is received into the frozen copy; G_i is not replaced (paper)."""
    _, client = _client()
    local_generator = {k: v.clone() for k, v in client.generator.state_dict().items()}
    download = _download(client)
    client.on_receive(download)
    for key, value in download.classifier.items():
        assert torch.equal(client.model.head.state_dict()[key], value)
    for key, value in download.generator.items():
        assert torch.equal(client.global_generator.state_dict()[key], value)
    assert all(torch.equal(client.generator.state_dict()[k], v) for k, v in local_generator.items())
    assert client.label_distribution is not None and client.has_global


def test_upload_never_carries_the_feature_extractor():
    """(G_i, D_i) and the label counts only."""
    _, client = _client()
    batches = [(torch.randn(3, 3, 16, 16), torch.tensor([1, 1, 4]))]
    upload = client.make_upload(batches)
    extractor = {k for k in client.model.state_dict() if not k.startswith("head.")}
    assert set(upload.classifier) == set(client.model.head.state_dict())
    assert set(upload.generator) == set(client.generator.state_dict())
    assert not extractor & (set(upload.classifier) | set(upload.generator))
    assert upload.label_counts.tolist() == [0, 2, 0, 0, 1, 0, 0, 0, 0, 0]


# ------------------------------------------------------------------ server
def test_server_average_then_each_crossed_term_trains_only_its_side():
    """After one round: (G, D) is the example-weighted average; L_kl,2 never touches G, L_kl,3 never D."""
    loop = _loop(FedMDCG(**{**SMALL, "server_steps": 1}), rounds=1)
    loop.run()
    server = loop.server
    tau = server.round_tau
    assert torch.allclose(tau.sum(0)[tau.sum(0) > 0], torch.ones(int((tau.sum(0) > 0).sum())))
    counts = torch.stack([torch.bincount(loop.scenario.client_data(c).train.y, minlength=10) for c in range(3)])
    assert server.round_counts.tolist() == counts.sum(0).double().tolist()  # p(y) from the summed counters
    labels = torch.tensor([0, 1, 2, 3])
    for terms, trained, untouched in (((False, True, False), "classifier", "generator"),
                                      ((False, False, True), "generator", "classifier")):
        server.zero_grad(set_to_none=True)
        server.terms = terms
        server.distillation_loss(labels).backward()
        assert all(p.grad is None for p in getattr(server, untouched).parameters()), terms
        assert any(p.grad is not None for p in getattr(server, trained).parameters()), terms
        for generator, classifier in server.teachers:
            assert all(p.grad is None for p in [*generator.parameters(), *classifier.parameters()])


def test_server_weighted_average_by_hand():
    """Two uploads with 1 and 3 examples: the average is 1/4 A + 3/4 B."""
    loop = _loop(FedMDCG(**{**SMALL, "aggregation": "ave"}), rounds=1)
    server = loop.server
    gen = {k: v.clone() for k, v in server.generator.state_dict().items()}
    cls = {k: v.clone() for k, v in server.classifier.state_dict().items()}
    a_cls = {k: torch.zeros_like(v) for k, v in cls.items()}
    b_cls = {k: torch.full_like(v, 4.0) for k, v in cls.items()}
    from fedhet.algorithms.base import ClientUpload

    counts = torch.tensor([1] + [0] * 9)
    uploads = [
        ClientUpload(0, "cnn_tiny", GeneratorClassifierPayload(num_examples=1, generator=gen, classifier=a_cls,
                                                               label_counts=counts)),
        ClientUpload(1, "cnn_tiny", GeneratorClassifierPayload(num_examples=3, generator=gen, classifier=b_cls,
                                                               label_counts=3 * counts)),
    ]
    server.aggregate(0, uploads)
    assert all(torch.allclose(v, torch.full_like(v, 3.0)) for v in server.classifier.state_dict().values())
    assert not server.should_refine()  # AVE_agg: no distillation
    torch.testing.assert_close(server.round_tau[:, 0], torch.tensor([0.25, 0.75]))
    bad = GeneratorClassifierPayload(num_examples=1, generator=gen, classifier=a_cls, label_counts=torch.ones(3).long())
    with pytest.raises(TrainingError, match="label_counts"):
        server.check_upload(ClientUpload(0, "cnn_tiny", bad))


# ------------------------------------------------------------------ whole runs
def test_fedmdcg_run_reports_lacc_and_gacc_and_keeps_local_generators():
    """acc_local (L.acc, before download) and acc_server (G.acc) are reported; G_i differs from G."""
    loop = _loop(FedMDCG(**SMALL), rounds=2)
    summary = loop.run()
    record = loop.history[-1]
    assert "acc_local" in record and "acc_server" in record and "server/virtual_global/acc" in record
    assert 0 <= summary["final"]["acc_server"] <= 100
    state = loop.store.get(0)["module"]
    assert not any(k.startswith("global_generator.") for k in state)
    local = {k[len("generator."):]: v for k, v in state.items() if k.startswith("generator.")}
    global_state = loop.server.generator.state_dict()
    assert any(not torch.equal(v, global_state[k]) for k, v in local.items() if v.is_floating_point())
    assert record["server/distill_loss"] >= 0 and math.isfinite(record["train/generator_loss"])


def test_virtual_global_model_is_the_example_weighted_average_of_client_models():
    """With FedAvg under the paper's protocol, the virtual global model equals FedAvg's new global model."""
    loop = _loop(PaperProtocol(FedAvg(lr=0.05)), rounds=1)
    loop.run()
    virtual = loop.algorithm.evaluation_models(loop.server, loop.client_states())["virtual_global"].state_dict()
    for key, value in loop.server.global_weights.items():
        torch.testing.assert_close(virtual[key], value)
    assert "acc_server" in loop.history[-1] and "acc_local" in loop.history[-1]


def test_identical_client_initialisation():
    """Every client starts from client 0's weights under FedMD-CG (its G.acc needs it)."""
    loop = _loop(FedMDCG(**SMALL), rounds=1)
    first = state_digests(loop.runtime.initial_state(0)["module"])
    assert state_digests(loop.runtime.initial_state(2)["module"]) == first
    plain = _loop(FedAvg(), rounds=1)
    own = [state_digests(plain.runtime.initial_state(c)["module"]) for c in (0, 2)]
    assert own[0] != own[1]


def test_fedmdcg_resume_equals_uninterrupted():
    """A run stopped after round 1 and resumed from its checkpoint ends with identical states and numbers."""
    whole = _loop(FedMDCG(**SMALL), rounds=3)
    summary = whole.run()
    first = _loop(FedMDCG(**SMALL), rounds=3)
    first.history.append(first.run_round(0))
    first.next_round = 1
    first.store.prune()
    checkpoint = first.checkpoint_state()
    resumed = _loop(FedMDCG(**SMALL), rounds=3)
    resumed.load_checkpoint_state(checkpoint)
    assert resumed.run()["final"] == summary["final"]
    for cid in range(3):
        assert state_digests(resumed.store.get(cid)) == state_digests(whole.store.get(cid))
    assert state_digests(resumed.server.server_state()) == state_digests(whole.server.server_state())


def test_same_seed_same_numbers():
    """Two identical FedMD-CG runs give identical histories."""
    a = _loop(FedMDCG(**SMALL), rounds=2)
    b = _loop(FedMDCG(**SMALL), rounds=2)
    a.run()
    b.run()
    keys = [k for k in a.history[-1] if k.startswith(("acc", "train/", "server/"))]
    assert [a.history[-1][k] for k in keys] == [b.history[-1][k] for k in keys]


@pytest.mark.parametrize("aggregation", ["kd", "ave"])
def test_table3_aggregation_switches_run(aggregation):
    """KD_agg and AVE_agg (and feature-only transfer) run end to end."""
    loop = _loop(FedMDCG(**SMALL, aggregation=aggregation, knowledge_transfer="feature"), rounds=2)
    loop.run()
    assert ("server/distill_loss" in loop.history[-1]) == (aggregation == "kd")


def test_bad_switch_is_one_line_config_error():
    """A misspelt switch fails at construction with the allowed values."""
    with pytest.raises(ConfigError, match="aggregation='kdcc'"):
        FedMDCG(aggregation="kdcc")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="generator_hidden"):
        FedMDCG(generator_hidden=(0, 4))


# ------------------------------------------------------------------ baselines
def test_fedper_shares_the_base_and_keeps_personal_heads():
    """After a round every client holds the same base layers, and its own head; heads are never uploaded."""
    loop = _loop(PaperProtocol(FedPer(lr=0.05)), rounds=2)
    loop.run()
    download = loop.server.download_for(0)
    assert download is not None and not any(k.startswith("head.") for k in download.weights)
    states = [loop.store.get(c)["module"] for c in range(3)]
    heads = [states[c]["model.head.weight"] for c in range(3)]
    assert not torch.equal(heads[0], heads[1])
    module = loop.runtime.module("cnn_tiny")
    module.load_client_state(states[1])
    module.on_receive(download)
    assert torch.equal(module.model.head.weight, heads[1])
    for key, value in download.weights.items():
        assert torch.equal(module.model.state_dict()[key], value)


def test_fedcg_cgan_run_and_generator_is_shared():
    """FedCG runs (cGAN stage, KD_agg server); the downloaded G replaces G_i; the discriminator is a sigmoid."""
    loop = _loop(FedCG(**{k: v for k, v in SMALL.items()}), rounds=2)
    loop.run()
    module = loop.runtime.module("cnn_tiny")
    module.load_client_state(loop.store.get(0)["module"])
    download = loop.server.download_for(0)
    module.on_receive(download)
    assert all(torch.equal(module.generator.state_dict()[k], v) for k, v in download.generator.items())
    labels = torch.tensor([0, 1, 2, 3, 4])
    scores = module.discriminator(torch.randn(5, module.model.num_features), labels)
    assert scores.shape == (5, 1) and bool(((scores > 0) & (scores < 1)).all())
    assert loop.history[-1]["server/distill_loss"] >= 0 and "acc_server" in loop.history[-1]
    assert loop.server.hp.server_loss_form == "hinton" and loop.server.hp.server_lr == pytest.approx(2e-4)
    with pytest.raises(ConfigError, match="server_loss_form"):
        FedCG(server_loss_form="sum")  # type: ignore[arg-type]


def test_fedcg_discriminator_is_conditioned_on_the_label():
    """FedCG's cGAN: the discriminator reads [h, onehot(y)]; the FedMD-CG authors' baseline reads h only."""
    from fedhet.algorithms.fedcg import LatentDiscriminator

    head = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 10))
    conditional = LatentDiscriminator(head, 10)
    assert conditional.body[0].in_features == 14 and conditional.body[-1].out_features == 1
    features = torch.randn(2, 4)
    same = torch.tensor([1, 1])
    # with the first layer's label columns set by hand, the label alone changes the score
    with torch.no_grad():
        conditional.body[0].weight[:, 4:] = 0.0
        conditional.body[0].weight[:, 5] = 1.0  # class 1 adds 1 to every hidden pre-activation
    scores_1 = conditional(features, same)
    scores_0 = conditional(features, torch.tensor([0, 0]))
    assert not torch.allclose(scores_1, scores_0)
    with pytest.raises(ValueError, match="labels"):
        conditional(features)
    blind = LatentDiscriminator(head, 10, conditional=False)
    assert blind.body[0].in_features == 4
    assert torch.equal(blind(features), blind(features, same))
    assert not torch.equal(head[0].weight, blind.body[0].weight)  # freshly initialised, not the head


# ------------------------------------------------------------------ data
def test_test_shards_are_disjoint_class_balanced_and_cover_the_global_test():
    """local_test='test_shards': each client's test split is a stratified shard of the global test set."""
    scenario = _scenario(num_clients=3, global_test_size=90)
    scenario.setup()
    global_test = scenario.eval_sets("test")["global"]
    shards = [scenario.client_data(c).test for c in range(3)]
    assert sum(len(s) for s in shards) == len(global_test) == 90
    for shard in shards:
        counts = torch.bincount(shard.y, minlength=10)
        assert int(counts.max() - counts.min()) <= 1
    with pytest.raises(DataError, match="pool_train_test"):
        tiny_label_skew(local_test="test_shards")


# ------------------------------------------------------------------ the paper's protocol around any base
def test_paper_protocol_forwards_everything_to_its_base():
    """PaperProtocol changes what is measured only; everything else is its base's.

    Hyperparameters, payload types, clients, phases and the scenario's format are the base's; every client starts
    from client 0's initialisation.
    """
    from fedhet.algorithms.base import DataFormat
    from fedhet.models import create_model

    base = FedPer(lr=0.05)
    protocol = PaperProtocol(base)
    assert protocol.hp is base.hp and protocol.name == base.name
    assert (protocol.upload_type, protocol.download_type) == (base.upload_type, base.download_type)
    assert [protocol.initialisation_of(c) for c in (0, 1, 7)] == [0, 0, 0]
    data_format = DataFormat(image_size=16, channels=1, mean=(0.5,), std=(0.5,), num_classes=7)
    protocol.configure(data_format)
    assert protocol.data_format is data_format and base.data_format is data_format
    client = protocol.build_client(create_model("cnn_tiny", 7, seed=0), 7)
    assert type(client) is type(base.build_client(create_model("cnn_tiny", 7, seed=0), 7)) and client.num_classes == 7
    seen = []
    base.build_collaborative_phase = lambda clients: seen.append(clients) or "phase"  # type: ignore[method-assign]
    assert protocol.build_collaborative_phase(["c0", "c1"]) == "phase" and seen == [["c0", "c1"]]
    loop = _loop(PaperProtocol(FedAvg(lr=0.05)), rounds=1)
    first = state_digests(loop.runtime.initial_state(0)["module"])
    assert state_digests(loop.runtime.initial_state(2)["module"]) == first


def test_client_keyword_overrides_and_a_fresh_clients_loss_parts():
    """A client reused on its own takes keyword overrides of its hyperparameters.

    Before any stage-2 step it has no loss parts to log (an empty dict, not None).
    """
    from fedhet.models import create_model

    algorithm = FedMDCG(**SMALL)
    model = create_model("cnn_tiny", 10, seed=0)
    client = FedMDCGClient(model, 10, algorithm.make_generator(16, 10), algorithm.hp, lambda_logit_kl=3.0)
    assert client.hp.lambda_logit_kl == 3.0 and algorithm.hp.lambda_logit_kl != 3.0
    assert client.last_parts == {}


def test_ramp_power_shapes_the_stage_one_ramp():
    """lambda(r) = (round_idx / R) ** power (App. C): round 6 of 10 with power 2 gives 0.25, power 1 gives 0.5."""
    _, linear = _client(FedMDCG(**SMALL), round_idx=5, total_rounds=10)
    _, squared = _client(FedMDCG(**SMALL, ramp_power=2.0), round_idx=5, total_rounds=10)
    assert linear.ramp() == 0.5 and squared.ramp() == 0.25


def test_zero_generated_ce_weight_draws_no_labels():
    """With lambda_1 = 0 the generated-sample CE is off even with a label distribution.

    The loss is CE plus the other two terms, and no random labels are drawn (the run's random stream is untouched).
    """
    algorithm = FedMDCG(**SMALL, lambda_generated_ce=0.0, lambda_feature_mse=0.5, lambda_logit_kl=2.0)
    _, client = _client(algorithm, round_idx=5, total_rounds=10)
    client.on_receive(_download(client))
    assert client.label_distribution is not None
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 2, 3, 9])
    with seeded(7):
        got = client.model_update_loss(x, y)
        stream_after_loss = torch.get_rng_state()
    with seeded(7):
        features = client.model.forward_features(x)
        logits = client.model.forward_head(features)
        generated, _ = client.global_generator(y)  # the only draw: the generator's noise
        stream_after_expected = torch.get_rng_state()
    target = F.softmax(client.model.forward_head(generated), 1)
    kl = (target * (target.log() - F.log_softmax(logits, 1))).sum(1).mean()
    expected = F.cross_entropy(logits, y) + 0.5 * (0.5 * ((features - generated) ** 2).mean() + 2.0 * kl)
    torch.testing.assert_close(got, expected)
    assert torch.equal(stream_after_loss, stream_after_expected)
