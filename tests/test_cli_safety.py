"""Run safety: run directories that never collide, bad values refused before anything is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml

from fedhet.cli import main
from fedhet.errors import ConfigError
from fedhet.tracking import RunDirectory
from fedhet.tracking.wandb_logger import wandb_credentials_available
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
SGD_CONFIG = str(ROOT / "configs/experiments/digits/fedproto.yaml")  # (any optimizer)
ADAM_CONFIG = str(ROOT / "configs/experiments/digits/fccl_plus.yaml")  # optimizer: adam
DIR_CONFIG = str(ROOT / "configs/experiments/digits_dir/fd.yaml")


def _fit(args, capsys):
    code = main(["fit", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _only_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


# ----------------------------------------------------------------------------- 1. run directories
def test_claim_gives_each_concurrent_run_its_own_directory(tmp_path):
    """Eight threads claiming the same default name get eight distinct, new directories."""
    claimed: list[Path] = []
    barrier = threading.Barrier(8)

    def claim() -> None:
        barrier.wait()
        claimed.append(RunDirectory.claim(tmp_path / "runs" / "fedproto-20260101-000000-s0", unique=True).path)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(claimed)) == 8
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(p.name for p in claimed)


@pytest.mark.slow
def test_two_runs_started_in_the_same_second_stay_whole_and_separate(tmp_path):
    """Two processes, same method, seed and second, no --run_dir: two directories, each a whole run."""
    pin_clock = (
        "import sys, time; time.strftime = lambda *a, **k: '20260101-000000'; "
        "from fedhet.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", pin_clock, "fit", "--config", SGD_CONFIG, *tiny_overrides(), f"--rounds={rounds}"],
            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for rounds in (1, 2)
    ]
    errors = [process.communicate(timeout=300)[1] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], errors
    runs = sorted((tmp_path / "runs").iterdir())
    assert [run.name for run in runs] == ["fedproto-20260101-000000-s0", "fedproto-20260101-000000-s0-2"]
    rounds_seen = set()
    for run in runs:
        config = yaml.safe_load((run / "config.yaml").read_text())
        summary = json.loads((run / "summary.json").read_text())
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert config["rounds"] == summary["rounds"] == len(metrics)
        assert [m["round"] for m in metrics] == list(range(config["rounds"]))
        rounds_seen.add(config["rounds"])
    assert rounds_seen == {1, 2}


def test_explicit_run_dir_must_be_new_or_empty(tmp_path, capsys):
    """A non-empty --run_dir is refused in one line naming --resume; an empty one is used."""
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    code, _, err = _fit(["--config", SGD_CONFIG, *tiny_overrides(), "--rounds=1", f"--run_dir={busy}"], capsys)
    assert code == 2 and "--resume" in _only_line(err) and "not empty" in err
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _fit(["--config", SGD_CONFIG, *tiny_overrides(), "--rounds=1", f"--run_dir={empty}"], capsys)
    assert code == 0, err
    assert (empty / "summary.json").is_file()


def test_failed_start_leaves_no_directory(tmp_path, capsys, monkeypatch):
    """An incompatible method/scenario pair, found while the loop is built, removes the claimed default directory."""
    monkeypatch.chdir(tmp_path)
    args = ["--config", SGD_CONFIG, *tiny_overrides(), "--method=fedavg", "--federation.state_store=disk"]
    code, _, err = _fit(args, capsys)
    assert code == 2 and "one architecture" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


# ----------------------------------------------------------------------------- 2. validation first
@pytest.mark.parametrize(
    "config,extra,key,allowed",
    [
        (SGD_CONFIG, ["--method.lr=-0.1"], "method.lr=-0.1", "> 0"),
        (ADAM_CONFIG, ["--method.lr=-0.1"], "method.lr=-0.1", "> 0"),
        (ADAM_CONFIG, ["--method.public_lr=0"], "method.public_lr=0", "> 0"),
        (SGD_CONFIG, ["--method.lam=-1"], "method.lam=-1", ">= 0"),
        (SGD_CONFIG, ["--method.momentum=1.5"], "method.momentum=1.5", "[0, 1)"),
        (SGD_CONFIG, ["--method=fedavg", "--method.lr=0"], "method.lr=0", "> 0"),
        (ADAM_CONFIG, ["--method.temperature=0"], "method.temperature=0", "> 0"),
        (DIR_CONFIG, ["--method.gamma=-0.5"], "method.gamma=-0.5", ">= 0"),
        (SGD_CONFIG, ["--federation.participation=1.5"], "federation.participation=1.5", "(0, 1] or an integer"),
        (SGD_CONFIG, ["--federation.eval_every=0"], "federation.eval_every=0", ">= 1"),
        (SGD_CONFIG, ["--trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0", ">= 1"),
        (SGD_CONFIG, ["--rounds=0"], "rounds=0", ">= 1"),
    ],
)
def test_out_of_range_value_is_one_line_before_anything_is_written(config, extra, key, allowed, tmp_path, capsys):
    """The key, the value and the allowed range in one line, exit 2, no run directory."""
    run_dir = tmp_path / "run"
    tiny = tiny_overrides("label_skew" if config == DIR_CONFIG else "domain_shift")
    code, out, err = _fit(["--config", config, *tiny, *extra, f"--run_dir={run_dir}"], capsys)
    line = _only_line(err)
    assert code == 2 and out == ""
    assert line.startswith("fedhet: error: ") and key in line and allowed in line and "Traceback" not in err
    assert not run_dir.exists()


def test_unknown_memory_format_is_one_line_naming_the_choices(tmp_path, capsys):
    """A layout other than contiguous or channels_last: the key, the value and both choices, exit 2."""
    run_dir = tmp_path / "run"
    code, out, err = _fit(["--config", SGD_CONFIG, *tiny_overrides(), "--trainer.memory_format=nhwc",
                           f"--run_dir={run_dir}"], capsys)
    line = _only_line(err)
    assert code == 2 and out == "" and "Traceback" not in err
    assert "trainer.memory_format" in line and "nhwc" in line
    assert "contiguous" in line and "channels_last" in line
    assert not run_dir.exists()


def test_every_method_checks_its_optimizer_ranges():
    """Each registered method's parser rejects lr <= 0, negative weight decay and momentum >= 1."""
    from jsonargparse import ArgumentParser

    from fedhet.algorithms import ALGORITHMS, ServerPlugin

    for cls in ALGORITHMS.values():
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, "m")
        parser.parse_args([])  # the defaults are in range
        # a server plugin's client optimizer is its base method's
        key = "m.base.init_args" if issubclass(cls, ServerPlugin) else "m"
        prefix = ["--m.base=fedhet.algorithms.FedAvg"] if issubclass(cls, ServerPlugin) else []
        for bad in (f"--{key}.lr=0", f"--{key}.lr=-1", f"--{key}.weight_decay=-1", f"--{key}.momentum=1"):
            with pytest.raises(Exception, match="restriction"):
                parser.parse_args([*prefix, bad])


