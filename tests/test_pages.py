"""``fedhet bench --grid``: a results page from a grid file, from run directories or from its recorded json."""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path

import pytest
import yaml

from fedhet.bench import Cell, validate_cells
from fedhet.cli import main
from fedhet.errors import ConfigError
from fedhet.pages import override_flag, parse_grid

ROOT = Path(__file__).resolve().parents[1]

GRID = """\
title: A test page
page: {page}
out: {out}
seeds: [0, 1]
flags: ["--rounds=2"]
rows:
  - label: skew/fedavg
    name: FedAvg
    config: configs/experiments/digits_dir/fedavg.yaml
  - label: skew/local
    name: Local
    config: configs/experiments/digits_dir/local.yaml
    set: {{method.init_args.lr: 0.1, federation.persist_optimizer_state: false}}
tables:
  - name: main
    block: last3
    metrics: [acc_local, {{final/acc_server: G.acc}}, {{mb_per_round: MB per round}},
              {{acc_local: {{header: gain over Local, minus: skew/local}}}}]
  - name: cost
    seeds: [1]
    metrics: [{{wall_s: {{header: wall s, digits: 0}}}}]
figures:
  - name: curves
    kind: curves
    metrics: [acc_local]
template: |
  # {{title}}

  Regenerate: `{{command}}`; seeds {{seeds}}; {{missing}}.

  {{table:main}}

  {{table:cost}}

  {{figure:curves}}
"""


def _error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and "Traceback" not in err
    return lines[-1]


def _fake_run(
    run_dir: Path, method: str, acc_local: list[float], acc_server: float | None, up: int, wall_s: float = 3.0
) -> None:
    """A finished run as ``fedhet fit`` leaves it: summary.json (no last3 value: it comes from the curve)."""
    run_dir.mkdir(parents=True)
    final = {"acc_local": acc_local[-1], **({} if acc_server is None else {"acc_server": acc_server})}
    summary = {
        "method": method, "scenario_kind": "label_skew", "seed": 0, "final": final, "best": final, "last3": {},
        "comm": {"bytes_up_per_round": up, "bytes_down_per_round": up}, "wall_s": wall_s,
    }  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"round": i, "acc_local": a}) + "\n"
                                                   for i, a in enumerate(acc_local)))  # fmt: skip


def _grid(tmp_path: Path) -> Path:
    path = tmp_path / "page.yaml"
    path.write_text(GRID.format(page=tmp_path / "docs" / "page.md", out=tmp_path / "runs"))
    return path


def test_grid_rows_become_cells_with_their_flags(tmp_path):
    """The grid's flags first, then the row's dotted overrides as --key=value (values as YAML)."""
    grid = parse_grid(_grid(tmp_path))
    cells = grid.cells()
    assert [(c.label, c.seed) for c in cells] == [("skew/fedavg", 0), ("skew/local", 0), ("skew/fedavg", 1),
                                                  ("skew/local", 1)]  # fmt: skip
    assert cells[1].flags == ("--rounds=2", "--method.init_args.lr=0.1", "--federation.persist_optimizer_state=false")
    assert [c.key for c in grid.tables[0].columns] == ["last3/acc_local", "final/acc_server", "mb_per_round",
                                                       "last3/acc_local"]  # fmt: skip
    assert grid.tables[0].columns[3].minus == "skew/local"
    path = tmp_path / "page.yaml"
    path.write_text(path.read_text().replace("    name: Local\n", "    name: Local\n    seeds: [1]\n"))
    assert [(c.label, c.seed) for c in parse_grid(tmp_path / "page.yaml").cells()] == [
        ("skew/fedavg", 0), ("skew/fedavg", 1), ("skew/local", 1)]  # a row may run some of the seeds
    assert override_flag("scenario.domains", ["mnist", "uci"]) == "--scenario.domains=[mnist, uci]"
    assert override_flag("trainer.max_steps", 10) == "--trainer.max_steps=10"


