"""FD (FedDistill): hand-computed logit-regularised client loss, class-mean logit uploads, uniform server mean."""

from __future__ import annotations

import pytest
import torch

from fedhet.algorithms.fd import FD, FDClient
from fedhet.core.payloads import ClassStatsPayload
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
    server.setup_server(context(num_classes=2))
    server.aggregate(0, [
        upload(0, ClassStatsPayload(values=torch.tensor([[2.0, 0.0], [0.0, 0.0]]), counts=torch.tensor([1, 0]))),
        upload(1, ClassStatsPayload(values=torch.tensor([[4.0, 2.0], [5.0, 7.0]]), counts=torch.tensor([9, 3]))),
    ])
    download = server.download_for(0)
    assert torch.allclose(download.values, torch.tensor([[3.0, 1.0], [5.0, 7.0]]))
    assert download.counts.tolist() == [1, 1]
    weighted = FD(logit_weighting="count").build_server()
    weighted.setup_server(context(num_classes=2))
    weighted.aggregate(0, [
        upload(0, ClassStatsPayload(values=torch.tensor([[2.0, 0.0], [0.0, 0.0]]), counts=torch.tensor([1, 0]))),
        upload(1, ClassStatsPayload(values=torch.tensor([[4.0, 2.0], [5.0, 7.0]]), counts=torch.tensor([3, 3]))),
    ])
    assert torch.allclose(weighted.download_for(0).values[0], torch.tensor([3.5, 1.5]))  # (2 + 12) / 4, 6 / 4


def test_fd_paper_regulariser_is_the_cross_entropy_to_the_softmaxed_global_logits_by_hand():
    """distillation=ce: CE + gamma * (-sum softmax(g) log softmax(z)); logits [1, 0], global [3, 0], gamma 0.5."""
    import math

    client = FD(gamma=0.5, distillation="ce").build_client(TinyLinear(), 2)
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    client.on_receive(ClassStatsPayload(values=torch.tensor([[3.0, 0.0], [0.0, 0.0]]), counts=torch.tensor([2, 2])))
    p_target = [1 / (1 + math.exp(-3.0)), 1 / (1 + math.exp(3.0))]  # softmax([3, 0])
    log_q = [-math.log(1 + math.exp(-1.0)), -math.log(1 + math.exp(1.0))]  # log softmax([1, 0])
    ce = -log_q[0]  # 0.313262
    expected = ce + 0.5 * -(p_target[0] * log_q[0] + p_target[1] * log_q[1])
    assert client.local_loss((x, y)).item() == pytest.approx(expected, abs=1e-6)


def test_fd_paper_regulariser_gradient_stays_bounded_when_targets_explode():
    """With global logits of 1e6 the MSE gradient explodes; the paper's stays within (1 + gamma) * 2 * |x|_1 = 4."""
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    download = ClassStatsPayload(values=torch.tensor([[1e6, -1e6], [0.0, 0.0]]), counts=torch.tensor([2, 2]))
    norms = {}
    for form in ("mse", "ce"):
        client = FD(gamma=1.0, distillation=form).build_client(TinyLinear(), 2)
        client.on_receive(download)
        client.local_loss((x, y)).backward()
        norms[form] = float(client.model.head.weight.grad.abs().sum())
    assert norms["mse"] > 1e5 and norms["ce"] < 4.0


def test_the_server_expects_logits_of_the_class_count_not_features():
    """Three classes on a two-feature network: [3, 3] mean logits are accepted, [3, 2] feature-wide rows refused."""
    from fedhet.errors import TrainingError

    client = FD().build_client(TinyLinear(head=torch.ones(3, 2)), 3)
    server = FD().build_server()
    server.setup_server(context(num_classes=3, initial=client.state_dict()))
    counts = torch.tensor([2, 1, 0])
    server.check_upload(upload(0, ClassStatsPayload(values=torch.ones(3, 3), counts=counts, num_examples=3)))
    with pytest.raises(TrainingError, match="client 0"):
        server.check_upload(upload(0, ClassStatsPayload(values=torch.ones(3, 2), counts=counts, num_examples=3)))
