"""The tuning stage of ``fedhet bench --grid``: search spaces, studies, selection, resume, pruning, sealed test splits.

The studies run a stand-in for ``fedhet fit`` (a short script that scores a trial from its
learning rate and checks that it was started at the tuning seed with sealed test splits), so the
study logic is tested in seconds; ``test_sealed_fit_reads_no_test_split`` runs the real loop.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fedhet.errors import ConfigError, DataError
from fedhet.tuning import RowStudy, TrialInterrupted, TuningPlan, parse_tuning, search_space, select, tune_rows

ROOT = Path(__file__).resolve().parents[1]
FEDPROX = str(ROOT / "configs/experiments/digits_dir/fedprox.yaml")
FEDAVG = str(ROOT / "configs/experiments/digits_dir/fedavg.yaml")

#: Stands in for ``fedhet fit``: val/acc_local = 100 - 1e4 (lr - 0.05)^2 + round, one record per round.
FAKE_FIT = """
import json, sys, time
from pathlib import Path
args = sys.argv[1:]
assert "--federation.seal_test=true" in args, args
seed = args[args.index("--seed") + 1]
assert seed == "7", seed
run_dir = Path(args[args.index("--run_dir") + 1])
lr = float(next(a.split("=", 1)[1] for a in reversed(args) if a.startswith("--method.init_args.lr=")))
pause = float(next((a.split("=", 1)[1] for a in args if a.startswith("--pause=")), "0"))
run_dir.mkdir(parents=True)
log = Path(str(run_dir) + ".calls")
log.write_text(log.read_text() + "x" if log.exists() else "x")
with open(run_dir / "metrics.jsonl", "w") as f:
    for r in range(3):
        f.write(json.dumps({"round": r, "val/acc_local": 100 - 1e4 * (lr - 0.05) ** 2 + r}) + "\\n")
        f.flush()
        time.sleep(pause)
(run_dir / "summary.json").write_text(json.dumps({"wall_s": 0.01}))
"""


def _plan(**changes) -> TuningPlan:
    values = {"trials": 4, "metric": "acc_local", "seed": 7, "flags": ("--rounds=1",),
              "exclude": ("momentum", "weight_decay", "mu")}  # fmt: skip
    values.update(changes)
    return TuningPlan(**values)


# ---------------------------------------------------------------------------------------------- search space
def test_search_space_is_the_declaration_minus_fixed_keys_plus_shared():
    """The declared ranges, minus what the row fixes or the grid excludes, plus the grid's shared ranges."""
    plan = _plan(exclude=(), shared={})
    space = search_space(FEDPROX, (), plan)
    assert space["method.init_args.lr"] == {"distribution": "log_uniform_values", "min": 1e-4, "max": 1.0}
    assert "method.init_args.mu" in space
    # a key the row sets is not searched; excluded names are searched by no row
    assert "method.init_args.mu" not in search_space(FEDPROX, ("--method.init_args.mu=0.1",), plan)
    assert "method.init_args.mu" not in search_space(FEDPROX, (), _plan(exclude=("m*",), shared={}))
    # a shared knob name replaces its declared range; a shared dotted key is added to every row
    lr = {"distribution": "log_uniform_values", "min": 0.01, "max": 0.1}
    shared = search_space(FEDAVG, (), _plan(shared={"lr": lr, "trainer.gradient_clip_val": {"values": [1.0, 10.0]}}))
    assert shared["method.init_args.lr"] == lr
    assert shared["trainer.gradient_clip_val"] == {"values": [1.0, 10.0]}


def test_search_space_reaches_a_wrapped_base_method():
    """FedFTG's own knobs and its base FedAvg's, each under its config key."""
    space = search_space(str(ROOT / "configs/experiments/mnist_ftg/fedftg_fedavg.yaml"), (), _plan(exclude=()))
    assert "method.init_args.base.init_args.lr" in space
    assert "method.init_args.generator_lr" in space


