"""``fedhet bench``: a grid of methods x settings x seeds, each cell a ``fedhet fit`` process.

``fedhet bench --configs A.yaml B.yaml --seeds 0 1 2 [--set NAME=FLAGS ...] [--jobs N] --out DIR
[-- extra fit flags]`` runs every (config, setting, seed) cell into ``DIR/<method>[/<setting>]/
seed<k>/`` and ends with the mean ± std over seeds of the headline metrics (Markdown on stdout
and in ``DIR/bench.md``, everything in ``DIR/bench.json``) and two figures: a bar chart of the
final headline metrics with error bars and the mean per-round curves.

Why subprocesses: each cell is exactly the run a user would start by hand (its own run
directory, config, seed and thread count), a crash or a leak in one cell cannot touch another,
and ``--jobs N`` runs N at once without sharing a Python interpreter.

Resumable: a cell whose run directory holds ``summary.json`` is never rerun; a cell that was
interrupted after at least one round (``checkpoint.pt``) continues with ``fedhet fit --resume``
(which reproduces the uninterrupted result exactly); one interrupted before that starts again.
The flags each cell was started with are recorded next to it, and a rerun with different flags
for an existing cell is refused rather than silently mixed into the table.

``fedhet bench --grid FILE`` writes a results page from a grid file (:mod:`fedhet.pages`); the
scripts under ``reproductions/`` (``comparison.py``) build on the same :class:`Cell`,
:func:`run_cells` and aggregation helpers and keep only their own tables.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhet.errors import CommandParser, ConfigError
from fedhet.files import atomic_savefig, atomic_write_text

#: The blocks of ``summary.json`` tabulated, with their table titles.
BLOCKS = {
    "final": "final round",
    "best": "at the round best on validation",
    "last3": "mean of the last 3 evaluated rounds",
}


# ---------------------------------------------------------------------------------------------- cells
#: The fedhet commands a cell may run: each takes ``--config``, ``--seed`` and ``--run_dir`` and writes a run
#: directory with ``summary.json`` last. ``attack`` is FedMD-CG's gradient-inversion cell (:mod:`fedhet.privacy`).
CELL_COMMANDS = ("fit", "attack")


@dataclass(frozen=True)
class Cell:
    """One ``fedhet fit`` run of a grid (or, with ``command="attack"``, one ``fedhet attack`` run).

    Args:
        label: the row it belongs to (method, or ``method/setting``); also its directory.
        config: the experiment config (relative to the working directory of the run).
        seed: the experiment seed (``--seed``).
        flags: more ``fedhet fit`` flags (the setting's and the grid's extra flags).
        command: the fedhet command of the run, one of :data:`CELL_COMMANDS`.
    """

    label: str
    config: str
    seed: int
    flags: tuple[str, ...] = field(default_factory=tuple)
    command_name: str = "fit"

    def run_dir(self, root: Path) -> Path:
        return Path(root) / self.label / f"seed{self.seed}"

    def log_path(self, root: Path) -> Path:
        """The process output; beside the run directory, which ``fedhet fit`` itself creates."""
        return Path(root) / self.label / f"seed{self.seed}.log"

    def record_path(self, root: Path) -> Path:
        return Path(root) / self.label / f"seed{self.seed}.cell.json"

    def fit_args(self, root: Path) -> list[str]:
        return ["--config", self.config, "--seed", str(self.seed), "--run_dir", str(self.run_dir(root)), *self.flags]

    def command(self, root: Path) -> list[str]:
        return [sys.executable, "-m", "fedhet", self.command_name, *self.fit_args(root)]

    def recorded(self) -> dict[str, Any]:
        """What a cell is started with, as kept beside it and in a page's json (a fit cell has no ``command``)."""
        return {"config": self.config, "flags": list(self.flags),
                **({"command": self.command_name} if self.command_name != "fit" else {})}  # fmt: skip


