"""``fedhet bench``: the methods x seeds grid, its resumability, and the mean ± std tables."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from fedhet.bench import Cell, cell_text, mean_std, parse_settings, plan
from fedhet.cli import main
from fedhet.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["configs/experiments/digits/fedavg.yaml", "configs/experiments/digits/local.yaml"]
TINY = [
    "--rounds=2", "--models=tiny_homo", "--trainer.max_epochs=1", "--scenario.domains=[mnist, uci, mnistm]",
    "--scenario.private_sizes=[32, 32, 32]", "--scenario.val_per_domain=20", "--scenario.test_per_domain=40",
    "--scenario.image_size=16", "--scenario.batch_size=16",
]


def _error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and "Traceback" not in err
    return lines[-1]


def test_plan_is_configs_x_settings_x_seeds():
    """Every cell once, labelled by config stem and setting, seed-major; the grid's extra flags last."""
    settings = parse_settings(["lr01=--method.init_args.lr=0.1", "long='--rounds 4' --trainer.max_epochs=2"])
    assert settings == {"lr01": ["--method.init_args.lr=0.1"], "long": ["--rounds 4", "--trainer.max_epochs=2"]}
    cells = plan(CONFIGS, [0, 1], settings, ["--x=1"])
    assert len(cells) == 8 and [c.seed for c in cells] == [0] * 4 + [1] * 4
    assert cells[0] == Cell("fedavg/lr01", CONFIGS[0], 0, ("--method.init_args.lr=0.1", "--x=1"))
    assert {c.label for c in cells} == {"fedavg/lr01", "fedavg/long", "local/lr01", "local/long"}
    assert [c.label for c in plan(["a/fedavg.yaml", "b/fedavg.yaml"], [0], {"": []}, [])] == ["a/fedavg", "b/fedavg"]
    for bad in (["nameonly"], ["=--rounds=2"], ["a=1", "a=2"]):
        with pytest.raises(ConfigError):
            parse_settings(bad)


def test_mean_std_is_the_sample_std():
    """The ± is the sample standard deviation over seeds (n - 1), as statistics.stdev."""
    values = [10.0, 12.5, 17.0]
    assert mean_std(values) == pytest.approx((statistics.mean(values), statistics.stdev(values)))
    assert mean_std([4.0]) == (4.0, 0.0)
    assert cell_text(values) == f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def test_bad_bench_input_is_one_clear_line(tmp_path, capsys, monkeypatch):
    """A missing config, a bad --set or a bad fit flag stops the grid before any run starts."""
    monkeypatch.chdir(ROOT)
    for args, pattern in (
        (["--configs", "configs/nope.yaml"], "no such file"),
        (["--configs", CONFIGS[0], "--set", "oops"], "NAME=FLAGS"),
        (["--configs", CONFIGS[0], "--", "--method.init_args.lamda=1"], "lamda"),
        (["--seeds", "0"], "--configs"),
        (["--configs", CONFIGS[0], "--ray_address", "auto"], "--ray_address: give it with --grid FILE"),
    ):
        code = main(["bench", "--out", str(tmp_path / "grid"), *args])
        line = _error_line(capsys.readouterr().err)
        assert code == 2 and line.startswith("fedhet: error:") and pattern in line, line
        assert not (tmp_path / "grid").exists()