def test_tuning_section_errors_are_one_line():
    """A mistake in the tuning section is one line naming the key."""
    with pytest.raises(ConfigError, match="unknown key 'trails'"):
        parse_tuning("g.yaml", {"trails": 3, "metric": "acc_local", "seed": 1})
    with pytest.raises(ConfigError, match="trials=0"):
        parse_tuning("g.yaml", {"trials": 0, "metric": "acc_local", "seed": 1})
    with pytest.raises(ConfigError, match="pruner='hyperband'"):
        parse_tuning("g.yaml", {"trials": 2, "metric": "acc_local", "seed": 1, "pruner": "hyperband"})
    plan = parse_tuning("g.yaml", {"trials": 2, "metric": "val/acc_server", "seed": 1})
    assert plan.metric == "acc_server"


# ---------------------------------------------------------------------------------------------- studies
def _tune(tmp_path: Path, plan: TuningPlan, root: str = "runs", rows: int = 1, jobs: int = 1) -> dict:
    rows = [("a", FEDAVG, ()), ("b", FEDAVG, ("--rounds=2",))][:rows]
    return tune_rows(rows, plan, tmp_path / root, tmp_path / "selected", "page", env=dict(__import__("os").environ),
                     jobs=jobs, echo=lambda _: None)  # fmt: skip


def test_each_row_gets_the_same_trials_and_selects_its_best_validation_value(tmp_path, fake_fit, monkeypatch):
    """Every row runs the budget; the selected trial is the best on validation and becomes a config.

    Two rows in parallel threads, with relative config paths (parsing one changes the working directory).
    """
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys.modules[__name__], "FEDAVG", "configs/experiments/digits_dir/fedavg.yaml")
    results = _tune(tmp_path, _plan(), rows=2, jobs=2)
    assert set(results) == {"a", "b"}
    for label, result in results.items():
        assert [t.number for t in result.trials] == [0, 1, 2, 3]
        assert all(t.state == "complete" for t in result.trials)
        best = max(result.trials, key=lambda t: t.value)
        assert result.selected == best
        lr = best.params["method.init_args.lr"]
        assert best.value == pytest.approx(100 - 1e4 * (lr - 0.05) ** 2 + 2)  # the last round's validation value
        # the selected config is a complete fedhet fit config holding the selected value
        text = (tmp_path / "selected" / f"{label}.yaml").read_text()
        assert f"lr: {lr}" in text and "seal_test: false" in text
    assert "rounds: 2" in (tmp_path / "selected" / "b.yaml").read_text()  # the row's own flags are kept


def test_selected_config_runs_with_fedhet_fit(tmp_path, fake_fit):
    """The selected config parses as a fedhet fit config."""
    from fedhet.config import parse_args

    _tune(tmp_path, _plan(trials=2))
    _, config = parse_args(["--config", str(tmp_path / "selected" / "a.yaml")])
    assert config.method.class_path == "fedhet.algorithms.FedAvg"


def test_a_selected_config_that_resolves_to_the_same_run_is_kept_byte_for_byte(tmp_path):
    """A key later added with its default must not change the file whose digest tags the row's seed runs."""
    from fedhet.tuning import write_selected_config

    path = tmp_path / "row.yaml"
    write_selected_config(FEDAVG, ["--rounds=3"], {"method.init_args.lr": 0.05}, path, "header")
    older = "".join(line for line in path.read_text().splitlines(keepends=True) if not line.startswith("feature_proj:"))
    assert older != path.read_text()  # as an earlier fedhet wrote it, without a key added since
    path.write_text(older)
    write_selected_config(FEDAVG, ["--rounds=3"], {"method.init_args.lr": 0.05}, path, "header")
    assert path.read_text() == older
    write_selected_config(FEDAVG, ["--rounds=3"], {"method.init_args.lr": 0.07}, path, "header")  # another selection
    assert "lr: 0.07" in path.read_text() and "feature_proj: pool" in path.read_text()


