"""FD (FedDistill): hand-computed logit-regularised client loss, class-mean logit uploads, uniform server mean."""

from __future__ import annotations

import pytest
import torch

from fedhet.algorithms.fd import FD, FDClient
from fedhet.federation.payloads import ClassStatsPayload
from tests.algorithms.helpers import TinyLinear, context, upload


def test_fd_client_regularises_logits_towards_global_class_logits():
    """CE + gamma * MSE(logits, global logits of the class): logits [1, 0] to [3, 0] adds gamma * 2."""
    client = FD(gamma=0.5).build_client(TinyLinear(), 2)
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    client.on_receive(ClassStatsPayload(values=torch.tensor([[3.0, 0.0], [0.0, 0.0]]), counts=torch.tensor([2, 2])))
    # logits = x; CE = log(1 + e^-1) = 0.313262; MSE([1,0], [3,0]) = (4 + 0) / 2 = 2
    assert client.local_loss((x, y)).item() == pytest.approx(0.313262 + 0.5 * 2.0, abs=1e-6)


def test_fd_upload_is_the_class_mean_logits_by_hand():
    """The upload holds, per class held, the mean logit vector over the client's training data."""
    client = FDClient(TinyLinear(head=torch.tensor([[2.0, 0.0], [0.0, 1.0]])), num_classes=2)
    batches = [
        (torch.tensor([[1.0, 0.0], [3.0, 1.0]]), torch.tensor([0, 0])),
        (torch.tensor([[0.0, 4.0]]), torch.tensor([1])),
    ]
    sent = client.make_upload(batches)
    # logits: [2, 0], [6, 1] (class 0, mean [4, 0.5]); [0, 4] (class 1)
    assert torch.allclose(sent.values, torch.tensor([[4.0, 0.5], [0.0, 4.0]]))
    assert sent.counts.tolist() == [2, 1]


def test_fd_server_averages_class_logits_uniformly_by_hand():
    """FD's server (HtFLlib) gives each client holding a class one vote: ([2, 0] + [4, 2]) / 2 = [3, 1]."""
    server = FD().build_server()
    assert server.weighting == "uniform"
    server.setup(context(num_classes=2))
    server.aggregate(0, [
        upload(0, ClassStatsPayload(values=torch.tensor([[2.0, 0.0], [0.0, 0.0]]), counts=torch.tensor([1, 0]))),
        upload(1, ClassStatsPayload(values=torch.tensor([[4.0, 2.0], [5.0, 7.0]]), counts=torch.tensor([9, 3]))),
    ])
    download = server.download_for(0)
    assert torch.allclose(download.values, torch.tensor([[3.0, 1.0], [5.0, 7.0]]))
    assert download.counts.tolist() == [1, 1]
    weighted = FD(logit_weighting="count").build_server()
    weighted.setup(context(num_classes=2))
    weighted.aggregate(0, [
        upload(0, ClassStatsPayload(values=torch.tensor([[2.0, 0.0], [0.0, 0.0]]), counts=torch.tensor([1, 0]))),
        upload(1, ClassStatsPayload(values=torch.tensor([[4.0, 2.0], [5.0, 7.0]]), counts=torch.tensor([3, 3]))),
    ])
    assert torch.allclose(weighted.download_for(0).values[0], torch.tensor([3.5, 1.5]))  # (2 + 12) / 4, 6 / 4
