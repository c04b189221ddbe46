"""Shared machinery of the paper-reproduction scripts (``feddyn_scaffold_diagnosis.py`` ...).

A comparison is a list of :class:`Run` (a config file, extra ``fedhet fit`` flags, a seed); each
runs as its own ``fedhet fit`` process into ``<root>/<label>/seed<k>``. The grid machinery is
``fedhet bench``'s (:mod:`fedhet.bench`): runs already complete (``summary.json`` present) are
skipped, a run interrupted after a checkpoint continues with ``fedhet fit --resume`` (exactly the
uninterrupted result) and one interrupted before starts again, so an interrupted comparison
continues where it stopped. ``--jobs 2`` runs two single-threaded processes at once, which on a
2-core machine finishes small-model runs sooner than one two-threaded process (each run's numbers
depend only on its own seed and thread count, fixed at 1 here).

The tables read every run's ``summary.json`` and per-round ``metrics.jsonl``; nothing is typed
in by hand. What stays here is what the comparison scripts have in common beyond ``fedhet bench``:
configs named relative to the repository, W&B off, and stopping on the first failed run.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the fedhet of this checkout, also when it is not installed

from fedhet.bench import Cell as Run  # noqa: E402  (label, config relative to REPO, seed, flags)
from fedhet.bench import cell_text as cell  # noqa: E402
from fedhet.bench import child_environment, last_mean, load_run, mean_std, run_cells  # noqa: E402
from fedhet.bench import curves_png as _curves_png  # noqa: E402
from fedhet.files import atomic_write_text as write_atomic  # noqa: E402

__all__ = ["REPO", "Run", "cell", "curves_png", "execute", "last_mean", "load", "mean_std", "reuse_archived",
           "write_atomic"]


def execute(runs: Sequence[Run], root: Path, jobs: int = 1) -> None:
    """Run every incomplete run, ``jobs`` single-threaded processes at a time; stop on the first failure."""
    env = child_environment(1, {"WANDB_MODE": "disabled"})
    outcomes = run_cells(runs, root, jobs, env=env, cwd=REPO)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise SystemExit(f"{failed[0].cell.label} seed {failed[0].cell.seed} failed (log {failed[0].log})")


def load(run: Run, root: Path) -> dict[str, Any]:
    """A run's summary plus its per-round records (``history``)."""
    return load_run(run.run_dir(root))


def reuse_archived(
    fresh: dict[str, list[dict[str, Any]]],
    archived: dict[str, list[dict[str, Any]]],
    labels: Sequence[str],
    seeds: Sequence[int],
) -> dict[str, list[dict[str, Any]]]:
    """Per planned label, its complete runs' records plus an earlier page's records of the seeds not run anew.

    A page's json keeps every run's numbers and curve, so a page can be rewritten after a subset of
    its runs is redone (a fix, a new default) without the other runs' directories at hand. A record
    taken from the archive is marked ``"reused": True`` so the page can say which numbers those are;
    a run made anew always replaces its archived record. Labels keep the plan's order, seeds sort.
    """
    merged: dict[str, list[dict[str, Any]]] = {}
    for label in labels:
        records = list(fresh.get(label, []))
        present = {r["seed"] for r in records}
        records += [{**r, "reused": True} for r in archived.get(label, [])
                    if r["seed"] in seeds and r["seed"] not in present]
        if records:
            merged[label] = sorted(records, key=lambda r: r["seed"])
    return merged


def curves_png(
    path: Path, series: dict[str, list[list[list[float]]]], keys: Sequence[str], titles: Sequence[str]
) -> None:
    """Per-round curves (mean over seeds) of each label, one panel per metric; the proposed methods drawn bold."""
    _curves_png(path, series, titles, highlight=lambda label: label.startswith("fccl_plus") or label == "fedktl")