def test_same_seed_same_proposals_and_a_longer_budget_continues_the_study(tmp_path, fake_fit):
    """Same seed, same proposals; a study resumed with a larger budget equals the uninterrupted one."""
    full = _tune(tmp_path, _plan(trials=3), root="full")["a"].trials
    again = _tune(tmp_path, _plan(trials=3), root="again")["a"].trials
    assert [t.params for t in full] == [t.params for t in again]
    assert len({json.dumps(t.params) for t in full}) == 3  # the configured point, then two proposals
    _tune(tmp_path, _plan(trials=2), root="resumed")
    resumed = _tune(tmp_path, _plan(trials=3), root="resumed")["a"].trials
    assert [t.params for t in resumed] == [t.params for t in full]
    calls = [(tmp_path / "resumed" / "tuning" / "a" / f"trial{i}.calls").read_text() for i in range(3)]
    assert calls == ["x"] * 3  # finished trials were kept, not rerun


def test_an_interrupted_trial_is_resumed_not_counted_twice(tmp_path, fake_fit, monkeypatch):
    """A trial a killed tuning run left running is resumed from its run directory, keeping its number and values."""
    plan = _plan(trials=2)
    study = RowStudy("a", FEDAVG, (), plan, tmp_path / "runs", "tune/page/a")
    asked = study.study(0).ask(study.distributions)  # a killed tuning run left this trial running
    params = study.params_of(asked)
    partial = study.run_dir(asked.number)
    partial.mkdir(parents=True)
    (partial / "checkpoint.pt").write_bytes(b"")
    (partial / "config.yaml").write_text("")
    resumed = []

    def resume_command(self: RowStudy, run_dir: Path) -> list[str]:
        resumed.append(run_dir)
        import shutil

        shutil.rmtree(run_dir)  # the stand-in cannot resume: it reruns the trial's own command
        return self.command(asked.number, params)

    monkeypatch.setattr(RowStudy, "resume_command", resume_command)
    lines: list[str] = []
    trials = study.run(dict(__import__("os").environ), echo=lines.append)
    assert resumed == [partial]
    assert [t.number for t in trials] == [0, 1] and trials[0].params == params
    # numbered as every trial line (from 1 of 2): the resumed trial is the first, the next the second
    assert [line.split(",")[0] for line in lines] == ["a: trial 1/2 resumed", "a: trial 2/2 complete"]
    assert all(t.state == "complete" for t in trials)
    # each trial's seconds are its run's (summary.json's wall_s), not Optuna's time since its (re)start
    assert [t.wall_s for t in trials] == [0.01, 0.01]


def test_median_pruner_stops_poor_trials_while_they_run(tmp_path, fake_fit):
    """A trial whose validation curve is below the median of the finished ones is stopped while it runs."""
    good = {"lr": {"values": [0.05]}}
    plan = _plan(trials=3, pruner="median", flags=("--rounds=1", "--pause=0.4"), shared=good)
    assert all(t.state == "complete" for t in _tune(tmp_path, plan)["a"].trials)
    poor = _plan(trials=4, pruner="median", flags=("--rounds=1", "--pause=0.4"), shared={"lr": {"values": [0.3]}})
    trials = _tune(tmp_path, poor)["a"].trials
    assert [t.state for t in trials] == ["complete", "complete", "complete", "pruned"]
    assert trials[3].params["method.init_args.lr"] == 0.3
    assert not (tmp_path / "runs" / "tuning" / "a" / "trial3" / "summary.json").exists()  # stopped mid-run


def test_selection_needs_a_completed_trial():
    """No completed trial is one line; ties go to the earliest trial."""
    from fedhet.tuning import TrialRecord

    with pytest.raises(ConfigError, match="none of its 1 trials completed"):
        select([TrialRecord(0, {}, None, "failed", 1.0)], "a")
    tie = [TrialRecord(0, {"x": 1}, 5.0, "complete", 1.0), TrialRecord(1, {"x": 2}, 5.0, "complete", 1.0)]
    assert select(tie, "a").number == 0


