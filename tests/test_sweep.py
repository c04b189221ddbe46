"""``fedhet sweep``: W&B-format sweeps run offline, the agent's command forms, and None values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fedhet.cli import main
from fedhet.sweep import DEFAULT_COMMAND, Sweep, build_command, load_sweep

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs/sweeps/tiny_digits.yaml"
FCCL_PLUS = str(ROOT / "configs/experiments/digits/fccl_plus.yaml")
DIGITS = str(ROOT / "configs/experiments/digits/fedproto.yaml")


@pytest.fixture(scope="module")
def parser():
    """The fedhet fit parser, built once for the module."""
    from fedhet.config import build_parser

    return build_parser()


def _error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and "Traceback" not in err
    return lines[-1]


@pytest.mark.parametrize("args", [["--feature_dim=None"], ["--feature_dim", "None"], ["--feature_dim=none"]])
def test_none_is_null_for_optional_values(parser, args):
    """A swept null arrives as ``--key=None`` (W&B's rendering) and is read as null."""
    from fedhet.config import parse_config

    assert parse_config(parser, ["--config", DIGITS, *args]).feature_dim is None
    assert parse_config(parser, ["--config", DIGITS, "--wandb.entity=None"]).wandb.entity is None


def test_lowercase_none_stays_a_choice_where_it_is_one(parser):
    """``none`` is FCCL+'s "no local distillation" choice, not null."""
    from fedhet.config import parse_config

    config = parse_config(parser, ["--config", FCCL_PLUS, "--method.init_args.local_distillation=none"])
    assert config.method.init_args.local_distillation == "none"


def test_flags_are_formatted_as_the_wandb_agent_formats_them():
    """``${args}`` and its variants expand to what ``wandb agent`` would run."""
    utils = pytest.importorskip("wandb.sdk.launch.sweeps.utils")
    params = {"feature_dim": None, "method.init_args.lr": 0.05, "seed": 2, "scenario.domains": ["mnist", "uci"]}
    params["b"] = True
    expected = utils.create_sweep_command_args({"args": {k: {"value": v} for k, v in params.items()}})
    template = ["${env}", "${interpreter}", "-m", "fedhet", "fit", "--config", "x.yaml", "${args}"]
    command = build_command(template, params, None)
    assert command[1:] == ["-m", "fedhet", "fit", "--config", "x.yaml", *expected["args"]]
    for macro in ("args_no_hyphens", "args_no_equals", "args_no_boolean_flags", "args_json", "args_override_hydra"):
        assert build_command(["fedhet", "fit", f"${{{macro}}}"], params, None)[4:] == expected[macro], macro
    assert command[0].endswith("python") or "python" in Path(command[0]).name  # this interpreter, not PATH's


@pytest.mark.parametrize(
    "command,pattern",
    [
        (DEFAULT_COMMAND, "${program} as a script"),  # W&B's default cannot start fedhet
        (["${env}", "${interpreter}", "-m", "fedhet", "fit", "${args}", "--config", "x.yaml"], "after --config"),
        (["fedhet", "fit", "--config", "x.yaml"], "${args}"),
    ],
)
def test_unusable_commands_are_one_clear_line(tmp_path, capsys, command, pattern):
    """A sweep whose command cannot run fedhet fit with the swept flags is refused before any run."""
    spec = {"method": "grid", "parameters": {"seed": {"values": [0]}}, "command": command, "program": "train.py"}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    code = main(["sweep", str(path), "--dir", str(tmp_path / "out")])
    line = _error_line(capsys.readouterr().err)
    assert code == 2 and line.startswith("fedhet: error:") and pattern in line
    assert not (tmp_path / "out").exists()


def test_random_search_needs_a_count(tmp_path, capsys):
    """Random search never runs out of points: without --count it is refused in one line."""
    spec = {
        "method": "random",
        "parameters": {"method.init_args.lr": {"distribution": "log_uniform_values", "min": 1e-3, "max": 1e-1}},
        "command": ["fedhet", "fit", "--config", DIGITS, "${args}"],
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    code = main(["sweep", str(path), "--dir", str(tmp_path / "out")])
    assert code == 2 and "--count" in _error_line(capsys.readouterr().err)


def test_random_and_bayes_proposals_are_seeded_and_use_results(tmp_path):
    """Offline proposals repeat for a seed; bayes reads the finished runs' metric."""
    space = {"method.init_args.lr": {"distribution": "log_uniform_values", "min": 1e-3, "max": 1e-1}}
    command = ["fedhet", "fit", "--config", DIGITS, "${args}"]
    random_spec = {"method": "random", "parameters": space, "command": command}
    first = [Sweep(random_spec, tmp_path / "a", seed=3).propose([]) for _ in range(2)]
    assert first[0] == first[1] and 1e-3 <= first[0]["method.init_args.lr"] <= 1e-1
    assert Sweep(random_spec, tmp_path / "b", seed=4).propose([]) != first[0]
    metric = {"name": "acc_inter", "goal": "maximize"}
    bayes_spec = {"method": "bayes", "metric": metric, "parameters": space, "command": command}
    sweep = Sweep(bayes_spec, tmp_path / "c")
    for index, lr in enumerate([0.001, 0.01, 0.1]):
        sweep.runs.append(
            {
                "name": f"run-{index:03d}",
                "params": {"method.init_args.lr": lr},
                "state": "finished",
                "summary_metrics": {"acc_inter": 50 - 100 * abs(lr - 0.01)},
                "history": [],
            }
        )
    proposal = sweep.propose([])
    assert 1e-3 <= proposal["method.init_args.lr"] <= 1e-1


def test_shipped_sweeps_parse_and_stay_offline(parser):
    """Every configs/sweeps/*.yaml is a valid sweep whose runs parse, and none forces online mode."""
    from fedhet.config import parse_config

    for path in sorted((ROOT / "configs/sweeps").glob("*.yaml")):
        spec = load_sweep(path)
        assert "wandb.mode" not in spec["parameters"] and "--wandb.mode" not in " ".join(spec["command"]), path
        sweep = Sweep(spec, Path("/nonexistent") / path.stem)
        run = sweep.new_run(sweep.propose([]), [])
        fit_args = run["command"][run["command"].index("fit") + 1 :]
        config_at = fit_args.index("--config") + 1
        fit_args[config_at] = str(ROOT / fit_args[config_at])
        parse_config(parser, fit_args)


def test_agent_runs_log_online_unless_told_otherwise(monkeypatch):
    """Under ``wandb agent`` (WANDB_SWEEP_ID set) an offline-configured run reports to the sweep server."""
    from fedhet.tracking import WandbConfig

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SWEEP_ID", "abc123")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # an agent's run has the agent's credentials
    assert WandbConfig().effective_mode() == "online"
    assert WandbConfig(mode="disabled").effective_mode() == "disabled"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert WandbConfig().effective_mode() == "offline"
    monkeypatch.delenv("WANDB_SWEEP_ID")
    monkeypatch.delenv("WANDB_MODE")
    assert WandbConfig().effective_mode() == "offline"


@pytest.mark.slow
def test_docs_worked_example_runs_offline_and_resumes(tmp_path, capsys, monkeypatch):
    """docs/sweeps.md's example: 4 grid runs, 2 at a time, a sorted table; rerunning starts nothing."""
    monkeypatch.chdir(ROOT)  # the sweep's --config path is relative to the repository root
    out = tmp_path / "sweep"
    code = main(["sweep", str(TINY), "--jobs", "2", "--dir", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    results = json.loads((out / "sweep_results.json").read_text())
    runs = results["runs"]
    assert len(runs) == 4 and all(r["state"] == "finished" for r in runs)
    grid = {(r["params"]["method.init_args.lr"], r["params"]["feature_dim"]) for r in runs}
    assert grid == {(0.01, None), (0.1, None), (0.01, 32), (0.1, 32)}
    for run in runs:  # the table's metric is the run's own final acc_inter, and each run has its own directory
        summary = json.loads((Path(run["run_dir"]) / "summary.json").read_text())
        assert run["metric"] == summary["final"]["acc_inter"]
        config = yaml.safe_load((Path(run["run_dir"]) / "config.yaml").read_text())
        assert config["feature_dim"] == run["params"]["feature_dim"]
    metrics = [r["metric"] for r in runs]
    assert metrics == sorted(metrics, reverse=True)  # goal: maximize
    assert "| rank | run | acc_inter |" in stdout and "best: " in stdout
    assert (out / "sweep_results.md").read_text() in stdout

    code = main(["sweep", str(TINY), "--jobs", "2", "--dir", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0 and "4 finished runs kept" in stdout and "started" not in stdout


def test_a_mistyped_parameter_stops_the_sweep_before_any_run(tmp_path, capsys, monkeypatch):
    """A parameter key fedhet fit does not know fails the first run's parse: one line, nothing started."""
    monkeypatch.chdir(ROOT)
    spec = load_sweep(TINY)
    spec["parameters"] = {"method.init_args.lamda": {"values": [0.1, 1.0]}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    code = main(["sweep", str(path), "--dir", str(tmp_path / "out")])
    line = _error_line(capsys.readouterr().err)
    assert code == 2 and "lamda" in line and "run-000" in line
    assert not list((tmp_path / "out").glob("run-*"))


def test_grid_and_random_sweeps_need_no_optional_package(tmp_path, monkeypatch):
    """W&B's ``sweeps`` package is not used (it pins numpy<2); only bayes needs Optuna, an install requirement."""
    import configparser
    import sys

    monkeypatch.setitem(sys.modules, "sweeps", None)  # import sweeps would raise ImportError
    monkeypatch.setitem(sys.modules, "optuna", None)
    spec = load_sweep(TINY)
    assert Sweep(spec, tmp_path / "out").propose([]) == {"feature_dim": None, "method.init_args.lr": 0.01}
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    requires = setup["options"]["install_requires"].split()
    assert "optuna>=3.0" in requires and not any(r.startswith("sweeps") for r in requires)


def test_print_config_accepts_none(capsys):
    """--print_config reads a swept None as null too."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", DIGITS, "--feature_dim=None", "--print_config"])
    assert exit_info.value.code == 0
    assert "feature_dim: null" in capsys.readouterr().out
