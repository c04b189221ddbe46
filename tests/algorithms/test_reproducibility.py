"""Same seed, same bits, and a resumed run equals an uninterrupted one, for every registered method.

Each method runs on its tiny scenario and model family (one local step per fit) three times:

* ``first`` and ``second``: two uninterrupted 2-round runs with the same seed. Determinism: every
  client's stored state (module and optimizer), the server's ``state_dict`` and the metrics agree
  bit for bit (SHA-256 of every tensor, not rounded accuracies).
* ``resumed``: a fresh loop (new algorithm, scenario, runtime and server) that loads the checkpoint
  ``second`` took after round 0 (round-tripped through ``torch.save`` / ``weights_only`` load, as
  the run directory does) and runs round 1. It must end exactly where ``first`` ended.

With channels-last client modules (``trainer.memory_format``) every method runs, keeps that
layout, and a resumed run again ends exactly where the uninterrupted one did: state clones,
aggregation and checkpoints must not assume contiguous (``view``-able) weights.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from fedhet.algorithms import list_algorithms
from fedhet.federation.trainer import TrainerTemplate
from tests.algorithms.helpers import differing, saved_and_loaded, state_digests, tiny_loop

ROUNDS = 2
SEED = 7
RESULT_KEYS = ("final", "best", "last3", "matrix", "comm")


class _CheckpointAfter:
    """Keeps a serialised copy of the loop's checkpoint taken at the end of round ``round_idx``."""

    def __init__(self, round_idx: int) -> None:
        self.round_idx = round_idx
        self.state: dict[str, Any] | None = None

    def on_round_end(self, loop, record) -> None:
        if record["round"] == self.round_idx:
            self.state = saved_and_loaded(loop.checkpoint_state())

    def on_run_end(self, loop, summary) -> None:
        pass


def _trainer(memory_format: str = "contiguous") -> TrainerTemplate:
    return TrainerTemplate(max_steps=1, accelerator="cpu", memory_format=memory_format)


def _snapshot(loop, summary) -> dict[str, Any]:
    """Digests of every client's stored state and of the server state, plus the run's metrics."""
    return {
        "clients": {cid: state_digests(loop.store.get(cid)) for cid in range(loop.scenario.num_clients)},
        "server": state_digests(loop.server.server_state()),
        "history": [{k: v for k, v in r.items() if not k.startswith("time/")} for r in loop.history],
        "results": {k: summary[k] for k in RESULT_KEYS},
    }


@functools.cache
def _runs(name: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    first = tiny_loop(name, trainer=_trainer(), rounds=ROUNDS, seed=SEED)
    first_snapshot = _snapshot(first, first.run())
    checkpoint = _CheckpointAfter(0)
    second = tiny_loop(name, trainer=_trainer(), rounds=ROUNDS, seed=SEED, callbacks=[checkpoint])
    second_snapshot = _snapshot(second, second.run())
    assert checkpoint.state is not None
    resumed = tiny_loop(name, trainer=_trainer(), rounds=ROUNDS, seed=SEED)
    resumed.load_checkpoint_state(checkpoint.state)
    assert resumed.next_round == 1
    resumed_snapshot = _snapshot(resumed, resumed.run())
    return first_snapshot, second_snapshot, resumed_snapshot


def _assert_identical(expected: dict[str, Any], actual: dict[str, Any], what: str) -> None:
    for cid, digests in expected["clients"].items():
        diff = differing(digests, actual["clients"][cid])
        assert not diff, f"{what}: client {cid} state differs in {diff[:5]}"
    diff = differing(expected["server"], actual["server"])
    assert not diff, f"{what}: server state differs in {diff[:5]}"
    assert actual["history"] == expected["history"], f"{what}: round records differ"
    for key in RESULT_KEYS:
        assert actual["results"][key] == expected["results"][key], f"{what}: summary '{key}' differs"


@pytest.mark.parametrize("name", list_algorithms())
def test_same_seed_gives_bit_identical_states_after_two_rounds(name):
    """Two 2-round runs with one seed hash to the same client states, server state and metrics."""
    first, second, _ = _runs(name)
    _assert_identical(first, second, f"{name} run twice")


@pytest.mark.parametrize("name", list_algorithms())
def test_resume_after_round_one_equals_the_uninterrupted_run(name):
    """A fresh loop resumed from the round-0 checkpoint ends with the uninterrupted run's states and metrics."""
    first, _, resumed = _runs(name)
    _assert_identical(first, resumed, f"{name} resumed")


@pytest.mark.parametrize("name", list_algorithms())
def test_channels_last_run_resumes_exactly(name):
    """Channels-last modules: the method runs, keeps the layout, and a resumed run equals the uninterrupted one."""
    checkpoint = _CheckpointAfter(0)
    first = tiny_loop(name, trainer=_trainer("channels_last"), rounds=ROUNDS, seed=SEED, callbacks=[checkpoint])
    first_snapshot = _snapshot(first, first.run())
    assert checkpoint.state is not None
    resumed = tiny_loop(name, trainer=_trainer("channels_last"), rounds=ROUNDS, seed=SEED)
    resumed.load_checkpoint_state(checkpoint.state)
    _assert_identical(first_snapshot, _snapshot(resumed, resumed.run()), f"{name} channels_last resumed")
    convolutions = [p for p in first.runtime.module(first.architectures[0]).parameters() if p.dim() == 4]
    assert convolutions and all(p.is_contiguous(memory_format=torch.channels_last) for p in convolutions)


def test_every_client_and_the_server_state_are_compared():
    """The snapshot covers every client (module and optimizer state) and a non-empty server state."""
    first, _, _ = _runs("fedavg")
    assert len(first["clients"]) == 3
    for digests in first["clients"].values():
        assert any(k.startswith(".module.") for k in digests) and any(k.startswith(".optimizer") for k in digests)
    assert any(k.endswith(".weight") for k in first["server"])  # the global model's tensors
