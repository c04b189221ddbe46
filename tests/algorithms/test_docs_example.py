"""The worked example of docs/adding_a_method.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from fedhet.core.payloads import WeightsPayload
from fedhet.federation import FederationLoop
from fedhet.federation.trainer import TrainerTemplate
from tests.conftest import tiny_label_skew

DOC = Path(__file__).resolve().parents[2] / "docs" / "adding_a_method.md"


def test_adding_a_method_example_runs():
    """The example method of docs/adding_a_method.md runs two rounds and sends one head per client."""
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
    scenario = tiny_label_skew()
    scenario.setup()
    loop = FederationLoop(
        namespace["FedHead"](lr=0.05),
        scenario,
        ["cnn_tiny", "mlp_tiny", "cnn_tiny"],
        TrainerTemplate(max_epochs=1, accelerator="cpu"),
        rounds=2,
        feature_dim=16,
    )
    summary = loop.run()
    head = loop.server.download_for(0)
    assert isinstance(head, WeightsPayload) and head.weights["weight"].shape == (10, 16)
    assert summary["comm"]["bytes_up"] == 2 * 3 * (10 * 16 + 10) * 4  # 2 rounds x 3 clients x head
    assert torch.isfinite(torch.tensor(summary["final"]["acc_global"]))


def _doc_block(index: int) -> dict:
    """Execute the ``index``-th Python block of docs/adding_a_method.md and return its namespace."""
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[index]
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
    return namespace


def _homogeneous_loop(algorithm, rounds=2):
    """A 2-round run of ``algorithm`` on the tiny label-skew scenario with one architecture."""
    scenario = tiny_label_skew()
    scenario.setup()
    return FederationLoop(
        algorithm,
        scenario,
        ["cnn_tiny"] * scenario.num_clients,
        TrainerTemplate(max_epochs=1, accelerator="cpu"),
        rounds=rounds,
    )


def test_server_refine_example_composes_with_two_bases():
    """The doc's ServerPlugin refines FedAvg and FedProx alike, and changes the global model it refines."""
    from fedhet.algorithms import FedAvg, FedProx

    refined = _doc_block(1)["NoiseRefined"]
    for base in (FedAvg(lr=0.05), FedProx(mu=0.01, lr=0.05)):
        plain = _homogeneous_loop(type(base)(**({"mu": 0.01} if isinstance(base, FedProx) else {}), lr=0.05))
        plain.run()
        loop = _homogeneous_loop(refined(base=base, steps=2))
        summary = loop.run()
        assert "acc_server" in summary["final"] and "acc_server" in summary["best"]
        refined_weights = loop.server.download_for(0).weights
        plain_weights = plain.server.download_for(0).weights
        assert any(not torch.equal(refined_weights[k], plain_weights[k]) for k in plain_weights)


def test_two_stage_client_example_trains_each_stage():
    """The doc's two-stage client runs both stages, logs both losses, and keeps one optimizer state per stage."""
    loop = _homogeneous_loop(_doc_block(2)["HeadThenBody"](lr=0.05), rounds=1)
    loop.run()
    record = loop.history[-1]
    assert torch.isfinite(torch.tensor(record["train/loss"])) and torch.isfinite(
        torch.tensor(record["train/body_loss"])
    )
    optimizers = loop.store.get(0)["optimizer"]
    assert set(optimizers) == {"head", "body"}
    assert "exp_avg" in next(iter(optimizers["head"][0]["state"].values()))  # Adam on the head
