"""Fixtures shared by the per-method tests (plain helpers live in ``tests/algorithms/helpers.py``)."""

from __future__ import annotations

import pytest

from fedhet.algorithms.fedavg import FedAvg
from tests.algorithms.helpers import SGD, label_skew_run


@pytest.fixture(scope="session")
def fedavg_run():
    """The FedAvg reference run (SGD, two rounds, tiny label skew) that the bit-for-bit limits compare with."""
    return label_skew_run(FedAvg(**SGD))


@pytest.fixture
def one_thread():
    """Run a test on one intra-op thread: the one-step oracles compare to 1e-6, and two threads sum in another order."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
