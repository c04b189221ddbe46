"""How long a tuned page takes under ``fedhet bench``'s two schedules, replayed from its recorded run times.

``python benchmarks/schedule_replay.py docs/results/fedvtc_tuned.json --jobs 1 2 4 8 16``

A tuned page's json keeps every tuning trial's seconds (``tuning.rows.<row>.trials[].wall_s``) and every
seed run's (``runs[].values.wall_s``). This script replays those durations through two schedules of
``--jobs N`` slots and prints each page's makespan and their ratio:

* **after** (``fedhet bench`` before 2026-11-29, stop 52): the rows are tuned N at a time, each row's trials
  one after another; the seed runs start when the last row is selected, N at a time, seed-major.
* **fill** (:class:`fedhet.bench.CellQueue`): the same tuning, and a selected row's seed runs start on the
  slots the tuning leaves free (N minus the rows still to select), lowest seed first in the grid's order.

It is a replay of recorded seconds, not a timing: it assumes each run takes what it took on the page (one
thread per run), whatever else runs beside it. What it shows is how much of a page's wall time the first
schedule left a core idle in the tail of the tuning.
"""

from __future__ import annotations

import argparse
import heapq
import json
from pathlib import Path


def tuning_seconds(page: dict) -> dict[str, float]:
    """Each tuned row's tuning time: its trials one after another."""
    return {row: sum(t.get("wall_s") or 0.0 for t in study["trials"]) for row, study in page["tuning"]["rows"].items()}


def seed_runs(page: dict) -> list[tuple[int, int, str, float]]:
    """(seed, the row's place in the grid, row, seconds) of every recorded seed run, in the grid's order."""
    labels = [r["label"] for r in page["runs"]]  # the json lists the runs in the grid's order, seed-major
    order = {label: labels.index(label) for label in labels}
    return sorted((r["seed"], order[r["label"]], r["label"], float(r["values"]["wall_s"])) for r in page["runs"])


def makespan(rows: dict[str, float], runs: list[tuple[int, int, str, float]], jobs: int, fill: bool) -> float:
    """The end of the last run when ``jobs`` slots take the rows' tunings first, then (or beside them) the seeds."""
    queued_rows = list(rows)  # the grid's order
    unselected = len(rows)
    ready: list[tuple[int, int, str, float]] = []  # seed runs whose row is selected (a heap, seed-major)
    waiting = {row: [r for r in runs if r[2] == row] for row in rows}
    untuned = [r for r in runs if r[2] not in rows]  # rows without a tuning run from the start
    for run in untuned:
        heapq.heappush(ready, run)
    events: list[tuple[float, int, str, str]] = []  # (end, tie, kind, row)
    now, tie, rows_running, seeds_running = 0.0, 0, 0, 0
    while True:
        while queued_rows and rows_running < jobs:  # the tuning goes first, N rows at a time
            row = queued_rows.pop(0)
            rows_running += 1
            heapq.heappush(events, (now + rows[row], tie, "row", row))
            tie += 1
        free = jobs - min(jobs, unselected) if fill else (jobs if unselected == 0 else 0)
        while ready and seeds_running < free:
            seeds_running += 1
            heapq.heappush(events, (now + heapq.heappop(ready)[3], tie, "seed", ""))
            tie += 1
        if not events:
            return now
        now, _, kind, row = heapq.heappop(events)
        if kind == "row":
            rows_running -= 1
            unselected -= 1
            for run in waiting[row]:
                heapq.heappush(ready, run)
        else:
            seeds_running -= 1


def main() -> None:
    """Print each page's makespan under both schedules for each number of jobs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="+", type=Path, help="tuned pages' json (docs/results/*_tuned.json)")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    print("| page | jobs | core-hours | after (h) | fill (h) | fill / after |")
    print("|---|---|---|---|---|---|")
    for path in args.pages:
        page = json.loads(path.read_text())
        if not page.get("tuning"):
            raise SystemExit(f"{path}: no tuning in this page's json; give a tuned page")
        rows, runs = tuning_seconds(page), seed_runs(page)
        core_hours = (sum(rows.values()) + sum(r[3] for r in runs)) / 3600
        for jobs in args.jobs:
            after, fill = makespan(rows, runs, jobs, fill=False), makespan(rows, runs, jobs, fill=True)
            print(f"| {path.stem} | {jobs} | {core_hours:.2f} | {after / 3600:.2f} | {fill / 3600:.2f} | "
                  f"{fill / after:.3f} |")


if __name__ == "__main__":
    main()