def test_page_from_run_directories_then_from_its_json(tmp_path, capsys, monkeypatch):
    """Hand-computed tables from fake runs; the json alone rewrites the same page; other flags are refused."""
    monkeypatch.chdir(ROOT)
    grid = _grid(tmp_path)
    runs = tmp_path / "runs"
    # last3 of acc_local = mean of the last 3 rounds: (20+30+40)/3 = 30 and (40+50+60)/3 = 50
    _fake_run(runs / "skew/fedavg/seed0", "FedAvg", [10, 20, 30, 40], 41.0, 1_000_000)
    _fake_run(runs / "skew/fedavg/seed1", "FedAvg", [30, 40, 50, 60], 45.0, 1_000_000, wall_s=7.4)
    _fake_run(runs / "skew/local/seed0", "Local", [70, 80, 90], None, 0)  # seed 1 of Local not run
    assert main(["bench", "--grid", str(grid), "--report_only"]) == 0
    page = (tmp_path / "docs" / "page.md").read_text()
    # FedAvg: 30 and 50 -> mean 40, sample std sqrt(((30-40)^2 + (50-40)^2) / 1) = 14.14; G.acc 43 ± 2.83
    # the gain is paired: FedAvg's seed 0 (30) minus Local's seed 0 ((70+80+90)/3 = 80); Local has no seed 1
    assert "| FedAvg | 40.00 ± 14.14 | 43.00 ± 2.83 | 2.00 ± 0.00 | -50.00 |" in page
    assert "| Local | 80.00 | - | 0.00 | - |" in page
    assert "| method | wall s |\n|---|---|\n| FedAvg | 7 |\n" in page  # seed 1 only (7.4 s), no decimals
    assert "| method | acc_local | G.acc | MB per round | gain over Local |" in page
    continued = f"fedhet bench --grid {grid} --from_json {tmp_path / 'docs' / 'page.json'}"
    assert (f"Regenerate: `fedhet bench --grid {grid}`; seeds 0 1; 1 of 4 have no numbers (`{continued}` runs them "
            "and rewrites this page): skew/local seed 1.") in page
    assert "![curves](page_curves.png)" in page
    assert (tmp_path / "docs" / "page_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    payload = json.loads((tmp_path / "docs" / "page.json").read_text())
    assert payload["command"] == f"fedhet bench --grid {grid}" and payload["missing"] == ["skew/local seed 1"]
    assert payload["tables"]["main"]["skew/fedavg"]["acc_local"]["values"] == [30.0, 50.0]
    record = payload["runs"][0]
    assert record["label"] == "skew/fedavg" and record["seed"] == 0 and record["flags"] == ["--rounds=2"]
    assert record["values"] == {"last3/acc_local": 30.0, "final/acc_server": 41.0, "mb_per_round": 2.0, "wall_s": 3.0}
    values = yaml.safe_load((ROOT / record["config"]).read_text())  # the config's values, not its comments
    assert record["config_sha256"] == hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()
    assert record["curves"] == {"acc_local": [10, 20, 30, 40]}
    assert "final/acc_server" not in payload["runs"][2]["values"]  # Local reports no server model

    # the run directories gone, the page's json rewrites the same page and runs nothing
    saved = tmp_path / "saved.json"
    saved.write_text((tmp_path / "docs" / "page.json").read_text())
    (runs / "skew").rename(tmp_path / "elsewhere")
    capsys.readouterr()
    assert main(["bench", "--grid", str(grid), "--from_json", str(saved), "--report_only"]) == 0
    assert (tmp_path / "docs" / "page.md").read_text() == page
    assert json.loads((tmp_path / "docs" / "page.json").read_text()) == payload
    assert "cells to run" not in capsys.readouterr().out
    # the command a page names for "from the recorded runs alone" runs nothing, though skew/local seed 1 is missing
    json_command = shlex.split(parse_grid(grid).json_command())
    assert json_command[-1] == "--report_only"
    assert main(json_command[1:]) == 0 and (tmp_path / "docs" / "page.md").read_text() == page
    assert "cells to run" not in capsys.readouterr().out

    # a record made with other flags is not this grid's
    payload["runs"][0]["flags"] = ["--rounds=3"]
    saved.write_text(json.dumps(payload))
    code = main(["bench", "--grid", str(grid), "--from_json", str(saved), "--report_only"])
    line = _error_line(capsys.readouterr().err)
    assert code == 2 and "skew/fedavg seed 0 was run with" in line and "--rounds=3" in line


def test_a_name_two_rows_share_gets_each_rows_label_where_both_are_listed(tmp_path, capsys, monkeypatch):
    """One method in two settings: plain in a table of one setting; labelled where both show (table, figure, claim)."""
    monkeypatch.chdir(ROOT)
    text = GRID.format(page=tmp_path / "docs" / "page.md", out=tmp_path / "runs")
    text = text.replace("    name: Local\n", "    name: FedAvg\n").replace("  - name: cost\n    seeds: [1]\n",
                                                                          "  - name: cost\n    rows: [skew/local]\n")
    text = text.replace("  {figure:curves}\n", "  {figure:curves}\n\n  {claims}\n")
    text += ("claims:\n  - {claim: one beats the other, better: skew/fedavg, than: skew/local, "
             "metric: last3/acc_local}\n")
    grid_path = tmp_path / "page.yaml"
    grid_path.write_text(text)
    grid = parse_grid(grid_path)
    assert grid.names() == {"skew/fedavg": "FedAvg (skew/fedavg)", "skew/local": "FedAvg (skew/local)"}
    assert grid.names(["skew/local"]) == {"skew/fedavg": "FedAvg", "skew/local": "FedAvg"}  # one shown: plain
    series = {}
    monkeypatch.setattr("fedhet.bench.curves_png", lambda path, drawn, metrics: series.update(drawn))
    runs = tmp_path / "runs"
    for seed in (0, 1):
        _fake_run(runs / f"skew/fedavg/seed{seed}", "FedAvg", [10, 20, 30 + seed], None, 0)
        _fake_run(runs / f"skew/local/seed{seed}", "FedAvg", [5, 10, 15 + seed], None, 0)
    assert main(["bench", "--grid", str(grid_path), "--report_only"]) == 0
    page = (tmp_path / "docs" / "page.md").read_text()
    # last3: (10 + 20 + 30) / 3 = 20 and (10 + 20 + 31) / 3 = 20.33: 20.17 ± 0.24 (Local: 10 lower)
    assert "| FedAvg (skew/fedavg) | 20.17 ± 0.24 |" in page and "| FedAvg (skew/local) | 10.17 ± 0.24 |" in page
    assert "| method | wall s |\n|---|---|\n| FedAvg | 3 ± 0 |\n" in page  # a table of one row: no label needed
    assert "| FedAvg (skew/fedavg) vs FedAvg (skew/local) |" in page  # the claim's rows compared
    assert sorted(series) == ["FedAvg (skew/fedavg)", "FedAvg (skew/local)"]  # two curves, not one merged


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (lambda t: t.replace("seeds: [0, 1]", "seeds: [0, one]"), "seeds: write a non-empty list of integers"),
        (lambda t: t.replace("    name: FedAvg\n", "    nmae: FedAvg\n"), "rows[0]: unknown key 'nmae'"),
        (lambda t: t.replace("{table:main}", "{table:mian}"), "{table:mian} names no table"),
        (lambda t: t.replace("{figure:curves}", "{figur:curves}"), "unknown placeholder {figur:curves}"),
        (lambda t: t.replace("`{command}`", "`fedhet bench`"), "{command} placeholder"),
        (lambda t: t.replace("block: last3", "block: last5"), "block 'last5': use one of final, best, last3"),
        (lambda t: t.replace("kind: curves", "kind: pie"), "kind 'pie'"),
        (lambda t: t.replace("block: last3", "block: round0"), "last or roundN (the value at federated round N)"),
        (lambda t: t.replace("kind: curves", "kind: images"), "an images figure names one row and the server's"),
        (lambda t: t.replace("minus: skew/local", "minus: skew/lcoal"), "minus: no row labelled 'skew/lcoal'"),
        (lambda t: t.replace("title: A test page\n", ""), "missing key 'title'"),
        (lambda t: t.replace("  - label: skew/local", "  - label: skew/fedavg"), "'skew/fedavg' is used twice"),
        (lambda t: t.replace("rows:\n", "rows: [\n"), "not valid YAML"),
        (lambda t: t.replace("    name: Local\n", "    name: Local\n    seeds: [1, 7]\n"), "not others"),
    ],
)
def test_bad_grid_is_one_line(tmp_path, capsys, change, pattern):
    """Every mistake in a grid file stops before any run with one line naming the file and the key."""
    grid = _grid(tmp_path)
    grid.write_text(change(grid.read_text()))
    with pytest.raises(ConfigError):
        parse_grid(grid)
    assert main(["bench", "--grid", str(grid)]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line.startswith(f"fedhet: error: {grid}") and pattern in line, line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "docs").exists()


