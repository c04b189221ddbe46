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

# The CPU families the embedded scenarios use, on both scenario kinds. Paper-scale (GPU) families
# are covered model by model in tests/models (forward, features, head, backward).
FAMILIES = ["tiny2", "tiny_homo", "cpu4", "cpu_homo"]


def _compatible(name: str, family: str, kind: str) -> bool:
    caps = ALGORITHMS[name].capabilities
    return (caps.heterogeneous_models or len(set(resolve_family(family))) == 1) and kind in caps.scenario_kinds


CASES = [
    (name, family, kind)
    for name in list_algorithms()
    for family in FAMILIES
    for kind in SCENARIOS
    if _compatible(name, family, kind)
]


def _loop(name, family, kind, trainer, rounds=2, seed=0):
    scenario = SCENARIOS[kind]()
    scenario.setup()
    architectures = [resolve_family(family)[c % len(resolve_family(family))] for c in range(scenario.num_clients)]
    caps = ALGORITHMS[name].capabilities
    return FederationLoop(
        ALGORITHMS[name](),
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
    loop = _loop(name, family, kind, cpu_trainer)
    algorithm = loop.algorithm
    summary = loop.run()
    headline = ["acc_intra", "acc_inter"] if kind == "domain_shift" else ["acc_local", "acc_global"]
    for key in headline:
        assert math.isfinite(summary["final"][key]) and 0.0 <= summary["final"][key] <= 100.0
    assert all(math.isfinite(r["train/loss"]) for r in loop.history)
    # uploads: declared type and measured size
    result = loop.runtime.fit_client(
        __import__("fedhet.federation.runtime", fromlist=["ClientTask"]).ClientTask(
            0, 2, loop.store.get(0), loop.server.download_for(0)
        )
    )
    if algorithm.upload_type is None:
        assert result.upload is None and summary["comm"]["bytes_up"] == 0
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
    family = "tiny2" if ALGORITHMS[name].capabilities.heterogeneous_models else "tiny_homo"
    first = _loop(name, family, "label_skew", cpu_trainer, seed=3).run()
    second = _loop(name, family, "label_skew", cpu_trainer, seed=3).run()
    assert first["final"] == second["final"] and first["comm"] == second["comm"]


def test_homogeneous_method_refuses_heterogeneous_family(cpu_trainer):
    with pytest.raises(ConfigError, match="one architecture"):
        _loop("fedavg", "tiny2", "label_skew", cpu_trainer)


def test_feature_methods_need_one_feature_dim(cpu_trainer):
    scenario = SCENARIOS["label_skew"]()
    scenario.setup()
    with pytest.raises(ConfigError, match="feature_dim"):
        FederationLoop(ALGORITHMS["fedproto"](), scenario, ["cnn_tiny", "mlp_tiny", "cnn_tiny"], cpu_trainer, rounds=1)
