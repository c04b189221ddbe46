"""FedMD and the shared public-distillation frame: hand-computed digest loss and Adam step, ledger, settings.

FedMD's file also holds the tests of :class:`PublicDistillationPhase` / ``PublicDistillationAlgorithm``
(defined in ``fedhet/algorithms/shared/common.py``), which FedDF, RHFL and FedMatch share.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import RHFL, FedDF, FedMatch, FedMD
from fedhet.errors import ConfigError, TrainingError
from tests.algorithms.helpers import (
    TinyLinear,
    collaborate,
    first_images,
    public_batches,
    public_clients,
    train_mode_logits,
    unlabelled,
)

HEADS = [torch.eye(2), 3 * torch.eye(2), torch.tensor([[2.0, 1.0], [1.0, 2.0]])]
X = torch.eye(2)  # two public samples: logits of client i are the columns of its head, Z_i = H_i^T


def _tiny_clients(algorithm):
    return [algorithm.build_client(TinyLinear(head=head.clone()), 2) for head in HEADS]


def test_fedmd_digest_losses_by_hand():
    """L1 to the consensus mean of all three clients' logits: [[2, 1/3], [1/3, 2]] gives 2/3, 2/3 and 1/3."""
    phase = FedMD().build_collaborative_phase(_tiny_clients(FedMD()))
    losses = phase.collaborative_losses(X)
    assert [loss.item() for loss in losses] == pytest.approx([2 / 3, 2 / 3, 1 / 3], abs=1e-6)
    mse = FedMD(digest_loss="mse").build_collaborative_phase(_tiny_clients(FedMD()))
    # squared differences: client 0 (1 + 1/9 + 1/9 + 1) / 4 = 5/9; client 2 (4/9 + 4/9) / 4 = 2/9
    assert [loss.item() for loss in mse.collaborative_losses(X)] == pytest.approx([5 / 9, 5 / 9, 2 / 9], abs=1e-6)


def test_fedmd_one_digest_step_is_a_fresh_adam_step_by_hand():
    """A fresh Adam's first step moves each head entry by -lr * sign(gradient), gradient (sign(Z - c) / 4)^T."""
    algorithm = FedMD(public_lr=0.01)
    clients = _tiny_clients(algorithm)
    collaborate(algorithm, clients, unlabelled(X))
    lr = 0.01
    # client 1: Z - c = [[1, -1/3], [-1/3, 1]]; client 2: [[0, 2/3], [2/3, 0]] (zero gradient on the diagonal)
    assert torch.allclose(clients[1].model.head.weight, torch.tensor([[3 - lr, lr], [lr, 3 - lr]]), atol=1e-6)
    assert torch.allclose(clients[2].model.head.weight, torch.tensor([[2.0, 1 - lr], [1 - lr, 2.0]]), atol=1e-6)
    assert torch.allclose(clients[0].model.head.weight, torch.tensor([[1 + lr, lr], [lr, 1 + lr]]), atol=1e-6)


def test_fedmd_a_collaborative_step_moves_every_client_towards_the_consensus():
    """After a digest step every client's L1 distance to the (fixed) consensus of the others shrank."""
    algorithm = FedMD()
    clients = public_clients(algorithm)
    batches = public_batches()
    x = first_images(batches)
    before = train_mode_logits(clients, x)
    consensus = torch.stack(before).mean(0)
    collaborate(algorithm, clients, batches)
    after = train_mode_logits(clients, x)
    for i in range(len(clients)):
        assert F.l1_loss(after[i], consensus) < F.l1_loss(before[i], consensus), f"client {i} did not move"


def test_targets_carry_no_gradient_to_other_clients():
    """One client's digest loss back-propagates into that client only."""
    clients = public_clients(FedMD())
    phase = FedMD().build_collaborative_phase(clients)
    losses = phase.collaborative_losses(first_images(public_batches()))
    losses[0].backward()
    assert all(p.grad is not None for p in clients[0].parameters() if p.requires_grad)
    for other in clients[1:]:
        assert all(p.grad is None for p in other.parameters()), "client 0's loss reached another client"


def test_ledger_counts_logits_up_and_targets_down_as_float32():
    """Per public batch each participant sends |B| x C float32 logits and receives a target of the same size."""
    clients = public_clients(FedDF())
    phase = collaborate(FedDF(), clients, public_batches(steps=2))
    # 2 batches x 3 participants x 8 images x 10 classes x 4 bytes
    assert phase.exchanged_bytes_up == 2 * 3 * 8 * 10 * 4
    assert phase.exchanged_bytes_down == phase.exchanged_bytes_up