def test_grid_refuses_command_line_rows(tmp_path, capsys):
    """The grid file is the one place of a page's settings: --configs, --seeds or '--' flags beside it are refused."""
    grid = str(_grid(tmp_path))
    for args, pattern in (
        (["--configs", "a.yaml"], "drop --configs"),
        (["--seeds", "3"], "drop --seeds"),
        (["--", "--rounds=3"], "drop --configs, --set and '--'"),
        (["--from_json", str(tmp_path / "none.json")], "no such file"),
    ):
        assert main(["bench", "--grid", grid, *args]) == 2
        line = _error_line(capsys.readouterr().err)
        assert pattern in line, line
    assert main(["bench", "--from_json", "x.json", "--configs", "a.yaml"]) == 2
    assert "give it with --grid" in _error_line(capsys.readouterr().err)


def test_shipped_grids_parse_and_name_their_pages(monkeypatch):
    """Every grid in configs/grids/ parses, its configs exist, and its page names its command."""
    monkeypatch.chdir(ROOT)
    grids = sorted((ROOT / "configs" / "grids").glob("*.yaml"))
    assert grids
    for path in grids:
        grid = parse_grid(path.relative_to(ROOT))
        for row in grid.rows:
            assert (ROOT / row.config).is_file(), (path, row.config)
        page = ROOT / grid.page
        if page.is_file():
            assert grid.command() in page.read_text(), page
        rows = [Cell(row.label, row.config, grid.seeds[0], row.flags, row.command) for row in grid.rows]
        selected = [cell for cell in grid.cells()[: len(grid.rows)] if (ROOT / cell.config).is_file()]
        validate_cells(rows + selected, ROOT / grid.out)  # every row (and selected config) parses as its command's



def test_a_cells_flags_validate_as_fedhet_fit_reads_them(tmp_path):
    """Short executor and method names pass validation, as ``fedhet fit`` maps them; a wrong one is one line."""
    config = "configs/experiments/digits_dir/fedavg.yaml"
    validate_cells([Cell("seq", config, 0, ("--federation.executor=sequential",)),
                    Cell("named", config, 0, ("--federation.executor", "process", "--method=fedprox"))], tmp_path)
    with pytest.raises(ConfigError, match=r"^typo: .*sequentail"):
        validate_cells([Cell("typo", config, 0, ("--federation.executor=sequentail",))], tmp_path)

ATTACK_GRID = """
title: Attack
page: {page}
out: {out}
command: attack
seeds: [0, 1]
flags: [--steps=1]
rows:
  - {{label: fedavg, config: configs/attacks/fedmdcg_table2.yaml, flags: [--target=fedavg]}}
  - {{label: mean, config: configs/attacks/fedmdcg_table2.yaml, flags: [--target=dataset_mean]}}
  - {{label: fit_row, config: configs/experiments/mnist_mdcg/fedavg.yaml, command: fit, seeds: [0]}}
tables:
  - {{name: t, metrics: [psnr_whole_model, psnr_uploads_only]}}
claims:
  - {{claim: FedAvg leaks, better: fedavg, than: mean, metric: psnr_whole_model}}
template: "{{command}} {{table:t}} {{claims}}"
"""


