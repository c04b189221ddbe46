"""The tuning stage on Ray Tune (``fedhet bench --grid FILE --ray_address local``): the same search and selection.

Skipped where Ray Tune is not installed (CI installs neither Ray nor its Tune extra: ``pip install "ray[tune]"``).
The trials run the stand-in for ``fedhet fit`` of ``test_tuning.py`` (the ``fake_fit`` fixture) in Ray workers
on this machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.test_tuning import FAKE_FIT, FEDAVG, _plan, assert_stopped_trial_reran_with_its_values

pytest.importorskip("ray.tune", exc_type=ImportError)  # Ray without its Tune extra: skipped too

from fedhet.tuning import tune_rows  # noqa: E402
from fedhet.tuning_ray import RUNNER, ray_trials  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    """Ray on this machine, two CPUs, for the module's tests."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def _tune_on_ray(tmp_path: Path, plan) -> dict:
    """Row ``a`` tuned through Ray Tune on the local Ray, one CPU per trial."""
    return tune_rows([("a", FEDAVG, ())], plan, tmp_path / "runs", tmp_path / "selected", "page",
                     env=dict(os.environ), echo=lambda _: None, trials=ray_trials("local", 1), runner=RUNNER)


def test_ray_tune_runs_the_rows_trials_and_selects_as_the_local_stage(tmp_path, fake_fit, local_ray):
    """Ray Tune runs a row's trials as the local stage does, and a rerun restores the finished experiment.

    Trial 0 is the row as configured, every trial a sealed fedhet fit at the tuning seed, the best on validation is
    selected and written; rerun, no trial runs again.
    """
    plan = _plan(trials=4)


    result = _tune_on_ray(tmp_path, plan)["a"]
    assert [t.number for t in result.trials] == [0, 1, 2, 3] and all(t.state == "complete" for t in result.trials)
    assert result.trials[0].params == {"method.init_args.lr": 0.05}  # the row as configured
    assert len({t.params["method.init_args.lr"] for t in result.trials}) == 4
    for trial in result.trials:  # the fake's validation value of its lr, at its last round (2)
        assert trial.value == pytest.approx(100 - 1e4 * (trial.params["method.init_args.lr"] - 0.05) ** 2 + 2)
    assert result.selected == max(result.trials, key=lambda t: (t.value, -t.number)) and result.runner == RUNNER
    assert f"lr: {result.selected.params['method.init_args.lr']}" in (tmp_path / "selected" / "a.yaml").read_text()
    calls = sorted(Path(tmp_path / "runs" / "tuning" / "a").glob("trial*.calls"))
    assert [c.read_text() for c in calls] == ["x"] * 4

    again = _tune_on_ray(tmp_path, plan)["a"]
    assert [(t.number, t.params, t.value) for t in again.trials] == [(t.number, t.params, t.value)
                                                                      for t in result.trials]
    assert [c.read_text() for c in calls] == ["x"] * 4  # restored, not rerun


def test_a_failed_trial_is_recorded_failed_and_never_selected(tmp_path, fake_fit, local_ray):
    """A trial whose fedhet fit fails is a failed trial (no value), as in the local stage; the others select."""
    fake_fit.write_text("import sys\nif sys.argv[-1].endswith('trial1'):\n    sys.exit(3)\n" + FAKE_FIT)
    result = _tune_on_ray(tmp_path, _plan(trials=3))["a"]
    assert [(t.number, t.state) for t in result.trials] == [(0, "complete"), (1, "failed"), (2, "complete")]
    assert result.trials[1].value is None and result.selected.number in (0, 2)


def test_a_trial_stopped_by_anything_but_its_training_stops_the_row(tmp_path, fake_fit, local_ray):
    """Exit 2 (bad input, e.g. a refused resume) is not a failed trial on Ray either: the row stops in one line."""
    from fedhet.tuning import TrialInterrupted
    from tests.test_tuning import _trial1_of_row_stops

    fake_fit.write_text(_trial1_of_row_stops("a", 2, "fedhet: error: no space left on the device") + FAKE_FIT)
    with pytest.raises(TrialInterrupted, match="tuning a: trial 2 stopped \\(exit 2\\).*no space left"):
        _tune_on_ray(tmp_path, _plan(trials=3))
    assert not (tmp_path / "selected" / "a.yaml").exists()


def test_a_rerun_after_a_stopped_trial_restores_the_experiment_and_runs_that_trial_again(tmp_path, fake_fit,
                                                                                         local_ray):
    """The same command, rerun once the cause is fixed, restores the row's Ray Tune experiment.

    The stopped trial runs again with its values (``resume_errored``), the finished ones are not rerun, the row
    selects.
    """
    from fedhet.tuning import TrialInterrupted
    from tests.test_tuning import _trial1_of_row_stops

    fake_fit.write_text(_trial1_of_row_stops("a", 2, "fedhet: error: no space left on the device") + FAKE_FIT)

    with pytest.raises(TrialInterrupted):
        _tune_on_ray(tmp_path, _plan(trials=3))
    fake_fit.write_text(FAKE_FIT)
    result = _tune_on_ray(tmp_path, _plan(trials=3))["a"]
    assert [(t.number, t.state) for t in result.trials] == [(0, "complete"), (1, "complete"), (2, "complete")]
    trials = tmp_path / "runs" / "tuning" / "a"
    assert_stopped_trial_reran_with_its_values(trials / "trial1", result.trials[1])
    assert [c.read_text() for c in sorted(trials.glob("trial*.calls"))] == ["x"] * 3  # trials 0 and 2 not rerun
    assert (tmp_path / "selected" / "a.yaml").is_file()
