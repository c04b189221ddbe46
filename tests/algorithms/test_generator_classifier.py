"""The generator-and-classifier frame FedMD-CG and FedCG share (``shared/generators.py``), piece by piece.

The one-step oracles (``test_oracle_fedmdcg.py``, ``test_oracle_fedcg.py``) pin the losses and
steps; these tests pin the frame around them: the generator's noise, the upload checks and their
messages, the server's set-up, bookkeeping and reports, and the method's generator factory.
"""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import pytest
import torch

from fedhet.algorithms import FedCG, FedMDCG
from fedhet.algorithms.base import ClientUpload, LocalStage, ServerContext
from fedhet.algorithms.shared.generators import ConditionalFeatureGenerator, GeneratorClassifierPayload
from fedhet.core.payloads import WeightsPayload
from fedhet.errors import ConfigError, TrainingError
from fedhet.federation.trainer import silence_lightning
from tests.algorithms.helpers import fit, one_batch_loader
from tests.algorithms.oracle import TinyBNNet
from tests.algorithms.test_oracle_fedmdcg import CHANNELS, FORMAT, SIZE, TINY, M

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_generator_draws_gaussian_noise_by_default_and_refuses_other_kinds():
    """``N(0, I)`` unless ``noise="uniform"`` (``U[0, 1)``); any other kind is named in one line."""
    generator = ConditionalFeatureGenerator(3, 2, 4, (5, 5))
    assert generator.noise == "gaussian"
    torch.manual_seed(0)
    drawn = generator.sample_noise(4, "cpu")
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.randn(4, 3))
    with pytest.raises(ConfigError) as error:
        ConditionalFeatureGenerator(3, 2, 4, noise="normal")
    assert str(error.value) == "noise='normal': use 'gaussian' or 'uniform'"


def test_generator_hidden_widths_are_two_positive_integers():
    """Widths of 1 are accepted; a zero width or three widths are refused by value."""
    FedMDCG(generator_hidden=(1, 1))
    with pytest.raises(ConfigError) as error:
        FedMDCG(generator_hidden=(0, 4))
    assert str(error.value) == "FedMDCG: generator_hidden=[0, 4]: give two positive widths"


def _algorithm(method=FedMDCG, **hp):
    shared = {k: v for k, v in TINY.items() if k in method.hparam_names()}
    algorithm = method(**{**shared, **hp})
    algorithm.configure(FORMAT)
    return algorithm


def _client(method=FedMDCG, **hp):
    torch.manual_seed(0)
    return _algorithm(method, **hp).build_client(TinyBNNet(CHANNELS, M, seed=3), M)


def _server(algorithm, clients=3, label_counts=None, factory=None):
    state = _client_of(algorithm).client_state()
    context = ServerContext(
        num_clients=clients,
        num_classes=M,
        architectures=("tiny",) * clients,
        seed=5,
        initial_client_state=lambda cid: state if cid == 0 else {},
        data_format=FORMAT,
        model_factory=factory or (lambda architecture, seed: TinyBNNet(CHANNELS, M, seed=seed)),
        label_counts=label_counts,
    )
    server = algorithm.build_server()
    server.setup_server(context)
    return server


def _client_of(algorithm):
    torch.manual_seed(0)
    return algorithm.build_client(TinyBNNet(CHANNELS, M, seed=3), M)