def test_a_grid_with_command_attack_plans_attack_cells(tmp_path, monkeypatch):
    """``command: attack`` makes every row's cells ``fedhet attack`` runs (a row may say otherwise); no tuning."""
    monkeypatch.chdir(ROOT)
    path = tmp_path / "attack.yaml"
    text = ATTACK_GRID.format(page=tmp_path / "page.md", out=tmp_path / "runs")
    path.write_text(text)
    cells = parse_grid(path).cells()
    assert [(c.label, c.seed, c.command_name) for c in cells] == [
        ("fedavg", 0, "attack"), ("mean", 0, "attack"), ("fit_row", 0, "fit"), ("fedavg", 1, "attack"),
        ("mean", 1, "attack")]  # fmt: skip
    assert cells[0].flags == ("--steps=1", "--target=fedavg")
    assert cells[0].command(tmp_path)[2:] == ["fedhet", "attack", "--config", "configs/attacks/fedmdcg_table2.yaml",
                                              "--seed", "0", "--run_dir", str(tmp_path / "fedavg" / "seed0"),
                                              "--steps=1", "--target=fedavg"]  # fmt: skip
    assert cells[2].command(tmp_path)[3] == "fit"
    assert cells[0].recorded() == {"config": "configs/attacks/fedmdcg_table2.yaml", "flags": ["--steps=1",
                                   "--target=fedavg"], "command": "attack"}  # fmt: skip
    assert "command" not in cells[2].recorded()  # a fit cell's record is as before
    validate_cells([c for c in cells if c.command_name == "attack"], tmp_path)  # parsed by fedhet attack's parser
    bad = Cell("fedavg", "configs/attacks/fedmdcg_table2.yaml", 0, ("--target=fedsgd",), "attack")
    with pytest.raises(ConfigError, match=r"^fedavg: --target 'fedsgd': use one of"):
        validate_cells([bad], tmp_path)
    for extra, pattern in (
        ("tuning: {trials: 2, metric: acc_local}\n", "tuning: the tuning stage trains fedhet fit runs; a grid with "
                                                      "fedhet attack cells has none, remove the tuning block"),
        ("", "command 'train': use one of fit, attack"),
    ):
        path.write_text(extra + (text if extra else text.replace("command: attack", "command: train")))
        with pytest.raises(ConfigError, match=pattern):
            parse_grid(path)


def test_an_attack_record_is_not_taken_for_a_fit_cell(tmp_path, monkeypatch):
    """A page json's record made by fedhet attack is refused for a cell the grid now runs with fedhet fit."""
    from fedhet.pages import records_from_json

    cell = Cell("fedavg", "configs/attacks/fedmdcg_table2.yaml", 0, ("--target=fedavg",), "attack")
    record = {"label": "fedavg", "seed": 0, "config": cell.config, "flags": list(cell.flags), "values": {}}
    (tmp_path / "page.json").write_text(json.dumps({"runs": [{**record, "command": "attack"}]}))
    assert list(records_from_json(tmp_path / "page.json", [cell])) == [("fedavg", 0)]
    (tmp_path / "page.json").write_text(json.dumps({"runs": [record]}))  # no command: a fit run
    with pytest.raises(ConfigError, match="with fedhet fit configs/attacks/fedmdcg_table2.yaml --target=fedavg, not"):
        records_from_json(tmp_path / "page.json", [cell])


@pytest.mark.slow
def test_an_attack_grid_runs_its_cells_and_writes_its_page(tmp_path, capsys, monkeypatch):
    """Two 1-step attack cells through fedhet bench: the page's numbers are their summaries'; a rerun runs nothing."""
    monkeypatch.chdir(ROOT)
    path = tmp_path / "attack.yaml"
    text = ATTACK_GRID.format(page=tmp_path / "page.md", out=tmp_path / "runs").replace("seeds: [0, 1]", "seeds: [0]")
    path.write_text("".join(line for line in text.splitlines(keepends=True) if "fit_row" not in line))
    assert main(["bench", "--grid", str(path), "--jobs", "1", "--threads", "1"]) == 0
    payload = json.loads((tmp_path / "page.json").read_text())
    for label in ("fedavg", "mean"):
        summary = json.loads((tmp_path / "runs" / label / "seed0" / "summary.json").read_text())
        (record,) = [r for r in payload["runs"] if r["label"] == label]
        assert record["command"] == "attack"
        assert record["values"]["final/psnr_whole_model"] == summary["final"]["psnr_whole_model"]
    assert payload["claims"][0]["seeds"] == [0]
    capsys.readouterr()
    assert main(["bench", "--grid", str(path), "--jobs", "1"]) == 0
    assert "2 of 2 cells already complete" in capsys.readouterr().out


