"""FedProc: hand-computed prototype-contrastive client loss with its round schedule, server averaging."""

from __future__ import annotations

import pytest
import torch

from fedhet.algorithms.fedproc import FedProcClient, FedProcServer, WeightsAndPrototypesPayload
from fedhet.core.payloads import WeightsPayload
from fedhet.errors import TrainingError
from tests.algorithms.helpers import TinyLinear, context, upload


def test_fedproc_client_loss_by_hand_with_round_schedule():
    """Round 0 is CE only; round 1 of 5 is 0.75 * L_proto + 0.25 * CE; the upload holds class-mean features."""
    client = FedProcClient(TinyLinear(), num_classes=2)
    x, y = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])
    weights = {"body.weight": torch.eye(2), "head.weight": torch.eye(2)}
    # round 0, no prototypes yet: CE of logits x = (log(1 + e^-1) + log(1 + e^-2)) / 2 = 0.220095
    assert client.local_loss((x, y)).item() == pytest.approx(0.220095, abs=1e-5)  # before any download
    empty, no_counts = torch.zeros(2, 0), torch.zeros(2, dtype=torch.long)
    client.on_receive(WeightsAndPrototypesPayload(weights=weights, prototypes=empty, counts=no_counts))
    assert client.local_loss((x, y)).item() == pytest.approx(0.220095, abs=1e-5)
    # round 1 of 5: alpha = 0.75; prototype loss with c0 = [1, 0], c1 = [1, 1] is 0.479110
    # (tests/functional/test_contrastive.py): 0.75 * 0.479110 + 0.25 * 0.220095 = 0.414356
    prototypes = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    client.on_receive(WeightsAndPrototypesPayload(weights=weights, prototypes=prototypes, counts=torch.tensor([1, 1])))
    client.round_idx, client.total_rounds = 1, 5
    assert client.local_loss((x, y)).item() == pytest.approx(0.414356, abs=1e-5)
    upload_ = client.make_upload([(x, y), (torch.tensor([[3.0, 0.0]]), torch.tensor([0]))])
    assert torch.allclose(upload_.prototypes, torch.tensor([[2.0, 0.0], [0.0, 2.0]]))
    assert upload_.counts.tolist() == [2, 1] and torch.equal(upload_.weights["body.weight"], torch.eye(2))


def test_fedproc_constant_schedule_weighs_the_two_losses_by_alpha():
    """With ``alpha_schedule="constant"`` the weight is alpha in every round: 0.5 * 0.479110 + 0.5 * 0.220095."""
    client = FedProcClient(TinyLinear(), num_classes=2, alpha_schedule="constant", alpha=0.5)
    weights = {"body.weight": torch.eye(2), "head.weight": torch.eye(2)}
    prototypes = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    client.on_receive(WeightsAndPrototypesPayload(weights=weights, prototypes=prototypes, counts=torch.tensor([1, 1])))
    client.round_idx, client.total_rounds = 3, 5
    loss = client.local_loss((torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])))
    assert loss.item() == pytest.approx(0.5 * 0.479110 + 0.5 * 0.220095, abs=1e-5)


def _server_with_two_uploads(weighting):
    server = FedProcServer(proto_weighting=weighting)
    server.setup_server(context(num_classes=3, initial={"model.w": torch.zeros(2)}))
    p0 = WeightsAndPrototypesPayload(
        weights={"w": torch.tensor([1.0, 2.0])},
        prototypes=torch.tensor([[2.0, 0.0], [0.0, 0.0], [1.0, 1.0]]),
        counts=torch.tensor([1, 0, 3]),
        num_examples=30,
    )
    p1 = WeightsAndPrototypesPayload(
        weights={"w": torch.tensor([5.0, 6.0])},
        prototypes=torch.tensor([[4.0, 2.0], [9.0, 9.0], [0.0, 0.0]]),
        counts=torch.tensor([3, 2, 0]),
        num_examples=10,
    )
    server.aggregate(0, [upload(0, p0), upload(1, p1)])
    return server, p0


def test_fedproc_server_averages_weights_and_prototypes_by_hand():
    """Weights by examples, prototypes per class over the clients holding it (count or uniform); bytes by hand."""
    server, sent = _server_with_two_uploads("count")
    download = server.download_for(0)
    # weights: 0.75 * [1, 2] + 0.25 * [5, 6] = [2, 3]
    assert torch.allclose(download.weights["w"], torch.tensor([2.0, 3.0]))
    # class 0: (1 * [2, 0] + 3 * [4, 2]) / 4 = [3.5, 1.5]; classes 1 and 2 held by one client each
    assert torch.allclose(download.prototypes, torch.tensor([[3.5, 1.5], [9.0, 9.0], [1.0, 1.0]]))
    assert download.counts.tolist() == [1, 1, 1]
    uniform, _ = _server_with_two_uploads("uniform")
    assert torch.allclose(uniform.download_for(0).prototypes[0], torch.tensor([3.0, 1.0]))  # ([2,0] + [4,2]) / 2
    # bytes: 2 float32 weights (8) + 2 held rows of 2 float32 (16) + 2 int64 counts (16) = 40
    assert sent.nbytes() == 40
    restored = FedProcServer()
    restored.setup_server(context(num_classes=3, initial={"model.w": torch.zeros(2)}))
    restored.load_server_state(server.server_state())
    assert torch.equal(restored.download_for(1).prototypes, download.prototypes)


def test_fedproc_first_download_has_weights_and_no_prototypes():
    """Before the first aggregation the download carries the initial weights and a [C, 0] prototype block."""
    server = FedProcServer()
    server.setup_server(context(num_classes=3, initial={"model.w": torch.ones(2)}))
    download = server.download_for(0)
    assert download.prototypes.shape == (3, 0) and int(download.counts.sum()) == 0
    assert download.nbytes() == 8


