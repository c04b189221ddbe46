"""The command line: configs, overrides, results files, resume, and one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fedhet.cli import main
from fedhet.errors import EXIT_BAD_INPUT, EXIT_TRAINING_STOPPED
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(ROOT / "configs/experiments/digits/fedproto.yaml")
DIGITS_DIR = str(ROOT / "configs/experiments/digits_dir/fd.yaml")


def _fit(args, capsys):
    code = main(["fit", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines, "expected an error message"
    assert "Traceback" not in err
    return lines[-1]


@pytest.fixture
def run_dir(tmp_path):
    """A run directory path that does not exist yet."""
    return tmp_path / "run"


def test_fit_writes_the_results_contract(run_dir, capsys):
    """A fit writes summary, metrics lines, the resolved config, the console table and per-round progress."""
    code, out, err = _fit(["--config", DIGITS, *tiny_overrides(), "--rounds", "2", "--run_dir", str(run_dir)], capsys)
    assert code == 0, err
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("method", "scenario", "seed", "rounds", "final", "best", "comm", "wall_s"):
        assert key in summary
    assert summary["method"] == "FedProto" and summary["rounds"] == 2 and summary["seed"] == 0
    assert {"acc_intra", "acc_inter"} <= set(summary["final"]) and {"acc_intra", "acc_inter"} <= set(summary["best"])
    assert summary["comm"]["bytes_up"] > 0 and summary["comm"]["bytes_down"] > 0
    environment = summary["environment"]  # what the numbers were computed on (bitwise reproducible only there)
    assert environment["torch"] == torch.__version__ and environment["threads"] == torch.get_num_threads()
    assert environment["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and environment["gpu"] is None
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [0, 1]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["rounds"] == 2 and config["models"] == "tiny2"
    assert "accuracy matrix" in out and "acc_inter" in out
    assert "round   2/2" in err  # progress per round


def test_label_skew_summary_and_equals_form_overrides(run_dir, capsys):
    """A label-skew run reports local/global metrics and --key=value overrides reach the config."""
    overrides = ["--rounds=1", f"--run_dir={run_dir}", "--method.gamma=0.5"]
    args = ["--config", DIGITS_DIR, *tiny_overrides("label_skew"), *overrides]
    code, _, err = _fit(args, capsys)
    assert code == 0, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {"acc_local", "acc_global", "acc_local_mean", "acc_local_std"} <= set(summary["final"])
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["method"]["init_args"]["gamma"] == 0.5


def test_same_seed_identical_summary_metrics(tmp_path, capsys):
    """Two CLI runs with the same seed write identical summary blocks."""
    summaries = []
    for name in ("a", "b"):
        overrides = ["--rounds", "2", "--seed", "7", "--run_dir", str(tmp_path / name)]
        args = ["--config", DIGITS, *tiny_overrides(), *overrides]
        code, _, err = _fit(args, capsys)
        assert code == 0, err
        summaries.append(json.loads((tmp_path / name / "summary.json").read_text()))
    for block in ("final", "best", "last3", "comm", "matrix"):
        assert summaries[0][block] == summaries[1][block]


def test_threads_pins_the_intra_op_threads_and_is_saved(run_dir, capsys):
    """``--threads`` sets torch's thread count before anything is built; the run's config records it."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        code, _, err = _fit(["--config", DIGITS, *tiny_overrides(), "--rounds", "1", "--threads", "1",
                             "--run_dir", str(run_dir)], capsys)
        assert code == 0, err
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["threads"] == 1


