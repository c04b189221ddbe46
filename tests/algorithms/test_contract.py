"""The method contract, checked for every registered method x compatible family x scenario kind.

Two rounds on a tiny scenario must finish; uploads and downloads have the declared types and a
positive size; metrics are finite; and the same seed gives identical numbers.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.algorithms import ALGORITHMS, list_algorithms
from fedhet.errors import ConfigError
from fedhet.federation import FederationLoop
from fedhet.models import resolve_family
from tests.conftest import SCENARIOS


# Every method runs on the tiny family of its kind (heterogeneous: tiny2, else tiny_homo) on each
# scenario kind it supports. The CPU architectures of the embedded configs (cpu4, cpu_homo) and
# the paper-scale (GPU) families are covered model by model in tests/models (forward, features,
# head, backward), and every shipped config is parsed and validated in tests/test_cli.py.
def _tiny_family(name: str) -> str:
    return "tiny2" if ALGORITHMS[name].capabilities.heterogeneous_models else "tiny_homo"


CASES = [(name, _tiny_family(name), kind) for name in list_algorithms() for kind in ALGORITHMS[name].capabilities.scenario_kinds]

# Budgets whose paper defaults take minutes (pretraining, server epochs) shrink to a few steps
# here; the contract is about shapes, types, sizes and determinism, not about convergence.
FAST = {
    "fccl": {"pretrain_epochs": 1},
    "feddf_server": {"distill_steps": 2},
    "fedgen": {"generator_steps": 2},
    "fedgh": {"server_epochs": 2},
    "fedtgp": {"server_epochs": 2},
    "fedktl": {"server_epochs": 2},
}


def _loop(name, family, kind, trainer, rounds=2, seed=0):
    caps = ALGORITHMS[name].capabilities
    # the tiny domain-shift scenario carries public photos; label-skew ones get them when the method needs them
    public = {"public": "photos", "public_size": 64, "public_batch_size": 32} if caps.needs_public_data and kind == "label_skew" else {}
    scenario = SCENARIOS[kind](**public)
    scenario.setup()
    architectures = [resolve_family(family)[c % len(resolve_family(family))] for c in range(scenario.num_clients)]
    return FederationLoop(
        ALGORITHMS[name](**FAST.get(name, {})),
        scenario,
        architectures,
        trainer,
        rounds=rounds,
        seed=seed,
        feature_dim=16 if caps.common_feature_dim else None,
        family_name=family,
    )


@pytest.mark.parametrize("name,family,kind", CASES)
def test_method_contract(name, family, kind, cpu_trainer):
    rounds = 2
    loop = _loop(name, family, kind, cpu_trainer, rounds=rounds)
    algorithm = loop.algorithm
    summary = loop.run()
    headline = ["acc_intra", "acc_inter"] if kind == "domain_shift" else ["acc_local", "acc_global"]
    for key in headline:
        assert math.isfinite(summary["final"][key]) and 0.0 <= summary["final"][key] <= 100.0
    assert all(math.isfinite(r["train/loss"]) for r in loop.history)
    # uploads: declared type and measured size
    result = loop.runtime.fit_client(
        __import__("fedhet.federation.runtime", fromlist=["ClientTask"]).ClientTask(
            0, rounds, loop.store.get(0), loop.server.download_for(0)
        )
    )
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


@pytest.mark.parametrize("name", list_algorithms())
def test_same_seed_same_numbers(name, cpu_trainer):
    caps = ALGORITHMS[name].capabilities
    family = "tiny2" if caps.heterogeneous_models else "tiny_homo"
    kind = caps.scenario_kinds[0]
    first = _loop(name, family, kind, cpu_trainer, rounds=1, seed=3).run()
    second = _loop(name, family, kind, cpu_trainer, rounds=1, seed=3).run()
    assert first["final"] == second["final"] and first["comm"] == second["comm"]


def test_homogeneous_method_refuses_heterogeneous_family(cpu_trainer):
    with pytest.raises(ConfigError, match="one architecture"):
        _loop("fedavg", "tiny2", "label_skew", cpu_trainer)


def test_feature_methods_need_one_feature_dim(cpu_trainer):
    scenario = SCENARIOS["label_skew"]()
    scenario.setup()
    with pytest.raises(ConfigError, match="feature_dim"):
        FederationLoop(ALGORITHMS["fedproto"](), scenario, ["cnn_tiny", "mlp_tiny", "cnn_tiny"], cpu_trainer, rounds=1)