@pytest.mark.slow
def test_grid_runs_a_tiny_cell_and_tabulates_its_summary(tmp_path, capsys, monkeypatch):
    """One real fedhet fit cell (1 round, tiny data): the page's numbers are its summary's; a rerun runs nothing."""
    from fedhet.bench import cell_text

    monkeypatch.chdir(ROOT)
    tiny = [
        "--rounds=1", "--models=tiny_homo", "--trainer.max_epochs=1", "--scenario.domains=[mnist, uci, mnistm]",
        "--scenario.private_sizes=[32, 32, 32]", "--scenario.val_per_domain=20", "--scenario.test_per_domain=40",
        "--scenario.image_size=16", "--scenario.batch_size=16",
    ]  # fmt: skip
    grid = tmp_path / "tiny.yaml"
    grid.write_text(
        f"title: Tiny\npage: {tmp_path / 'tiny.md'}\nout: {tmp_path / 'runs'}\nseeds: [3]\n"
        f"rows:\n  - {{label: fedavg, config: configs/experiments/digits/fedavg.yaml, flags: {json.dumps(tiny)}}}\n"
        "tables:\n  - {name: t, metrics: [acc_intra, last3/acc_inter, mb_per_round]}\n"
        "template: |\n  `{command}`\n\n  {table:t}\n"
    )
    assert main(["bench", "--grid", str(grid)]) == 0, capsys.readouterr()
    summary = json.loads((tmp_path / "runs" / "fedavg" / "seed3" / "summary.json").read_text())
    record = json.loads((tmp_path / "tiny.json").read_text())["runs"][0]
    mb = (summary["comm"]["bytes_up_per_round"] + summary["comm"]["bytes_down_per_round"]) / 1e6
    assert record["values"]["final/acc_intra"] == summary["final"]["acc_intra"]
    assert record["values"]["last3/acc_inter"] == summary["last3"]["acc_inter"]
    assert record["values"]["mb_per_round"] == pytest.approx(mb) and mb > 0
    assert len(record["curves"]["acc_intra"]) == 1 and record["seed"] == 3
    row = f"| fedavg | {cell_text([summary['final']['acc_intra']])} | {cell_text([summary['last3']['acc_inter']])} |"
    assert row in (tmp_path / "tiny.md").read_text()
    capsys.readouterr()
    assert main(["bench", "--grid", str(grid)]) == 0
    assert "1 of 1 cells already complete" in capsys.readouterr().out


def test_rounds_to_target_and_the_round_time_split(tmp_path, capsys, monkeypatch):
    """Rounds to a target come from the summary (never reached: counted, not averaged); round seconds from history."""
    monkeypatch.chdir(ROOT)
    grid = tmp_path / "reach.yaml"
    grid.write_text(
        f"title: Reach\npage: {tmp_path / 'reach.md'}\nout: {tmp_path / 'runs'}\nseeds: [0, 1, 2]\n"
        "rows:\n  - {label: a, config: configs/experiments/digits_dir/fedavg.yaml}\n"
        "  - {label: b, config: configs/experiments/digits_dir/local.yaml}\n"
        "tables:\n  - {name: t, metrics: [{rounds_to_target/acc_server>=80: {header: to 80, digits: 1}},"
        " {fit_s_per_round: fit}, {server_s_per_round: server}]}\n"
        "template: |\n  `{command}`\n\n  {table:t}\n"
    )
    reached = {("a", 0): 4, ("a", 1): 6, ("a", 2): None, ("b", 0): None, ("b", 1): None, ("b", 2): None}
    for (label, seed), rounds in reached.items():
        run_dir = tmp_path / "runs" / label / f"seed{seed}"
        _fake_run(run_dir, label, [50.0, 60.0], 70.0, 10)
        summary = json.loads((run_dir / "summary.json").read_text())
        summary["rounds_to_target"] = {"acc_server>=80": rounds}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        # two rounds: fit 2 and 4 s; server = round - fit - eval = (3 - 2 - 0.5) and (6 - 4 - 1) -> 0.5 and 1.0
        history = [{"round": 0, "time/round_s": 3.0, "time/fit_s": 2.0, "time/eval_s": 0.5},
                   {"round": 1, "time/round_s": 6.0, "time/fit_s": 4.0, "time/eval_s": 1.0}]  # fmt: skip
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    assert main(["bench", "--grid", str(grid), "--report_only"]) == 0
    page = (tmp_path / "reach.md").read_text()
    # a: rounds 4 and 6 -> 5.0 ± 1.4 (sample std sqrt(2)), seed 2 never; fit (2+4)/2 = 3.00, server 0.75
    assert "| a | 5.0 ± 1.4 (1 of 3 never) | 3.00 ± 0.00 | 0.75 ± 0.00 |" in page
    assert "| b | never | 3.00 ± 0.00 | 0.75 ± 0.00 |" in page
    records = json.loads((tmp_path / "reach.json").read_text())["runs"]
    assert records[2]["unreached"] == ["rounds_to_target/acc_server>=80"] and "unreached" not in records[0]
    assert "acc_server>=80" not in records[0]["curves"]


def test_pivot_table_puts_settings_side_by_side(tmp_path, capsys, monkeypatch):
    """``across``: one line per label suffix, a column group per prefix; ``minus`` pairs within the group."""
    monkeypatch.chdir(ROOT)
    grid = tmp_path / "pivot.yaml"
    rows = "".join(f"  - {{label: {p}/{m}, name: {m.upper()}, config: configs/experiments/digits_dir/fedavg.yaml}}\n"
                   for p in ("lo", "hi") for m in ("base", "ftg") if (p, m) != ("hi", "ftg"))  # fmt: skip
    grid.write_text(
        f"title: Pivot\npage: {tmp_path / 'pivot.md'}\nout: {tmp_path / 'runs'}\nseeds: [0, 1]\nrows:\n{rows}"
        "tables:\n  - {name: t, across: {lo: low, hi: high}, rows: [base, ftg],"
        " metrics: [{acc_server: G}, {acc_server: {header: gain, minus: base}}]}\n"
        "template: |\n  `{command}`\n\n  {table:t}\n"
    )
    server = {("lo", "base"): (80.0, 84.0), ("lo", "ftg"): (83.0, 85.0), ("hi", "base"): (90.0, 92.0)}
    for (prefix, method), per_seed in server.items():
        for seed, value in enumerate(per_seed):
            _fake_run(tmp_path / "runs" / prefix / method / f"seed{seed}", method, [1.0], value, 10)
    assert main(["bench", "--grid", str(grid), "--report_only"]) == 0
    page = (tmp_path / "pivot.md").read_text()
    # lo/ftg - lo/base per seed: 3 and 1 -> 2.00 ± 1.41; hi has no ftg row: '-'
    assert "| method | low: G | low: gain | high: G | high: gain |" in page
    assert "| BASE | 82.00 ± 2.83 | - | 91.00 ± 1.41 | - |" in page
    assert "| FTG | 84.00 ± 1.41 | 2.00 ± 1.41 | - | - |" in page
    tables = json.loads((tmp_path / "pivot.json").read_text())["tables"]["t"]
    assert tables["lo/ftg"]["gain"]["values"] == [3.0, 1.0] and "hi/ftg" not in tables
    grid.write_text(grid.read_text().replace("across: {lo: low, hi: high}", "across: {mid: middle}"))
    assert main(["bench", "--grid", str(grid), "--report_only"]) == 2
    assert "across: no row label starts with mid and '/'" in _error_line(capsys.readouterr().err)


