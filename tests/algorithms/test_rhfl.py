"""RHFL: hand-computed SCE local loss, confidence-weighted peer KL, CCR server weights, loop behaviour."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import RHFL
from fedhet.algorithms.rhfl import ClientConfidencePayload, ClientConfidenceServer, PrivateLossPayload, RHFLClient
from fedhet.errors import ConfigError, TrainingError
from fedhet.federation import FederationLoop
from fedhet.federation.trainer import TrainerTemplate
from tests.algorithms.helpers import (
    PUBLIC_CLASSES,
    TinyLinear,
    collaborate,
    context,
    first_images,
    public_batches,
    public_clients,
    train_mode_logits,
    upload,
)
from tests.conftest import tiny_domain_shift

HEADS = [torch.eye(2), 3 * torch.eye(2), torch.tensor([[2.0, 1.0], [1.0, 2.0]])]


def _kl_rows(target_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(target) || softmax(student)) per row, averaged, from plain softmaxes."""
    q, p = torch.softmax(target_logits, 1), torch.softmax(student_logits, 1)
    return (q * (q.log() - p.log())).sum(1).mean()


def test_rhfl_local_loss_is_symmetric_cross_entropy_by_hand():
    """0.1 CE + 1.0 RCE, RCE = -sum_k p_k log(clamp(onehot_k, 1e-4)) = p_1 * log(1e4) for logits [1, 0], class 0."""
    client = RHFLClient(TinyLinear(), 2, sce_alpha=0.1, sce_beta=1.0)
    p1 = 1 / (1 + math.e)
    expected = 0.1 * math.log1p(math.exp(-1.0)) + 1.0 * p1 * math.log(1e4)
    loss = client.local_loss((torch.tensor([[1.0, 0.0]]), torch.tensor([0])))
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_rhfl_peer_losses_by_hand_uniform_then_confidence_weighted():
    """Client i's loss is sum_{j != i} w_j KL(p_j || p_i): w = 1/(K-1) before CCR, then the received weights."""
    algorithm = RHFL()
    clients = [algorithm.build_client(TinyLinear(head=head.clone()), 2) for head in HEADS]
    logits = [head.T for head in HEADS]  # x = I: logits are the columns of each head
    phase = algorithm.build_collaborative_phase(clients)
    losses = phase.collaborative_losses(torch.eye(2))
    expected_0 = 0.5 * _kl_rows(logits[1], logits[0]) + 0.5 * _kl_rows(logits[2], logits[0])
    assert losses[0].item() == pytest.approx(expected_0.item(), rel=1e-5)
    for client, weight in zip(clients, (0.2, 0.3, 0.5), strict=True):
        client.on_receive(ClientConfidencePayload(weight=torch.tensor(weight)))
    weights = (0.2, 0.3, 0.5)
    losses = phase.collaborative_losses(torch.eye(2))
    for i in range(3):
        expected = sum(weights[j] * _kl_rows(logits[j], logits[i]) for j in range(3) if j != i)
        assert losses[i].item() == pytest.approx(expected.item(), rel=1e-5), i


def test_rhfl_phase_weights_peers_by_their_confidence():
    """On real models each peer is a separate KL target weighted by its confidence; stale weights are forgotten."""
    algorithm = RHFL()
    clients = public_clients(algorithm)
    phase = algorithm.build_collaborative_phase(clients)
    assert phase.peer_confidences().tolist() == pytest.approx([0.5, 0.5, 0.5])  # 1 / (K - 1) before CCR
    for client, weight in zip(clients, (0.2, 0.3, 0.5), strict=True):
        client.on_receive(ClientConfidencePayload(weight=torch.tensor(weight)))
    x = first_images(public_batches())
    with torch.no_grad():
        logits = [c(x) for c in clients]
        loss_0 = phase.distillation_losses(logits, x)[0]
        # client 0 learns from client 1 (w = 0.3) and client 2 (w = 0.5), each KL separately
        kl = [F.kl_div(F.log_softmax(logits[0], 1), F.softmax(logits[j], 1), reduction="batchmean") for j in (1, 2)]
    assert loss_0.item() == pytest.approx((0.3 * kl[0] + 0.5 * kl[1]).item(), rel=1e-5)
    clients[0].on_receive(None)  # a module reused for a client without a weight forgets the old one
    assert clients[0].confidence is None


def test_rhfl_a_collaborative_step_moves_every_client_towards_its_peers():
    """After a collaborative step every client's summed KL to its (fixed) peers shrank."""
    algorithm = RHFL()
    clients = public_clients(algorithm)
    batches = public_batches()
    x = first_images(batches)
    before = train_mode_logits(clients, x)

    def distance(z, i):
        return sum(_kl_rows(before[j], z) for j in range(len(before)) if j != i)

    collaborate(algorithm, clients, batches)
    after = train_mode_logits(clients, x)
    for i in range(len(clients)):
        assert distance(after[i], i) < distance(before[i], i), f"client {i} did not move towards its peers"