@pytest.mark.slow
def test_grid_tables_resume_and_refuse_other_flags(tmp_path, capsys, monkeypatch):
    """A 2-method x 2-seed grid: tables equal the runs' mean/std; a rerun reruns nothing; a partial cell resumes."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "grid"
    args = ["bench", "--configs", *CONFIGS, "--seeds", "0", "1", "--jobs", "2", "--out", str(out), "--", *TINY]
    assert main(args) == 0, capsys.readouterr()
    stdout = capsys.readouterr().out
    assert "0 of 4 cells already complete" in stdout and "| run | seeds | acc_intra | acc_inter |" in stdout

    payload = json.loads((out / "bench.json").read_text())
    assert set(payload["results"]) == {"fedavg", "local"} and len(payload["cells"]) == 4
    for label, entry in payload["results"].items():
        summaries = [json.loads((out / label / f"seed{s}" / "summary.json").read_text()) for s in (0, 1)]
        for block in ("final", "best", "last3"):
            for key in ("acc_intra", "acc_inter"):
                values = [s[block][key] for s in summaries]
                stats = entry["metrics"][f"{block}/{key}"]
                assert stats["values"] == values
                assert stats["mean"] == pytest.approx(statistics.mean(values), abs=1e-4)
                assert stats["std"] == pytest.approx(statistics.stdev(values), abs=1e-4)
        final = [s["final"]["acc_inter"] for s in summaries]
        assert f"| {label} | 2 |" in stdout and cell_text(final) in stdout
    for figure in ("bench_bars.png", "bench_curves.png"):
        assert (out / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "bench.md").read_text() in stdout

    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/seed*/summary.json")}
    assert main(args) == 0
    stdout = capsys.readouterr().out
    assert "4 of 4 cells already complete" in stdout and " ok in " not in stdout
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/seed*/summary.json")} == stamps

    (out / "local" / "seed1" / "summary.json").unlink()  # as if killed after its last checkpoint
    assert main(args) == 0
    stdout = capsys.readouterr().out
    assert "3 of 4 cells already complete" in stdout and "local seed 1: resumed, ok" in stdout
    assert json.loads((out / "bench.json").read_text())["results"] == payload["results"]

    code = main([*args[:-len(TINY)], *TINY[1:], "--rounds=3"])  # other flags for the same cells
    line = _error_line(capsys.readouterr().err)
    assert code == 2 and "other flags" in line


def test_comparison_benchmarks_share_the_grid_machinery(monkeypatch):
    """reproductions/comparison.py runs and tabulates through fedhet.bench, not a copy of it."""
    import fedhet.bench as bench

    monkeypatch.syspath_prepend(str(ROOT / "reproductions"))
    import comparison

    assert comparison.Run is bench.Cell and comparison.mean_std is bench.mean_std and comparison.cell is bench.cell_text
    assert comparison.last_mean is bench.last_mean
    run = comparison.Run("fccl_plus", "configs/experiments/digits/fccl_plus.yaml", 1, ("--rounds", "2"))
    assert run.run_dir(Path("/r")) == Path("/r/fccl_plus/seed1") and run.command(Path("/r"))[-2:] == ["--rounds", "2"]


def test_a_page_rewrite_keeps_archived_records_only_where_no_run_was_made_anew(monkeypatch):
    """``--reuse``: a fresh run replaces its archived record; archived seeds and rows outside the plan drop out."""
    monkeypatch.syspath_prepend(str(ROOT / "reproductions"))
    import comparison

    fresh = {"t10e5/fedvtc": [{"seed": 1, "final": 40.0}]}
    archived = {
        "t10e5/fedvtc": [{"seed": 0, "final": 38.0}, {"seed": 1, "final": 35.0}, {"seed": 7, "final": 1.0}],
        "t5e5/fedproto": [{"seed": 0, "final": 34.0}],
        "gone/row": [{"seed": 0, "final": 0.0}],
    }
    merged = comparison.reuse_archived(fresh, archived, ["t5e5/fedproto", "t10e5/fedvtc", "t20e5/fedtgp"], [0, 1])
    assert list(merged) == ["t5e5/fedproto", "t10e5/fedvtc"]  # the plan's order; a row with no record is left out
    assert merged["t10e5/fedvtc"] == [{"seed": 0, "final": 38.0, "reused": True}, {"seed": 1, "final": 40.0}]
    assert merged["t5e5/fedproto"] == [{"seed": 0, "final": 34.0, "reused": True}]
    assert fresh == {"t10e5/fedvtc": [{"seed": 1, "final": 40.0}]}  # the caller's records are not modified


def test_a_cell_queue_runs_cells_only_on_the_slots_other_work_leaves_lowest_rank_first(tmp_path, monkeypatch):
    """Two jobs: both slots held, nothing starts; one held, one cell at a time by rank; none, two at once.

    Each cell of the last pair waits (up to 20 s) until the other has started, so one slot would show.
    """
    import sys
    import time

    from fedhet.bench import CellQueue

    log = tmp_path / "log.txt"
    script = f"""
import sys, time
log, label = {str(log)!r}, sys.argv[1]
open(log, "a").write("start " + label + "\\n")
deadline = time.time() + 20
while label in ("r0", "r1") and open(log).read().count("start r") < 4 and time.time() < deadline:
    time.sleep(0.01)
open(log, "a").write("end " + label + "\\n")
"""
    monkeypatch.setattr(Cell, "command", lambda self, root: [sys.executable, "-c", script, self.label])
    queue = CellQueue(tmp_path / "runs", jobs=2, echo=lambda _: None, reserved=3, rank=lambda c: -c.seed)
    queue.add([Cell(f"r{seed}", "unused.yaml", seed) for seed in range(4)])
    time.sleep(0.5)
    queue.release()  # three rows tuning held both slots; two still do
    time.sleep(0.5)
    assert not log.exists()
    queue.release()  # one slot: the highest seeds first, one at a time, until r1 waits for a second slot
    while not log.exists() or log.read_text().count("start r") < 3:
        time.sleep(0.01)
    queue.release()
    outcomes = queue.finish()
    lines = log.read_text().splitlines()
    assert lines[:5] == ["start r3", "end r3", "start r2", "end r2", "start r1"]
    assert lines[5] == "start r0" and sorted(lines[6:]) == ["end r0", "end r1"]  # r0 started while r1 ran
    assert [o.cell.label for o in outcomes][:2] == ["r3", "r2"] and all(o.ok for o in outcomes)


def test_an_interrupted_bench_starts_no_queued_cell(tmp_path, monkeypatch):
    """Ctrl-C while cells wait in the pool stops the bench: the queued cells are cancelled, not all started."""
    import sys

    from fedhet.bench import run_cells

    started = tmp_path / "started.txt"
    script = f"import sys; open({str(started)!r}, 'a').write(sys.argv[1] + '\\n')"
    monkeypatch.setattr(Cell, "command", lambda self, root: [sys.executable, "-c", script, str(self.seed)])
    cells = [Cell("row", "unused.yaml", seed) for seed in range(4)]

    def interrupt(outcome):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_cells(cells, tmp_path / "runs", jobs=1, echo=lambda _: None, on_done=interrupt)
    assert started.read_text().split() in (["0"], ["0", "1"])  # the one a worker took already may finish
