"""FCCL+: hand-computed FNTD local loss and FCCM + FISL collaboration, lock-step batches, teacher snapshots."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fedhet.algorithms.fccl_plus import FCCLPlus, FCCLPlusClient, FCCLPlusCollaboration
from fedhet.algorithms.shared.cross_correlation import CrossCorrelationCollaboration, PublicOutputsPayload
from fedhet.errors import ConfigError, TrainingError
from fedhet.federation import FederationLoop
from fedhet.federation.runtime import ClientTask
from fedhet.federation.trainer import TrainerTemplate
from fedhet.models import create_model
from tests.algorithms.helpers import TinyLinear
from tests.conftest import tiny_domain_shift

# three public samples; with an identity body the features (and, with an identity head, the logits) are X
X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])


def _loop(algorithm, architectures=("cnn_tiny", "mlp_tiny", "cnn_tiny"), rounds=1, seed=0):
    scenario = tiny_domain_shift()  # 3 clients, 32 private images each, 64 public images in batches of 32
    return FederationLoop(
        algorithm,
        scenario,
        list(architectures),
        TrainerTemplate(max_epochs=1, accelerator="cpu"),
        rounds=rounds,
        seed=seed,
    )


def _client(name, seed):
    return FCCLPlusClient(create_model(name, num_classes=10, in_channels=3, seed=seed), 10)


def test_averaged_targets_carry_no_gradient_to_other_clients():
    """One client's collaborative loss back-propagates into its own model only."""
    clients = [_client("cnn_tiny", 0), _client("mlp_tiny", 1)]
    phase = CrossCorrelationCollaboration(clients)
    losses = phase.collaborative_losses(torch.randn(8, 3, 16, 16))
    losses[0].backward()
    assert any(p.grad is not None for p in clients[0].model.parameters())
    assert all(p.grad is None for p in clients[1].model.parameters())


def test_exchanged_bytes_follow_the_spec():
    """Per client and public batch, Z (B x C) and S (B x (B-1)) go up and their means come down."""
    loop = _loop(FCCLPlus())
    tasks = [ClientTask(c, 0, None, None) for c in range(3)]
    result = loop.runtime.collaborate(tasks)
    # 2 public batches of B = 32, C = 10, K = 3: per client and batch Z (B x C) and S (B x (B-1))
    # float32 up, and Zbar, Sbar down
    expected = 3 * 2 * (32 * 10 + 32 * 31) * 4
    assert result.bytes_up == expected and result.bytes_down == expected


def test_invalid_public_outputs_are_rejected():
    """Non-finite or wrongly shaped public outputs are refused naming the participant."""
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


class RecordingCollaboration(FCCLPlusCollaboration):
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
    """FCCL+ whose collaborative phase records the batches it sees."""

    def build_collaborative_phase(self, clients):
        return RecordingCollaboration(clients, self.hp)


def test_all_clients_receive_the_identical_public_batch():
    """Every participant's feature extractor sees the same augmented public batch, a new one per step."""
    RecordingCollaboration.seen = []
    loop = _loop(RecordingFCCLPlus())
    loop.runtime.collaborate([ClientTask(c, 0, None, None) for c in range(3)])
    assert len(RecordingCollaboration.seen) == 2
    for batch in RecordingCollaboration.seen:
        assert len(batch) == 3 and all(torch.equal(batch[0], other) for other in batch[1:])
    assert not torch.equal(RecordingCollaboration.seen[0][0], RecordingCollaboration.seen[1][0])


def test_teacher_is_the_model_after_local_updating():
    """After a round the stored teacher equals the model at the end of local updating."""
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
    """The homogeneous variant averages all models after collaborating, keeping each client's teacher."""
    loop = _loop(FCCLPlus(average_after_collaboration=True), architectures=("cnn_tiny",) * 3)
    states = loop.runtime.collaborate([ClientTask(c, 0, None, None) for c in range(3)]).states
    models = [{k: v for k, v in s["module"].items() if k.startswith("model.")} for s in states]
    for key, value in models[0].items():
        assert all(torch.equal(value, other[key]) for other in models[1:]), key
    with pytest.raises(ConfigError, match="one architecture"):
        _loop(FCCLPlus(average_after_collaboration=True))


