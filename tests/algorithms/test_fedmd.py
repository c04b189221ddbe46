"""FedMD, FedDF, RHFL and FedMatch: collaborative steps, CCR server, ledger bytes, loop runs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torch.utils.data import DataLoader, TensorDataset

from fedhet.algorithms import FedDF, FedMatch, FedMD, RHFL
from fedhet.algorithms.base import ClientUpload, ServerContext
from fedhet.algorithms.fedmatch import Cutout
from fedhet.algorithms.rhfl import ClientConfidencePayload, ClientConfidenceServer, PrivateLossPayload, RHFLClient
from fedhet.errors import ConfigError, TrainingError
from fedhet.federation import FederationLoop
from fedhet.federation.trainer import TrainerTemplate
from fedhet.models import create_model
from tests.conftest import tiny_domain_shift, tiny_label_skew

NUM_CLASSES = 10
BATCH = 8


def _clients(algorithm, architectures=("cnn_tiny", "mlp_tiny", "cnn_tiny")):
    clients = []
    for index, name in enumerate(architectures):
        torch.manual_seed(index)
        model = create_model(name, num_classes=NUM_CLASSES, in_channels=3, seed=index)
        clients.append(algorithm.build_client(model, NUM_CLASSES))
    return clients


def _public_batch(seed=0, steps=1):
    """``steps`` identical unlabelled public batches (labels -1), in a loader Lightning accepts."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, 3, 16, 16, generator=generator)
    return DataLoader(TensorDataset(x.repeat(steps, 1, 1, 1), torch.full((BATCH * steps,), -1)), batch_size=BATCH)


def _first_images(loader):
    return next(iter(loader))[0]


def _collaborate(algorithm, clients, batches, round_idx=0):
    """Fit the method's collaborative phase on ``batches`` exactly as the runtime does."""
    phase = algorithm.build_collaborative_phase(clients)
    phase.round_idx, phase.total_rounds = round_idx, 2
    template = TrainerTemplate(max_epochs=1, accelerator="cpu")
    trainer = template.build(max_epochs=1, max_steps=-1, limit_train_batches=None)
    torch.manual_seed(0)
    trainer.fit(phase, train_dataloaders=batches)
    return phase


@torch.no_grad()
def _train_mode_logits(clients, x):
    for client in clients:
        client.train()
    return [client(x) for client in clients]


def _peer_distance(kind, logits, i):
    """How far participant ``i`` is from the method's consensus target (fixed ``logits`` of everyone)."""
    others = [z for j, z in enumerate(logits) if j != i]
    if kind == "fedmd":
        return lambda z: F.l1_loss(z, torch.stack(logits).mean(0))
    if kind == "feddf":
        target = F.softmax(torch.stack(logits).mean(0), dim=1)
        return lambda z: F.kl_div(F.log_softmax(z, 1), target, reduction="batchmean")
    if kind == "rhfl":
        return lambda z: sum(F.kl_div(F.log_softmax(z, 1), F.softmax(o, 1), reduction="batchmean") for o in others)
    helpers = torch.stack([F.softmax(o, 1) for o in others]).mean(0)  # fedmatch
    return lambda z: F.kl_div(F.log_softmax(z, 1), helpers, reduction="batchmean")


@pytest.mark.parametrize(
    "kind,algorithm",
    [
        ("fedmd", FedMD()),
        ("feddf", FedDF(public_lr=0.05)),  # the code's SGD 1e-3 moves logits by ~1e-6 per step
        ("rhfl", RHFL()),
        ("fedmatch", FedMatch()),
    ],
)
def test_a_collaborative_step_moves_every_client_towards_the_consensus(kind, algorithm):
    clients = _clients(algorithm)
    batches = _public_batch()
    x = _first_images(batches)
    before = _train_mode_logits(clients, x)
    distances = [_peer_distance(kind, before, i) for i in range(len(clients))]
    _collaborate(algorithm, clients, batches)
    after = _train_mode_logits(clients, x)
    for i in range(len(clients)):
        assert distances[i](after[i]) < distances[i](before[i]), f"{kind}: client {i} did not move towards the others"


def test_targets_carry_no_gradient_to_other_clients():
    clients = _clients(FedMD())
    phase = FedMD().build_collaborative_phase(clients)
    x = _first_images(_public_batch())
    losses = phase.collaborative_losses(x)
    losses[0].backward()
    assert all(p.grad is not None for p in clients[0].parameters() if p.requires_grad)
    for other in clients[1:]:
        assert all(p.grad is None for p in other.parameters()), "client 0's loss reached another client"


