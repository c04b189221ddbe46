"""Dropped uploads are counted in summary.json, in total and per client, across a resume."""

from __future__ import annotations

import json

import torch

from fedhet.algorithms import FedAvg
from fedhet.algorithms.fedavg import FedAvgClient
from fedhet.federation import FederationLoop, FederationSettings
from fedhet.federation.trainer import TrainerTemplate
from tests.conftest import tiny_label_skew


class _NaNClient(FedAvgClient):
    """Sends NaN weights when its ``broken`` flag is set."""

    def make_upload(self, train_batches):
        """The honest upload, or one with a NaN tensor."""
        upload = super().make_upload(train_batches)
        if getattr(self, "broken", False):
            key = next(iter(upload.weights))
            upload.weights[key] = torch.full_like(upload.weights[key], float("nan"))
        return upload


class _NaNFedAvg(FedAvg):
    """FedAvg whose clients can send NaN."""

    client_type = _NaNClient


def _loop(rounds: int, broken: dict[int, set[int]]) -> FederationLoop:
    """3 clients; client c sends NaN in the rounds ``broken[c]``."""
    scenario = tiny_label_skew()
    scenario.setup()
    loop = FederationLoop(
        _NaNFedAvg(lr=0.05), scenario, ["cnn_tiny"] * scenario.num_clients,
        TrainerTemplate(max_epochs=1, accelerator="cpu"), rounds=rounds,
        settings=FederationSettings(on_invalid_upload="drop"),
    )
    original = loop.runtime._load

    def load(module, task, apply_download=True):
        module.broken = task.round_idx in broken.get(task.client_id, set())
        return original(module, task, apply_download)

    loop.runtime._load = load
    return loop


def test_summary_counts_dropped_uploads_per_client_and_in_total():
    """Client 1 breaks in rounds 0 and 2, client 2 in round 1: total 3, per client {1: 2, 2: 1}, in JSON."""
    loop = _loop(3, {1: {0, 2}, 2: {1}})
    summary = loop.run()
    assert [r["comm/dropped_uploads"] for r in loop.history] == [1, 1, 1]
    assert summary["dropped_uploads"] == {"total": 3, "per_client": {"1": 2, "2": 1}}
    assert json.loads(json.dumps(summary))["dropped_uploads"]["per_client"] == {"1": 2, "2": 1}


def test_a_run_without_the_drop_policy_has_no_dropped_block():
    """With on_invalid_upload=fail (the default) nothing can be dropped and the summary says nothing of drops."""
    scenario = tiny_label_skew()
    scenario.setup()
    loop = FederationLoop(FedAvg(lr=0.05), scenario, ["cnn_tiny"] * 3, TrainerTemplate(max_epochs=1,
                          accelerator="cpu"), rounds=1)
    assert "dropped_uploads" not in loop.run()
