"""The worked example of docs/adding_a_method.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from fedhet.algorithms.shared.common import batch_norm_state_keys
from fedhet.federation import FederationLoop
from fedhet.federation.trainer import TrainerTemplate
from tests.conftest import tiny_label_skew

DOC = Path(__file__).resolve().parents[2] / "docs" / "adding_a_method.md"


def test_adding_a_method_example_is_the_shipped_fedbn_and_runs():
    """The worked example is fedhet/algorithms/fedbn.py verbatim, and it runs two rounds keeping BatchNorm local."""
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    assert code == (DOC.parents[1] / "fedhet" / "algorithms" / "fedbn.py").read_text()
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
    loop = _homogeneous_loop(namespace["FedBN"](lr=0.05))
    summary = loop.run()
    sent = loop.server.download_for(0).weights
    model = loop.runtime.module(loop.architectures[0], slot=0).model
    local = batch_norm_state_keys(model)
    assert local and set(sent) == set(model.state_dict()) - local
    assert torch.isfinite(torch.tensor(summary["final"]["acc_global"]))


def _doc_block(index: int) -> dict:
    """Execute the ``index``-th Python block of docs/adding_a_method.md and return its namespace."""
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[index]
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
    return namespace


def _homogeneous_loop(algorithm, rounds=2, architecture="cnn_tiny"):
    """A 2-round run of ``algorithm`` on the tiny label-skew scenario with one architecture."""
    scenario = tiny_label_skew()
    scenario.setup()
    return FederationLoop(
        algorithm,
        scenario,
        [architecture] * scenario.num_clients,
        TrainerTemplate(max_epochs=1, accelerator="cpu"),
        rounds=rounds,
    )


def test_server_refine_example_composes_with_two_bases():
    """The doc's ServerPlugin refines FedAvg and FedProx alike, and changes the global model it refines."""
    from fedhet.algorithms import FedAvg, FedProx

    refined = _doc_block(2)["NoiseRefined"]
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
    loop = _homogeneous_loop(_doc_block(3)["HeadThenBody"](lr=0.05), rounds=1)
    loop.run()
    record = loop.history[-1]
    assert torch.isfinite(torch.tensor(record["train/loss"])) and torch.isfinite(
        torch.tensor(record["train/body_loss"])
    )
    optimizers = loop.store.get(0)["optimizer"]
    assert set(optimizers) == {"head", "body"}
    assert "exp_avg" in next(iter(optimizers["head"][0]["state"].values()))  # Adam on the head