def override_flag(key: str, value: Any) -> str:
    """A dotted override as one ``fedhet fit`` flag, ``--key=value``, the value as YAML (``true``, ``[a, b]``)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    text = text.removesuffix("...").strip()
    return f"--{key}={text}"


def cell_state(run_dir: Path) -> str:
    """The state of a cell's run directory.

    ``"complete"`` (summary.json), ``"partial"`` (a checkpoint to resume), ``"stale"`` (a directory
    without a checkpoint: interrupted before its first round ended) or ``"absent"``.
    """
    if (run_dir / "summary.json").is_file():
        return "complete"
    if (run_dir / "checkpoint.pt").is_file() and (run_dir / "config.yaml").is_file():
        return "partial"
    return "stale" if run_dir.exists() else "absent"


@dataclass
class CellOutcome:
    """How one cell's process ended."""

    cell: Cell
    code: int
    seconds: float
    resumed: bool
    log: Path

    @property
    def ok(self) -> bool:
        return self.code == 0


def last_log_line(path: Path) -> str:
    """The last non-empty line of a log (``fedhet fit`` ends a user error with one line)."""
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def child_environment(threads: int | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a run process: this one's, with fixed BLAS/OpenMP threads when given.

    N runs at once on a machine with C cores each get C/N threads by default, so that parallel
    cells do not oversubscribe the cores (which slows every cell down, often below sequential).
    """
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env.update(extra or {})
    return env


def default_threads(jobs: int) -> int:
    """Threads per run: ``OMP_NUM_THREADS`` when set, else the cores divided among the jobs."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // max(1, jobs))


def run_process(command: Sequence[str], log_path: Path, env: dict[str, str], cwd: Path | None = None) -> int:
    """Run one command with its output in ``log_path``; returns the exit status."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + shlex.join(command) + "\n")
        log.flush()
        return subprocess.call(list(command), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)


def run_cells(cells: Sequence[Cell], root: Path, jobs: int = 1, **options: Any) -> list[CellOutcome]:
    """Run every cell that is not complete, ``jobs`` processes at a time; returns their outcomes.

    Complete cells are skipped, partial ones resumed, stale ones restarted (see the module
    docstring). A failed cell does not stop the others; its log path and last line are echoed.
    ``options`` are :class:`CellQueue`'s (``env``, ``cwd``, ``echo``, ``on_done``: called with each
    outcome as it arrives, one call at a time).
    """
    queue = CellQueue(root, jobs, **options)
    with queue.stopped_on_error():
        queue.add(cells)
        return queue.finish()


class CellQueue:
    """Runs cells on at most ``jobs`` processes as they are added, seed-major, while other work holds some slots.

    A grid's seed cells wait for their rows' tuning, which occupies the same cores: the tuning of
    ``reserved`` rows holds ``min(jobs, reserved)`` slots, and each :meth:`release` (a row
    selected) frees one. A cell therefore starts only when a core would otherwise be idle, the
    rows still to tune first (the tail of a tuning, or more jobs than rows, fills with the cells of
    the rows tuned). Among the cells ready, the lowest ``rank`` runs first (by default the seed,
    then the order added): seed-major, as :func:`plan` orders a grid, so that an interrupted bench
    has every row it ran on the first seeds.

    ``on_done`` and ``echo`` are called from the worker threads, one outcome at a time. An
    exception in a worker or in ``on_done`` stops the queue (no other cell starts; running ones
    finish) and is raised again by :meth:`finish`; :meth:`stopped_on_error` stops it when the
    caller's own work raises (an interrupt, a tuning that fails). Complete cells are skipped,
    partial ones resumed, stale ones restarted.
    """

    def __init__(
        self,
        root: Path,
        jobs: int = 1,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        echo: Callable[[str], None] = print,
        on_done: Callable[[CellOutcome], None] | None = None,
        reserved: int = 0,
        rank: Callable[[Cell], int] | None = None,
    ) -> None:
        self.root = Path(root)
        self.jobs = max(1, jobs)
        self.env = dict(os.environ) if env is None else env
        self.cwd = Path.cwd() if cwd is None else cwd  # fixed now: the runs' relative config paths resolve from here
        self.echo, self.on_done = echo, on_done
        self.outcomes: list[CellOutcome] = []
        self._reserved = reserved
        self._rank = rank or (lambda cell: cell.seed)
        self._ready: list[tuple[int, int, Cell]] = []  # a heap: (rank, order added, cell)
        self._added = 0
        self._running = 0
        self._closed = self._stopped = False
        self._error: BaseException | None = None
        self._state = threading.Condition()
        self._report = threading.Lock()
        self._workers = [threading.Thread(target=self._work, name=f"cell-{i}", daemon=True) for i in range(self.jobs)]
        for worker in self._workers:
            worker.start()

    def add(self, cells: Sequence[Cell]) -> None:
        """Queue the cells that are not complete (and say how many were)."""
        pending = [c for c in cells if cell_state(c.run_dir(self.root)) != "complete"]
        if cells:
            self.echo(f"{len(cells) - len(pending)} of {len(cells)} cells already complete under {self.root}")
        with self._state:
            for cell in pending:
                heapq.heappush(self._ready, (self._rank(cell), self._added, cell))
                self._added += 1
            self._state.notify_all()

    def release(self, slots: int = 1) -> None:
        """Free slots the other work held (a tuned row's), for the cells."""
        with self._state:
            self._reserved = max(0, self._reserved - slots)
            self._state.notify_all()

    def finish(self) -> list[CellOutcome]:
        """Wait for every cell added (no more are coming) and return the outcomes, in the order they ended."""
        with self._state:
            self._closed = True
            self._reserved = 0
            self._state.notify_all()
        return self._join()

    def stop(self) -> None:
        """Start no other cell and wait for the running ones (an interrupt reaches their processes too)."""
        with self._state:
            self._stopped = True
            self._state.notify_all()
        with contextlib.suppress(BaseException):
            self._join()

    @contextlib.contextmanager
    def stopped_on_error(self) -> Iterator[CellQueue]:
        """The caller's work beside the queue: an error or interrupt in it stops the queue, then goes on."""
        try:
            yield self
        except BaseException:
            self.stop()
            raise

    def _join(self) -> list[CellOutcome]:
        for worker in self._workers:
            worker.join()
        if self._error is not None:
            raise self._error
        return list(self.outcomes)

    def _next(self) -> Cell | None:
        """The next cell to run, once a slot is free; None when the queue is stopped or finished."""
        with self._state:
            while True:
                if self._stopped:
                    return None
                if self._ready and self._running < self.jobs - min(self.jobs, self._reserved):
                    self._running += 1
                    return heapq.heappop(self._ready)[2]
                if self._closed and not self._ready:
                    return None
                self._state.wait()

    def _work(self) -> None:
        while (cell := self._next()) is not None:
            try:
                outcome = self._run(cell)
                with self._report:
                    self.outcomes.append(outcome)
                    self._say(outcome)
                    if self.on_done is not None:
                        self.on_done(outcome)
            except BaseException as exc:  # noqa: BLE001 - raised again by finish(), in the caller's thread
                with self._state:
                    self._error = self._error or exc
                    self._stopped = True
            finally:
                with self._state:
                    self._running -= 1
                    self._state.notify_all()

    def _run(self, cell: Cell) -> CellOutcome:
        run_dir = cell.run_dir(self.root)
        state = cell_state(run_dir)
        if state == "partial":
            command = [sys.executable, "-m", "fedhet", "fit", "--resume", str(run_dir)]
        else:
            if run_dir.exists():  # interrupted before its first checkpoint: nothing to keep
                shutil.rmtree(run_dir)
            command = cell.command(self.root)
        record_cell(cell, self.root)
        log = cell.log_path(self.root)
        started = time.perf_counter()
        code = run_process(command, log, self.env, self.cwd)
        return CellOutcome(cell, code, time.perf_counter() - started, state == "partial", log)

    def _say(self, outcome: CellOutcome) -> None:
        where = f"{outcome.cell.label} seed {outcome.cell.seed}"
        if outcome.ok:
            self.echo(f"{where}: {'resumed, ' if outcome.resumed else ''}ok in {outcome.seconds:.0f} s")
        else:
            self.echo(f"{where}: FAILED (exit {outcome.code}, log {outcome.log}): {last_log_line(outcome.log)}")


@contextlib.contextmanager
def cancel_queued_on_exit(pool: Executor, on_exit: Callable[[], None] | None = None) -> Iterator[None]:
    """On an interrupt or error, cancel the queued jobs: leaving the pool's block would otherwise start them all.

    ``on_exit`` then tells the running jobs to stop (they run in threads, which Ctrl-C does not reach).
    """
    try:
        yield
    except BaseException:
        if on_exit is not None:
            on_exit()
        pool.shutdown(wait=False, cancel_futures=True)
        raise


def record_cell(cell: Cell, root: Path) -> None:
    """Keep the flags a cell was started with, so that a rerun can refuse different ones."""
    atomic_write_text(cell.record_path(root), json.dumps(cell.recorded()) + "\n")


def check_recorded(cells: Sequence[Cell], root: Path) -> None:
    """Refuse to mix results: an existing cell must have been started with the same config and flags."""
    for cell in cells:
        path = cell.record_path(root)
        if cell_state(cell.run_dir(root)) not in ("complete", "partial") or not path.is_file():
            continue
        recorded = json.loads(path.read_text())
        if recorded != cell.recorded():
            how = " ".join([*([f"fedhet {recorded['command']}"] if "command" in recorded else []), *recorded["flags"]])
            raise ConfigError(
                f"{cell.run_dir(root)} was run with other flags ({how or 'none'}); "
                f"use another --out, or delete that directory to rerun it"
            )


# ---------------------------------------------------------------------------------------------- aggregation
def load_run(run_dir: Path) -> dict[str, Any]:
    """A finished run's ``summary.json`` plus its per-round records under ``history``."""
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    summary["history"] = [json.loads(line) for line in lines if line.strip()]
    return summary


def last_mean(history: Sequence[dict[str, Any]], key: str, last: int = 3) -> float:
    """Mean of ``key`` over the last ``last`` rounds that have it (FCCL+'s reporting rule)."""
    values = [row[key] for row in history if key in row][-last:]
    return sum(values) / len(values) if values else math.nan


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1 in the denominator; 0 for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def cell_text(values: Sequence[float], digits: int = 2) -> str:
    """``mean ± std`` over seeds, or the single value."""
    if not values:
        return "-"
    mean, std = mean_std(values)
    return f"{mean:.{digits}f}" if len(values) == 1 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def headline_keys(kind: str, top5: bool = False) -> tuple[str, ...]:
    """The headline metrics of a scenario kind (:data:`fedhet.metrics.report.HEADLINE`), top-1 only by default."""
    from fedhet.metrics.report import HEADLINE

    return tuple(k for k in HEADLINE[kind] if top5 or not k.endswith("_top5"))


def run_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The tabulated numbers of one run: ``<block>/<headline metric>``, communication and wall time.

    A run that is not federated (``fedhet attack``: no headline metrics of a scenario kind, no
    communication) gives every number of its blocks and its wall time.
    """
    from fedhet.metrics.report import HEADLINE

    values: dict[str, float] = {}
    kind = summary.get("scenario_kind")
    for block in BLOCKS:
        numbers = summary.get(block, {})
        for key in headline_keys(kind, top5=True) if kind in HEADLINE else sorted(numbers):
            value = numbers.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values[f"{block}/{key}"] = float(value)
    comm = summary.get("comm")
    if comm is not None:
        values["comm/mb_per_round"] = (comm["bytes_up_per_round"] + comm["bytes_down_per_round"]) / 1e6
    values["wall_s"] = float(summary["wall_s"])
    return values


def aggregate(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per row label, the mean, sample std and values over its runs of every :func:`run_metrics` number."""
    results: dict[str, dict[str, Any]] = {}
    for label, summaries in runs.items():
        per_run = [run_metrics(s) for s in summaries]
        keys = sorted({k for m in per_run for k in m})
        metrics = {}
        for key in keys:
            values = [m[key] for m in per_run if key in m]
            mean, std = mean_std(values)
            metrics[key] = {"mean": round(mean, 4), "std": round(std, 4), "n": len(values), "values": values}
        results[label] = {
            "method": summaries[0]["method"],
            "scenario_kind": summaries[0]["scenario_kind"],
            "seeds": [s["seed"] for s in summaries],
            "metrics": metrics,
        }
    return results


def markdown_tables(results: dict[str, dict[str, Any]], settings: dict[str, str] | None = None) -> str:
    """One table per block of :data:`BLOCKS` (headline metrics, mean ± std over seeds) and a cost table."""
    kinds = list(dict.fromkeys(r["scenario_kind"] for r in results.values()))
    keys = [k for kind in kinds for k in headline_keys(kind)]

    def row(label: str, cells: list[str]) -> str:
        return f"| {label} | {len(results[label]['seeds'])} | " + " | ".join(cells) + " |"

    lines: list[str] = []
    for block, title in BLOCKS.items():
        lines += [f"### {title} (%, mean ± std over seeds)", "", "| run | seeds | " + " | ".join(keys) + " |"]
        lines.append("| --- | --- |" + " --- |" * len(keys))
        for label, entry in results.items():
            cells = [cell_text(entry["metrics"].get(f"{block}/{k}", {}).get("values", [])) for k in keys]
            lines.append(row(label, cells))
        lines.append("")
    lines += ["### cost", "", "| run | seeds | up+down MB per round | wall s |", "| --- | --- | --- | --- |"]
    for label, entry in results.items():
        metrics = entry["metrics"]
        cost = [cell_text(metrics["comm/mb_per_round"]["values"], 3), cell_text(metrics["wall_s"]["values"], 1)]
        lines.append(row(label, cost))
    if settings:
        lines += ["", "Settings: " + "; ".join(f"`{name}`: `{flags or '(none)'}`" for name, flags in settings.items())]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- figures
def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def curves_png(
    path: Path,
    series: dict[str, list[list[list[float]]]],
    titles: Sequence[str],
    highlight: Callable[[str], bool] = lambda label: False,
) -> None:
    """Per-round curves, mean over seeds, of each label; one panel per metric.

    ``series[label][seed][panel]`` is the list of per-round values; seeds are cut to the shortest. A
    label keeps one colour in every panel, also where another label has no curve.
    """
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(titles), figsize=(6 * len(titles), 4.2), squeeze=False)
    for panel, title in enumerate(titles):
        ax = axes[0][panel]
        for index, (label, per_seed) in enumerate(series.items()):
            curves = [c[panel] for c in per_seed if c[panel]]
            if not curves:
                continue
            length = min(len(c) for c in curves)
            mean = [sum(c[r] for c in curves) / len(curves) for r in range(length)]
            ax.plot(range(1, length + 1), mean, label=label, marker="o" if length == 1 else None,
                    color=f"C{index % 10}", linewidth=2.2 if highlight(label) else 1.2)
        ax.set_title(title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("evaluated round")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    atomic_savefig(fig, path)
    plt.close(fig)


def bars_png(path: Path, results: dict[str, dict[str, Any]], keys: Sequence[str], block: str = "final") -> None:
    """Grouped bars of ``<block>/<key>`` per row label, with the std over seeds as error bars."""
    plt = _pyplot()
    labels = list(results)
    width = 0.8 / max(1, len(keys))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(labels) * max(1, len(keys)) ** 0.5 + 2), 4.2))
    for index, key in enumerate(keys):
        stats = [results[label]["metrics"].get(f"{block}/{key}") for label in labels]
        means = [s["mean"] if s else 0.0 for s in stats]
        stds = [s["std"] if s else 0.0 for s in stats]
        positions = [i + (index - (len(keys) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(positions, means, width, yerr=stds, capsize=3, label=key)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(f"{block} accuracy (%)")
    ax.set_title(f"{BLOCKS.get(block, block)}: mean ± std over seeds")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- the command
def build_parser() -> argparse.ArgumentParser:
    """The ``fedhet bench`` parser."""
    parser = CommandParser(
        prog="fedhet bench",
        description="Run a grid of configs x settings x seeds (each a fedhet fit) and tabulate mean ± std over seeds.",
        epilog="Flags after '--' go to every fedhet fit, e.g. -- --rounds 5 --trainer.max_epochs=1",
    )
    parser.add_argument("--configs", nargs="+", help="experiment configs: one row (method) each (or --grid)")
    parser.add_argument(
        "--grid", default=None, metavar="FILE",
        help="a grid file (configs/grids/*.yaml): run its cells and write its results page (docs/results_pages.md)",
    )
    parser.add_argument(
        "--from_json", type=Path, default=None, metavar="PAGE.json",
        help="with --grid: take the runs recorded in a page's json instead of rerunning them",
    )
    parser.add_argument(
        "--claims", nargs="+", default=None, metavar="GRID",
        help="write docs/results/claims.md: every claim of these grids' pages with its verdict (from their json)",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds of every cell (default: 0)")
    parser.add_argument(
        "--set", dest="settings", action="append", default=[], metavar="NAME=FLAGS",
        help="a setting: a name and fedhet fit flags (shell-quoted), e.g. --set lr01=--method.init_args.lr=0.1; repeat",
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (default 1)")
    parser.add_argument(
        "--threads", type=int, default=None, help="threads per run (default: cores / jobs, or OMP_NUM_THREADS)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="grid directory: run directories, logs, tables, plots (--grid: its out)"
    )
    parser.add_argument("--report_only", action="store_true", help="tabulate the complete cells; run nothing")
    parser.add_argument(
        "--ray_address", default=None, metavar="ADDRESS",
        help="with --grid: run the tuning trials through Ray Tune on this cluster ('auto', 'ray://host:10001', or "
             "'local' for Ray on this machine); the run directories need a filesystem the nodes share",
    )  # fmt: skip
    return parser


def parse_settings(specs: Sequence[str]) -> dict[str, list[str]]:
    """``NAME=FLAGS`` strings to ``{name: flags}``; no ``--set`` is one setting without flags."""
    settings: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name or "/" in name or name.startswith("-"):
            raise ConfigError(f"--set {spec!r}: write NAME=FLAGS, e.g. --set lr01=--method.init_args.lr=0.1")
        if name in settings:
            raise ConfigError(f"--set {name}: the setting name is used twice")
        settings[name] = shlex.split(flags)
    return settings or {"": []}


def row_labels(configs: Sequence[str]) -> dict[str, str]:
    """A short row label per config: its file stem, or ``parent/stem`` where stems collide."""
    stems = [Path(c).stem for c in configs]
    labels = {}
    for config, stem in zip(configs, stems, strict=True):
        labels[config] = f"{Path(config).parent.name}/{stem}" if stems.count(stem) > 1 else stem
    if len(set(labels.values())) < len(labels):
        raise ConfigError("--configs: two configs have the same name and folder; list each config once")
    return labels


def plan(
    configs: Sequence[str], seeds: Sequence[int], settings: dict[str, list[str]], extra: Sequence[str]
) -> list[Cell]:
    """Every (config, setting, seed) cell, seed-major so that an interrupted grid has every row on the first seeds."""
    labels = row_labels(configs)
    return [
        Cell(labels[config] + (f"/{name}" if name else ""), config, seed, (*flags, *extra))
        for seed in seeds
        for config in configs
        for name, flags in settings.items()
    ]


def validate_cells(cells: Sequence[Cell], root: Path) -> None:
    """Parse each distinct config + flags as its command does (``fedhet fit``'s or ``fedhet attack``'s).

    Bad input fails before any run; what the command accepts passes (a method's or an executor's
    short name is mapped first, as :func:`fedhet.cli.main` maps it).
    """
    from fedhet.config import build_parser, parse_config, prepare_args
    from fedhet.privacy.command import parse_attack

    parser = build_parser()
    seen = set()
    for cell in cells:
        key = (cell.command_name, cell.config, cell.flags)
        if key in seen:
            continue
        seen.add(key)
        try:
            if cell.command_name == "attack":
                parse_attack(["--config", cell.config, *cell.flags])
            elif cell.command_name == "fit":
                parse_config(parser, prepare_args(["--config", cell.config, *cell.flags]))
            else:
                raise ConfigError(f"command {cell.command_name!r}: a cell runs one of {', '.join(CELL_COMMANDS)}")
        except ConfigError as exc:
            raise ConfigError(f"{cell.label}: {exc}") from None


@dataclass(frozen=True)
class PageRequest:
    """What ``fedhet bench --grid FILE`` or ``--claims GRID ...`` asks of the page writer (:mod:`fedhet.pages`)."""

    grid: str | None
    claims: tuple[str, ...] | None
    out: Path | None
    jobs: int
    threads: int | None
    report_only: bool
    from_json: Path | None
    ray_address: str | None = None


GridRunner = Callable[[PageRequest, Callable[[str], None]], int]


def bench_command(argv: Sequence[str], echo: Callable[[str], None] = print, grid: GridRunner | None = None) -> int:
    """``fedhet bench``: run (or resume) the grid, then write and print the tables and figures.

    ``--grid FILE`` goes to ``grid`` (:func:`fedhet.pages.grid_bench`, the layer above, which the
    command line passes), so that this module never imports the page writer built on it.
    """
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        index = argv.index("--")
        argv, extra = argv[:index], argv[index + 1 :]
    args = build_parser().parse_args(argv)
    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: run at least one job")
    if args.grid is not None or args.claims is not None:
        if "--seeds" in argv:
            raise ConfigError("--grid: the grid file holds the seeds; drop --seeds")
        if grid is None:
            raise ConfigError("--grid, --claims: run them as 'fedhet bench' (fedhet.pages writes the pages)")
        if args.claims is not None and (args.grid is not None or args.configs or args.settings or extra):
            raise ConfigError("--claims: give only the grid files whose claims to collect")
        if args.configs or args.settings or extra:
            raise ConfigError(
                "--grid: the grid file holds the configs, settings and flags; drop --configs, --set and '--'"
            )
        claims = None if args.claims is None else tuple(args.claims)
        request = PageRequest(args.grid, claims, args.out, args.jobs, args.threads, args.report_only, args.from_json,
                              args.ray_address)  # fmt: skip
        return grid(request, echo)
    for given, flag in ((args.from_json, "--from_json"), (args.ray_address, "--ray_address")):
        if given is not None:
            raise ConfigError(f"{flag}: give it with --grid FILE (the page's grid)")
    if not args.configs:
        raise ConfigError("the following arguments are required: --configs (or --grid FILE); see 'fedhet bench --help'")
    if args.out is None:
        raise ConfigError("the following arguments are required: --out; see 'fedhet bench --help'")
    for config in args.configs:
        if not Path(config).is_file():
            raise ConfigError(f"--configs {config}: no such file")
    settings = parse_settings(args.settings)
    cells = plan(args.configs, args.seeds, settings, extra)
    root: Path = args.out
    outcomes: list[CellOutcome] = []
    if not args.report_only:
        check_recorded(cells, root)
        validate_cells(cells, root)
        threads = args.threads or default_threads(args.jobs)
        echo(f"{len(cells)} cells ({len(args.configs)} configs x {len(settings)} settings x {len(args.seeds)} seeds), "
             f"{args.jobs} at a time, {threads} threads each")
        outcomes = run_cells(cells, root, args.jobs, env=child_environment(threads))
    complete = [c for c in cells if cell_state(c.run_dir(root)) == "complete"]
    if not complete:
        echo(f"no complete cell under {root}; nothing to tabulate")
        return 1
    text = write_report(complete, root, {n: shlex.join(f) for n, f in settings.items() if n})
    echo(text)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        echo(f"{len(failed)} of {len(cells)} cells failed (logs above); rerun the same command to retry them")
        return 1
    return 0


def write_report(cells: Sequence[Cell], root: Path, settings: dict[str, str] | None = None) -> str:
    """Tables (``bench.md``, ``bench.json``) and figures (``bench_{bars,curves}.png``) of the complete cells."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for cell in cells:
        runs.setdefault(cell.label, []).append(load_run(cell.run_dir(root)))
    results = aggregate(runs)
    kinds = list(dict.fromkeys(r["scenario_kind"] for r in results.values()))
    keys = [k for kind in kinds for k in headline_keys(kind)]
    text = f"## fedhet bench: {root}\n\n" + markdown_tables(results, settings)
    cells_json = [
        {"label": c.label, "config": c.config, "seed": c.seed, "flags": list(c.flags), "run_dir": str(c.run_dir(root))}
        for c in cells
    ]
    payload = {"std": "sample (n - 1)", "settings": settings or {}, "cells": cells_json, "results": results}
    atomic_write_text(root / "bench.json", json.dumps(payload, indent=1) + "\n")
    atomic_write_text(root / "bench.md", text)
    bars_png(root / "bench_bars.png", results, keys)
    series = {
        label: [[[r[k] for r in s["history"] if k in r] for k in keys] for s in summaries]
        for label, summaries in runs.items()
    }
    curves_png(root / "bench_curves.png", series, keys)
    return text + "\nFigures: bench_bars.png, bench_curves.png; all numbers: bench.json\n"