def test_a_client_trains_its_two_stages_for_local_steps_and_never_its_copy_of_the_global_generator():
    """Both stages take ``local_steps``; ``G`` is frozen; after a stage every part trains again."""
    client = _client(local_steps=4)
    assert tuple(client.local_stages()) == (LocalStage("model", steps=4), LocalStage("generator", steps=4))
    assert not any(p.requires_grad for p in client.global_generator.parameters())
    x = torch.rand(4, CHANNELS, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    for stage in ("model", "generator"):
        client.on_receive(None)  # no download: stage 1 is plain cross-entropy
        client.stage = stage
        fit(client, one_batch_loader(x, torch.tensor([0, 1, 2, 3])))
        assert all(p.requires_grad for p in client.model.parameters()), stage
        assert all(p.requires_grad for p in client.generator.parameters()), stage


def test_a_client_logs_the_loss_it_trains_on(tmp_path):
    """``train/loss`` of a stage-1 step is the loss the step returned."""
    from lightning.pytorch.loggers import CSVLogger

    silence_lightning()
    client = _client()
    client.stage = "model"
    returned = []

    class Recorder(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            returned.append(float(outputs["loss"]))

    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=CSVLogger(tmp_path), enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[Recorder()])  # fmt: skip
    x = torch.rand(4, CHANNELS, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    trainer.fit(client, one_batch_loader(x, torch.tensor([0, 1, 2, 3])))
    assert float(trainer.logged_metrics["train/loss_step"]) == pytest.approx(returned[0], rel=1e-6)


def test_fedcg_names_the_stage_loss_it_does_not_define():
    """FedCG trains its generator in its own training step; the frame's stage-2 loss says who must define it."""
    with pytest.raises(NotImplementedError) as error:
        _client(FedCG).generator_update_loss(torch.zeros(1), torch.zeros(1))
    assert str(error.value) == "FedCGClient must define generator_update_loss()"


def test_the_method_builds_generators_once_it_knows_features_and_classes():
    """Every party's generator starts from client 0's initialisation; unknown sizes are named in one line."""
    algorithm = _algorithm()
    assert algorithm.initialisation_of(2) == 0
    with pytest.raises(ConfigError) as error:
        algorithm.make_generator()
    assert str(error.value) == "FedMDCG: build a client before the server (feature size unknown)"
    unconfigured = FedMDCG(**TINY)
    with pytest.raises(ConfigError) as error:
        unconfigured.make_generator(feature_dim=5)
    assert str(error.value) == "FedMDCG: build a client before the server (feature size unknown)"
    assert unconfigured.make_generator(feature_dim=5, num_classes=3).num_classes == 3


def test_the_server_needs_a_factory_and_builds_its_classifier_from_client_zero_without_touching_the_factorys():
    """The global classifier is a deep copy of the factory network's head loaded with client 0's initial head."""
    built = []

    def factory(architecture, seed):
        network = TinyBNNet(CHANNELS, M, seed=seed)
        built.append(network)
        return network

    algorithm = _algorithm()
    server = _server(algorithm, clients=1, factory=factory)
    head = TinyBNNet(CHANNELS, M, seed=5).head.state_dict()  # what the factory built (run seed 5)
    initial = _client_of(algorithm).model.head.state_dict()
    assert all(torch.equal(server.classifier.state_dict()[k], initial[k]) for k in initial)
    assert all(torch.equal(built[0].head.state_dict()[k], head[k]) for k in head)  # the factory's net untouched
    assert server.metrics() == {}
    with pytest.raises(ConfigError) as error:
        algorithm.build_server().setup_server(
            ServerContext(num_clients=1, num_classes=M, architectures=("tiny",), seed=0,
                          initial_client_state=lambda cid: {})  # fmt: skip
        )
    assert str(error.value) == (
        "GeneratorClassifierServer (the server of FedMD-CG and FedCG) needs the server context's model_factory "
        "to build the global classifier; build the ServerContext with model_factory=..."
    )


def _payload(client, counts=(1, 1, 1, 1), examples=4):
    return GeneratorClassifierPayload(
        generator={k: v.clone() for k, v in client.generator.state_dict().items()},
        classifier={k: v.clone() for k, v in client.model.head.state_dict().items()},
        label_counts=torch.tensor(counts),
        num_examples=examples,
    )


def test_the_server_refuses_uploads_by_name():
    """The payload type, generator and classifier layouts and label counts: one line each, naming the client."""
    algorithm = _algorithm()
    client = _client_of(algorithm)
    server = _server(algorithm, label_counts=torch.tensor([[2, 2, 2, 2], [1, 0, 0, 0], [1, 1, 1, 1]]))
    server.check_upload(ClientUpload(0, "tiny", _payload(client, (2, 2, 2, 2))))

    def refusal(payload, client_id=1):
        with pytest.raises(TrainingError) as error:
            server.check_upload(ClientUpload(client_id, "tiny", payload))
        return str(error.value)

    good = _payload(client, (1, 0, 0, 0))
    assert refusal(WeightsPayload(weights={})) == (
        "client 1 sent WeightsPayload, expected (G_i, D_i) (GeneratorClassifierPayload)"
    )
    assert refusal(dataclasses.replace(good, generator={})).startswith(
        "client 1 sent generator whose keys differ from the global generator"
    )
    assert refusal(dataclasses.replace(good, classifier={})).startswith(
        "client 1 sent classifier whose keys differ from the global classifier"
    )
    assert refusal(dataclasses.replace(good, label_counts=torch.tensor([1, 1, 0, 0]))) == (
        "client 1 sent label counts inconsistent with its data (class 1: 1 examples, it holds 0)"
    )
    assert refusal(dataclasses.replace(good, label_counts=torch.tensor([1, 0, 0]))).startswith(
        "client 1 sent 'label_counts' of shape (3,), expected (4,)"
    )
    assert refusal(dataclasses.replace(good, label_counts=torch.tensor([1.0, 0.0, 0.0, 0.0]))) == (
        "client 1 sent invalid label counts (must be non-negative integers, int64)"
    )
    free = _server(algorithm)  # no label counts known: any counts
    free.check_upload(ClientUpload(1, "tiny", _payload(client, (9, 9, 9, 9))))


def test_the_server_keeps_frozen_teachers_counts_and_a_round_counter():
    """After an aggregate: one frozen teacher pair per upload (none under ``ave``), int64 counts, one round counted."""
    algorithm = _algorithm()
    client = _client_of(algorithm)
    server = _server(algorithm)
    uploads = [ClientUpload(cid, "tiny", _payload(client)) for cid in range(2)]
    server.aggregate(0, uploads)
    assert int(server.rounds_aggregated) == 1 and server.should_refine() and len(server.teachers) == 2
    for generator, classifier in server.teachers:
        assert not any(p.requires_grad for p in [*generator.parameters(), *classifier.parameters()])
    download = server.download_for(0)
    assert download.label_counts.dtype == torch.long and download.label_counts.tolist() == [2, 2, 2, 2]
    plain = _server(_algorithm(aggregation="ave"))
    plain.aggregate(0, uploads)
    assert plain.teachers == [] and not plain.should_refine()
    with pytest.raises(TrainingError) as error:
        _server(algorithm).server_dataloader(seed=0)
    assert str(error.value) == "FedMD-CG's server was fitted before any upload arrived"


def test_the_server_reports_its_first_and_last_distillation_loss_of_the_round():
    """``distill_loss_first`` is the round's first step's loss, ``distill_loss`` its last."""
    algorithm = _algorithm(server_steps=3)
    client = _client_of(algorithm)
    server = _server(algorithm)
    server.aggregate(0, [ClientUpload(cid, "tiny", _payload(client)) for cid in range(2)])
    losses = []

    class Recorder(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    silence_lightning()
    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[Recorder()])  # fmt: skip
    trainer.fit(server, server.server_dataloader(seed=0))
    assert len(losses) == 3 and server.steps_done == 3
    assert server.metrics() == pytest.approx({"distill_loss_first": losses[0], "distill_loss": losses[2]})