def _loss_uploads(losses):
    return [
        upload(cid, PrivateLossPayload(loss=torch.tensor(value), num_examples=10)) for cid, value in enumerate(losses)
    ]


def test_rhfl_server_computes_ccr_from_two_rounds_of_private_losses():
    """CCR by hand: q = (1, 0.5, 0), a = 1/2 + 0.5 q / sum q, w = softmax(a); state round-trips."""
    server = ClientConfidenceServer(ccr_beta=0.5)
    server.setup_server(context(num_classes=PUBLIC_CLASSES, num_clients=3))
    server.aggregate(0, _loss_uploads([2.0, 3.0, 1.0]))
    assert server.download_for(0) is None  # one loss per client: no decrease known yet
    server.aggregate(1, _loss_uploads([1.0, 2.0, 1.0]))
    # q = (1, 0.5, 0) -> a = 1/2 + 0.5 * (2/3, 1/3, 0) -> softmax = (0.390166, 0.330268, 0.279566)
    weights = [float(server.download_for(cid).weight) for cid in range(3)]
    assert weights == pytest.approx([0.390166, 0.330268, 0.279566], abs=1e-6)
    restored = ClientConfidenceServer()
    restored.load_server_state(server.server_state())
    assert float(restored.download_for(2).weight) == pytest.approx(0.279566, abs=1e-6)


@pytest.mark.parametrize("bad", [torch.tensor(math.nan), torch.tensor([1.0, 2.0]), torch.tensor(-1.0), torch.tensor(3)])
def test_rhfl_server_rejects_invalid_losses(bad):
    """NaN, non-scalar, negative or integer private losses are refused naming the client."""
    server = ClientConfidenceServer()
    server.setup_server(context(num_classes=PUBLIC_CLASSES, num_clients=3))
    with pytest.raises(TrainingError, match="client 0"):
        server.check_upload(upload(0, PrivateLossPayload(loss=bad, num_examples=1)))


def test_rhfl_client_uploads_its_mean_private_sce_loss():
    """The upload is the example-weighted mean SCE over the private batches (4 + 2 examples)."""
    client = public_clients(RHFL(), ("mlp_tiny",))[0].eval()
    x, y = torch.randn(6, 3, 16, 16), torch.arange(6) % PUBLIC_CLASSES
    with torch.no_grad():
        sent = client.make_upload([(x[:4], y[:4]), (x[4:], y[4:])])
        whole = client.local_loss((x, y))  # one batch of all 6: the example-weighted mean
    assert isinstance(client, RHFLClient) and float(sent.loss) == pytest.approx(float(whole), rel=1e-5)


def test_rhfl_invalid_hyperparameters_fail_in_one_line():
    """Negative SCE weights (or both zero) are configuration errors."""
    with pytest.raises(ConfigError, match="sce_alpha"):
        RHFL(sce_alpha=0.0, sce_beta=0.0)


def test_rhfl_loop_sends_confidences_from_round_two():
    """Round 0 has no confidences, round 1 logs weights summing to one; bytes = logits both ways plus losses."""
    scenario = tiny_domain_shift()
    scenario.setup()
    trainer = TrainerTemplate(max_epochs=1, accelerator="cpu")
    loop = FederationLoop(RHFL(), scenario, ["cnn_tiny", "mlp_tiny", "cnn_tiny"], trainer, rounds=2)
    summary = loop.run()
    assert all(math.isfinite(r["train/loss"]) for r in loop.history)
    assert not any(k.startswith("server/confidence") for k in loop.history[0])
    weights = [loop.history[1][f"server/confidence/{cid}"] for cid in range(3)]
    assert sum(weights) == pytest.approx(1.0, abs=1e-6)
    # logits and targets of 2 rounds x 2 public batches x 3 x 32 x 10 floats, plus 3 losses per round
    assert summary["comm"]["bytes_up"] == 2 * 2 * 3 * 32 * PUBLIC_CLASSES * 4 + 2 * 3 * 4