def test_homogeneous_variant_starts_every_client_from_one_initial_model():
    """Synchronised initialisation (the authors' homogeneous setting): equal initial weights, teacher included.

    The heterogeneous form keeps one initialisation per client, so two clients of one architecture differ.
    """
    synchronised = _loop(FCCLPlus(average_after_collaboration=True), architectures=("cnn_tiny",) * 3)
    initial = [synchronised.runtime.initial_state(c)["module"] for c in range(3)]
    assert initial[0].keys() == initial[1].keys()
    for key, value in initial[0].items():
        assert all(torch.equal(value, other[key]) for other in initial[1:]), key
    assert any(k.startswith("previous_model.") for k in initial[0])
    separate = _loop(FCCLPlus(), architectures=("cnn_tiny",) * 3)
    first, second = (separate.runtime.initial_state(c)["module"] for c in (0, 1))
    assert not torch.equal(first["model.head.weight"], second["model.head.weight"])


def test_local_optimizer_runs_at_the_configured_rate():
    """The client builds its Adam at ``lr`` in every round: the per-round decay is the platform's lr_schedule."""
    client = _client("cnn_tiny", 0)
    client.round_idx, client.total_rounds = 5, 10
    assert client.configure_optimizers().param_groups[0]["lr"] == 1e-3
    assert client.configure_optimizers().param_groups[0]["weight_decay"] == 1e-5


class _BatchNormNet(torch.nn.Module):
    """BatchNorm1d(2) (affine identity, fresh running stats 0 / 1) then the identity head: logits = BN(x)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(2)
        self.head = torch.nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.eye(2))

    def forward(self, x):
        return self.head(self.norm(x))


def test_fntd_teacher_runs_in_train_mode_by_default_as_the_authors_code():
    """Train mode normalises with the batch's statistics, eval mode with the running ones (the switch).

    Batch [[1, 0], [3, 0]]: batch mean [2, 0], biased variance [1, 0], so train mode gives
    [[-1, 0], [1, 0]] (up to eps); fresh running stats (mean 0, variance 1) leave the batch as it is.
    """
    x = torch.tensor([[1.0, 0.0], [3.0, 0.0]])
    default = FCCLPlus().build_client(_BatchNormNet(), 2)
    assert default.hp.teacher_train_mode
    assert torch.allclose(default.teacher_logits(x), torch.tensor([[-1.0, 0.0], [1.0, 0.0]]), atol=1e-4)
    switched = FCCLPlus(teacher_train_mode=False).build_client(_BatchNormNet(), 2)
    assert torch.allclose(switched.teacher_logits(x), x / math.sqrt(1 + 1e-5), atol=1e-6)


def test_fccl_plus_local_loss_is_ce_plus_tau_squared_fntd_by_hand():
    """CE + tau^2 sum_{u != y} p_T^u log(p_T^u / p_S^u), temperature softmax over all 3 classes, tau = 2."""
    head = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    client = FCCLPlusClient(TinyLinear(head=head), 3, temperature=2.0)
    with torch.no_grad():
        client.previous_model.head.weight.copy_(torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]]))
    x, y = torch.tensor([[1.0, 2.0]]), torch.tensor([0])
    student, teacher = [1.0, 2.0, 3.0], [2.0, 1.0, 0.0]  # head x and previous head x

    def softmax(logits, tau):
        exps = [math.exp(v / tau) for v in logits]
        return [e / sum(exps) for e in exps]

    p_s, p_t = softmax(student, 2.0), softmax(teacher, 2.0)
    fntd = 4.0 * sum(p_t[u] * math.log(p_t[u] / p_s[u]) for u in (1, 2))
    ce = -math.log(softmax(student, 1.0)[0])
    assert client.local_loss((x, y)).item() == pytest.approx(ce + fntd, rel=1e-6)
    # the renormalised form softmaxes the non-target logits only
    client.hp = dataclasses.replace(client.hp, fntd_renormalize=True)
    q_s, q_t = softmax(student[1:], 2.0), softmax(teacher[1:], 2.0)
    renormalised = 4.0 * sum(q_t[u] * math.log(q_t[u] / q_s[u]) for u in (0, 1))
    assert client.local_loss((x, y)).item() == pytest.approx(ce + renormalised, rel=1e-6)
    # the KD ablation keeps the target class too
    client.hp = dataclasses.replace(client.hp, fntd_renormalize=False, local_distillation="kd")
    kd = 4.0 * sum(p_t[u] * math.log(p_t[u] / p_s[u]) for u in (0, 1, 2))
    assert client.local_loss((x, y)).item() == pytest.approx(ce + kd, rel=1e-6)


def test_fccl_plus_collaborative_loss_is_fccm_plus_weighted_fisl_by_hand():
    """FCCM to the mean logits plus omega * KL(softmax(Sbar) || softmax(S_i)) of the instance similarities."""
    clients = [
        FCCLPlusClient(TinyLinear(), 2),
        FCCLPlusClient(TinyLinear(body=torch.diag(torch.tensor([1.0, 2.0]))), 2),  # features X diag(1, 2)
    ]
    phase = CrossCorrelationCollaboration(clients, fisl_weight=3.0, similarity_temperature=1.0)
    losses = phase.collaborative_losses(X)
    # logits: A = X, B = X diag(1, 2); per column they standardise alike, so M = corr(X) (B - 1)/B:
    # [[2/3, 1/3], [1/3, 2/3]] and FCCM = 2 (1/3)^2 + 2 * 0.0051 * (1/3 + 1)^2
    fccm = 2 * (1 / 3) ** 2 + 2 * 0.0051 * (4 / 3) ** 2
    # off-diagonal cosine similarities of the three samples' features, row by row (mu = 1)
    r2, r5 = 1 / math.sqrt(2), 1 / math.sqrt(5)
    similarity_a = torch.tensor([[0.0, -r2], [0.0, -r2], [-r2, -r2]])
    similarity_b = torch.tensor([[0.0, -r5], [0.0, -2 * r5], [-r5, -2 * r5]])
    target = torch.softmax((similarity_a + similarity_b) / 2, dim=1)

    def fisl(similarity):
        return (target * (target.log() - torch.log_softmax(similarity, dim=1))).sum(1).mean().item()

    assert losses[0].item() == pytest.approx(fccm + 3.0 * fisl(similarity_a), rel=1e-4)
    assert losses[1].item() == pytest.approx(fccm + 3.0 * fisl(similarity_b), rel=1e-4)
    # per client and batch: Z (3 x 2) and S (3 x 2) up, the means of both down
    assert phase.exchanged_bytes_up == phase.exchanged_bytes_down == 2 * (3 * 2 + 3 * 2) * 4


def test_homogeneous_switch_sets_a_boolean_capability_and_client_zeros_initialisation():
    """Averaging after collaborating: one architecture (False, a bool) and client 0's initial model for all."""
    averaged, separate = FCCLPlus(average_after_collaboration=True), FCCLPlus()
    assert averaged.capabilities.heterogeneous_models is False and separate.capabilities.heterogeneous_models is True
    assert [averaged.initialisation_of(c) for c in range(3)] == [0, 0, 0]
    assert [separate.initialisation_of(c) for c in range(3)] == [0, 1, 2]


