"""Verdicts computed from paired intervals over seeds: the statistics by hand, and a page's claims from its runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedhet.errors import ConfigError
from fedhet.pages import claims_page, parse_grid, render_page
from fedhet.statistics import FAILS, HOLDS, INCONCLUSIVE, NOT_RUN, paired_difference, t_quantile

GRID = """\
title: A tuned test page
page: {page}
out: {out}
seeds: [0, 1, 2]
tuning: {{trials: 3, metric: acc_local, seed: 9, flags: [--rounds=1], exclude: [momentum]}}
claims:
  - {{claim: "A beats B", paper: "Table 1", better: a, than: b, metric: acc_local}}
  - {{claim: "B beats A", paper: "Table 1", better: b, than: a, metric: acc_local}}
  - {{claim: "A beats C", paper: "Table 2", better: a, than: c, metric: acc_local}}
rows:
  - {{label: a, name: Method A, config: configs/experiments/digits_dir/fedavg.yaml}}
  - {{label: b, name: Method B, config: configs/experiments/digits_dir/fedprox.yaml}}
  - {{label: c, name: Method C, config: configs/experiments/digits_dir/local.yaml, tune: false}}
tables:
  - {{name: main, metrics: [acc_local], per_seed: true}}
template: |
  # {{title}}
  `{{command}}`
  {{budget}}
  {{tuning}}
  {{table:main}}
  {{claims}}