def test_a_grid_extends_another_and_keeps_only_some_rows(tmp_path, capsys, monkeypatch):
    """``extends``: the other grid's keys under this file's; ``only``: rows, tables, figures and claims filtered."""
    monkeypatch.chdir(ROOT)
    base = _grid(tmp_path)
    base.write_text(base.read_text().replace("{figure:curves}", "{figure:curves}\n\n  {claims}")
                    + "claims:\n  - {claim: c, better: skew/fedavg, than: skew/local, metric: acc_local}\n")
    child = tmp_path / "child.yaml"
    child.write_text(f"extends: {base}\npage: {tmp_path / 'child.md'}\nout: {tmp_path / 'child_runs'}\nseeds: [4]\n"
                     "flags: [--rounds=3]\nonly: [skew/fedavg]\n")  # fmt: skip
    parent, grid = parse_grid(base), parse_grid(child)
    assert [r.label for r in parent.rows] == ["skew/fedavg", "skew/local"] and len(parent.claims) == 1
    assert [r.label for r in grid.rows] == ["skew/fedavg"] and grid.claims == () and grid.seeds == (4,)
    assert [c.flags for c in grid.cells()] == [("--rounds=3",)] and grid.template == parent.template
    assert grid.tables[0].rows == ("skew/fedavg",) and grid.figures[0].rows == ("skew/fedavg",)
    assert grid.page == tmp_path / "child.md" and grid.out == tmp_path / "child_runs"
    for text, pattern in [
        (f"extends: {base}\nout: x\n", "extends: name this grid's own page"),
        (f"extends: {child}\npage: {tmp_path / 'c.md'}\nout: x\n", "a cycle"),
        (f"extends: {tmp_path / 'none.yaml'}\npage: {tmp_path / 'c.md'}\nout: x\n", "extends: no such file"),
        (f"extends: {base}\npage: {tmp_path / 'c.md'}\nout: x\nonly: [skew/nope]\n", "only: no row labelled"),
    ]:
        child.write_text(text)
        with pytest.raises(ConfigError, match=pattern):
            parse_grid(child)


def test_every_grid_page_is_what_its_json_alone_rewrites(monkeypatch):
    """Each shipped grid page equals the page its own json renders (what ``--from_json ... --report_only`` writes).

    A page whose runs its json no longer matches (a renamed config key, a changed config) or whose text
    was edited by hand fails here, not when someone next tries to regenerate it. Figures are not redrawn.
    """
    from fedhet import bench, pages
    from fedhet.tracking import figures

    monkeypatch.chdir(ROOT)
    for module, writer in ((bench, "curves_png"), (pages, "bars_png"), (figures, "images_figure")):
        monkeypatch.setattr(module, writer, lambda *args, **kwargs: None)  # decide each figure, write no file
    checked = 0
    for path in sorted((ROOT / "configs" / "grids").glob("*.yaml")):
        grid = parse_grid(path.relative_to(ROOT))
        recorded = grid.page.with_suffix(".json")
        if not (grid.page.is_file() and recorded.is_file()):
            continue  # a page not written yet (its bench still running)
        cells = grid.cells()
        studies = pages.studies_from_json(recorded) if grid.tuning is not None else {}
        records, failures = pages.records_from_json(recorded, cells), pages.failures_from_json(recorded, cells)
        text, _ = pages.render_page(grid, records, studies, pages.studies_threads(recorded), failures)
        assert text == grid.page.read_text(), f"{grid.page} differs from what {recorded} rewrites"
        checked += 1
    assert checked >= 10


def test_the_kd_probe_section_of_docs_fedmdcg_is_what_its_json_renders(monkeypatch):
    """docs/fedmdcg.md's KD-probe tables (a diagnostic, not a results page) are what the probe's json renders."""
    monkeypatch.syspath_prepend(str(ROOT / "reproductions"))
    monkeypatch.delenv("FEDMDCG_BENCH_OUT", raising=False)
    import fedmdcg_kd_probe as probe

    text = probe.DOC.read_text()
    probes = json.loads(probe.PROBE_JSON.read_text())
    assert probe.document_with_section(text, probes) == text
    assert text.count("The distilled D is below the averaged D in") == len(probes) == 2


