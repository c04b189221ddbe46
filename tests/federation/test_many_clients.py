"""Many clients: a round costs its participants, not the federation; the disk store keeps one state per client."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from fedhet.algorithms import FedAvg
from fedhet.data import SyntheticScenario
from fedhet.federation import DiskStateStore, FederationLoop, FederationSettings
from fedhet.federation.runtime import ClientRuntime
from fedhet.federation.trainer import TrainerTemplate

STATE_FILE = re.compile(r"client_(\d+)_r(\d+)\.pt$")


def _files_per_client(directory) -> Counter:
    return Counter(int(STATE_FILE.match(p.name).group(1)) for p in directory.iterdir() if STATE_FILE.match(p.name))


class _DiskWatch:
    """After each round's checkpoint point: how many state files each client has on disk."""

    def __init__(self, directory):
        self.directory = directory
        self.most_per_client: list[int] = []

    def on_round_end(self, loop, record):
        counts = _files_per_client(self.directory)
        self.most_per_client.append(max(counts.values()))

    def on_run_end(self, loop, summary):
        """Nothing to do."""


def _loop(scenario, tmp_path, rounds, participation, callbacks=()):
    return FederationLoop(
        FedAvg(lr=0.05),
        scenario,
        ["logreg"] * scenario.num_clients,
        TrainerTemplate(max_steps=2, accelerator="cpu"),
        rounds=rounds,
        settings=FederationSettings(participation=participation),
        state_store=DiskStateStore(tmp_path / "clients"),
        callbacks=callbacks,
    )


def test_a_round_of_2000_clients_touches_only_its_participants(tmp_path, monkeypatch):
    """2,000 clients at 1 %: 20 clients generated, trained, evaluated, stored; none of the others."""
    initialised: list[int] = []
    original = ClientRuntime.initial_state

    def counting_initial_state(self, client_id):
        initialised.append(client_id)
        return original(self, client_id)

    monkeypatch.setattr(ClientRuntime, "initial_state", counting_initial_state)
    scenario = SyntheticScenario(num_clients=2000, seed=0, cache_clients=64)
    loop = _loop(scenario, tmp_path, rounds=1, participation=0.01)
    assert scenario.generated_clients == 0  # building the loop walks no client (no label counts up front)
    loop.run()
    record = loop.history[0]
    participants = sorted(loop._participants)
    assert len(participants) == 20 and record["clients"] == 20
    assert scenario.generated_clients == 20  # fit and evaluation of the same 20 (cached between them)
    # client 0's initial state only, for FedAvg's server to start from: the participants are
    # materialised from their first download, which replaces all of a FedAvg client's state
    assert set(initialised) == {0}
    assert record["eval/clients"] == 20.0
    evaluated = {int(k.split("/")[1]) for k in record if k.startswith("client/") and k.endswith("/acc_local")}
    assert evaluated == set(participants)
    assert sorted(_files_per_client(tmp_path / "clients")) == participants


def test_label_counts_are_counted_only_when_read(tmp_path):
    """A lazily generated scenario's label counts are counted on first read, not when the loop is built."""
    scenario = SyntheticScenario(num_clients=30, seed=0)
    loop = _loop(scenario, tmp_path, rounds=1, participation=3)
    context = loop.server_context()
    assert context.label_counts is None and scenario.generated_clients == 0
    counts = context.client_label_counts()
    assert counts.shape == (30, 10)
    assert counts.sum(1).tolist() == [scenario.client_train_size(c) for c in range(30)]


def test_disk_store_keeps_one_state_per_client(tmp_path):
    """Over rounds, the disk holds at most old + new for the round's participants and one file per client after it."""
    scenario = SyntheticScenario(num_clients=8, seed=0, max_size=80)
    watch = _DiskWatch(tmp_path / "clients")
    loop = _loop(scenario, tmp_path, rounds=4, participation=0.5, callbacks=[watch])
    loop.run()
    # the checkpoint point (on_round_end) comes before the prune: a participant may hold old and new there
    assert max(watch.most_per_client) <= 2
    counts = _files_per_client(tmp_path / "clients")
    trained = {int(k.split("/")[1]) for r in loop.history for k in r if k.endswith("/train_loss")}
    assert set(counts) == trained and set(counts.values()) == {1}
    names = {p.name for p in (tmp_path / "clients").iterdir()}
    assert not [n for n in names if ".tmp" in n]  # atomic writes leave no temporary file
    for client_id, round_idx in loop.store.checkpoint_state()["index"].items():
        assert f"client_{client_id}_r{round_idx}.pt" in names


def test_disk_store_prune_never_lists_the_directory(tmp_path, monkeypatch):
    """Per-round pruning deletes the superseded files it remembers; only a restore scans the directory."""
    store = DiskStateStore(tmp_path)
    state = {"module": {"w": torch.zeros(2)}, "optimizer": None}
    for round_idx in range(3):
        for client_id in (0, 1):
            store.put(client_id, round_idx, state)
        store.commit(round_idx)
        checkpoint = store.checkpoint_state()
        monkeypatch.setattr(type(tmp_path), "iterdir", _no_listing)
        store.prune()
        monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client_0_r2.pt", "client_1_r2.pt"]
    store.put(0, 3, state)  # staged by a round that never commits
    (tmp_path / ".client_1_r3.pt.tmp123").write_bytes(b"half a write")
    fresh = DiskStateStore(tmp_path)
    fresh.restore(checkpoint)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client_0_r2.pt", "client_1_r2.pt"]


def _no_listing(self):
    pytest.fail("DiskStateStore.prune listed the directory")


def test_parallel_executors_order_tasks_without_generating_clients():
    """Largest-first task order comes from the sizes a lazy scenario knows, not from generating the clients."""
    from types import SimpleNamespace

    from fedhet.federation.executors import largest_first
    from fedhet.federation.runtime import ClientTask

    scenario = SyntheticScenario(num_clients=1000, seed=0)
    tasks = [ClientTask(client_id, 0, None, None) for client_id in (5, 17, 400, 999)]
    order = largest_first(tasks, SimpleNamespace(scenario=scenario))
    sizes = [scenario.client_train_size(tasks[i].client_id) for i in order]
    assert sizes == sorted(sizes, reverse=True) and scenario.generated_clients == 0
