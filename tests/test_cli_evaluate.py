"""``fedhet test`` / ``fedhet validate``: re-evaluate a run's saved state without training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedhet.cli import evaluate_run, main
from fedhet.errors import ConfigError
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(ROOT / "configs/experiments/digits/fedproto.yaml")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 1-round tiny run (shared: the tests only read it)."""
    run_dir = tmp_path_factory.mktemp("evaluate") / "run"
    assert main(["fit", "--config", DIGITS, *tiny_overrides(), "--rounds=1", f"--run_dir={run_dir}"]) == 0
    return run_dir


def _snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run_dir.rglob("*")}


def test_test_reproduces_the_final_metrics_and_prints_the_table(finished_run, capsys):
    """Test RUN_DIR: the run's final test metrics and matrix, the fit table, nothing written."""
    before = _snapshot(finished_run)
    capsys.readouterr()
    assert main(["test", str(finished_run)]) == 0
    out = capsys.readouterr().out
    assert "evaluated on the test sets" in out and "accuracy matrix" in out and "acc_intra" in out
    summary = json.loads((finished_run / "summary.json").read_text())
    result = evaluate_run(finished_run)
    assert {"acc_intra", "acc_inter", "domain/mnist/acc_intra"} <= set(result["final"])
    assert result["final"] == {k: summary["final"][k] for k in result["final"]}  # the training-time values
    assert result["matrix"] == summary["matrix"]
    assert _snapshot(finished_run) == before


def test_validate_reports_the_validation_metrics(finished_run, capsys):
    """Validate RUN_DIR: the validation metrics the run logged in its last round."""
    last = json.loads((finished_run / "metrics.jsonl").read_text().splitlines()[-1])
    result = evaluate_run(finished_run, split="val")
    assert result["final"] == {k.removeprefix("val/"): v for k, v in last.items() if k.startswith("val/")}
    assert main(["validate", str(finished_run)]) == 0
    assert "evaluated on the validation sets" in capsys.readouterr().out


def test_another_scenarios_sets(finished_run):
    """--scenario overrides evaluate the same state on other sets (same number of clients)."""
    base = evaluate_run(finished_run)
    other = evaluate_run(finished_run, ["--scenario.test_per_domain=80"])
    assert other["matrix"]["rows"] == base["matrix"]["rows"]
    assert other["matrix"]["top1"] != base["matrix"]["top1"]


def test_client_count_mismatch_is_a_clear_error(finished_run, capsys):
    """A scenario with another number of clients is refused in one line."""
    code = main(["test", str(finished_run), "--scenario.domains=[mnist, uci]", "--scenario.private_sizes=[32, 32]"])
    err = capsys.readouterr().err
    assert code == 2 and "3 clients" in err and "has 2" in err and "Traceback" not in err


def test_method_changes_are_refused(finished_run):
    """Only --scenario and --trainer may change: the state belongs to the run's method and models."""
    with pytest.raises(ConfigError, match="changed: method"):
        evaluate_run(finished_run, ["--method.lam=3"])
    with pytest.raises(ConfigError, match="changed: models"):
        evaluate_run(finished_run, ["--models=cpu4"])


def test_missing_run_or_checkpoint_is_one_line(tmp_path, finished_run, capsys):
    """No run directory, or a run without checkpoint: one line each, exit 2."""
    assert main(["test", str(tmp_path / "nowhere")]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    early = tmp_path / "early"
    early.mkdir()
    (early / "config.yaml").write_text((finished_run / "config.yaml").read_text())
    assert main(["validate", str(early)]) == 2
    assert "no checkpoint.pt" in capsys.readouterr().err
    assert main(["test"]) == 2
    assert "needs a run directory" in capsys.readouterr().err


def test_interrupted_run_with_disk_state_is_evaluated_read_only(tmp_path):
    """An interrupted run (no summary) with client states on disk is evaluated; no file is pruned."""
    run_dir = tmp_path / "run"
    args = ["fit", "--config", DIGITS, *tiny_overrides(), "--rounds=1", "--federation.state_store=disk"]
    assert main([*args, f"--run_dir={run_dir}"]) == 0
    (run_dir / "summary.json").unlink()
    stray = run_dir / "clients" / "client_0_r7.pt"  # a round in progress in a still-running process
    stray.write_bytes(b"in progress")
    result = evaluate_run(run_dir)
    assert result["final"] and stray.exists()
