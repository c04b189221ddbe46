"""The examples of docs/reuse.md run as written: a plain Trainer, and LightningCLI from a shell."""

from __future__ import annotations

import csv
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reuse.md"
CLI_HEADING = "## `LightningCLI`"


def _blocks(language: str, text: str) -> list[str]:
    """The fenced code blocks of ``language`` in ``text``, in order."""
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def _sections() -> tuple[str, str]:
    """The doc before and after its LightningCLI heading."""
    plain, cli = DOC.read_text().split(CLI_HEADING)
    return plain, cli


def _exec(code: str, namespace: dict) -> None:
    exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation


def _columns(metrics: Path) -> set[str]:
    with metrics.open() as handle:
        return {key for row in csv.DictReader(handle) for key, value in row.items() if value}


def test_plain_trainer_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Python block before the CLI section runs in one namespace and logs train/loss."""
    monkeypatch.chdir(tmp_path)
    plain, _ = _sections()
    blocks = _blocks("python", plain)
    assert len(blocks) == 3
    namespace: dict = {}
    for block in blocks:
        _exec(block, namespace)
    (metrics,) = tmp_path.glob("logs/**/metrics.csv")
    assert {"train/loss_step", "train/loss_epoch", "val/acc", "test/acc"} <= _columns(metrics)


def test_lightning_cli_example_runs_from_a_shell_and_reloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented config trains through ``python -m fedhet.examples.reuse_cli``; the checkpoint reloads."""
    from fedhet.examples.reuse_cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["reuse_cli"])  # main(args) below: pytest's own arguments are not the CLI's
    _, cli = _sections()
    (config,) = _blocks("yaml", cli)
    (tmp_path / "client.yaml").write_text(config)
    commands = [shlex.split(line, comments=True) for line in _blocks("bash", cli)[0].splitlines() if line.strip()]
    fit, override, test = commands
    assert fit[:3] == ["python", "-m", "fedhet.examples.reuse_cli"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, *fit[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (metrics,) = tmp_path.glob("lightning_logs/version_0/metrics.csv")
    assert {"train/loss_step", "train/loss_epoch", "val/acc"} <= _columns(metrics)

    (reload,) = _blocks("python", cli)
    _exec(reload, {})

    with pytest.raises(SystemExit) as printed:  # the override line parses (printing, not training)
        main([*override[3:], "--print_config"])
    assert printed.value.code == 0
    (checkpoint,) = tmp_path.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    main([arg.replace("<file>.ckpt", checkpoint.name) for arg in test[3:]])
    assert any("test/acc" in _columns(m) for m in tmp_path.glob("lightning_logs/version_*/metrics.csv"))
