"""``benchmarks/schedule_replay.py``: the two schedules of a tuned page, replayed by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def replay(monkeypatch):
    """The script as a module."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import schedule_replay

    return schedule_replay


def test_seeds_wait_for_the_last_row_or_fill_the_slot_the_tuning_leaves(replay):
    """Row a tunes 10 s, b 4 s; seeds a0 1 s, b0 and b1 3 s each; two slots.

    after: both rows until 10, then a0 10-11 and b0 10-13 together, b1 11-14: 14.
    fill: b selected at 4 frees one slot (a still tunes): b0 4-7, b1 7-10; a0 10-11: 11.
    One slot: the rows 0-14, then the seeds 14-21, under either schedule.
    """
    rows = {"a": 10.0, "b": 4.0}
    runs = [(0, 0, "a", 1.0), (0, 1, "b", 3.0), (1, 1, "b", 3.0)]
    assert replay.makespan(rows, runs, jobs=2, fill=False) == 14.0
    assert replay.makespan(rows, runs, jobs=2, fill=True) == 11.0
    assert replay.makespan(rows, runs, jobs=1, fill=False) == replay.makespan(rows, runs, jobs=1, fill=True) == 21.0
    untuned = [*runs, (0, 2, "c", 5.0)]  # an untuned row's seeds may start at once where a slot is free
    assert replay.makespan(rows, untuned, jobs=3, fill=True) == 11.0  # c0 0-5 on the third slot
    assert replay.makespan(rows, untuned, jobs=3, fill=False) == 15.0  # c0 10-15


def test_a_page_json_is_read_and_a_page_without_tuning_refused(replay, tmp_path):
    """Row a tunes 6 + 4 s, then a0 2 s; untuned c0 5 s; two slots: fill 12 s (c0 beside a), after 15 s."""
    page = {"tuning": {"rows": {"a": {"trials": [{"wall_s": 6.0}, {"wall_s": 4.0}]}}},
            "runs": [{"label": "a", "seed": 0, "values": {"wall_s": 2.0}},
                     {"label": "c", "seed": 0, "values": {"wall_s": 5.0}}]}  # fmt: skip
    assert replay.tuning_seconds(page) == {"a": 10.0}
    assert replay.seed_runs(page) == [(0, 0, "a", 2.0), (0, 1, "c", 5.0)]
    path = tmp_path / "page.json"
    path.write_text(json.dumps(page))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "schedule_replay.py"), str(path), "--jobs", "2"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.splitlines()[-1] == "| page | 2 | 0.00 | 0.00 | 0.00 | 0.800 |"
    path.write_text(json.dumps({"runs": []}))
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "schedule_replay.py"), str(path)],
                             capture_output=True, text=True)  # fmt: skip
    assert refused.returncode == 1
    assert refused.stderr.strip() == f"{path}: no tuning in this page's json; give a tuned page"
