"""FCCL+ and FCCL mechanics: lock-step collaboration, teacher snapshots, averaging, pretraining."""

from __future__ import annotations

import pytest
import torch

from fedhet.algorithms.fccl import FCCL, FCCLClient
from fedhet.algorithms.fccl_plus import CrossCorrelationCollaboration, FCCLPlus, FCCLPlusClient, PublicOutputsPayload
from fedhet.errors import ConfigError, TrainingError
from fedhet.federation import FederationLoop
from fedhet.federation.runtime import ClientTask
from fedhet.federation.trainer import TrainerTemplate
from fedhet.models import create_model
from tests.conftest import tiny_domain_shift


def _loop(algorithm, architectures=("cnn_tiny", "mlp_tiny", "cnn_tiny"), rounds=1, seed=0):
    scenario = tiny_domain_shift()  # 3 clients, 32 private images each, 64 public images in batches of 32
    return FederationLoop(
        algorithm, scenario, list(architectures), TrainerTemplate(max_epochs=1, accelerator="cpu"), rounds=rounds, seed=seed
    )


def _client(name, seed):
    return FCCLPlusClient(create_model(name, num_classes=10, in_channels=3, seed=seed), 10)


def test_averaged_targets_carry_no_gradient_to_other_clients():
    clients = [_client("cnn_tiny", 0), _client("mlp_tiny", 1)]
    phase = CrossCorrelationCollaboration(clients)
    losses = phase.collaborative_losses(torch.randn(8, 3, 16, 16))
    losses[0].backward()
    assert any(p.grad is not None for p in clients[0].model.parameters())
    assert all(p.grad is None for p in clients[1].model.parameters())


def test_exchanged_bytes_follow_the_spec():
    loop = _loop(FCCLPlus())
    tasks = [ClientTask(c, 0, None, None) for c in range(3)]
    result = loop.runtime.collaborate(0, tasks)
    # 2 public batches of B = 32, C = 10, K = 3: per client and batch Z (B x C) and S (B x (B-1))
    # float32 up, and Zbar, Sbar down
    expected = 3 * 2 * (32 * 10 + 32 * 31) * 4
    assert result.bytes_up == expected and result.bytes_down == expected
    fccl = _loop(FCCL(pretrain_epochs=0))
    fccl.runtime.collaborate(0, tasks)  # clients not pretrained yet: nothing exchanged
    assert fccl.runtime.collaborate(0, tasks).bytes_up == 0


def test_invalid_public_outputs_are_rejected():
    good = PublicOutputsPayload(logits=torch.zeros(4, 10), similarity=torch.zeros(4, 3))
    good.validate_shape(4, 10, True, "participant 0")
    with pytest.raises(TrainingError, match="non-finite"):
        PublicOutputsPayload(logits=torch.full((4, 10), float("nan")), similarity=torch.zeros(4, 3)).validate_shape(
            4, 10, True, "participant 0"
        )
    with pytest.raises(TrainingError, match="shape"):
        PublicOutputsPayload(logits=torch.zeros(4, 10), similarity=torch.zeros(4, 4)).validate_shape(
            4, 10, True, "participant 0"
        )


class RecordingCollaboration(CrossCorrelationCollaboration):
    """Records the public batch each client's feature extractor receives."""

    seen: list[list[torch.Tensor]] = []

    def collaborative_losses(self, x):
        batch = []
        for client in self.clients:
            original = type(client.model).forward_features.__get__(client.model)

            def record(inputs, original=original):
                batch.append(inputs.detach().clone())
                return original(inputs)

            client.model.forward_features = record
        try:
            return super().collaborative_losses(x)
        finally:
            for client in self.clients:
                del client.model.forward_features
            RecordingCollaboration.seen.append(batch)


class RecordingFCCLPlus(FCCLPlus):
    def build_collaborative_phase(self, clients):
        return RecordingCollaboration(clients)


def test_all_clients_receive_the_identical_public_batch():
    RecordingCollaboration.seen = []
    loop = _loop(RecordingFCCLPlus())
    loop.runtime.collaborate(0, [ClientTask(c, 0, None, None) for c in range(3)])
    assert len(RecordingCollaboration.seen) == 2
    for batch in RecordingCollaboration.seen:
        assert len(batch) == 3 and all(torch.equal(batch[0], other) for other in batch[1:])
    assert not torch.equal(RecordingCollaboration.seen[0][0], RecordingCollaboration.seen[1][0])


def test_teacher_is_the_model_after_local_updating():
    loop = _loop(FCCLPlus())
    loop.run()
    for cid in range(3):
        state = loop.store.get(cid)["module"]
        initial = loop.runtime.initial_state(cid)["module"]
        model = {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}
        teacher = {k[len("previous_model.") :]: v for k, v in state.items() if k.startswith("previous_model.")}
        assert model.keys() == teacher.keys()
        assert all(torch.equal(model[k], teacher[k]) for k in model)
        # and it moved: the round-0 teacher was the initial (random) model
        assert not torch.equal(state["model.head.weight"], initial["previous_model.head.weight"])
        assert torch.equal(initial["model.head.weight"], initial["previous_model.head.weight"])


def test_homogeneous_variant_makes_all_models_equal_after_collaboration():
    loop = _loop(FCCLPlus(average_after_collaboration=True), architectures=("cnn_tiny",) * 3)
    states = loop.runtime.collaborate(0, [ClientTask(c, 0, None, None) for c in range(3)]).states
    models = [{k: v for k, v in s["module"].items() if k.startswith("model.")} for s in states]
    for key, value in models[0].items():
        assert all(torch.equal(value, other[key]) for other in models[1:]), key
    # the teachers stay each client's own (different initialisations)
    assert not torch.equal(states[0]["module"]["previous_model.head.weight"], states[1]["module"]["previous_model.head.weight"])
    with pytest.raises(ConfigError, match="one architecture"):
        _loop(FCCLPlus(average_after_collaboration=True))


def test_local_learning_rate_decays_per_round():
    client = _client("cnn_tiny", 0)
    client.round_idx, client.total_rounds = 5, 10
    # 1e-3 * (1 - 0.9 * 4 / 10) = 6.4e-4
    assert client.configure_optimizers().param_groups[0]["lr"] == pytest.approx(6.4e-4)
    assert client.configure_optimizers().param_groups[0]["weight_decay"] == 1e-5


def test_fccl_pretrains_once_and_collaborates_afterwards(monkeypatch):
    calls = []
    original = FCCLClient.pretrain

    def counting(self, batches):
        calls.append(self.round_idx)
        original(self, batches)

    monkeypatch.setattr(FCCLClient, "pretrain", counting)
    loop = _loop(FCCL(pretrain_epochs=1), rounds=2)
    loop.run()
    assert calls == [0, 0, 0]  # each client once, in its first local update, never in round 1
    assert [r["comm/bytes_up"] for r in loop.history] == [0.0, 3 * 2 * 32 * 10 * 4]  # FCCM only: Z up
    for cid in range(3):
        state = loop.store.get(cid)["module"]
        assert bool(state["pretrained"])
        assert not torch.equal(state["pretrained_model.head.weight"], state["model.head.weight"])


def test_same_seed_same_numbers():
    first = _loop(FCCLPlus(), seed=3).run()
    second = _loop(FCCLPlus(), seed=3).run()
    assert first["final"] == second["final"] and first["comm"] == second["comm"]
