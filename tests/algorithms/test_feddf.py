"""FedDF (lock-step form): hand-computed T^2-scaled distillation towards the ensemble, one SGD step, bytes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import FedDF
from fedhet.errors import ConfigError
from fedhet.federation import FederationLoop
from fedhet.federation.trainer import TrainerTemplate
from tests.algorithms.helpers import (
    PUBLIC_CLASSES,
    TinyLinear,
    collaborate,
    first_images,
    public_batches,
    public_clients,
    train_mode_logits,
    unlabelled,
)
from tests.conftest import tiny_label_skew

HEADS = [torch.eye(2), 3 * torch.eye(2), torch.tensor([[2.0, 1.0], [1.0, 2.0]])]
X = torch.eye(2)  # logits of client i are Z_i = H_i^T; the ensemble is their mean [[2, 1/3], [1/3, 2]]
ENSEMBLE = torch.tensor([[2.0, 1 / 3], [1 / 3, 2.0]])


def _tiny_clients(algorithm):
    return [algorithm.build_client(TinyLinear(head=head.clone()), 2) for head in HEADS]


def _kl_rows(target: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Mean over rows of sum_c target_c (log target_c - log student_c), from probabilities."""
    return (target * (target.log() - student.log())).sum(1).mean()


def test_feddf_distillation_losses_by_hand():
    """Each client's loss is T^2 KL(softmax(ensemble / T) || softmax(Z_i / T)), here at T = 2."""
    algorithm = FedDF(temperature=2.0)
    phase = algorithm.build_collaborative_phase(_tiny_clients(algorithm))
    losses = phase.collaborative_losses(X)
    target = torch.softmax(ENSEMBLE / 2, dim=1)
    for loss, head in zip(losses, HEADS, strict=True):
        expected = 4.0 * _kl_rows(target, torch.softmax(head.T / 2, dim=1))
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    # the client with the ensemble's own logits would have a zero loss
    assert _kl_rows(target, target).item() == pytest.approx(0.0, abs=1e-7)


def test_feddf_one_sgd_step_by_hand():
    """Plain SGD with weight decay: H -= lr (T (softmax(Z/T) - softmax(ens/T))^T / B + wd H), at T = 2."""
    algorithm = FedDF(temperature=2.0, public_lr=0.5, public_weight_decay=0.1)
    clients = _tiny_clients(algorithm)
    collaborate(algorithm, clients, unlabelled(X))
    target = torch.softmax(ENSEMBLE / 2, dim=1)
    for client, head in zip(clients, HEADS, strict=True):
        grad_logits = 2.0 * (torch.softmax(head.T / 2, dim=1) - target) / 2  # T (p - q) / B
        expected = head - 0.5 * (grad_logits.T + 0.1 * head)
        assert torch.allclose(client.model.head.weight, expected, atol=1e-6)


def test_feddf_a_collaborative_step_moves_every_client_towards_the_consensus():
    """After a distillation step every client's KL to the (fixed) ensemble shrank."""
    algorithm = FedDF(public_lr=0.05)  # the code's SGD 1e-3 moves logits by ~1e-6 per step
    clients = public_clients(algorithm)
    batches = public_batches()
    x = first_images(batches)
    before = train_mode_logits(clients, x)
    target = F.softmax(torch.stack(before).mean(0), dim=1)
    collaborate(algorithm, clients, batches)
    after = train_mode_logits(clients, x)
    for i in range(len(clients)):
        distance = [F.kl_div(F.log_softmax(z[i], 1), target, reduction="batchmean") for z in (before, after)]
        assert distance[1] < distance[0], f"client {i} did not move towards the ensemble"


def test_feddf_invalid_temperature_fails_in_one_line():
    """A non-positive temperature is a configuration error."""
    with pytest.raises(ConfigError, match="temperature"):
        FedDF(temperature=0.0)


def test_feddf_runs_on_label_skew_with_public_data_and_counts_bytes():
    """A label-skew round with public photos counts |B| x C float32 logits up and targets down per batch."""
    scenario = tiny_label_skew(public="photos", public_size=64, public_batch_size=32)
    scenario.setup()
    trainer = TrainerTemplate(max_epochs=1, accelerator="cpu")
    loop = FederationLoop(FedDF(), scenario, ["cnn_tiny", "mlp_tiny", "cnn_tiny"], trainer, rounds=1)
    summary = loop.run()
    assert math.isfinite(summary["final"]["acc_global"])
    # 1 round x 2 public batches x 3 participants x 32 images x 10 classes x 4 bytes, each way
    assert summary["comm"]["bytes_up"] == 2 * 3 * 32 * PUBLIC_CLASSES * 4
    assert summary["comm"]["bytes_down"] == summary["comm"]["bytes_up"]


def test_feddf_local_loss_is_cross_entropy_by_hand():
    """After the public phase FedDF trains on plain cross-entropy: log(1 + e^-1) for logits [1, 0], class 0."""
    client = FedDF().build_client(TinyLinear(), 2)
    loss = client.local_loss((torch.tensor([[1.0, 0.0]]), torch.tensor([0])))
    assert loss.item() == pytest.approx(0.313262, abs=1e-6)
    assert client.make_upload([]) is None and FedDF().build_server().download_for(0) is None
