"""FedProto: hand-computed prototype-regularised client loss, class-mean uploads, per-class server mean."""

from __future__ import annotations

import pytest
import torch

from fedhet.algorithms.fedproto import FedProto
from fedhet.algorithms.shared.common import ClassMeanServer, ClassSums, FedProtoClient
from fedhet.core.payloads import ClassStatsPayload
from fedhet.errors import TrainingError
from tests.algorithms.helpers import TinyLinear, context, upload


def test_fedproto_client_loss_and_upload_by_hand():
    """CE + lam * MSE(features, global prototype) over samples whose class has one; uploads class-mean features."""
    client = FedProtoClient(TinyLinear(), num_classes=2, lam=0.5)
    x = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    y = torch.tensor([0, 1])
    # global prototype only for class 0
    client.on_receive(ClassStatsPayload(values=torch.tensor([[0.0, 0.0], [0.0, 0.0]]), counts=torch.tensor([1, 0])))
    loss = client.local_loss((x, y))
    # logits = x: CE = (log(1 + e^-1) + log(1 + e^-3)) / 2 = (0.313262 + 0.048587) / 2 = 0.180925
    # MSE over the class-0 sample only: ([1, 0] - [0, 0])^2 averaged over 2 elements = 0.5
    assert loss.item() == pytest.approx(0.180925 + 0.5 * 0.5, abs=1e-6)
    sent = client.make_upload([(x, y), (torch.tensor([[3.0, 0.0]]), torch.tensor([0]))])
    assert torch.allclose(sent.values, torch.tensor([[2.0, 0.0], [0.0, 3.0]]))
    assert sent.counts.tolist() == [2, 1]


def test_fedproto_client_without_prototypes_is_plain_cross_entropy():
    """Before the first download (or with no class covered) the loss is CE only."""
    client = FedProtoClient(TinyLinear(), num_classes=2, lam=100.0)
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    assert client.local_loss((x, y)).item() == pytest.approx(0.313262, abs=1e-6)
    client.on_receive(ClassStatsPayload(values=torch.tensor([[9.0, 9.0], [0.0, 0.0]]), counts=torch.tensor([0, 1])))
    assert client.local_loss((x, y)).item() == pytest.approx(0.313262, abs=1e-6)


def test_fedproto_server_with_classes_missing_on_some_clients():
    """Per class: the count-weighted (paper) or uniform (HtFLlib) mean over the clients holding it, by hand."""
    server = ClassMeanServer("count")
    server.setup_server(context(num_classes=3))
    assert server.download_for(0) is None  # nothing before the first aggregation
    p0 = ClassStatsPayload(values=torch.tensor([[2.0, 0.0], [0.0, 0.0], [1.0, 1.0]]), counts=torch.tensor([1, 0, 3]))
    p1 = ClassStatsPayload(values=torch.tensor([[4.0, 2.0], [9.0, 9.0], [0.0, 0.0]]), counts=torch.tensor([3, 2, 0]))
    server.aggregate(0, [upload(0, p0), upload(1, p1)])
    download = server.download_for(0)
    # class 0: (1*[2,0] + 3*[4,2]) / 4 = [3.5, 1.5]; class 1 only client 1; class 2 only client 0
    assert torch.allclose(download.values, torch.tensor([[3.5, 1.5], [9.0, 9.0], [1.0, 1.0]]))
    assert download.counts.tolist() == [1, 1, 1]
    uniform = ClassMeanServer("uniform")
    uniform.setup_server(context(num_classes=3))
    uniform.aggregate(0, [upload(0, p0), upload(1, p1)])
    assert torch.allclose(uniform.download_for(0).values[0], torch.tensor([3.0, 1.0]))
    restored = ClassMeanServer("count")
    restored.setup_server(context(num_classes=3))
    restored.load_server_state(server.server_state())
    assert torch.equal(restored.download_for(1).values, download.values)