# ---------------------------------------------------------------------------------------------- sealed test splits
def test_sealed_scenario_refuses_every_read_of_a_test_split():
    """Sealed: every test split refuses its data; sizes and validation stay readable."""
    from fedhet.data.synthetic import SyntheticScenario

    scenario = SyntheticScenario(num_clients=3, min_size=20, max_size=40, holdout_clients=2)
    scenario.setup()
    size = len(scenario.client_data(0).test)
    scenario.seal_test()
    assert scenario.evaluation_splits == ("val",)
    assert len(scenario.client_data(0).test) == size  # sizes stay readable (describe)
    with pytest.raises(DataError, match="client 0's test split was read while the test splits are sealed"):
        _ = scenario.client_data(0).test.x
    with pytest.raises(DataError, match="sealed"):
        list(scenario.eval_loader(next(iter(scenario.eval_sets("test").values()))))
    _ = scenario.client_data(0).val.x  # validation stays open
    scenario.describe()


def test_sealed_fit_reads_no_test_split(tmp_path):
    """A whole sealed run completes, so nothing read a test set; it records validation values only."""
    from fedhet.cli import main

    run = tmp_path / "run"
    code = main(["fit", "--config", str(ROOT / "configs/experiments/synthetic/fedprox.yaml"), "--rounds", "2",
                 "--trainer.max_epochs=1", "--scenario.init_args.num_clients=6", "--federation.participation=1.0",
                 "--scenario.init_args.holdout_clients=2", "--federation.seal_test=true", "--run_dir", str(run),
                 "--threads", "1"])  # fmt: skip
    assert code == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = {k for r in records for k in r if "acc" in k}
    assert keys and all(k.startswith("val/") for k in keys)
    assert not json.loads((run / "summary.json").read_text())["matrix"]  # the test matrix: never computed


def test_an_empty_validation_split_reports_no_value_rather_than_zero():
    """A scenario without local validation: val/acc_local is absent (a tuner would read 0 % as a score)."""
    import torch

    from fedhet.metrics.report import round_metrics

    def matrices(totals: list[float]) -> dict:
        total = torch.tensor([totals, totals])
        return {"top1": torch.full((2, 2), 0.5), "top5": torch.ones(2, 2), "total": total}

    metrics = round_metrics("label_skew", None, matrices([0.0, 100.0]), torch.zeros(2), ["mnist"])
    assert "val/acc_local" not in metrics and metrics["val/acc_global"] == 50.0
    with_local = round_metrics("label_skew", None, matrices([40.0, 100.0]), torch.zeros(2), ["mnist"])
    assert with_local["val/acc_local"] == 50.0


def test_an_interrupt_leaves_the_running_trial_to_resume_not_failed(tmp_path, fake_fit):
    """A stopped tuning run leaves its running trial to resume, not failed, and asks for no other.

    Ctrl-C reaches the main thread only; rows tuned in other threads see STOP, end their trial's run and leave the
    trial running in the study (resumed from its checkpoint next time).
    """
    import threading

    from optuna.trial import TrialState

    from fedhet.tuning import STOP

    study = RowStudy("a", FEDAVG, (), _plan(trials=3, flags=("--rounds=1", "--pause=0.5")), tmp_path / "runs",
                     "tune/page/a")  # fmt: skip
    started = threading.Event()

    def stop_once_the_first_trial_runs() -> None:  # not on a timer: a slow machine may not have started it yet
        while not started.is_set() and not study.run_dir(0).exists():
            started.wait(0.01)
        STOP.set()

    stopper = threading.Thread(target=stop_once_the_first_trial_runs)
    stopper.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            study.run(dict(__import__("os").environ), echo=lambda _: None)
    finally:
        started.set()
        stopper.join()
        STOP.clear()
    assert [t.state for t in study.study(0).get_trials(deepcopy=False)] == [TrialState.RUNNING]


def _trial1_of_row_stops(row: str, code: int, line: str) -> str:
    """A prefix for the stand-in: row ``row``'s trial 1 prints ``line`` and exits ``code``."""
    return (f"import sys\nif sys.argv[-1].endswith('{row}/trial1'):\n"
            f"    print({line!r}, file=sys.stderr)\n    sys.exit({code})\n")  # fmt: skip


