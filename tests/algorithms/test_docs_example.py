"""The worked example of docs/adding_a_method.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from fedhet.federation import FederationLoop
from fedhet.federation.payloads import WeightsPayload
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
        namespace["FedHead"](lr=0.05), scenario, ["cnn_tiny", "mlp_tiny", "cnn_tiny"],
        TrainerTemplate(max_epochs=1, accelerator="cpu"), rounds=2, feature_dim=16,
    )
    summary = loop.run()
    head = loop.server.download_for(0)
    assert isinstance(head, WeightsPayload) and head.weights["weight"].shape == (10, 16)
    assert summary["comm"]["bytes_up"] == 2 * 3 * (10 * 16 + 10) * 4  # 2 rounds x 3 clients x head
    assert torch.isfinite(torch.tensor(summary["final"]["acc_global"]))