def test_rhfl_server_weighs_as_soon_as_two_clients_have_a_decrease_and_reads_its_beta():
    """Two returning clients are enough for CCR; ``ccr_beta = 0`` (from the method) gives them equal weights."""
    for beta in (0.5, 0.0):
        server = RHFL(ccr_beta=beta).build_server()
        server.setup_server(context(num_classes=PUBLIC_CLASSES, num_clients=3))
        server.aggregate(0, _loss_uploads([2.0, 3.0, 1.0])[:2])
        server.aggregate(1, _loss_uploads([1.0, 2.5, 1.0])[:2])  # q = (1, 0.2): a = 1 + beta * (1, 0.2) / 1.2
        weights = [float(server.download_for(cid).weight) for cid in range(2)]
        a = torch.tensor([1.0 + beta / 1.2, 1.0 + beta * 0.2 / 1.2])
        assert weights == pytest.approx(torch.softmax(a, 0).tolist(), abs=1e-6)  # beta 0.5: (0.582570, 0.417430)
        assert server.download_for(2) is None


def test_rhfl_server_resumes_the_previous_losses():
    """A restored server computes the next CCR from the losses saved before the interruption."""
    server = ClientConfidenceServer()
    server.setup_server(context(num_classes=PUBLIC_CLASSES, num_clients=2))
    server.aggregate(0, _loss_uploads([2.0, 3.0])[:2])
    restored = ClientConfidenceServer()
    restored.load_server_state(server.server_state())
    for each in (server, restored):
        each.aggregate(1, _loss_uploads([1.0, 2.0])[:2])
    assert float(restored.download_for(0).weight) == float(server.download_for(0).weight)


def test_rhfl_server_refusals_name_the_client_and_the_problem():
    """The payload type, a float64 loss and a negative one are refused in one line; a zero loss is accepted."""
    from fedhet.core.payloads import WeightsPayload

    server = ClientConfidenceServer()
    server.setup_server(context(num_classes=PUBLIC_CLASSES, num_clients=3))

    def refusal(payload):
        with pytest.raises(TrainingError) as error:
            server.check_upload(upload(1, payload))
        return str(error.value)

    for loss in (0.0, 0.5):
        server.check_upload(upload(1, PrivateLossPayload(loss=torch.tensor(loss), num_examples=1)))
    assert refusal(WeightsPayload(weights={})) == "client 1 sent WeightsPayload, expected PrivateLossPayload"
    assert refusal(PrivateLossPayload(loss=torch.tensor(1.0, dtype=torch.float64))).startswith(
        "client 1 sent 'loss' as torch.float64 where the server holds torch.float32"
    )
    assert refusal(PrivateLossPayload(loss=torch.tensor(-1.0))) == (
        "client 1 sent an invalid private loss tensor(-1.) (must be a non-negative float)"
    )


def test_rhfl_client_keeps_its_overrides_and_needs_data_to_upload():
    """A single example is enough to measure the private loss (accumulated in float64); none is an error."""
    client = RHFLClient(TinyLinear(), 2, sce_alpha=0.3)
    assert client.hp.sce_alpha == 0.3
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(n, 2, generator=generator), torch.arange(n) % 2) for n in (1, 3, 2, 5, 7, 1, 4)]
    with torch.no_grad():
        sent = client.make_upload(batches)
        total = sum(client.local_loss(batch).double() * len(batch[1]) for batch in batches)
    assert torch.equal(sent.loss, (total / 23).float())
    assert client.make_upload(batches[:1]).loss.dtype == torch.float32
    with pytest.raises(TrainingError) as error:
        client.make_upload([])
    assert str(error.value) == "RHFL: a client without training data cannot measure its private loss"


def test_rhfl_needs_some_weight_on_its_local_loss():
    """``sce_alpha + sce_beta`` must be positive: any positive split is accepted."""
    RHFL(sce_alpha=0.1, sce_beta=0.4)
    with pytest.raises(ConfigError) as error:
        RHFL(sce_alpha=0.0, sce_beta=0.0)
    assert str(error.value) == "RHFL: sce_alpha=0.0, sce_beta=0.0 must not both be 0"


def test_rhfl_two_participants_learn_from_each_other_and_a_lone_one_learns_nothing():
    """Two participants without a confidence weigh each other fully (1 / (K - 1) = 1); one alone has a zero loss."""
    phase = RHFL().build_collaborative_phase(public_clients(RHFL(), ("mlp_tiny", "mlp_tiny")))
    z0 = torch.tensor([[2.0, 0.0, 0.0]], requires_grad=True)
    z1 = torch.tensor([[0.0, 1.0, 0.0]])
    phase.exchanging = [0]
    (alone,) = phase.distillation_losses([z0], torch.zeros(1))
    assert alone.item() == 0.0 and alone.requires_grad
    phase.exchanging = [0, 1]
    assert phase.peer_confidences().tolist() == [1.0, 1.0]
    first, _ = phase.distillation_losses([z0, z1], torch.zeros(1))
    assert first.item() > 0.0
