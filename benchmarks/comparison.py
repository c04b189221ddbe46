"""Shared machinery of the method-comparison benchmarks (``fccl_plus_digits.py``, ``fedktl_digits.py``).

A comparison is a list of :class:`Run` (a config file, extra ``fedhet fit`` flags, a seed); each
runs as its own ``fedhet fit`` process into ``<root>/<label>/seed<k>``. Runs already complete
(``summary.json`` present) are skipped, so an interrupted comparison continues where it
stopped. ``--jobs 2`` runs two single-threaded processes at once, which on a 2-core machine
finishes small-model runs sooner than one two-threaded process (each run's numbers depend only
on its own seed and thread count, fixed at 1 here).

The tables read every run's ``summary.json`` and per-round ``metrics.jsonl``; nothing is typed
in by hand.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Run:
    """One ``fedhet fit`` invocation of a comparison."""

    label: str  # row of the tables (method or ablation variant)
    config: str  # path relative to the repository root
    seed: int
    flags: tuple[str, ...] = field(default_factory=tuple)

    def run_dir(self, root: Path) -> Path:
        return root / self.label / f"seed{self.seed}"

    def command(self, root: Path) -> list[str]:
        return [
            sys.executable, "-m", "fedhet", "fit", "--config", str(REPO / self.config),
            "--seed", str(self.seed), "--run_dir", str(self.run_dir(root)), *self.flags,
        ]


def execute(runs: Sequence[Run], root: Path, jobs: int = 1) -> None:
    """Run every incomplete run, ``jobs`` single-threaded processes at a time; stop on the first failure."""
    pending = [r for r in runs if not (r.run_dir(root) / "summary.json").exists()]
    print(f"{len(runs) - len(pending)} of {len(runs)} runs already complete under {root}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "disabled"}

    def one(run: Run) -> tuple[Run, int, float]:
        run_dir = run.run_dir(root)
        if run_dir.exists():  # an interrupted run: start it again from scratch
            for path in sorted(run_dir.rglob("*"), reverse=True):
                path.unlink() if path.is_file() else path.rmdir()
            run_dir.rmdir()
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with open(run_dir.parent / f"seed{run.seed}.log", "w") as log:
            code = subprocess.call(run.command(root), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        return run, code, time.perf_counter() - started

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for run, code, seconds in pool.map(one, pending):
            status = "ok" if code == 0 else f"FAILED (exit {code}, log {run.run_dir(root).parent}/seed{run.seed}.log)"
            print(f"{run.label} seed {run.seed}: {status} in {seconds:.0f} s", flush=True)
            if code != 0:
                raise SystemExit(f"{run.label} seed {run.seed} failed")


def load(run: Run, root: Path) -> dict[str, Any]:
    """A run's summary plus its per-round records (``history``)."""
    run_dir = run.run_dir(root)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["history"] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return summary


def last_mean(history: Sequence[dict[str, Any]], key: str, last: int = 3) -> float:
    """Mean of ``key`` over the last ``last`` evaluated rounds (FCCL+'s reporting rule)."""
    values = [row[key] for row in history if key in row][-last:]
    return sum(values) / len(values) if values else math.nan


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def cell(values: Sequence[float]) -> str:
    """``mean ± std`` over seeds, or the single value."""
    mean, std = mean_std(values)
    return f"{mean:.2f}" if len(values) == 1 else f"{mean:.2f} ± {std:.2f}"


def curves_png(
    path: Path, series: dict[str, list[list[list[float]]]], keys: Sequence[str], titles: Sequence[str]
) -> None:
    """Per-round curves (mean over seeds) of each label, one panel per metric key."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.2))
    axes = axes if len(keys) > 1 else [axes]
    for panel, (key, title) in enumerate(zip(keys, titles)):
        ax = axes[panel]
        for label, per_seed in series.items():
            curves = [c[panel] for c in per_seed]
            length = min(len(c) for c in curves)
            mean = [sum(c[r] for c in curves) / len(curves) for r in range(length)]
            ax.plot(range(1, length + 1), mean, label=label, linewidth=2.2 if label.startswith("fccl_plus") or label == "fedktl" else 1.2)
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file (never a half-written result)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