def test_fedproto_server_marks_classes_nobody_holds_absent():
    """A class no participant holds gets count 0 and a zero row, and no client is regularised towards it."""
    server = FedProto().build_server()
    server.setup_server(context(num_classes=3))
    server.aggregate(0, [upload(0, ClassStatsPayload(values=torch.ones(3, 2), counts=torch.tensor([2, 0, 0])))])
    download = server.download_for(0)
    assert download.counts.tolist() == [1, 0, 0] and torch.equal(download.values[1:], torch.zeros(2, 2))
    assert download.nbytes() == 2 * 4 + 8  # one held row of 2 float32 and its int64 count


def test_fedproto_server_rejects_mismatched_prototypes():
    """Prototypes of another feature size or class count are refused naming the client."""
    server = ClassMeanServer()
    server.setup_server(context(num_classes=3))
    good = ClassStatsPayload(values=torch.ones(3, 2), counts=torch.ones(3, dtype=torch.long))
    bad = ClassStatsPayload(values=torch.ones(3, 4), counts=torch.ones(3, dtype=torch.long))
    with pytest.raises(TrainingError, match="client 1"):
        server.aggregate(0, [upload(0, good), upload(1, bad)])


def test_class_means_from_training_steps_by_hand():
    """The steps' own features (every step and epoch) are averaged, with the data's counts; each fit starts afresh."""
    client = FedProtoClient(TinyLinear(), num_classes=3, class_means_from="training_steps")
    client.train()  # a fresh client: its first steps need no on_train_start
    data = [
        (torch.tensor([[1.0, 0.0], [0.0, 3.0]]), torch.tensor([0, 1])),
        (torch.tensor([[3.0, 0.0]]), torch.tensor([0])),
    ]
    for x, y in data:  # epoch 1 with these features ...
        client.local_loss((x, y))
    client.local_loss((torch.tensor([[5.0, 2.0]]), torch.tensor([0])))  # ... and a later step saw others
    client.eval()
    client.local_loss((torch.tensor([[100.0, 100.0]]), torch.tensor([1])))  # eval mode: not a training step
    sent = client.make_upload(data)
    # class 0: (1 + 3 + 5) / 3 = 3 and (0 + 0 + 2) / 3 = 2/3; class 1: [0, 3]; class 2: never seen
    assert torch.allclose(sent.values, torch.tensor([[3.0, 2.0 / 3.0], [0.0, 3.0], [0.0, 0.0]]))
    assert sent.counts.tolist() == [2, 1, 0]  # |D_ij| of the data, not the 3 class-0 features the steps saw
    assert sent.counts.dtype == torch.long

    client.on_train_start()  # the next client's (or round's) fit
    client.train()
    client.local_loss((torch.tensor([[0.0, 7.0]]), torch.tensor([1])))
    # the data also holds a class-0 image no step saw (a budget cut short): no mean, so no count
    sent = client.make_upload([(torch.tensor([[0.0, 7.0], [4.0, 4.0]]), torch.tensor([1, 0]))])
    assert torch.allclose(sent.values, torch.tensor([[0.0, 0.0], [0.0, 7.0], [0.0, 0.0]]))
    assert sent.counts.tolist() == [0, 1, 0]


def test_class_means_from_training_steps_needs_a_step():
    """Without a training step in the fit there is nothing to upload: one line naming the fix."""
    client = FedProtoClient(TinyLinear(), num_classes=2, class_means_from="training_steps")
    client.on_train_start()
    with pytest.raises(TrainingError) as error:
        client.make_upload([(torch.tensor([[1.0, 0.0]]), torch.tensor([0]))])
    assert str(error.value) == (
        "FedProtoClient: class_means_from='training_steps' but no training step ran in this fit; "
        "give the client a local budget or use class_means_from='eval_pass'"
    )
    with pytest.raises(AssertionError, match="^no batch was added$"):
        ClassSums(2).means()