"""


def test_t_quantiles_match_the_tables():
    """Two-sided 95 % critical values of Student's t (any statistics table)."""
    for df, value in ((1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (9, 2.262), (29, 2.045)):
        assert t_quantile(0.95, df) == pytest.approx(value, abs=1e-3)
    assert t_quantile(0.99, 4) == pytest.approx(4.604, abs=1e-3)


def test_paired_difference_by_hand():
    """Differences (2, 3, 2): mean 7/3, sd 1/sqrt(3), half-width 4.303 * sd / sqrt(3) = 1.434."""
    d = paired_difference({0: 3.0, 1: 5.0, 2: 4.0, 7: 1.0}, {0: 1.0, 1: 2.0, 2: 2.0})
    assert d.seeds == (0, 1, 2) and d.differences == (2.0, 3.0, 2.0)  # seed 7 has no pair
    assert d.mean == pytest.approx(7 / 3, abs=1e-4)
    half = 4.302653 * math.sqrt(1 / 3) / math.sqrt(3)
    assert d.low == pytest.approx(7 / 3 - half, abs=1e-5) and d.high == pytest.approx(7 / 3 + half, abs=1e-5)
    assert (d.wins, d.verdict) == (3, HOLDS)


def test_verdicts_follow_the_interval_alone():
    """Above 0 holds, below 0 fails, across 0 (or one seed) is inconclusive, whatever the tally."""
    assert paired_difference({0: 1.0, 1: 2.0, 2: 1.5}, {0: 3.0, 1: 4.0, 2: 3.2}).verdict == FAILS
    mixed = paired_difference({0: 1.0, 1: 5.0, 2: 4.0}, {0: 3.0, 1: 2.0, 2: 2.0})  # wins 2 of 3, mean +1
    assert (mixed.wins, mixed.verdict) == (2, INCONCLUSIVE)
    assert paired_difference({0: 9.0}, {0: 1.0}).verdict == INCONCLUSIVE  # one seed: no interval
    assert paired_difference({}, {0: 1.0}).verdict == NOT_RUN  # no paired seed yet: no verdict at all
    same = paired_difference({0: 2.0, 1: 3.0}, {0: 1.0, 1: 2.0})  # sd 0: the interval is the mean
    assert (same.low, same.high, same.verdict) == (1.0, 1.0, HOLDS)


def _grid(tmp_path: Path, text: str = GRID) -> Path:
    path = tmp_path / "page.yaml"
    path.write_text(text.format(page=tmp_path / "page.md", out=tmp_path / "runs"))
    return path


def _records(values: dict[str, list[float]], grid) -> dict:
    cells = {(c.label, c.seed): c for c in grid.cells()}
    records = {}
    for label, per_seed in values.items():
        for seed, value in enumerate(per_seed):
            cell = cells[label, seed]
            records[label, seed] = {"label": label, "config": cell.config, "seed": seed, "flags": list(cell.flags),
                                    "values": {"final/acc_local": value, "wall_s": 60.0}, "curves": {}}  # fmt: skip
    return records


def test_page_computes_each_claims_verdict_and_lists_the_tuning(tmp_path):
    """The claims table is computed from the runs; the tuning table lists what each row searched and selected."""
    grid = parse_grid(_grid(tmp_path))
    assert [r.label for r in grid.rows if grid.tuned(r)] == ["a", "b"]
    assert grid.cells()[0].config == str(grid.selected / "a.yaml")  # tuned rows run their selected config
    assert grid.cells()[2].config.endswith("local.yaml")
    records = _records({"a": [50.0, 52.0, 51.0], "b": [40.0, 41.0, 43.0], "c": [49.0, 53.0, 50.0]}, grid)
    study = {"space": {"method.init_args.lr": {}}, "selected": {"number": 2, "value": 61.5,
             "params": {"method.init_args.lr": 0.0312}},
             "trials": [{"number": i, "state": s, "wall_s": 30.0, "value": 1.0, "params": {}}
                        for i, s in enumerate(["complete", "pruned", "complete"])]}  # fmt: skip
    text, payload = render_page(grid, records, {"a": study}, threads=2)
    verdicts = [c["verdict"] for c in payload["claims"]]
    assert verdicts == [HOLDS, FAILS, INCONCLUSIVE]  # a-b = (10, 11, 8); a-c = (1, -1, 1)
    assert payload["claims"][0]["differences"] == [10.0, 11.0, 8.0]
    assert "| A beats B | Table 1 | Method A vs Method B | final/acc_local | +9.67 [" in text
    assert "| 3/3 | **holds** |" in text and "| 2/3 | **inconclusive** |" in text
    assert "| Method A | `lr` | 3: 2 / 1 / 0 | 61.50 (trial 2) | lr=0.0312 |" in text
    assert "| Method B | (not tuned yet) |" in text and "Not tuned (run as configured): Method C." in text
    # cost: 3 trials x 30 s of tuning + 9 runs x 60 s of test, at 2 threads
    assert "0.03 h of tuning runs and 0.15 h of test runs, 2 thread(s) per run: 0.35 core-hours" in text
    assert payload["tuning"]["plan"]["trials"] == 3
    assert "Machines" not in text and payload["environments"] == []  # records made before runs kept it
    home = {"torch": "2.14.1", "cpu": "Xeon", "cpu_capability": "AVX512", "gpu": None, "threads": 1}
    for (label, seed), record in records.items():
        record["environment"] = {**home, "cpu_capability": "AVX2"} if (label, seed) == ("c", 2) else home
    text, payload = render_page(grid, records, {"a": study}, threads=2)
    assert "* **Machines**: 8 runs on Xeon (AVX512), torch 2.14.1; 1 runs on Xeon (AVX2), torch 2.14.1." in text
    assert [e["runs"] for e in payload["environments"]] == [8, 1]
    assert "| Method A | 51.00 ± 1.00 (50.00, 52.00, 51.00) |" in text  # mean ± std (per-seed values)


def test_claims_page_collects_every_pages_verdicts(tmp_path, monkeypatch):
    """``fedhet bench --claims``: each grid's claims with the verdicts of its page json, or 'not run yet'."""
    grid_path = _grid(tmp_path)
    grid = parse_grid(grid_path)
    records = _records({"a": [50.0, 52.0, 51.0], "b": [40.0, 41.0, 43.0], "c": [49.0, 53.0, 50.0]}, grid)
    _, payload = render_page(grid, records, {}, threads=1)
    out = tmp_path / "claims.md"
    text = claims_page([str(grid_path)], out)
    assert "Not run yet" in text and "* A beats B (Table 1)" in text
    grid.page.with_suffix(".json").write_text(json.dumps(payload))
    text = claims_page([str(grid_path)], out)
    assert "In all: 1 fails, 1 holds, 1 inconclusive." in text and "Partial" not in text
    assert out.read_text() == text
    del records["c", 2]  # a page still running: its verdicts are marked as partial
    _, payload = render_page(grid, records, {}, threads=1)
    grid.page.with_suffix(".json").write_text(json.dumps(payload))
    assert "**Partial**: 1 cells of the page are not recorded yet" in claims_page([str(grid_path)], out)
    _, payload = render_page(grid, {}, {}, threads=1)  # tuning done, no seed run yet: no verdict counted
    grid.page.with_suffix(".json").write_text(json.dumps(payload))
    text = claims_page([str(grid_path)], out)
    assert "In all: 3 not run." in text and "| no paired seeds | - | 0/0 | **not run** |" in text


def test_grid_mistakes_in_tuning_and_claims_are_one_line(tmp_path):
    """Unknown claim rows, a missing {claims} placeholder and a bad tuning key stop before any run."""
    bad_row = GRID.replace("better: a, than: c", "better: a, than: zz")
    with pytest.raises(ConfigError, match=r"claims\[2\]: than: no row labelled 'zz'"):
        parse_grid(_grid(tmp_path, bad_row))
    with pytest.raises(ConfigError, match=r"a grid with claims shows it: add the \{claims\} placeholder"):
        parse_grid(_grid(tmp_path, GRID.replace("  {{claims}}\n", "")))
    with pytest.raises(ConfigError, match="tuning: unknown key 'budget'"):
        parse_grid(_grid(tmp_path, GRID.replace("trials: 3,", "budget: 3, trials: 3,")))
    with pytest.raises(ConfigError, match="tune: 'no'"):
        parse_grid(_grid(tmp_path, GRID.replace("tune: false", "tune: 'no'")))


#: Stands in for ``fedhet fit`` in both stages: a tuning trial (sealed test splits) scores its lr on validation;
#: a seed run records acc_local = 50 (row a), 40 (row b) or 45 (row c) plus its seed. Every call is logged, and
#: seed runs listed in FEDHET_TEST_FAIL_SEEDS fail (a machine lost mid-bench). The trials of the config named in
#: FEDHET_TEST_SLOW_TUNING take a second, and each process ends by logging its start and end times there.
FAKE_FIT = """
import json, os, sys, time
from pathlib import Path
args = sys.argv[1:]
config, seed, run_dir = (args[args.index(k) + 1] for k in ("--config", "--seed", "--run_dir"))
run_dir = Path(run_dir)
with open(os.environ["FEDHET_TEST_CALLS"], "a") as calls:
    calls.write(f"{Path(config).stem} {seed}\\n")
started = time.time()
if os.environ.get("FEDHET_TEST_SLOW_TUNING") == Path(config).stem and "--federation.seal_test=true" in args:
    time.sleep(1.0)
if "FEDHET_TEST_TIMES" in os.environ:
    import atexit
    atexit.register(lambda: open(os.environ["FEDHET_TEST_TIMES"], "a").write(
        f"{Path(config).stem} {seed} {started} {time.time()}\\n"))
if "--federation.seal_test=true" in args:
    lr = float(next(a.split("=", 1)[1] for a in reversed(args) if a.startswith("--method.init_args.lr=")))
    run_dir.mkdir(parents=True)
    record = {"round": 0, "val/acc_local": 100 - 1e4 * (lr - 0.05) ** 2}
    (run_dir / "metrics.jsonl").write_text(json.dumps(record) + "\\n")
    (run_dir / "summary.json").write_text(json.dumps({"wall_s": 0.01}))
    sys.exit(0)
if seed in os.environ.get("FEDHET_TEST_FAIL_SEEDS", "").split():
    print("fedhet: error: the machine went away")
    sys.exit(1)
value = {"a": 50.0, "b": 40.0}.get(Path(config).stem, 45.0) + int(seed)
run_dir.mkdir(parents=True)
(run_dir / "metrics.jsonl").write_text(json.dumps({"round": 0, "acc_local": value}) + "\\n")
final = {"acc_local": value}
(run_dir / "summary.json").write_text(json.dumps({"method": "m", "final": final, "best": final, "last3": {},
    "comm": {"bytes_up_per_round": 1, "bytes_down_per_round": 1}, "wall_s": 1.0}))
"""


def _fake_fit_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trials: int):
    """``bench(name, *flags) -> (code, page json)`` over GRID with FAKE_FIT standing in for ``fedhet fit``."""
    import sys

    from fedhet.bench import Cell
    from fedhet.cli import main
    from fedhet.tuning import RowStudy

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    script, calls = tmp_path / "fake_fit.py", tmp_path / "calls.txt"
    script.write_text(FAKE_FIT)
    calls.write_text("")
    monkeypatch.setenv("FEDHET_TEST_CALLS", str(calls))
    monkeypatch.setattr(RowStudy, "command", lambda self, number, params, original=RowStudy.command:
                        [sys.executable, str(script), *original(self, number, params)[4:]])  # fmt: skip
    monkeypatch.setattr(Cell, "command", lambda self, root: [sys.executable, str(script), *self.fit_args(root)])
    text = GRID.replace("seeds: [0, 1, 2]\n", "seeds: [0, 1, 2]\nselected: {selected}\n")
    text = text.replace("trials: 3,", f"trials: {trials},")

    def bench(name: str, *flags: str) -> tuple[int, dict]:
        path = tmp_path / f"{name}.yaml"
        path.write_text(text.format(page=tmp_path / name / "page.md", out=tmp_path / name / "runs",
                                    selected=tmp_path / name / "selected"))  # fmt: skip
        code = main(["bench", "--grid", str(path), "--jobs", "1", *flags])
        return code, json.loads((tmp_path / name / "page.json").read_text())

    return bench, calls


