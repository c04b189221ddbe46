"""``federation.lr_schedule``: one per-round learning-rate schedule, applied by the platform to every method.

The contract test runs every registered method twice on a tiny scenario, with constant rates
and with the linear schedule, records the learning rate of every client optimizer step (local
stages and the public-data phase; server stages are not client optimizers) and checks that in
round ``r`` each rate is the constant run's rate times the schedule's factor.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fedhet.algorithms import ALGORITHMS, list_algorithms
from fedhet.errors import ConfigError
from fedhet.federation import FederationLoop, FederationSettings, LRSchedule
from fedhet.federation.lr_schedule import RoundLRScale
from fedhet.federation.runtime import FEDERATION, ClientRuntime
from fedhet.federation.trainer import OptimizerStateCarrier, TrainerTemplate, silence_lightning
from fedhet.functional import linear_round_decay
from tests.algorithms.helpers import FAST, TinyLinear, one_batch_loader, tiny_loop
from tests.conftest import tiny_label_skew

ROUNDS = 3


def test_linear_factor_is_the_authors_lagged_decay():
    """Rounds 0 and 1 at the base rate, then 1 - 0.9 (r - 1) / R; ``none`` is constant."""
    schedule = LRSchedule("linear")
    assert [schedule.factor(r, 10) for r in (0, 1, 2, 9)] == [1.0, 1.0, pytest.approx(0.91), pytest.approx(0.28)]
    assert LRSchedule("linear", final_fraction=0.5).factor(3, 4) == pytest.approx(1 - 0.5 * 2 / 4)
    assert LRSchedule().factor(7, 10) == 1.0
    with pytest.raises(ConfigError, match="final_fraction"):
        LRSchedule("linear", final_fraction=1.5)


def test_scale_reads_the_configured_rate_not_a_restored_one():
    """A carried state saved at a scaled rate does not compound: the base is what configure_optimizers built."""
    from fedhet.algorithms.base import ClientModule

    silence_lightning()
    module = ClientModule(TinyLinear(), 2, optimizer="sgd", lr=0.1, momentum=0.9)
    loader = one_batch_loader(torch.tensor([[1.0, 0.0]]), torch.tensor([0]))
    carrier = OptimizerStateCarrier(None)
    for factor in (0.5, 0.25):
        scale = RoundLRScale(factor)
        TrainerTemplate(max_epochs=1, accelerator="cpu").build(callbacks=[scale, carrier]).fit(module, loader)
        # the carried state holds the rate the fit used: 0.1 * factor, never 0.1 * 0.5 * 0.25
        assert carrier.states[0]["param_groups"][0]["lr"] == pytest.approx(0.1 * factor)


class _Recorder:
    """Learning rates of every client optimizer step, keyed by (phase, round), while client work runs."""

    def __init__(self) -> None:
        self.current: tuple[str, int, str] | None = None
        self.steps: list[tuple[str, int, str, tuple[float, ...]]] = []

    def hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.current is not None:
            self.steps.append((*self.current, tuple(float(g["lr"]) for g in optimizer.param_groups)))

    @contextlib.contextmanager
    def during(self, phase: str, round_idx: int, part: str):
        previous, self.current = self.current, (phase, round_idx, part)
        try:
            yield
        finally:
            self.current = previous


def _recorded_run(name: str, schedule: LRSchedule, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    recorder = _Recorder()
    train_local, collaborate = ClientRuntime._train_local, ClientRuntime._collaborate

    def recorded_train_local(self, module, task, state):
        with recorder.during(task.phase, task.round_idx, "local"):
            return train_local(self, module, task, state)

    def recorded_collaborate(self, tasks):
        with recorder.during(tasks[0].phase, tasks[0].round_idx, "public"):
            return collaborate(self, tasks)

    monkeypatch.setattr(ClientRuntime, "_train_local", recorded_train_local)
    monkeypatch.setattr(ClientRuntime, "_collaborate", recorded_collaborate)
    handle = register_optimizer_step_pre_hook(recorder.hook)
    try:
        # two local steps a round and one evaluation at the end: the rates of every step are what is compared
        trainer = TrainerTemplate(max_epochs=1, max_steps=2, accelerator="cpu")
        tiny_loop(name, rounds=ROUNDS, lr_schedule=schedule, trainer=trainer, eval_every=ROUNDS).run()
    finally:
        handle.remove()
        monkeypatch.undo()
    return recorder.steps


@pytest.mark.parametrize("name", list_algorithms())
def test_every_method_follows_the_platform_schedule(name, monkeypatch):
    """In round r every local and public-phase client step runs at the constant run's rate times factor(r)."""
    constant = _recorded_run(name, LRSchedule("none"), monkeypatch)
    scheduled = _recorded_run(name, LRSchedule("linear"), monkeypatch)
    assert constant, f"{name}: no client optimizer step was recorded"
    assert [s[:3] for s in scheduled] == [s[:3] for s in constant], f"{name}: the schedule changed which steps ran"
    parts = set()
    for (phase, round_idx, part, rates), (*_, base_rates) in zip(scheduled, constant, strict=True):
        factor = linear_round_decay(round_idx, ROUNDS) if phase == FEDERATION else 1.0
        assert rates == pytest.approx([r * factor for r in base_rates], rel=1e-12), (name, phase, round_idx, part)
        parts.add(part)
    # the last round decays (1 - 0.9 / 3 = 0.7), so the comparison above is not trivially 1.0
    assert any(s[0] == FEDERATION and s[1] == ROUNDS - 1 for s in scheduled), f"{name}: no step in the last round"
    if ALGORITHMS[name](**FAST.get(name, {})).collaborative_epochs() > 0:
        assert "public" in parts, f"{name}: its public-data phase took no step"


class _StopAfter:
    """A kill right after round ``n`` was checkpointed."""

    def __init__(self, n: int, sink: list) -> None:
        self.n, self.sink = n, sink

    def on_round_end(self, loop, record) -> None:
        self.sink.append(loop.checkpoint_state())
        if record["round"] + 1 == self.n:
            raise KeyboardInterrupt

    def on_run_end(self, loop, summary) -> None:
        pass


def _local_run(schedule: LRSchedule, callbacks=()) -> FederationLoop:
    from fedhet.algorithms.local import Local

    scenario = tiny_label_skew()
    scenario.setup()
    return FederationLoop(
        Local(lr=0.05, momentum=0.9),
        scenario,
        ["cnn_tiny", "mlp_tiny", "cnn_tiny"],
        TrainerTemplate(max_epochs=1, accelerator="cpu"),
        rounds=4,
        callbacks=callbacks,
        settings=FederationSettings(lr_schedule=schedule),
    )


def test_resume_under_the_schedule_equals_the_uninterrupted_run():
    """The factor depends on the round only, so a run killed after round 2 of 4 resumes to the same numbers.

    SGD with momentum carried across rounds: the carried state holds round 1's scaled rate, which
    must not leak into round 2 (the base is what configure_optimizers builds).
    """
    full = _local_run(LRSchedule("linear")).run()
    checkpoints: list = []
    interrupted = _local_run(LRSchedule("linear"), [_StopAfter(2, checkpoints)])
    with pytest.raises(KeyboardInterrupt):
        interrupted.run()
    resumed = _local_run(LRSchedule("linear"))
    resumed.load_checkpoint_state(checkpoints[-1])
    assert resumed.next_round == 2
    summary = resumed.run()
    assert summary["final"] == full["final"] and summary["best"] == full["best"]
    assert _local_run(LRSchedule("none")).run()["final"] != full["final"]  # the schedule did change the training