def test_every_results_page_names_the_command_that_regenerates_it(monkeypatch):
    """Every page under docs/results/ names the one ``fedhet bench`` command (its grid file) that regenerates it.

    A grid page names ``fedhet bench --grid`` with its own grid; claims.md names ``fedhet bench --claims``.
    No page is written by a script any more (FedMD-CG's privacy page became a grid of ``fedhet attack`` cells).
    """
    import re

    monkeypatch.chdir(ROOT)
    pages = sorted((ROOT / "docs" / "results").glob("*.md"))
    assert pages
    for page in pages:
        text = page.read_text()
        grids = re.findall(r"fedhet bench --grid (configs/grids/[\w.-]+\.yaml)", text)
        claims = re.search(r"fedhet bench --claims ((?:configs/grids/[\w.-]+\.yaml ?)+)`", text)
        assert grids or claims, f"{page.name} names no fedhet bench command that regenerates it"
        for path in grids + (claims.group(1).split() if claims else []):
            assert (ROOT / path).is_file(), f"{page.name} names {path}, which does not exist"
        if not claims:
            own = [g for g in grids if parse_grid(g).page == Path("docs/results") / page.name]
            assert own, f"{page.name}: none of the grids it names ({', '.join(grids)}) writes it"


def test_a_cell_that_failed_says_why_on_the_page(tmp_path, capsys, monkeypatch):
    """A cell without numbers whose log ends in fedhet's one-line error is listed with that line, not silently."""
    monkeypatch.chdir(ROOT)
    grid = _grid(tmp_path)
    runs = tmp_path / "runs"
    for label, seed in (("skew/fedavg", 0), ("skew/fedavg", 1), ("skew/local", 0)):
        _fake_run(runs / label / f"seed{seed}", label, [10.0, 20.0], None, 10)
    (runs / "skew" / "local").mkdir(parents=True, exist_ok=True)
    (runs / "skew" / "local" / "seed1.log").write_text(
        "epoch 1\nfedhet: error: client 3 got a non-finite training loss in round 4 (stage 'local')\n")
    assert main(["bench", "--grid", str(grid), "--report_only"]) == 0
    page = (tmp_path / "docs" / "page.md").read_text()
    assert ("this page): skew/local seed 1 (failed: client 3 got a non-finite training loss in round 4 "
            "(stage 'local'))") in page
    payload = json.loads((tmp_path / "docs" / "page.json").read_text())
    assert payload["missing"] == ["skew/local seed 1 (failed: client 3 got a non-finite training loss in round 4 "
                                  "(stage 'local'))"]  # fmt: skip


def test_outcome_table_over_a_folder_of_configs_and_its_json(tmp_path, capsys, monkeypatch):
    """A wildcard row is one row per config; the outcome table says how each run ended.

    First from the run directories and logs, then from the page's json alone.
    """
    monkeypatch.chdir(ROOT)
    folder = tmp_path / "configs"
    folder.mkdir()
    for name in ("alpha", "beta", "gamma"):
        (folder / f"{name}.yaml").write_text((ROOT / "configs/experiments/digits_dir/fedavg.yaml").read_text())
    grid = tmp_path / "stability.yaml"
    grid.write_text(
        f"title: Stability\npage: {tmp_path / 'docs' / 'stability.md'}\nout: {tmp_path / 'runs'}\nseeds: [0, 1, 2]\n"
        f"flags: [--trainer.max_epochs=1]\nrows:\n  - {{label: shipped, config: '{folder}/*.yaml'}}\n"
        "tables:\n  - {name: ended, outcomes: true, label: config}\n  - {name: acc, metrics: [acc_local]}\n"
        "template: |\n  `{command}`\n\n  {table:ended}\n\n  {table:acc}\n"
    )
    from fedhet.pages import parse_grid

    parsed = parse_grid(grid)
    assert [r.label for r in parsed.rows] == ["shipped/alpha", "shipped/beta", "shipped/gamma"]
    assert parsed.rows[1].config == str(folder / "beta.yaml") and parsed.rows[1].flags == ("--trainer.max_epochs=1",)
    runs = tmp_path / "runs"
    for seed in (0, 1, 2):
        _fake_run(runs / "shipped/alpha" / f"seed{seed}", "FedAvg", [50, 60 + seed], None, 1)
    _fake_run(runs / "shipped/beta/seed0", "FedAvg", [40, 45], None, 1)
    (runs / "shipped/beta/seed1.log").write_text(
        "$ fedhet fit\nfedhet: error: client 2 got a non-finite training loss in round 7; lower the lr\n")
    (runs / "shipped/beta/seed2.log").write_text("$ fedhet fit\nfedhet: error: out of memory\n")
    assert main(["bench", "--grid", str(grid), "--report_only"]) == 0
    page = (tmp_path / "docs" / "stability.md").read_text()
    assert "| config | seeds run | completed | diverged (seed: round) | failed (seed) |" in page
    assert "| shipped/alpha | 0, 1, 2 | 3 of 3 | - | - |" in page
    assert "| shipped/beta | 0, 1, 2 | 1 of 3 | 1: 7 | 2 |" in page
    assert "| shipped/gamma | not run | 0 of 3 | - | - |" in page
    assert ("Completed at every seed: **1 of 3** rows; diverged or failed at some seed: shipped/beta; "
            "not yet run at every seed: shipped/gamma.") in page  # fmt: skip
    assert "| shipped/alpha | 61.00 ± 1.00 |" in page  # the other tables read the completed runs as usual
    payload = json.loads((tmp_path / "docs" / "stability.json").read_text())
    assert payload["tables"]["ended"]["shipped/beta"] == {
        "completed": [0], "diverged": {"1": 7}, "failed": {"2": "out of memory"}, "not_run": []}  # fmt: skip
    assert [(f["label"], f["seed"]) for f in payload["failed"]] == [("shipped/beta", 1), ("shipped/beta", 2)]

    # the run directories and logs gone, the json alone gives the same page (failures included)
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(payload))
    (runs / "shipped").rename(tmp_path / "elsewhere")
    assert main(["bench", "--grid", str(grid), "--from_json", str(saved), "--report_only"]) == 0
    assert (tmp_path / "docs" / "stability.md").read_text() == page

    # a comment added to a config changes no run; a changed value leaves its records and failures out (rerun)
    (folder / "beta.yaml").write_text((folder / "beta.yaml").read_text() + "\n# a comment\n")
    assert main(["bench", "--grid", str(grid), "--from_json", str(saved), "--report_only"]) == 0
    assert (tmp_path / "docs" / "stability.md").read_text() == page
    (folder / "beta.yaml").write_text((folder / "beta.yaml").read_text() + "rounds: 3\n")
    assert main(["bench", "--grid", str(grid), "--from_json", str(saved), "--report_only"]) == 0
    page = (tmp_path / "docs" / "stability.md").read_text()
    assert "| shipped/beta | not run | 0 of 3 | - | - |" in page and "| shipped/alpha | 0, 1, 2 | 3 of 3 |" in page

    grid.write_text(grid.read_text().replace("*.yaml", "*.yml"))
    assert main(["bench", "--grid", str(grid), "--report_only"]) == 2
    assert "no file matches" in _error_line(capsys.readouterr().err)