def test_an_interrupted_bench_continues_from_its_page_json_alone(tmp_path, monkeypatch, capsys):
    """A bench interrupted in either stage continues from its page's json alone, and ends as it would have.

    Each tuned row and each finished cell is in the json at once; the run directories are deleted before each
    continuation, so nothing finished can be rerun from them.
    """
    import shutil

    import fedhet.pages

    bench, calls = _fake_fit_bench(tmp_path, monkeypatch, trials=2)
    _, uninterrupted = bench("whole")
    calls.write_text("")

    # 1. interrupted after row a's tuning: its study is in the json already, row b's is not
    real_tune_rows = fedhet.pages.tune_rows

    def interrupted_tuning(*args, on_selected, **kwargs):
        def selected_then_stop(result):
            on_selected(result)
            raise KeyboardInterrupt

        return real_tune_rows(*args, on_selected=selected_then_stop, **kwargs)

    monkeypatch.setattr(fedhet.pages, "tune_rows", interrupted_tuning)
    capsys.readouterr()
    assert bench("cut")[0] == 130
    assert f"interrupted; what finished is in {tmp_path / 'cut' / 'page.json'}: continue with 'fedhet bench --grid " \
        in capsys.readouterr().err
    monkeypatch.setattr(fedhet.pages, "tune_rows", real_tune_rows)
    saved = tmp_path / "saved.json"
    shutil.copy(tmp_path / "cut" / "page.json", saved)
    assert list(json.loads(saved.read_text())["tuning"]["rows"]) == ["a"]
    shutil.rmtree(tmp_path / "cut" / "runs")

    # 2. continued from the json: row b is tuned, row a is not; the seeds 1 and 2 are lost with the machine
    calls.write_text("")
    monkeypatch.setenv("FEDHET_TEST_FAIL_SEEDS", "1 2")
    code, payload = bench("cut", "--from_json", str(saved))
    ran = calls.read_text().splitlines()
    assert code == 1 and ran[:2] == ["fedprox 9", "fedprox 9"] and not any(r.startswith("fedavg") for r in ran)
    assert [(r["label"], r["seed"]) for r in payload["runs"]] == [("a", 0), ("b", 0), ("c", 0)]
    assert payload["missing"][0] == "a seed 1 (failed: the machine went away)" and len(payload["missing"]) == 6
    shutil.copy(tmp_path / "cut" / "page.json", saved)
    shutil.rmtree(tmp_path / "cut" / "runs")

    # 3. continued again: only the six missing cells run, and the page is the uninterrupted one
    calls.write_text("")
    monkeypatch.delenv("FEDHET_TEST_FAIL_SEEDS")
    code, payload = bench("cut", "--from_json", str(saved))
    assert code == 0 and sorted(calls.read_text().splitlines()) == sorted(f"{r} {s}" for r in "ab" for s in "12") + [
        "local 1", "local 2"]
    def numbers(runs: list[dict]) -> list[dict]:  # config paths and their digest tags name the page's directory
        return [{k: v for k, v in r.items() if k not in ("config", "config_sha256", "flags")} for r in runs]

    assert numbers(payload["runs"]) == numbers(uninterrupted["runs"]) and len(payload["runs"]) == 9
    assert payload["claims"] == uninterrupted["claims"]
    assert payload["tables"] == uninterrupted["tables"] and payload["missing"] == []
    strip = [{k: v for k, v in t.items() if k != "wall_s"} for row in ("a", "b")
             for t in payload["tuning"]["rows"][row]["trials"]]  # fmt: skip
    assert strip == [{k: v for k, v in t.items() if k != "wall_s"} for row in ("a", "b")
                     for t in uninterrupted["tuning"]["rows"][row]["trials"]]  # fmt: skip