def test_ledger_counts_logits_up_and_targets_down_as_float32():
    clients = _clients(FedDF())
    phase = _collaborate(FedDF(), clients, _public_batch(steps=2))
    # 2 batches x 3 participants x 8 images x 10 classes x 4 bytes
    assert phase.exchanged_bytes_up == 2 * 3 * BATCH * NUM_CLASSES * 4
    assert phase.exchanged_bytes_down == phase.exchanged_bytes_up


def test_optimizer_state_is_reset_every_public_step_unless_disabled():
    for reset, expected_steps in ((True, 1), (False, 2)):
        algorithm = FedMD(reset_public_optimizer=reset)
        phase = _collaborate(algorithm, _clients(algorithm), _public_batch(steps=2))
        optimizer = phase.trainer.optimizers[0]
        steps = {int(state["step"]) for state in optimizer.state.values()}
        assert steps == {expected_steps}, f"reset={reset}"


def test_fedmd_pretrain_rounds_skip_the_digest():
    algorithm = FedMD(pretrain_rounds=1)
    clients = _clients(algorithm)
    weights = [{k: v.clone() for k, v in c.state_dict().items() if v.is_floating_point()} for c in clients]
    phase = _collaborate(algorithm, clients, _public_batch(), round_idx=0)
    assert phase.exchanged_bytes_up == 0
    for client, saved in zip(clients, weights):
        state = client.state_dict()
        assert all(torch.equal(state[k], v) for k, v in saved.items() if "running" not in k)
    assert _collaborate(algorithm, clients, _public_batch(), round_idx=1).exchanged_bytes_up > 0


def test_non_finite_public_logits_are_rejected_in_one_line():
    clients = _clients(FedMD())
    with torch.no_grad():
        next(clients[1].parameters()).fill_(math.nan)
    phase = FedMD().build_collaborative_phase(clients)
    with pytest.raises(TrainingError, match="participant 1 sent non-finite"):
        phase.collaborative_losses(_first_images(_public_batch()))


def _context(num_clients=3):
    return ServerContext(
        num_clients=num_clients,
        num_classes=NUM_CLASSES,
        architectures=("x",) * num_clients,
        seed=0,
        initial_client_state=lambda c: {},
    )


def _loss_uploads(losses):
    return [
        ClientUpload(cid, "x", PrivateLossPayload(loss=torch.tensor(value), num_examples=10))
        for cid, value in enumerate(losses)
    ]


def test_rhfl_server_computes_ccr_from_two_rounds_of_private_losses():
    server = ClientConfidenceServer(ccr_beta=0.5)
    server.setup(_context())
    server.aggregate(0, _loss_uploads([2.0, 3.0, 1.0]))
    assert server.download_for(0) is None  # one loss per client: no decrease known yet
    server.aggregate(1, _loss_uploads([1.0, 2.0, 1.0]))
    # q = (1, 0.5, 0) -> a = 1/2 + 0.5 * (2/3, 1/3, 0) -> softmax = (0.390166, 0.330268, 0.279566)
    weights = [float(server.download_for(cid).weight) for cid in range(3)]
    assert weights == pytest.approx([0.390166, 0.330268, 0.279566], abs=1e-6)
    restored = ClientConfidenceServer()
    restored.load_state_dict(server.state_dict())
    assert float(restored.download_for(2).weight) == pytest.approx(0.279566, abs=1e-6)


@pytest.mark.parametrize("bad", [torch.tensor(math.nan), torch.tensor([1.0, 2.0]), torch.tensor(-1.0), torch.tensor(3)])
def test_rhfl_server_rejects_invalid_losses(bad):
    server = ClientConfidenceServer()
    server.setup(_context())
    with pytest.raises(TrainingError, match="client 0"):
        server.aggregate(0, [ClientUpload(0, "x", PrivateLossPayload(loss=bad, num_examples=1))])


def test_rhfl_phase_weights_peers_by_their_confidence():
    algorithm = RHFL()
    clients = _clients(algorithm)
    phase = algorithm.build_collaborative_phase(clients)
    assert phase.peer_confidences().tolist() == pytest.approx([0.5, 0.5, 0.5])  # 1 / (K - 1) before CCR
    for client, weight in zip(clients, (0.2, 0.3, 0.5)):
        client.on_receive(ClientConfidencePayload(weight=torch.tensor(weight)))
    x = _first_images(_public_batch())
    with torch.no_grad():
        logits = [c(x) for c in clients]
        loss_0 = phase.distillation_losses(logits, x)[0]
        # client 0 learns from client 1 (w = 0.3) and client 2 (w = 0.5), each KL separately
        kl = [F.kl_div(F.log_softmax(logits[0], 1), F.softmax(logits[j], 1), reduction="batchmean") for j in (1, 2)]
    assert loss_0.item() == pytest.approx((0.3 * kl[0] + 0.5 * kl[1]).item(), rel=1e-5)
    clients[0].on_receive(None)  # a module reused for a client without a weight forgets the old one
    assert clients[0].confidence is None