def test_python_callers_pass_plain_floats_and_the_cli_builds_plain_numbers():
    """Annotations do not bind Python callers; values built by the command line are plain floats."""
    from fedhet.algorithms import FedProto
    from fedhet.config import build_experiment, build_parser

    assert FedProto(lam=0.5, lr=0.1).lr == 0.1
    parser = build_parser()
    config = parser.parse_args(["--config", SGD_CONFIG, *tiny_overrides(), "--method.lr=0.2"])
    experiment = build_experiment(parser, config)
    assert type(experiment.method.lr) is float and type(experiment.method.lam) is float
    assert type(experiment.objects.trainer.accumulate_grad_batches) is int


@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
def test_missing_gpu_is_one_line_before_anything_is_written(accelerator, tmp_path, capsys, monkeypatch):
    """--trainer.accelerator gpu without a GPU: one line naming the fix, exit 2, no run directory."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run_dir = tmp_path / "run"
    args = ["--config", SGD_CONFIG, *tiny_overrides(), f"--trainer.accelerator={accelerator}", f"--run_dir={run_dir}"]
    code, _, err = _fit(args, capsys)
    line = _only_line(err)
    assert code == 2 and f"trainer.accelerator={accelerator}" in line and "--trainer.accelerator=cpu" in line
    assert not run_dir.exists()


def _no_wandb_credentials(monkeypatch, tmp_path):
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


def test_wandb_credentials_are_found_where_wandb_looks(tmp_path, monkeypatch):
    """WANDB_API_KEY or a netrc entry for the W&B host count as credentials; nothing else does."""
    _no_wandb_credentials(monkeypatch, tmp_path)
    assert not wandb_credentials_available()
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "0" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert wandb_credentials_available()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert not wandb_credentials_available()
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    assert wandb_credentials_available()


def test_wandb_online_without_credentials_logs_offline_with_one_warning(tmp_path, capsys, monkeypatch):
    """--wandb.mode online and no login: one warning line, the run completes and logs offline."""
    _no_wandb_credentials(monkeypatch, tmp_path)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    args = ["--config", SGD_CONFIG, *tiny_overrides(), "--rounds=1", "--wandb.mode=online", f"--run_dir={run_dir}"]
    code, _, err = _fit(args, capsys)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "offline" in warnings[0] and "wandb sync" in warnings[0]
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1


def test_resume_of_a_run_without_checkpoint_proposes_a_rerun_that_works(tmp_path, capsys):
    """A run killed before its first checkpoint cannot continue; the hint's command starts it again."""
    run_dir = tmp_path / "run"
    code, _, err = _fit(["--config", SGD_CONFIG, *tiny_overrides(), "--rounds=1", f"--run_dir={run_dir}"], capsys)
    assert code == 0, err
    for name in ("summary.json", "checkpoint.pt", "metrics.jsonl"):
        (run_dir / name).unlink()
    code, _, err = _fit(["--resume", str(run_dir)], capsys)
    line = _only_line(err)
    assert code == 2 and "no checkpoint.pt" in line
    command = line.split("fedhet fit ", 1)[1].split()
    code, _, err = _fit(command, capsys)
    assert code == 0, err
    assert (Path(f"{run_dir}-rerun") / "summary.json").is_file()


def test_run_directory_claim_refuses_a_file(tmp_path):
    """A --run_dir that is an existing file is refused, not overwritten."""
    target = tmp_path / "taken"
    target.write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        RunDirectory.claim(target)
    assert target.read_text() == "x"