def test_a_tuned_rows_seeds_run_on_the_cores_the_tuning_leaves_idle(tmp_path, monkeypatch):
    """With two jobs, row a's seed cells (and untuned row c's) start once a is selected, beside b's slow tuning.

    No seed cell starts while both rows tune, never more than two processes run at once, the first seed
    cell is the grid's first (a at seed 0), and the page equals the one-job bench's.
    """
    bench, _ = _fake_fit_bench(tmp_path, monkeypatch, trials=3)
    _, one_job = bench("one")
    times = tmp_path / "times.txt"
    monkeypatch.setenv("FEDHET_TEST_SLOW_TUNING", "fedprox")
    monkeypatch.setenv("FEDHET_TEST_TIMES", str(times))
    code, two_jobs = bench("two", "--jobs", "2")
    assert code == 0
    spans = [line.split() for line in times.read_text().splitlines()]
    spans = [(f"{stem} {seed}", float(start), float(end)) for stem, seed, start, end in spans]
    trials = {stem: [(s, e) for name, s, e in spans if name == f"{stem} 9"] for stem in ("fedavg", "fedprox")}
    seeds = sorted((s, e, name) for name, s, e in spans if not name.endswith(" 9"))
    assert len(trials["fedavg"]) == len(trials["fedprox"]) == 3 and len(seeds) == 9
    a_selected = max(e for _, e in trials["fedavg"])
    assert all(start >= a_selected for start, _, _ in seeds)  # no seed cell while both rows tune
    assert seeds[0][2] == "a 0"  # seed-major in the grid's order: a (its selected config a.yaml) before c
    assert seeds[0][0] < max(e for _, e in trials["fedprox"])  # beside b's tuning, not after it
    events = sorted([(s, 1) for _, s, _ in spans] + [(e, -1) for _, _, e in spans])
    running = [sum(step for _, step in events[: i + 1]) for i in range(len(events))]
    assert max(running) == 2

    def numbers(runs: list[dict]) -> list[dict]:  # the two pages' config paths name their own directories
        return [{k: v for k, v in r.items() if k not in ("config", "config_sha256", "flags", "wall_s")} for r in runs]

    assert numbers(two_jobs["runs"]) == numbers(one_job["runs"]) and len(two_jobs["runs"]) == 9
    assert two_jobs["claims"] == one_job["claims"] and two_jobs["tables"] == one_job["tables"]


