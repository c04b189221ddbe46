"""``fedhet attack``: one gradient-inversion cell into a run directory that ``fedhet bench`` reads as any run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedhet.bench import Cell, aggregate, cell_state, load_run, run_metrics
from fedhet.cli import main
from fedhet.errors import EXIT_TRAINING_STOPPED, TrainingError
from fedhet.privacy.attack import KNOWLEDGES, AttackSettings, attack_cell

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/attacks/fedmdcg_table2.yaml"


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_attack_writes_a_run_directory_with_the_numbers_of_the_library_call(tmp_path, capsys, monkeypatch):
    """FedMD-CG at 3 steps, 2 digits: the summary holds what attack_cell computes; bench and pages read it."""
    from fedhet.pages import parse_grid, record_of

    monkeypatch.chdir(ROOT)
    run_dir = tmp_path / "fedmdcg" / "seed3"
    args = ["--config", CONFIG, "--target=fedmdcg", "--steps", "3", "--images", "2", "--seed", "3"]
    assert main(["attack", *args, "--run_dir", str(run_dir)]) == 0
    expected = attack_cell(AttackSettings("fedmdcg", steps=3, images=2), seed=3)  # the same cell, called directly
    assert len(expected) == 2 and expected[0]["index"] != expected[1]["index"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["digits"] == expected
    assert summary["method"] == "fedmdcg" and summary["seed"] == 3 and summary["command"] == "attack"
    assert summary["settings"] == {"target": "fedmdcg", "steps": 3, "images": 2, "lr": 0.1, "tv_weight": 0.01}
    for knowledge in ("whole_model", "uploads_only"):  # final: the mean over the seed's digits
        mean = (expected[0][f"psnr_{knowledge}"] + expected[1][f"psnr_{knowledge}"]) / 2
        assert summary["final"][f"psnr_{knowledge}"] == pytest.approx(mean, abs=1e-4)
    assert summary["wall_s"] > 0 and "environment" in summary
    assert f"results: {run_dir}/summary.json" in capsys.readouterr().out
    # the run-directory contract: summary last, one metrics line per digit, the resolved settings
    assert cell_state(run_dir) == "complete" and not (run_dir / ".fedhet.lock").exists()
    run = load_run(run_dir)
    assert [line["index"] for line in run["history"]] == [e["index"] for e in expected]
    assert (run_dir / "config.yaml").read_text().startswith("command: attack\ntarget: fedmdcg\nsteps: 3\n")
    numbers = run_metrics(run)
    assert numbers["final/psnr_whole_model"] == summary["final"]["psnr_whole_model"]
    assert "comm/mb_per_round" not in numbers  # not a federated run: no communication
    row = aggregate({"fedmdcg": [run]})["fedmdcg"]
    assert row["seeds"] == [3] and row["metrics"]["final/psnr_uploads_only"]["values"] == [
        summary["final"]["psnr_uploads_only"]]
    (tmp_path / "grid.yaml").write_text(
        f"title: t\npage: {tmp_path / 'page.md'}\ncommand: attack\nseeds: [3]\ntemplate: '{{command}} {{table:t}}'\n"
        f"rows: [{{label: fedmdcg, config: {CONFIG}, flags: [--target=fedmdcg]}}]\n"
        "tables: [{name: t, metrics: [psnr_whole_model, psnr_uploads_only]}]\n"
    )
    grid = parse_grid(tmp_path / "grid.yaml")
    assert grid.cells() == [Cell("fedmdcg", CONFIG, 3, ("--target=fedmdcg",), "attack")]
    cell = Cell("fedmdcg", CONFIG, 3, ("--target=fedmdcg",), "attack")
    record = record_of(cell, run, grid)
    assert record["command"] == "attack" and "mb_per_round" not in record["values"]
    assert record["values"]["final/psnr_whole_model"] == summary["final"]["psnr_whole_model"]
    # a finished run is not overwritten
    assert main(["attack", *args, "--run_dir", str(run_dir)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err


def test_reference_rows_score_the_same_digit_by_hand(tmp_path, monkeypatch):
    """A reference cell: reference_psnrs of the seed's digit, the same under both knowledges; no attack step."""
    from fedhet.data.embedded import load_mnist_all
    from fedhet.privacy import reference_psnrs
    from fedhet.privacy.gradient_inversion import denormalizer

    monkeypatch.chdir(ROOT)
    assert main(["attack", "--config", CONFIG, "--target", "dataset_mean", "--seed", "4",
                 "--run_dir", str(tmp_path / "r")]) == 0  # fmt: skip
    (digit,) = json.loads((tmp_path / "r" / "summary.json").read_text())["digits"]
    splits = load_mnist_all(0)
    index = int(torch.randperm(len(splits.train), generator=torch.Generator().manual_seed(4))[0])
    x = (splits.train.x[index : index + 1].float() / 255.0 - 0.5) / 0.5
    mean_image = (splits.train.x.float() / 255.0).mean(0)
    value = reference_psnrs(x, denormalizer((0.5,) * 3, (0.5,) * 3), mean_image, seed=index)["dataset_mean"]
    assert digit == {"index": index, "label": int(splits.train.y[index]), "psnr_whole_model": round(value, 3),
                     "psnr_uploads_only": round(value, 3)}  # fmt: skip


