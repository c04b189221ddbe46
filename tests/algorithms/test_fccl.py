"""FCCL: hand-computed dual-domain distillation loss and FCCM collaboration, pretraining once, bytes."""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.algorithms.fccl import FCCL, FCCLClient
from fedhet.federation import FederationLoop
from fedhet.federation.runtime import ClientTask
from fedhet.federation.trainer import TrainerTemplate
from tests.algorithms.helpers import TinyLinear
from tests.conftest import tiny_domain_shift

SWAP = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
# three public samples; client A's logits are X, client B's (head SWAP) X with its columns swapped
X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])


def _loop(algorithm, rounds=1, seed=0):
    scenario = tiny_domain_shift()  # 3 clients, 32 private images each, 64 public images in batches of 32
    architectures = ["cnn_tiny", "mlp_tiny", "cnn_tiny"]
    return FederationLoop(
        algorithm, scenario, architectures, TrainerTemplate(max_epochs=1, accelerator="cpu"), rounds=rounds, seed=seed
    )


def test_fccl_local_loss_is_ce_plus_kl_to_both_teachers_by_hand():
    """CE + KL(p_prev || p) + KL(p_pre || p) at temperature 1: previous-round logits [0, 1], pretrained [2, 0]."""
    client = FCCLClient(TinyLinear(), 2, pretrain_epochs=0)
    with torch.no_grad():
        client.previous_model.head.weight.copy_(SWAP)
        client.pretrained_model.head.weight.copy_(2 * torch.eye(2))
    s = math.e / (1 + math.e)  # p = (s, 1 - s) for logits [1, 0]
    r = math.e**2 / (1 + math.e**2)  # p_pre = (r, 1 - r) for logits [2, 0]
    kl_previous = (1 - s) * math.log((1 - s) / s) + s * math.log(s / (1 - s))
    kl_pretrained = r * math.log(r / s) + (1 - r) * math.log((1 - r) / (1 - s))
    expected = math.log1p(math.exp(-1.0)) + kl_previous + kl_pretrained
    loss = client.local_loss((torch.tensor([[1.0, 0.0]]), torch.tensor([0])))
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_fccl_collaborative_loss_is_fccm_to_the_mean_logits_by_hand():
    """FCCM against the participants' mean: every entry of M is 1/sqrt(3), so L = 2 (1 - m)^2 + 2 lambda (1 + m)^2."""
    algorithm = FCCL(pretrain_epochs=0)
    clients = [algorithm.build_client(TinyLinear(), 2), algorithm.build_client(TinyLinear(head=SWAP), 2)]
    for client in clients:
        client.pretrained.fill_(True)
    phase = algorithm.build_collaborative_phase(clients)
    losses = phase.collaborative_losses(X)
    # mean logits: both columns (z0 + z1) / 2 = (0.5, 0.5, -1), standardised (1, 1, -2) / sqrt(3); each client
    # column has unit std, so M[u, v] = (1 + 2) / sqrt(3) / 3 = 1 / sqrt(3) for every u, v
    m = 1 / math.sqrt(3)
    expected = 2 * (1 - m) ** 2 + 2 * 0.0051 * (1 + m) ** 2
    assert [loss.item() for loss in losses] == pytest.approx([expected, expected], rel=1e-4)
    # FCCL exchanges logits only: one [B, C] upload per client, the mean back to each
    assert phase.exchanged_bytes_up == phase.exchanged_bytes_down == 2 * 3 * 2 * 4


def test_fccl_clients_join_the_collaboration_only_once_pretrained():
    """A client that has not pretrained yet gets a zero collaborative loss and sends nothing."""
    algorithm = FCCL(pretrain_epochs=0)
    clients = [algorithm.build_client(TinyLinear(), 2), algorithm.build_client(TinyLinear(head=SWAP), 2)]
    clients[0].pretrained.fill_(True)
    phase = algorithm.build_collaborative_phase(clients)
    losses = phase.collaborative_losses(X)
    assert losses[1].item() == 0.0 and losses[0].item() > 0.0
    assert phase.exchanged_bytes_up == 3 * 2 * 4  # one participant's logits


def test_fccl_exchanges_nothing_before_clients_pretrained():
    """With no client pretrained yet (fresh states) the collaborative phase exchanges no bytes."""
    fccl = _loop(FCCL(pretrain_epochs=0))
    tasks = [ClientTask(c, 0, None, None) for c in range(3)]
    assert fccl.runtime.collaborate(tasks).bytes_up == 0


def test_fccl_pretrains_once_and_collaborates_afterwards(monkeypatch):
    """Every client pretrains once, in the run's "pretrain" phase before round 0; every round collaborates."""
    fits = []
    original = FCCLClient.on_fit_end

    def counting(self):
        fits.append((self.phase, self.stage))
        original(self)

    monkeypatch.setattr(FCCLClient, "on_fit_end", counting)
    loop = _loop(FCCL(pretrain_epochs=1), rounds=2)
    loop.run()
    assert fits[:3] == [("pretrain", "pretrain")] * 3 and fits.count(("pretrain", "pretrain")) == 3
    assert [r.get("phase") for r in loop.history] == ["pretrain", None, None]
    # the pretrain step exchanges nothing; both rounds collaborate and send Z only (FCCM)
    assert [r["comm/bytes_up"] for r in loop.history] == [0.0, 3 * 2 * 32 * 10 * 4, 3 * 2 * 32 * 10 * 4]
    for cid in range(3):
        state = loop.store.get(cid)["module"]
        assert bool(state["pretrained"])
        assert not torch.equal(state["pretrained_model.head.weight"], state["model.head.weight"])


def test_fccl_pretrains_once_before_the_federation_with_its_own_adam_and_cosine_schedule():
    """One pretraining phase before the rounds, no exchange: ``pretrain_epochs`` of Adam, cosine to the floor."""
    from fedhet.algorithms.base import LocalStage, RunPhase
    from fedhet.algorithms.fccl import PRETRAIN

    assert tuple(FCCL().phases()) == (RunPhase(PRETRAIN, "before", rounds=1, participation=None, exchange=False),)
    client = FCCLClient(TinyLinear(), 2, pretrain_epochs=1, pretrain_lr=0.3, pretrain_min_lr=0.01)
    assert client.num_classes == 2 and client.hp.pretrain_lr == 0.3
    assert not any(p.requires_grad for p in client.pretrained_model.parameters())
    client.phase = PRETRAIN
    assert tuple(client.local_stages()) == (LocalStage(PRETRAIN, epochs=1),)
    client.stage = PRETRAIN
    config = client.configure_optimizers()
    schedule = config["lr_scheduler"]
    assert isinstance(config["optimizer"], torch.optim.Adam) and config["optimizer"].param_groups[0]["lr"] == 0.3
    assert schedule["interval"] == "epoch"
    assert (schedule["scheduler"].T_max, schedule["scheduler"].eta_min) == (1, 0.01)