def test_a_claim_compares_two_numbers_of_one_row(tmp_path):
    """``than_metric``: the row's last round against its first, paired by seed (and a self-comparison needs one)."""
    text = GRID.replace(
        '  - {{claim: "A beats C", paper: "Table 2", better: a, than: c, metric: acc_local}}\n',
        '  - {{claim: "A rises", paper: "Fig. 5", better: a, than: a, metric: acc_local, '
        'than_metric: round1/acc_local}}\n')
    grid = parse_grid(_grid(tmp_path, text))
    assert grid.claims[2].than_key == "round1/acc_local" and "round1/acc_local" in grid.keys()
    records = _records({"a": [50.0, 52.0, 51.0], "b": [40.0, 41.0, 43.0], "c": [1.0, 1.0, 1.0]}, grid)
    for (label, seed), record in records.items():
        record["values"]["round1/acc_local"] = {0: 20.0, 1: 22.0, 2: 30.0}[seed] if label == "a" else 0.0
    _, payload = render_page(grid, records, {}, threads=1)
    rises = payload["claims"][2]
    assert rises["differences"] == [30.0, 30.0, 21.0] and rises["verdict"] == HOLDS
    assert rises["metric"] == "final/acc_local vs round1/acc_local"
    with pytest.raises(ConfigError, match="a row compared with itself needs another number: add than_metric"):
        parse_grid(_grid(tmp_path, text.replace(", than_metric: round1/acc_local", "")))