def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, capsys):
    """A run killed (SIGKILL) after round 2 of 4 and resumed ends with exactly the uninterrupted metrics."""
    base = ["--config", DIGITS, *tiny_overrides(), "--rounds", "4"]
    code, _, err = _fit([*base, "--run_dir", str(tmp_path / "full")], capsys)
    assert code == 0, err
    cut = tmp_path / "cut"
    # bitwise-equal numbers need the same intra-op thread count in both processes
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    process = subprocess.Popen(
        [sys.executable, "-m", "fedhet", "fit", *base, "--run_dir", str(cut)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT, env=env,
    )
    for line in process.stderr:  # the checkpoint of a round is written before its progress line
        if "round   2/4" in line:
            process.send_signal(signal.SIGKILL)
            break
    process.wait(timeout=120)
    assert not (cut / "summary.json").exists()
    code, _, err = _fit(["--resume", str(cut)], capsys)
    assert code == 0, err
    resumed = json.loads((cut / "summary.json").read_text())
    full = json.loads((tmp_path / "full" / "summary.json").read_text())
    for block in ("final", "best", "last3", "comm", "matrix"):
        assert resumed[block] == full[block], block
    assert [json.loads(line)["round"] for line in (cut / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "extra,pattern",
    [
        (["--method.lamda=1"], "lamda"),  # unknown key
        (["--rounds=many"], "rounds"),  # wrong type
        (["--method=fedhet.algorithms.NoSuchMethod"], "NoSuchMethod"),  # unknown method
        (["--models=[resnet_huge]"], "resnet_huge"),  # unknown model
        (["--method=fedhet.algorithms.FedAvg"], "one architecture"),  # incompatible pair
        (["--federation.lr_schedule.kind=cosine"], "lr_schedule"),  # unknown schedule
        (["--federation.lr_schedule.final_fraction=1.5"], "final_fraction"),  # out of range
        (["--threads=0"], "threads"),  # not a thread count
    ],
)
def test_bad_input_is_one_clear_line(extra, pattern, run_dir, capsys):
    """Bad keys, types, methods or models fail in one 'fedhet: error:' line before writing anything."""
    code, _, err = _fit(["--config", DIGITS, *tiny_overrides(), *extra, "--run_dir", str(run_dir)], capsys)
    assert code == EXIT_BAD_INPUT
    line = _error_line(err)
    assert line.startswith("fedhet: error:") and pattern in line
    assert not run_dir.exists()  # rejected before anything is written


def test_empty_partition_is_a_clear_error(run_dir, capsys):
    """An impossible partition (min_size too large) is a one-line error naming min_size."""
    args = [
        "--config",
        DIGITS_DIR,
        *tiny_overrides("label_skew"),
        "--scenario.num_clients=3",
        "--scenario.partitioner.init_args.min_size=5000",
    ]
    code, _, err = _fit([*args, "--run_dir", str(run_dir)], capsys)
    assert code != 0 and "min_size" in _error_line(err)
    assert not (run_dir / "summary.json").exists()


def test_missing_dataset_root_is_a_clear_error(run_dir, capsys):
    """A paper dataset without a local root is a one-line error naming the dataset and root."""
    args = [
        "--config",
        DIGITS_DIR,
        *tiny_overrides("label_skew"),
        "--scenario.dataset=cifar10",
        f"--scenario.root={run_dir}/nowhere",
    ]
    code, _, err = _fit([*args, "--run_dir", str(run_dir)], capsys)
    assert code != 0 and "cifar10" in _error_line(err) and "root" in _error_line(err)


def test_corrupt_checkpoint_is_a_clear_error(run_dir, capsys):
    """Resuming from a corrupt checkpoint is a one-line error and writes no summary."""
    code, _, err = _fit(["--config", DIGITS, *tiny_overrides(), "--rounds", "1", "--run_dir", str(run_dir)], capsys)
    assert code == 0, err
    (run_dir / "summary.json").unlink()
    (run_dir / "checkpoint.pt").write_bytes(b"\x00garbage")
    code, _, err = _fit(["--resume", str(run_dir)], capsys)
    assert code != 0 and "corrupt" in _error_line(err)
    assert not (run_dir / "summary.json").exists()


def test_nan_loss_is_a_clear_error(run_dir, capsys):
    """A diverging run stops with a one-line non-finite loss error, exit 3 (not bad input's 2), and no summary."""
    args = ["--config", DIGITS, *tiny_overrides(), "--method.lr=1e30", "--rounds=1", "--run_dir", str(run_dir)]
    code, _, err = _fit(args, capsys)
    assert code == EXIT_TRAINING_STOPPED and "non-finite" in _error_line(err)
    assert not (run_dir / "summary.json").exists()


def test_resume_refuses_changed_config(run_dir, capsys):
    """Resume refuses any change to the config but --rounds."""
    code, _, _ = _fit(["--config", DIGITS, *tiny_overrides(), "--rounds", "1", "--run_dir", str(run_dir)], capsys)
    (run_dir / "summary.json").unlink()
    code, _, err = _fit(["--resume", str(run_dir), "--method.lam=5"], capsys)
    assert code != 0 and "only --rounds" in _error_line(err)


def test_resume_accepts_a_class_without_arguments_chosen_on_the_command_line(run_dir, capsys):
    """A config's process executor replaced by ``--federation.executor=sequential`` resumes.

    The run saves ``init_args: {}`` (the process executor's arguments dropped); read back from
    config.yaml the executor has no ``init_args``. The two spellings are one config.
    """
    process = ["--federation.executor=process", "--federation.executor.init_args.workers=2"]
    args = ["--config", DIGITS, *tiny_overrides(), *process, "--federation.executor=sequential", "--rounds", "2"]
    code, _, err = _fit([*args, "--run_dir", str(run_dir)], capsys)
    assert code == 0, err
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["federation"]["executor"]["init_args"] == {}
    (run_dir / "summary.json").unlink()
    code, _, err = _fit(["--resume", str(run_dir)], capsys)
    assert code == 0, err
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 2


def test_existing_run_dir_is_not_overwritten(run_dir, capsys):
    """A finished run directory is never overwritten; the error points at --resume."""
    args = ["--config", DIGITS, *tiny_overrides(), "--rounds", "1", "--run_dir", str(run_dir)]
    assert _fit(args, capsys)[0] == 0
    before = (run_dir / "summary.json").read_text()
    code, _, err = _fit(args, capsys)
    assert code != 0 and "--resume" in _error_line(err)
    assert (run_dir / "summary.json").read_text() == before


def test_print_config_and_python_dash_m():
    """Running ``python -m fedhet fit --print_config`` prints the resolved config with overrides applied."""
    result = subprocess.run(
        [sys.executable, "-m", "fedhet", "fit", "--config", DIGITS, "--rounds=3", "--print_config"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert config["rounds"] == 3 and config["method"]["class_path"] == "fedhet.algorithms.FedProto"


def test_sweep_agent_command_line_form(run_dir, capsys):
    """W&B agents append --key=value after the config: the last value wins."""
    overrides = ["--rounds=1", f"--run_dir={run_dir}", "--method.init_args.lam=0.7", "--seed=4"]
    args = ["--config", DIGITS, *tiny_overrides(), *overrides]
    code, _, err = _fit(args, capsys)
    assert code == 0, err
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["method"]["init_args"]["lam"] == 0.7 and config["seed"] == 4


def test_every_experiment_config_parses():
    """Every shipped experiment config parses."""
    from fedhet.config import build_parser

    parser = build_parser()
    configs = sorted((ROOT / "configs/experiments").rglob("*.yaml"))
    assert len(configs) >= 10
    for path in configs:
        parser.parse_args(["--config", str(path)])


def test_sweep_configs_expand_to_valid_command_lines():
    """Every sweep's parameters, expanded as the W&B agent does (--key=value after the config), parse."""
    import itertools

    from fedhet.config import build_parser, parse_accepting_none
    from fedhet.sweep import fit_index

    parser = build_parser()
    sweeps = sorted((ROOT / "configs/sweeps").glob("*.yaml"))
    assert sweeps
    for path in sweeps:
        sweep = yaml.safe_load(path.read_text())
        command = sweep["command"]
        start = fit_index(command) + 1  # [${env}, ${interpreter}, -m, fedhet, fit, ...] or [fedhet, fit, ...]
        assert command[-1] == "${args}"
        names = list(sweep["parameters"])
        grids = [spec.get("values", [spec.get("value")]) for spec in sweep["parameters"].values()]
        for values in itertools.product(*grids):
            args = [*command[start:-1], *(f"--{k}={v}" for k, v in zip(names, values, strict=True))]
            args = [str(ROOT / a) if a.endswith(".yaml") else a for a in args]
            config = parse_accepting_none(parser, args)  # a swept null arrives as --key=None
            for key, value in zip(names, values, strict=True):
                node = config
                for part in key.split("."):
                    node = node[part]
                assert node == value, key


def test_wandb_offline_run_is_written_without_network(run_dir, capsys, monkeypatch):
    """An offline W&B run is written into the run directory and its id stored in the checkpoint."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = ["--config", DIGITS, *tiny_overrides(), "--rounds=1", "--wandb.mode=offline", f"--run_dir={run_dir}"]
    code, _, err = _fit(args, capsys)
    assert code == 0, err
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    from fedhet.tracking import RunDirectory

    checkpoint_id = RunDirectory(run_dir).load_checkpoint()["wandb_id"]
    assert checkpoint_id and checkpoint_id in runs[0].name