def test_optimizer_state_is_reset_every_public_step_unless_disabled():
    """``reset_public_optimizer`` gives a fresh Adam per public batch (step count 1), else one per round (2)."""
    for reset, expected_steps in ((True, 1), (False, 2)):
        algorithm = FedMD(reset_public_optimizer=reset)
        phase = collaborate(algorithm, public_clients(algorithm), public_batches(steps=2))
        optimizer = phase.trainer.optimizers[0]
        steps = {int(state["step"]) for state in optimizer.state.values()}
        assert steps == {expected_steps}, f"reset={reset}"


def test_fedmd_pretrain_rounds_skip_the_digest():
    """Rounds before ``pretrain_rounds`` exchange nothing and leave the weights unchanged."""
    algorithm = FedMD(pretrain_rounds=1)
    clients = public_clients(algorithm)
    weights = [{k: v.clone() for k, v in c.state_dict().items() if v.is_floating_point()} for c in clients]
    phase = collaborate(algorithm, clients, public_batches(), round_idx=0)
    assert phase.exchanged_bytes_up == 0
    for client, saved in zip(clients, weights, strict=True):
        state = client.state_dict()
        assert all(torch.equal(state[k], v) for k, v in saved.items() if "running" not in k)
    assert collaborate(algorithm, clients, public_batches(), round_idx=1).exchanged_bytes_up > 0


def test_non_finite_public_logits_are_rejected_in_one_line():
    """A participant whose logits are NaN is named in a one-line TrainingError."""
    clients = public_clients(FedMD())
    with torch.no_grad():
        next(clients[1].parameters()).fill_(math.nan)
    phase = FedMD().build_collaborative_phase(clients)
    with pytest.raises(TrainingError, match="participant 1 sent non-finite"):
        phase.collaborative_losses(first_images(public_batches()))


def test_fedmd_invalid_hyperparameters_fail_in_one_line():
    """An unknown digest loss or negative pretraining rounds are configuration errors."""
    with pytest.raises(ConfigError, match="digest_loss"):
        FedMD(digest_loss="huber")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="pretrain_rounds"):
        FedMD(pretrain_rounds=-1)


@pytest.mark.parametrize("method", [FedMD, FedDF, RHFL, FedMatch])
def test_public_phase_settings_are_checked_once_for_every_method(method):
    """The shared declaration checks public_epochs and public_lr and hands the phase its optimizer settings."""
    with pytest.raises(ConfigError, match=rf"^{method.__name__}: public_epochs=-1 is not an integer >= 0"):
        method(public_epochs=-1)
    with pytest.raises(ConfigError, match=rf"^{method.__name__}: public_lr=0.0 is not a number > 0"):
        method(public_lr=0.0)
    algorithm = method(
        public_epochs=3, public_optimizer="sgd", public_lr=0.5, public_weight_decay=0.1, reset_public_optimizer=False
    )
    assert algorithm.collaborative_epochs() == 3
    phase = algorithm.build_collaborative_phase(public_clients(algorithm, ("mlp_tiny",)))
    expected = {
        "public_optimizer": "sgd", "public_lr": 0.5, "public_weight_decay": 0.1, "reset_public_optimizer": False
    }
    assert {name: getattr(phase.hp, name) for name in expected} == expected
    optimizer = phase.configure_optimizers()[0]
    assert isinstance(optimizer, torch.optim.SGD)
    assert (optimizer.defaults["lr"], optimizer.defaults["weight_decay"]) == (0.5, 0.1)
    assert algorithm.capabilities.needs_public_data and algorithm.capabilities.heterogeneous_models


def test_fedmd_local_loss_is_cross_entropy_by_hand():
    """After the public phase FedMD trains on plain cross-entropy: log(1 + e^-1) for logits [1, 0], class 0."""
    client = FedMD().build_client(TinyLinear(), 2)
    loss = client.local_loss((torch.tensor([[1.0, 0.0]]), torch.tensor([0])))
    assert loss.item() == pytest.approx(0.313262, abs=1e-6)
    assert client.make_upload([]) is None and FedMD().build_server().download_for(0) is None