def test_a_row_interrupted_mid_tuning_keeps_its_finished_trials(tmp_path, monkeypatch, capsys):
    """Each finished trial is in the page json; with ``runs/`` gone, the row restarts after them and selects the same.

    Row a is stopped after 3 of its 5 trials (2 random, then TPE). Continued from the json alone, only trials
    3 and 4 run again (the sampler, seeded per trial number, proposes what it would have), and every trial,
    selection and number equals the uninterrupted bench's.
    """
    import shutil

    import fedhet.pages

    bench, calls = _fake_fit_bench(tmp_path, monkeypatch, trials=5)
    _, uninterrupted = bench("whole")
    real_tune_rows = fedhet.pages.tune_rows

    def stopped_after_three(*args, on_trial, **kwargs):
        def saved_then_stop(label, partial):
            on_trial(label, partial)
            if len(partial["trials"]) == 3:
                raise KeyboardInterrupt

        return real_tune_rows(*args, on_trial=saved_then_stop, **kwargs)

    monkeypatch.setattr(fedhet.pages, "tune_rows", stopped_after_three)
    calls.write_text("")
    assert bench("cut")[0] == 130
    monkeypatch.setattr(fedhet.pages, "tune_rows", real_tune_rows)
    saved = tmp_path / "saved.json"
    shutil.copy(tmp_path / "cut" / "page.json", saved)
    kept = json.loads(saved.read_text())["tuning"]["rows"]["a"]
    assert kept["partial"] and [t["number"] for t in kept["trials"]] == [0, 1, 2] and kept["trials"][0]["configured"]
    assert "| Method A | `lr` | 3 of 5 so far: 3 / 0 / 0 | (tuning) | - |" in (tmp_path / "cut" / "page.md").read_text()
    shutil.rmtree(tmp_path / "cut" / "runs")

    calls.write_text("")
    capsys.readouterr()
    code, payload = bench("cut", "--from_json", str(saved))
    assert code == 0 and "a: 3 finished trials restored from the page json" in capsys.readouterr().out
    tuning = [c for c in calls.read_text().splitlines() if c.endswith(" 9")]
    assert tuning.count("fedavg 9") == 2 and tuning.count("fedprox 9") == 5  # a: trials 3 and 4; b: all five
    def untimed(trial: dict) -> dict:
        """A trial record without its wall-clock time (the one field two runs of it may differ in)."""
        return {k: v for k, v in trial.items() if k != "wall_s"}

    selected = [page["tuning"]["rows"]["a"]["selected"] for page in (payload, uninterrupted)]
    assert untimed(selected[0]) == untimed(selected[1])

    def trials(page: dict) -> list[dict]:
        return [untimed(t) for row in ("a", "b") for t in page["tuning"]["rows"][row]["trials"]]

    assert trials(payload) == trials(uninterrupted)
    assert payload["claims"] == uninterrupted["claims"] and payload["tables"] == uninterrupted["tables"]


def test_claims_page_takes_grid_files_only(tmp_path):
    """A page json given to --claims is one line naming its grid file instead (no page is a script's any more)."""
    with pytest.raises(ConfigError) as error:
        claims_page([str(tmp_path / "attack.json")], tmp_path / "claims.md")
    assert str(error.value) == (
        f"--claims {tmp_path / 'attack.json'}: give the page's grid file (configs/grids/*.yaml), not its json"
    )
    assert not (tmp_path / "claims.md").exists()