def test_public_outputs_refusals_name_the_participant_and_the_field():
    """Each refusal of an exchanged output is one line naming who sent which field and what was wrong."""

    def refusal(payload, with_similarity=True):
        with pytest.raises(TrainingError) as error:
            payload.validate_shape(4, 10, with_similarity, "participant 2")
        return str(error.value)

    similarity = torch.zeros(4, 3)
    assert refusal(PublicOutputsPayload(logits=torch.zeros(4, 9), similarity=similarity)).startswith(
        "participant 2 sent 'logits' of shape (4, 9), expected (4, 10)"
    )
    assert refusal(PublicOutputsPayload(logits=torch.zeros(4, 10), similarity=torch.zeros(4, 4))).startswith(
        "participant 2 sent 'similarity' of shape (4, 4), expected (4, 3)"
    )
    assert refusal(PublicOutputsPayload(logits=torch.zeros(4, 10, dtype=torch.long), similarity=similarity)) == (
        "participant 2 sent 'logits' with dtype torch.int64, expected a floating dtype"
    )
    assert refusal(PublicOutputsPayload(logits=torch.full((4, 10), math.inf), similarity=similarity)).startswith(
        "participant 2 sent non-finite values in 'logits'"
    )
    PublicOutputsPayload(logits=torch.zeros(4, 10)).validate_shape(4, 10, False, "participant 2")  # FCCL: no FISL