def test_a_column_at_one_federated_round_and_a_figure_of_server_images(tmp_path, capsys, monkeypatch):
    """``round2/acc_local`` reads federated round 2 (phase steps do not count); an images figure draws a run's images.

    The figure stays on the page when ``runs/`` is gone (drawn from the run once, not recorded in the json).
    """
    import torch

    from fedhet.tracking.figures import save_round_images

    monkeypatch.chdir(ROOT)
    text = GRID.format(page=tmp_path / "docs" / "page.md", out=tmp_path / "runs")
    text = text.replace("metrics: [acc_local, {final",
                        "metrics: [acc_local, {round2/acc_local: at round 2}, {last/acc_local: last logged}, {final")
    images = "  - name: images\n    kind: images\n    images: class_images\n    rows: [skew/fedavg]\n    seed: 1\n"
    text = text.replace("    metrics: [acc_local]\n", "    metrics: [acc_local]\n" + images)
    text = text.replace("  {figure:curves}\n", "  {figure:curves}\n\n  {figure:images}\n")
    grid = tmp_path / "page.yaml"
    grid.write_text(text)
    runs = tmp_path / "runs"
    _fake_run(runs / "skew/fedavg/seed0", "FedAvg", [10, 20, 30, 40], 41.0, 1_000_000)
    _fake_run(runs / "skew/fedavg/seed1", "FedAvg", [30, 40, 50, 60], 45.0, 1_000_000)
    _fake_run(runs / "skew/local/seed0", "Local", [70, 80, 90], None, 0)
    # Local's first step is a pretraining phase: its federated round 2 is step 2 (90), not step 1 (80)
    lines = (runs / "skew/local/seed0/metrics.jsonl").read_text().splitlines()
    lines[0] = json.dumps({"round": 0, "phase": "pretrain", "acc_local": 70})
    (runs / "skew/local/seed0/metrics.jsonl").write_text("\n".join(lines) + "\n")
    save_round_images(runs / "skew/fedavg/seed1", 0, {"class_images": torch.rand(3, 1, 4, 4)})
    save_round_images(runs / "skew/fedavg/seed1", 1, {"class_images": torch.rand(3, 1, 4, 4)})
    assert main(["bench", "--grid", str(grid), "--report_only"]) == 0
    page = (tmp_path / "docs" / "page.md").read_text()
    # FedAvg round 2: 20 and 40 -> 30 ± 14.14, last 40 and 60 -> 50 ± 14.14; Local: 90 and 90 (seed 0 only)
    assert "| method | acc_local | at round 2 | last logged | G.acc |" in page
    assert "| FedAvg | 40.00 ± 14.14 | 30.00 ± 14.14 | 50.00 ± 14.14 | 43.00 ± 2.83 |" in page
    assert "| Local | 80.00 | 90.00 | 90.00 | - |" in page
    figure = tmp_path / "docs" / "page_images.png"
    assert "![images](page_images.png)" in page and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    payload = json.loads((tmp_path / "docs" / "page.json").read_text())
    assert payload["runs"][0]["values"]["round2/acc_local"] == 20.0
    assert parse_grid(grid).tables[0].columns[1].key == "round2/acc_local"
    # the runs gone: the drawn figure stays and the page is the same
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(payload))
    (runs / "skew").rename(tmp_path / "elsewhere")
    assert main(["bench", "--grid", str(grid), "--from_json", str(saved), "--report_only"]) == 0
    assert (tmp_path / "docs" / "page.md").read_text() == page
    figure.unlink()  # never drawn and no run: the page says so
    assert main(["bench", "--grid", str(grid), "--from_json", str(saved), "--report_only"]) == 0
    assert "(figure images: no run has its numbers recorded)" in (tmp_path / "docs" / "page.md").read_text()
