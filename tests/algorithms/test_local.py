"""Local: plain cross-entropy on private data, nothing sent either way (hand-computed on a tiny model)."""

from __future__ import annotations

import pytest
import torch

from fedhet.algorithms.base import ServerPhase
from fedhet.algorithms.local import Local
from tests.algorithms.helpers import TinyLinear, fit, one_batch_loader

# x = [1, 0], class 0, through identity body and head: logits [1, 0], p = [e/(1+e), 1/(1+e)]
P0 = 0.731059  # e / (1 + e)
CE_10 = 0.313262  # -log p0 = log(1 + e^-1)
CE_02 = 0.126928  # class 1 of logits [0, 2]: log(1 + e^-2)


def test_local_loss_is_plain_cross_entropy_by_hand():
    """Local's objective on the tiny model is the batch mean of the cross-entropies worked out by hand."""
    client = Local().build_client(TinyLinear(), 2)
    loss = client.local_loss((torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])))
    assert loss.item() == pytest.approx((CE_10 + CE_02) / 2, abs=1e-6)


def test_local_one_sgd_step_through_lightning_by_hand():
    """One Lightning step of SGD (lr 0.1) moves head and body by -0.1 * (p - onehot) x^T, worked by hand."""
    client = Local(lr=0.1).build_client(TinyLinear(), 2)
    meter = fit(client, one_batch_loader(torch.tensor([[1.0, 0.0]]), torch.tensor([0])), max_steps=1)
    # dL/dlogits = p - onehot = [-(1 - p0), 1 - p0]; features = x, so both layers get (p - onehot) [1, 0]
    step = 0.1 * (1 - P0)
    expected = torch.tensor([[1.0 + step, 0.0], [-step, 1.0]])
    assert torch.allclose(client.model.head.weight, expected, atol=1e-6)
    assert torch.allclose(client.model.body.weight, expected, atol=1e-6)
    assert meter.mean() == pytest.approx(CE_10, abs=1e-6)


def test_local_mean_train_loss_averages_the_steps_of_the_epoch():
    """The loss the loop logs is the mean over the epoch's steps (lr 1e-12 keeps both batches' losses known)."""
    client = Local(lr=1e-12).build_client(TinyLinear(), 2)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])), batch_size=1
    )
    meter = fit(client, loader)
    assert meter.steps == 2
    assert meter.mean() == pytest.approx((CE_10 + CE_02) / 2, abs=1e-6)


def test_local_sends_nothing_and_keeps_its_whole_model():
    """No upload, no download, a server that does nothing, and the client state is the whole module."""
    algorithm = Local(optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=1e-3)
    client = algorithm.build_client(TinyLinear(), 2)
    assert client.make_upload([(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long))]) is None
    server = algorithm.build_server()
    assert type(server) is ServerPhase and server.download_for(0) is None
    assert algorithm.upload_type is None and algorithm.download_type is None
    assert set(client.client_state()) == {"model.body.weight", "model.head.weight"}
    optimizer = client.configure_optimizers()
    assert optimizer.defaults["momentum"] == 0.9 and optimizer.defaults["weight_decay"] == 1e-3