def test_fedproc_server_rejects_bad_prototypes():
    """Prototypes of the wrong shape, non-finite ones, or weights without prototypes are refused."""
    server, _ = _server_with_two_uploads("count")
    counts = torch.ones(3, dtype=torch.long)
    weights = {"w": torch.zeros(2)}
    wrong_shape = WeightsAndPrototypesPayload(weights=weights, prototypes=torch.zeros(3, 5), counts=counts)
    with pytest.raises(TrainingError, match="shape"):
        server.check_upload(upload(0, wrong_shape))
    not_finite = WeightsAndPrototypesPayload(
        weights={"w": torch.zeros(2)}, prototypes=torch.tensor([[float("nan"), 0.0]] * 3), counts=counts
    )
    with pytest.raises(TrainingError, match="non-finite"):
        server.check_upload(upload(0, not_finite))
    with pytest.raises(TrainingError, match="expected weights and prototypes"):
        server.check_upload(upload(0, WeightsPayload(weights={"w": torch.zeros(2)})))


def test_fedproc_contrasts_only_against_the_classes_with_a_prototype():
    """Class 2 has no global prototype (count 0): its row, however placed, is not among the negatives."""
    head = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    client = FedProcClient(TinyLinear(head=head), num_classes=3)
    x, y = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])
    weights = {"body.weight": torch.eye(2), "head.weight": head}
    prototypes = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    payload = WeightsAndPrototypesPayload(weights=weights, prototypes=prototypes, counts=torch.tensor([1, 1, 0]))
    client.on_receive(payload)
    client.round_idx, client.total_rounds = 1, 5
    ce = torch.nn.functional.cross_entropy(x @ head.T, y)
    # alpha = 0.75; L_proto over c0 = [1, 0] and c1 = [1, 1] alone is 0.479110 (tests/functional/test_contrastive.py)
    assert client.local_loss((x, y)).item() == pytest.approx(0.75 * 0.479110 + 0.25 * ce.item(), abs=1e-5)


def test_fedproc_client_uploads_int64_counts_and_needs_data():
    """Counts are int64 (what the server accepts); a client without a batch says why it cannot upload."""
    client = FedProcClient(TinyLinear(), num_classes=2)
    sent = client.make_upload([(torch.tensor([[1.0, 0.0]]), torch.tensor([1]))])
    assert sent.counts.dtype == torch.long and sent.counts.tolist() == [0, 1]
    with pytest.raises(TrainingError) as error:
        client.make_upload([])
    assert str(error.value) == "a FedProc client without training data cannot upload class prototypes"


def test_fedproc_builds_its_server_with_the_methods_weighting():
    """``proto_weighting`` reaches the server the algorithm builds."""
    from fedhet.algorithms import FedProc

    assert FedProc(proto_weighting="uniform").build_server().hp.proto_weighting == "uniform"
    assert FedProc().build_server().hp.proto_weighting == "count"


def test_fedproc_checks_prototypes_against_the_head_width_and_what_the_client_holds():
    """Before any prototype exists the width is the global head's input; counts stay within the held examples."""
    head = {"model.body.weight": torch.eye(2), "model.head.weight": torch.zeros(3, 2)}
    server = FedProcServer()
    server.setup_server(context(num_classes=3, initial=head, label_counts=torch.tensor([[2, 2, 2], [1, 0, 0]])))
    first = server.download_for(0)
    assert first.prototypes.shape == (3, 0) and first.counts.dtype == torch.long and first.counts.shape == (3,)
    weights = {"body.weight": torch.eye(2), "head.weight": torch.zeros(3, 2)}
    counts = torch.tensor([1, 1, 1])

    def refusal(client_id, prototypes, counts=counts):
        payload = WeightsAndPrototypesPayload(weights=weights, prototypes=prototypes, counts=counts)
        with pytest.raises(TrainingError) as error:
            server.check_upload(upload(client_id, payload))
        return str(error.value)

    accepted = WeightsAndPrototypesPayload(weights=weights, prototypes=torch.zeros(3, 2), counts=counts)
    server.check_upload(upload(0, accepted))
    assert refusal(0, torch.zeros(3, 5)).startswith("client 0 sent 'values' of shape (3, 5), expected (3, 2)")
    assert refusal(0, torch.zeros(2, 2)).startswith("client 0 sent 'values' of shape (2, 2), expected (3, 2)")
    assert refusal(0, torch.zeros(3, 2, dtype=torch.float64)).startswith(
        "client 0 sent 'values' as torch.float64 where the server holds torch.float32"
    )
    assert refusal(1, torch.zeros(3, 2)) == (
        "client 1 sent class counts inconsistent with its data (class 1: 1 examples, it holds 0)"
    )


def test_fedproc_without_a_linear_head_takes_the_first_uploads_width():
    """No head to read a width from: one upload sets it, a second of another width is refused by name."""
    server = FedProcServer()
    server.setup_server(context(num_classes=2, initial={"model.w": torch.zeros(1)}))

    def sent(width):
        return WeightsAndPrototypesPayload(
            weights={"w": torch.zeros(1)}, prototypes=torch.ones(2, width), counts=torch.tensor([1, 1]), num_examples=1
        )

    server.aggregate(0, [upload(0, sent(3))])
    assert server.download_for(0).prototypes.shape == (2, 3)
    fresh = FedProcServer()
    fresh.setup_server(context(num_classes=2, initial={"model.w": torch.zeros(1)}))
    with pytest.raises(TrainingError) as error:
        fresh.aggregate(0, [upload(0, sent(3)), upload(1, sent(4))])
    assert str(error.value).startswith("client 1 sent 'values' of shape (2, 4), expected (2, 3)")