def test_rhfl_client_uploads_its_mean_private_sce_loss():
    client = _clients(RHFL(), ("mlp_tiny",))[0].eval()
    x, y = torch.randn(6, 3, 16, 16), torch.arange(6) % NUM_CLASSES
    with torch.no_grad():
        upload = client.make_upload([(x[:4], y[:4]), (x[4:], y[4:])])
        whole = client.local_loss((x, y))  # one batch of all 6: the example-weighted mean
    assert isinstance(client, RHFLClient) and float(upload.loss) == pytest.approx(float(whole), rel=1e-5)


def test_cutout_zeroes_one_square_per_image():
    images = torch.ones(2, 1, 8, 8)
    out = Cutout(4)(images, torch.Generator().manual_seed(0))
    zeroed = (out == 0).sum(dim=(1, 2, 3))
    # a 5 x 5 window (|offset| <= 2) clipped at the border: between 3 x 3 and 5 x 5 pixels
    assert all(9 <= int(n) <= 25 for n in zeroed)


def test_invalid_hyperparameters_fail_in_one_line():
    with pytest.raises(ConfigError, match="digest_loss"):
        FedMD(digest_loss="huber")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="temperature"):
        FedDF(temperature=0.0)
    with pytest.raises(ConfigError, match="threshold"):
        FedMatch(threshold=1.5)


@pytest.mark.parametrize("method", [FedMD, FedDF, RHFL, FedMatch])
def test_public_phase_settings_are_checked_once_for_every_method(method):
    with pytest.raises(ConfigError, match=rf"^{method.__name__}: public_epochs=-1 must be >= 0"):
        method(public_epochs=-1)
    with pytest.raises(ConfigError, match=rf"^{method.__name__}: public_lr=0.0 must be > 0"):
        method(public_lr=0.0)
    algorithm = method(public_epochs=3, public_optimizer="sgd", public_lr=0.5, public_weight_decay=0.1, reset_public_optimizer=False)
    assert algorithm.collaborative_epochs() == 3
    assert algorithm.public_phase_kwargs() == {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.1, "reset_optimizer_each_step": False}
    assert algorithm.capabilities.needs_public_data and algorithm.capabilities.heterogeneous_models


def _loop(algorithm, scenario, architectures, seed=0, rounds=2):
    scenario.setup()
    trainer = TrainerTemplate(max_epochs=1, accelerator="cpu")
    return FederationLoop(algorithm, scenario, architectures, trainer, rounds=rounds, seed=seed)


def test_feddf_runs_on_label_skew_with_public_data_and_counts_bytes():
    scenario = tiny_label_skew(public="photos", public_size=64, public_batch_size=32)
    summary = _loop(FedDF(), scenario, ["cnn_tiny", "mlp_tiny", "cnn_tiny"], rounds=1).run()
    assert math.isfinite(summary["final"]["acc_global"])
    # 1 round x 2 public batches x 3 participants x 32 images x 10 classes x 4 bytes, each way
    assert summary["comm"]["bytes_up"] == 2 * 3 * 32 * NUM_CLASSES * 4
    assert summary["comm"]["bytes_down"] == summary["comm"]["bytes_up"]


def test_fedmatch_same_seed_same_numbers():
    # FedMatch draws its strong augmentation from the global RNG: it must come from the loop's seed
    scenario = tiny_domain_shift()
    first = _loop(FedMatch(), scenario, ["cnn_tiny", "mlp_tiny", "cnn_tiny"], seed=5, rounds=1).run()
    second = _loop(FedMatch(), scenario, ["cnn_tiny", "mlp_tiny", "cnn_tiny"], seed=5, rounds=1).run()
    assert first["final"] == second["final"] and first["comm"] == second["comm"]


def test_rhfl_loop_sends_confidences_from_round_two():
    loop = _loop(RHFL(), tiny_domain_shift(), ["cnn_tiny", "mlp_tiny", "cnn_tiny"], rounds=2)
    summary = loop.run()
    assert all(math.isfinite(r["train/loss"]) for r in loop.history)
    assert not any(k.startswith("server/confidence") for k in loop.history[0])
    weights = [loop.history[1][f"server/confidence/{cid}"] for cid in range(3)]
    assert sum(weights) == pytest.approx(1.0, abs=1e-6)
    # logits and targets of 2 rounds x 2 public batches x 3 x 32 x 10 floats, plus 3 losses per round
    assert summary["comm"]["bytes_up"] == 2 * 2 * 3 * 32 * NUM_CLASSES * 4 + 2 * 3 * 4