def test_a_dropped_participant_is_left_out_and_the_others_still_collaborate():
    """Under ``drop`` a participant whose logits exceed the bound is recorded by its own index; the rest exchange."""
    clients = [FCCLPlusClient(TinyLinear(head=100.0 * torch.eye(2)), 2), FCCLPlusClient(TinyLinear(), 2),
               FCCLPlusClient(TinyLinear(body=torch.diag(torch.tensor([1.0, 2.0]))), 2)]  # fmt: skip
    phase = CrossCorrelationCollaboration(clients, fisl_weight=0.0)
    phase.drop_invalid, phase.value_bound = True, 10.0
    losses = phase.collaborative_losses(X)
    assert list(phase.dropped) == [0] and phase.dropped[0].startswith("participant 0 sent")
    assert losses[0].item() == 0.0 and not losses[0].requires_grad
    assert losses[1].item() > 0.0 and losses[2].item() > 0.0
    # per remaining participant and batch: Z (3 x 2) up; FISL off: no similarity bytes
    assert phase.exchanged_bytes_up == phase.exchanged_bytes_down == 2 * 3 * 2 * 4
    phase.drop_invalid = False
    phase.dropped.clear()
    with pytest.raises(TrainingError, match="^participant 0 sent"):
        phase.collaborative_losses(X)


def test_a_public_batch_of_one_image_is_skipped_and_the_adam_is_fresh_each_step():
    """One image has no per-dimension std nor a peer to be similar to: the step does nothing."""
    clients = [FCCLPlusClient(TinyLinear(), 2), FCCLPlusClient(TinyLinear(), 2)]
    phase = CrossCorrelationCollaboration(clients)
    before = [p.detach().clone() for p in phase.parameters()]
    assert phase.training_step((X[:1],), 0) is None
    assert all(torch.equal(a, b) for a, b in zip(before, phase.parameters(), strict=True))
    optimizer = phase.client_optimizer(clients[0])
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.param_groups[0]["weight_decay"] == 0.0


def test_only_ready_participants_exchange_and_non_finite_outputs_are_named():
    """A client not yet pretrained (FCCL) waits; a non-finite output is dropped naming its participant."""
    from fedhet.algorithms.fccl import FCCLClient

    waiting = FCCLClient(TinyLinear(), 2)  # FCCL pretrains before it collaborates
    broken = FCCLPlusClient(TinyLinear(head=torch.full((2, 2), math.nan)), 2)
    plain = [FCCLPlusClient(TinyLinear(), 2) for _ in range(2)]
    phase = CrossCorrelationCollaboration([waiting, plain[0], broken, plain[1]])
    assert phase.ready() == [1, 2, 3]
    phase.drop_invalid = True
    losses = phase.collaborative_losses(X)
    assert list(phase.dropped) == [2]
    assert phase.dropped[2].startswith("participant 2 sent non-finite values in 'logits'")
    assert losses[0].item() == losses[2].item() == 0.0


def test_the_std_epsilon_reaches_fccm():
    """``std_eps`` is FCCM's: a larger epsilon gives another loss on the same batch."""
    def loss(std_eps):
        scaled = TinyLinear(body=torch.diag(torch.tensor([1.0, 2.0])))
        clients = [FCCLPlusClient(TinyLinear(), 2), FCCLPlusClient(scaled, 2)]
        phase = CrossCorrelationCollaboration(clients, fisl_weight=0.0, std_eps=std_eps)
        return phase.collaborative_losses(X)[0].item()

    assert loss(0.5) != pytest.approx(loss(1e-5), rel=1e-3)


def test_a_bf16_participant_gets_its_targets_in_its_own_dtype():
    """The averaged logits and similarities (sent as float32) are cast to the receiver's dtype: a bf16 loss."""
    clients = [FCCLPlusClient(TinyLinear().to(torch.bfloat16), 2) for _ in range(2)]
    phase = CrossCorrelationCollaboration(clients, fisl_weight=1.0, similarity_temperature=1.0)
    losses = phase.collaborative_losses(X.to(torch.bfloat16))
    assert [loss.dtype for loss in losses] == [torch.bfloat16, torch.bfloat16]
    assert all(torch.isfinite(loss) for loss in losses)


@pytest.mark.parametrize("participants", [1, 2])
def test_a_public_batch_of_two_images_trains_every_participant_also_alone(participants):
    """Two images are enough for FCCM's std and FISL's peer; one participant steps with its single optimizer."""
    from torch.utils.data import DataLoader, TensorDataset

    from tests.algorithms.helpers import fit

    clients = [FCCLPlusClient(TinyLinear(), 2) for _ in range(participants)]
    phase = CrossCorrelationCollaboration(clients, fisl_weight=1.0, similarity_temperature=1.0)
    before = [p.detach().clone() for p in phase.parameters()]
    fit(phase, DataLoader(TensorDataset(X[:2]), batch_size=2))
    moved = [not torch.equal(a, b) for a, b in zip(before, phase.parameters(), strict=True)]
    assert any(moved)
