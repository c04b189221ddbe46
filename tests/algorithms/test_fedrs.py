"""FedRS: hand-computed restricted-softmax loss (both restriction rules), label counts, alpha = 1 is FedAvg."""

from __future__ import annotations

import pytest
import torch

from fedhet.algorithms.fedavg import FedAvgServer
from fedhet.algorithms.fedrs import FedRS, FedRSClient, label_counts
from tests.algorithms.helpers import SGD, TinyLinear, assert_same_global_model, label_skew_run


def test_fedrs_with_alpha_one_equals_fedavg_bit_for_bit(fedavg_run):
    """FedRS with alpha = 1 reproduces FedAvg exactly; every client keeps the label counts of its training split."""
    avg_loop, avg = fedavg_run
    rs_loop, rs = label_skew_run(FedRS(alpha=1.0, **SGD))
    assert avg["final"] == rs["final"]
    assert_same_global_model(avg_loop, rs_loop)
    # every client counted its own training labels at its first fit and kept them in its state
    for client in range(rs_loop.scenario.num_clients):
        expected = torch.bincount(rs_loop.scenario.client_data(client).train.y, minlength=10)
        assert torch.equal(rs_loop.store.get(client)["module"]["class_counts"], expected)
        assert rs_loop.store.get(client)["module"]["class_counts"].dtype == torch.long  # kept as counts


def test_fedrs_client_loss_by_hand():
    """A missing class's logit is scaled by alpha: logits [2, 4] -> [2, 2], CE = log 2; evaluation is unrestricted."""
    client = FedRSClient(TinyLinear(), num_classes=2, alpha=0.5)
    client.class_counts.copy_(torch.tensor([3, 0]))
    # logits [2, 4] -> restricted [2, 2]: CE = log 2 = 0.693147 (plain CE would be 2.126928)
    loss = client.local_loss((torch.tensor([[2.0, 4.0]]), torch.tensor([0])))
    assert loss.item() == pytest.approx(0.693147, abs=1e-6)
    # evaluation uses the unrestricted logits
    assert torch.equal(client(torch.tensor([[2.0, 4.0]])), torch.tensor([[2.0, 4.0]]))


def test_fedrs_proportional_restriction_by_hand():
    """The official code's rule: alpha_c = 0.5 + 0.5 * n_c / max n = [1, 0.75]; logits [2, 4] -> [2, 3]."""
    client = FedRSClient(TinyLinear(), num_classes=2, alpha=0.5, restriction="proportional")
    client.class_counts.copy_(torch.tensor([4, 2]))
    loss = client.local_loss((torch.tensor([[2.0, 4.0]]), torch.tensor([0])))
    assert loss.item() == pytest.approx(1.313262, abs=1e-6)  # log(1 + e^1)


def test_fedrs_unknown_counts_leave_the_softmax_unrestricted():
    """Until the first fit has counted the labels, every class has scale 1 (plain CE)."""
    client = FedRSClient(TinyLinear(), num_classes=2, alpha=0.1)
    loss = client.local_loss((torch.tensor([[2.0, 4.0]]), torch.tensor([0])))
    assert loss.item() == pytest.approx(2.126928, abs=1e-6)  # log(1 + e^2)


def test_label_counts_from_loader_data_or_batches():
    """Counts come from the loader's labels without drawing batches, else from one pass over the batches."""

    class _Data:
        y = torch.tensor([0, 2, 2, -1])

    class _Loader:
        data = _Data()

        def __iter__(self):
            raise AssertionError("labels must be read without drawing batches")

    assert label_counts(_Loader(), 3).tolist() == [1, 0, 2]
    batches = [(torch.zeros(2, 1), torch.tensor([1, 1])), (torch.zeros(1, 1), torch.tensor([0]))]
    counted = label_counts(batches, 3)
    assert counted.tolist() == [1, 2, 0] and counted.dtype == torch.long  # counts, not floats


def test_fedrs_server_is_fedavgs_example_weighted_average():
    """FedRS aggregates exactly as FedAvg (the server is FedAvg's, tested by hand in test_fedavg.py)."""
    assert type(FedRS().build_server()) is FedAvgServer