def test_a_run_ended_by_its_training_is_a_failed_trial(tmp_path, fake_fit):
    """Exit 3 (a non-finite loss): the trial is failed, never selected, and the budget goes on."""
    line = "fedhet: error: client 2 got a non-finite training loss in round 1 (stage 'local'); lower method.lr"
    fake_fit.write_text(_trial1_of_row_stops("a", 3, line) + FAKE_FIT)
    result = _tune(tmp_path, _plan(trials=3))["a"]
    assert [(t.number, t.state) for t in result.trials] == [(0, "complete"), (1, "failed"), (2, "complete")]
    assert result.trials[1].value is None and result.selected.number in (0, 2)


@pytest.mark.parametrize("code", [2, 1, -9])  # bad input (a refused resume), a traceback, a kill
def test_a_run_stopped_by_anything_else_stops_the_tuning_and_resumes(tmp_path, fake_fit, code):
    """Any other end is not the hyperparameters' doing: one line naming the trial, its reason and the rerun.

    The trial stays running in the study (resumed by the next run of the command), is not told failed, and no
    further trial is asked: a refused resume once spent two of the FedVTC page's trials this way.
    """
    from optuna.trial import TrialState

    line = "fedhet: error: --resume continues a run with its own config; only --rounds may change (changed: federation)"
    script = _trial1_of_row_stops("a", code, line) if code >= 0 else \
        "import os, signal, sys\nif sys.argv[-1].endswith('a/trial1'):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    fake_fit.write_text(script + FAKE_FIT)
    with pytest.raises(TrialInterrupted) as raised:
        _tune(tmp_path, _plan(trials=3))
    message = str(raised.value)
    assert f"tuning a: trial 2 stopped (exit {code})" in message and "rerun the same command" in message
    assert (line if code >= 0 else "killed by SIGKILL") in message and "\n" not in message
    study = RowStudy("a", FEDAVG, (), _plan(trials=3), tmp_path / "runs", "tune/page/a")
    assert [t.state for t in study.study(0).get_trials(deepcopy=False)] == [TrialState.COMPLETE, TrialState.RUNNING]
    # the cause fixed, the same command runs the stopped trial again, with its values, and completes the row
    fake_fit.write_text(FAKE_FIT)
    result = _tune(tmp_path, _plan(trials=3))["a"]
    assert [(t.number, t.state) for t in result.trials] == [(0, "complete"), (1, "complete"), (2, "complete")]
    assert_stopped_trial_reran_with_its_values(study.run_dir(1), result.trials[1])


def assert_stopped_trial_reran_with_its_values(run_dir: Path, record) -> None:
    """The stopped trial's log holds two identical commands (stopped, then run again), with the record's values."""
    from fedhet.tuning import trial_log_path

    commands = [line for line in trial_log_path(run_dir).read_text().splitlines() if line.startswith("$ ")]
    assert len(commands) == 2 and commands[0] == commands[1]
    assert f"--method.init_args.lr={record.params['method.init_args.lr']}" in commands[0]


def test_a_row_that_stops_stops_the_rows_tuned_beside_it_at_once(tmp_path, fake_fit):
    """Row b's trial 1 stops while row a (submitted first, slower) is tuned: row a stops, selecting nothing.

    Waiting for the rows in submission order would run all of row a's trials before the error surfaced; a row
    stopped between two trials once selected from the trials it had.
    """
    from optuna.trial import TrialState

    slow_a = "import sys, time\nif '/a/trial' in sys.argv[-1]:\n    time.sleep(3)\n"
    fake_fit.write_text(slow_a + _trial1_of_row_stops("b", 2, "fedhet: error: no space left on the device") + FAKE_FIT)
    rows = [("a", FEDAVG, ()), ("b", FEDAVG, ())]
    with pytest.raises(TrialInterrupted, match="tuning b: trial 2"):
        tune_rows(rows, _plan(trials=4), tmp_path / "runs", tmp_path / "selected", "page",
                  env=dict(__import__("os").environ), jobs=2, echo=lambda _: None)  # fmt: skip
    row_a = RowStudy("a", FEDAVG, (), _plan(trials=4), tmp_path / "runs", "tune/page/a")
    states = [t.state for t in row_a.study(0).get_trials(deepcopy=False)]
    assert states.count(TrialState.COMPLETE) < 4 and TrialState.FAIL not in states
    assert not (tmp_path / "selected" / "a.yaml").exists()
