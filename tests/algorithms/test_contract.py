"""The method contract, checked for every registered method x compatible family x scenario kind.

Two rounds on a tiny scenario must finish; uploads and downloads have the declared types and a
positive size; metrics are finite; client state round-trips through a fresh module. Same seed,
same numbers (bit-identical states) and resume are checked in ``test_reproducibility.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.algorithms import ALGORITHMS, list_algorithms
from fedhet.errors import ConfigError
from fedhet.federation import FederationLoop
from fedhet.federation.runtime import ClientTask
from tests.algorithms.helpers import state_digests, tiny_family, tiny_loop
from tests.conftest import SCENARIOS

# Every method runs on the tiny family of its kind (heterogeneous: tiny2, else tiny_homo) on each
# scenario kind it supports. The CPU architectures of the embedded configs (cpu4, cpu_homo) and
# the paper-scale (GPU) families are covered model by model in tests/models (forward, features,
# head, backward), and every shipped config is parsed and validated in tests/test_cli.py. Budgets
# whose paper defaults take minutes (pretraining, server epochs) shrink to a few steps
# (``helpers.FAST``); the contract is about shapes, types, sizes and state, not convergence.
CASES = [
    (name, tiny_family(name), kind)
    for name in list_algorithms()
    for kind in ALGORITHMS[name].capabilities.scenario_kinds
]


@pytest.mark.parametrize("name,family,kind", CASES)
def test_method_contract(name, family, kind, cpu_trainer):
    """Two rounds finish with finite metrics, declared payload types and sizes, and a round-tripping client state."""
    rounds = 2
    loop = tiny_loop(name, kind, family, cpu_trainer, rounds=rounds)
    algorithm = loop.algorithm
    summary = loop.run()
    headline = ["acc_intra", "acc_inter"] if kind == "domain_shift" else ["acc_local", "acc_global"]
    for key in headline:
        assert math.isfinite(summary["final"][key]) and 0.0 <= summary["final"][key] <= 100.0
    # every step that trained reports a finite loss (a step may train nothing: FedVTC's VTC upload)
    assert all(math.isfinite(r["train/loss"]) for r in loop.history if "train/loss" in r)
    assert any("train/loss" in r for r in loop.history)
    # uploads: declared type and measured size
    result = loop.runtime.fit_client(ClientTask(0, rounds, loop.store.get(0), loop.server.download_for(0)))
    if algorithm.upload_type is None:
        # nothing uploaded after local training; a lock-step phase exchanges (and counts) per-batch outputs
        assert result.upload is None
        assert (summary["comm"]["bytes_up"] > 0) == (algorithm.collaborative_epochs() > 0)
    else:
        assert isinstance(result.upload, algorithm.upload_type)
        assert result.upload.nbytes() > 0 and summary["comm"]["bytes_up"] > 0
        assert result.upload.num_examples == len(loop.scenario.client_data(0).train)
    download = loop.server.download_for(0)
    if algorithm.download_type is None:
        assert download is None
    else:
        assert isinstance(download, algorithm.download_type) and download.nbytes() > 0
    # client state round-trips through a fresh module
    module = loop.runtime.module(loop.architectures[0], slot=5)
    module.load_client_state(result.state["module"])
    for key, value in module.client_state().items():
        assert torch.equal(value, result.state["module"][key])


def test_homogeneous_method_refuses_heterogeneous_family(cpu_trainer):
    """A weight-averaging method refuses a family of two architectures at start-up."""
    with pytest.raises(ConfigError, match="one architecture"):
        tiny_loop("fedavg", "label_skew", "tiny2", cpu_trainer)


def test_feature_methods_need_one_feature_dim(cpu_trainer):
    """A feature-exchanging method refuses backbones of different feature sizes, pointing at feature_dim."""
    scenario = SCENARIOS["label_skew"]()
    scenario.setup()
    with pytest.raises(ConfigError, match="feature_dim"):
        FederationLoop(ALGORITHMS["fedproto"](), scenario, ["cnn_tiny", "mlp_tiny", "cnn_tiny"], cpu_trainer, rounds=1)


@pytest.mark.parametrize("name", list_algorithms())
def test_a_download_said_to_replace_the_client_state_replaces_all_of_it(name, cpu_trainer):
    """Where a client says its first download overwrites its whole state, its own initialisation never shows.

    The runtime then materialises the client from the download alone (no model built per client):
    the client's state after the download must be the same bit for bit whatever it held before.
    """
    loop = tiny_loop(name, trainer=cpu_trainer)
    claims = []
    for client_id in range(loop.scenario.num_clients):
        download = loop.server.download_for(client_id)
        module = loop.runtime.module(loop.architectures[client_id])
        if not module.download_replaces_state(download):
            continue
        claims.append(client_id)
        module.load_client_state(loop.runtime.initial_state(client_id)["module"])
        module.on_receive(download)
        from_own_initialisation = state_digests(module.client_state())
        with torch.no_grad():
            for tensor in module.client_state().values():
                tensor.fill_(7)
        module.on_receive(download)
        assert state_digests(module.client_state()) == from_own_initialisation
    # the property holds for FedAvg's family and not for a partial download (FedBN keeps its BatchNorm)
    expected = {"fedavg": True, "fedprox": True, "fedbn": False, "scaffold": False, "moon": False, "fedproto": False}
    if name in expected:
        assert bool(claims) == expected[name]