def test_fedavg_uploads_everything_so_both_knowledges_are_one_attack():
    """FedAvg's attacker holds the whole model under either knowledge: one attack, the same number twice."""
    (entry,) = attack_cell(AttackSettings("fedavg", steps=2), seed=0)
    assert entry["psnr_uploads_only"] == entry["psnr_whole_model"]
    (lg,) = attack_cell(AttackSettings("lg_fedavg", steps=2), seed=0)
    assert lg["index"] == entry["index"]  # every target attacks the seed's digit


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--target", "fedsgd"], "--target 'fedsgd': use one of fedavg, fedper"),
        (["--target", "fedavg", "--steps", "-1"], "--steps -1: write a whole number of attack steps"),
        (["--target", "fedavg", "--steps", "many"], "argument --steps: invalid int value: 'many'"),
        (["--target", "fedavg", "--images", "0"], "--images 0: attack at least one digit per seed"),
        (["--target", "fedavg", "--lr", "0"], "lr 0: the attack would not move its dummy image"),
        (["--steps", "5"], "give the attacked method or reference row: --target NAME"),
        (["--target", "fedavg", "--config", "nowhere.yaml"], "--config nowhere.yaml: no such file"),
        (["--target", "fedavg", "--rounds", "3"], "unrecognized arguments: --rounds 3; see 'fedhet attack --help'"),
    ],
)
def test_a_bad_attack_setting_is_one_line_and_exit_2(args, pattern, tmp_path, capsys):
    """Every bad setting: one 'fedhet: error:' line, exit 2, and no run directory."""
    run_dir = tmp_path / "run"
    assert main(["attack", *args, "--run_dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("fedhet: error: ") and pattern in err, err
    assert not run_dir.exists()


def test_an_unknown_config_key_is_one_line(tmp_path, capsys):
    """A --config key that is no attack setting is named with the known keys."""
    config = tmp_path / "attack.yaml"
    config.write_text("steps: 5\nrounds: 3\n")
    assert main(["attack", "--config", str(config), "--target", "fedavg"]) == 2
    assert "unknown key 'rounds'; known keys: target, steps, images, lr, tv_weight" in capsys.readouterr().err


def test_attack_help_and_the_command_list(capsys):
    """--help prints the usage (exit 0); fedhet --help lists the command; a misspelling suggests it."""
    assert main(["attack", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fedhet attack") and "--target" in out and "--run_dir" in out
    assert main(["--help"]) == 0
    assert "  attack    one gradient-inversion cell" in capsys.readouterr().out
    assert main(["atack"]) == 2
    assert "did you mean 'attack'?" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("failure", "code", "message"),
    [
        (TrainingError("the dummy image diverged"), EXIT_TRAINING_STOPPED, "the dummy image diverged"),
        (KeyboardInterrupt(), 130, "interrupted; rerun the same command (an attack keeps no checkpoint)"),
    ],
)
def test_a_failed_attack_leaves_nothing_and_the_same_command_runs_again(
    failure, code, message, tmp_path, capsys, monkeypatch
):
    """An attack that fails or is interrupted removes what it wrote; the same --run_dir then takes a new attack."""
    import fedhet.privacy.command as command

    def failing(settings, seed):
        raise failure

    made, given = tmp_path / "made" / "run", tmp_path / "given"
    given.mkdir()  # an empty directory the user made: kept, and empty again
    monkeypatch.setattr(command, "attack_cell", failing)
    for run_dir in (made, given):
        assert main(["attack", "--target", "fedavg", "--run_dir", str(run_dir)]) == code
        assert message in capsys.readouterr().err
    assert not made.exists() and given.is_dir() and not any(given.iterdir())
    digit = {"index": 7, **{f"{kind}_{k}": 1.0 for kind in ("psnr", "matching_loss") for k in KNOWLEDGES}}
    monkeypatch.setattr(command, "attack_cell", lambda settings, seed: [digit])
    for run_dir in (made, given):
        assert main(["attack", "--target", "fedavg", "--run_dir", str(run_dir)]) == 0
        assert cell_state(run_dir) == "complete"
