"""Results pages from grid files: ``fedhet bench --grid configs/grids/<page>.yaml``.

A results page under ``docs/results/`` is one grid file: its rows (a config plus ``fedhet fit``
flags or dotted overrides), seeds, the tables and figures it shows, and the page's text with
placeholders for them. ``fedhet bench --grid FILE`` runs the missing cells (each a ``fedhet fit``
process, resumable, as every ``fedhet bench`` grid) and writes the page: ``<page>.md``,
``<page>.json`` (every run's tabulated numbers and per-round curves, and the tables) and one PNG
per figure. Why a file and not a script: every hyperparameter of a page is then in a config or in
the grid, reviewable in one place, and the page is reproduced by one command that it names.

Why ``--from_json``: a page's json keeps every run's numbers, so the page can be rewritten (new
text, another table layout) from its recorded runs without rerunning them or keeping their run
directories. A record is used only for the cell of the same label, seed, config and flags: the
numbers of runs made with other settings are refused rather than shown under this grid's rows.

The format is documented in ``docs/results_pages.md``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import re
import shlex
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fedhet.bench import (
    BLOCKS,
    CELL_COMMANDS,
    Cell,
    CellOutcome,
    CellQueue,
    PageRequest,
    bars_png,
    bench_command,
    cell_state,
    cell_text,
    check_recorded,
    child_environment,
    default_threads,
    last_log_line,
    last_mean,
    load_run,
    mean_std,
    override_flag,
    validate_cells,
)
from fedhet.errors import ConfigError
from fedhet.files import atomic_write_text
from fedhet.statistics import paired_difference
from fedhet.tuning import LOCAL_RUNNER, StudyResult, TuningPlan, parse_tuning, tune_rows

GRID_KEYS = {"title", "page", "out", "seeds", "flags", "rows", "tables", "figures", "template", "tuning", "claims",
             "selected", "extends", "only", "command"}
ROW_KEYS = {"label", "name", "config", "flags", "set", "seeds", "tune", "command"}
CLAIM_KEYS = {"claim", "paper", "better", "than", "metric", "than_metric"}
TABLE_KEYS = {"name", "rows", "block", "metrics", "digits", "label", "seeds_column", "seeds", "per_seed", "across",
              "outcomes"}
FIGURE_KEYS = {"name", "kind", "rows", "block", "metrics", "images", "seed"}
#: a block naming one federated round: ``round5/acc_global`` is the value logged at federated round 5
#: (the fifth step of ``metrics.jsonl`` outside phases; ``-`` when the run did not log it then)
ROUND_BLOCK = re.compile(r"round([1-9]\d*)")
#: the block of the last value ``metrics.jsonl`` holds of a metric: ``last/server/image_separation`` (the
#: summary's ``final`` block keeps the last evaluation's numbers, without the server's per-round metrics)
LAST_BLOCK = "last"
#: numbers of a run that belong to no block of ``summary.json``: bytes and time per run, and the seconds
#: per round its clients fitted and its server took (aggregate and refine: the round less fit and evaluation)
RUN_NUMBERS = ("mb_per_round", "wall_s", "fit_s_per_round", "server_s_per_round")
#: the summary's block of first rounds reaching a target (``federation.target_accuracy``; ``null``: never):
#: a column ``rounds_to_target/acc_server>=80``, shown with how many seeds never reached it
REACHED = "rounds_to_target"
#: sections of ``summary.json`` a column may read besides the blocks: rounds to a target, and the uploads that
#: ``on_invalid_upload: drop`` left out (``dropped_uploads/total``)
SECTIONS = (REACHED, "dropped_uploads")
PLACEHOLDER = re.compile(
    r"\{(title|command|json_command|seeds|missing|tuning|claims|budget|table:[\w.-]+|figure:[\w.-]+)\}"
)
ANY_PLACEHOLDER = re.compile(r"\{([a-z_]+(?::[^{}\s]*)?)\}")
#: the round a run was stopped in, from its one-line error ("client 3 got a non-finite training loss in round 7")
STOPPED_ROUND = re.compile(r"in round (\d+)")


@dataclass(frozen=True)
class Row:
    """One row of a page: a config and the ``fedhet fit`` flags it runs with."""

    label: str
    name: str
    config: str
    flags: tuple[str, ...]
    seeds: tuple[int, ...] | None = None  # None: the grid's seeds
    tune: bool = True  # searched by the grid's tuning stage (when it has one)
    command: str = "fit"  # the fedhet command of its cells: fit, or attack (FedMD-CG's gradient inversion)


@dataclass(frozen=True)
class Claim:
    """A claim of a paper checked on the page: ``better``'s metric above ``than``'s, paired over seeds.

    ``than_key`` compares with another number of the ``than`` row (the same row, even): "the class
    images are more separated at the last round than at the first" is ``last/x`` against ``round1/x``.
    """

    claim: str
    paper: str
    better: str
    than: str
    key: str  # block/metric of summary.json
    than_key: str | None = None  # None: ``key``

    @property
    def compared(self) -> str:
        """The metric column of the claims table: the key, or both keys when they differ."""
        return self.key if self.than_key is None else f"{self.key} vs {self.than_key}"

    @property
    def metric(self) -> str:
        return self.key.split("/", 1)[1]


@dataclass(frozen=True)
class Column:
    """One column of a table: a ``summary.json`` number (``block/metric``, or a run number) and its header."""

    key: str
    header: str
    digits: int | None = None  # None: the table's
    minus: str | None = None  # a row label: the column is the paired (same seed) difference to that row


@dataclass(frozen=True)
class Table:
    """One table of a page: the rows it shows and a column per number."""

    name: str
    rows: tuple[str, ...]
    columns: tuple[Column, ...]
    digits: int
    label: str
    seeds_column: bool
    seeds: tuple[int, ...] | None = None  # None: every seed of a row
    per_seed: bool = False  # each cell also lists the per-seed values, in seed order
    #: ``((prefix, header), ...)``: a pivot. ``rows`` are then label suffixes and each prefix is a group of
    #: columns: the cell of row ``r`` under prefix ``p`` is row ``p/r``'s (``b0.3/fedavg`` beside ``b0.6/fedavg``)
    across: tuple[tuple[str, str], ...] = ()
    #: not numbers but how each row's runs ended: completed, diverged (a non-finite loss or upload stopped the
    #: run; with its round) or failed, per seed, and a line counting the rows that completed every seed
    outcomes: bool = False

    def groups(self) -> tuple[tuple[str | None, str], ...]:
        """The column groups: each pivot prefix with its header, or one unnamed group."""
        return self.across or ((None, ""),)

    def labels(self, row: str) -> list[str]:
        """The grid row labels of one table row, one per column group."""
        return [row if prefix is None else f"{prefix}/{row}" for prefix, _ in self.groups()]

    def header(self, group: str, column: Column) -> str:
        """A column's header: its own, or in a pivot its group's (with the metric's when there are several)."""
        if not self.across:
            return column.header
        return group if len(self.columns) == 1 else f"{group}: {column.header}"


@dataclass(frozen=True)
class Figure:
    """One figure: bars of a block's values, per-round curves (mean over seeds) of some rows, or server images.

    An ``images`` figure draws the image batch ``images`` a server kept every round
    (:meth:`~fedhet.algorithms.base.ServerPhase.images`) in one row's run at ``seed``: a line per round.
    """

    name: str
    kind: str
    rows: tuple[str, ...]
    block: str
    metrics: tuple[str, ...]
    images: str = ""
    seed: int | None = None


@dataclass(frozen=True)
class Grid:
    """A parsed grid file (see the module docstring)."""

    path: str
    title: str
    page: Path
    out: Path
    seeds: tuple[int, ...]
    rows: tuple[Row, ...]
    tables: tuple[Table, ...]
    figures: tuple[Figure, ...]
    template: str
    tuning: TuningPlan | None = None
    claims: tuple[Claim, ...] = ()
    selected: Path = Path("configs/selected")

    def tuned(self, row: Row) -> bool:
        return self.tuning is not None and row.tune

    def names(self, shown: Iterable[str] | None = None) -> dict[str, str]:
        """Every row's name on the page, by label; a name two ``shown`` rows share (default: all) gets its label.

        One method often stands in several rows (FedVTC at Dir(0.1) and at Dir(1.0)): a list of
        every row, a claim's "rows compared" or a figure's legend would otherwise not say which row
        a line is (a legend would even merge the two), while a table of one setting keeps the names plain.
        """
        shown = {r.label for r in self.rows} if shown is None else set(shown)
        counts = Counter(r.name for r in self.rows if r.label in shown)
        return {r.label: r.name if counts[r.name] < 2 else f"{r.name} ({r.label})" for r in self.rows}

    def selected_config(self, row: Row) -> Path:
        """Where the tuning stage writes a tuned row's selected config (its seeds run it)."""
        return self.selected / f"{row.label}.yaml"

    def cells(self) -> list[Cell]:
        """Every (row, seed) cell, seed-major as :func:`fedhet.bench.plan`; a tuned row runs its selected config.

        A tuned row's runs are tagged with a digest of the selected config, so that runs or records
        of an earlier selection (another trial budget, another search space) are refused, not mixed in.
        """
        return [
            Cell(row.label, str(self.selected_config(row)), seed, self.selection_tag(row)) if self.tuned(row)
            else Cell(row.label, row.config, seed, row.flags, row.command)
            for seed in self.seeds
            for row in self.rows
            if row.seeds is None or seed in row.seeds
        ]  # fmt: skip

    def selection_tag(self, row: Row) -> tuple[str, ...]:
        path = self.selected_config(row)
        if not path.is_file():
            return ()
        return (f"--wandb.tags=[selected-{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}]",)

    def command(self) -> str:
        """The one command that reruns the missing cells and rewrites the page."""
        return f"fedhet bench --grid {self.path}"

    def continue_command(self) -> str:
        """The command that runs the cells the page's json lacks, then rewrites the page."""
        return f"fedhet bench --grid {self.path} --from_json {self.page.with_suffix('.json')}"

    def json_command(self) -> str:
        """The command that rewrites the page from its recorded runs alone: it runs nothing."""
        return f"{self.continue_command()} --report_only"

    def keys(self) -> list[str]:
        """Every number a run record keeps: the tables' and figures' ``block/metric`` keys, then the run numbers."""
        keys = [c.key for t in self.tables for c in t.columns]
        keys += [f"{f.block}/{m}" for f in self.figures if f.kind == "bars" for m in f.metrics]
        keys += [k for c in self.claims for k in (c.key, c.than_key) if k is not None]
        return list(dict.fromkeys([*keys, *RUN_NUMBERS]))

    def curve_metrics(self) -> list[str]:
        """The per-round metrics a run record keeps (every tabulated or plotted metric)."""
        names = [k.split("/", 1)[1] for k in self.keys() if "/" in k and not k.startswith(f"{REACHED}/")]
        names += [m for f in self.figures if f.kind != "images" for m in f.metrics]
        return list(dict.fromkeys(names))


# ---------------------------------------------------------------------------------------------- parsing
def _fail(where: str, message: str) -> ConfigError:
    return ConfigError(f"{where}: {message}")


def _keys(where: str, entry: Any, known: set[str], required: Sequence[str]) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise _fail(where, f"write a mapping with the keys {', '.join(sorted(known))}")
    unknown = sorted(set(entry) - known)
    if unknown:
        raise _fail(where, f"unknown key '{unknown[0]}'; known keys: {', '.join(sorted(known))}")
    missing = [k for k in required if k not in entry]
    if missing:
        raise _fail(where, f"missing key '{missing[0]}'")
    return entry


def _flags(where: str, value: Any) -> tuple[str, ...]:
    """``flags``: a list of ``fedhet fit`` flags or one shell-quoted string."""
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(shlex.split(value))
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        return tuple(str(v) for v in value)
    raise _fail(where, "flags: write a list of fedhet fit flags, e.g. ['--rounds=10']")


def _seeds(where: str, seeds: Any) -> tuple[int, ...]:
    integers = isinstance(seeds, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
    if not seeds or not integers:
        raise _fail(where, "seeds: write a non-empty list of integers, e.g. [0, 1, 2]")
    return tuple(seeds)


def _rows(
    where: str, entry: Any, flags: tuple[str, ...], grid_seeds: tuple[int, ...], command: str = "fit"
) -> list[Row]:
    """One ``rows:`` entry; a ``config`` with a wildcard is one row per matching file, labelled ``<label>/<stem>``.

    Why: a page over every shipped config of a folder (``config: configs/experiments/digits/*.yaml``) lists
    them once, and a config added to the folder joins the page without an edit.
    """
    entry = _keys(where, entry, ROW_KEYS, ("label", "config"))
    pattern = str(entry["config"])
    if not any(char in pattern for char in "*?["):
        return [_row(where, entry, flags, grid_seeds, command)]
    if "name" in entry:
        raise _fail(where, "name: a row with a wildcard config is named after each file; leave name out")
    matches = [Path(match) for match in sorted(glob.glob(pattern))]
    if not matches:
        raise _fail(where, f"config {pattern}: no file matches (paths are relative to the repository root)")
    return [_row(where, {**entry, "label": f"{entry['label']}/{path.stem}", "config": str(path)}, flags, grid_seeds,
                 command) for path in matches]  # fmt: skip


def _command(where: str, command: Any) -> str:
    """``command``: the fedhet command a row's cells run (``fit``, or ``attack``: :mod:`fedhet.privacy.command`)."""
    if command not in CELL_COMMANDS:
        raise _fail(where, f"command {command!r}: use one of {', '.join(CELL_COMMANDS)} (the fedhet command of a cell)")
    return str(command)


def _row(where: str, entry: Any, flags: tuple[str, ...], grid_seeds: tuple[int, ...], command: str = "fit") -> Row:
    entry = _keys(where, entry, ROW_KEYS, ("label", "config"))
    label = str(entry["label"])
    if not re.fullmatch(r"[\w.+-]+(/[\w.+-]+)*", label):
        raise _fail(where, f"label {label!r}: use letters, digits, '._+-' and '/' (it is the run's directory)")
    overrides = entry.get("set") or {}
    if not isinstance(overrides, dict):
        raise _fail(where, "set: write a mapping of dotted keys to values, e.g. {method.init_args.lr: 0.1}")
    row_flags = (*flags, *(override_flag(k, v) for k, v in overrides.items()), *_flags(where, entry.get("flags")))
    seeds = None if "seeds" not in entry else _seeds(where, entry["seeds"])
    if seeds is not None and not set(seeds) <= set(grid_seeds):
        raise _fail(where, f"seeds {list(seeds)}: a row runs some of the grid's seeds {list(grid_seeds)}, not others")
    tune = entry.get("tune", True)
    if not isinstance(tune, bool):
        raise _fail(where, f"tune: {tune!r}: write true (searched by the grid's tuning stage) or false")
    command = _command(where, entry.get("command", command))
    return Row(label, str(entry.get("name", label)), str(entry["config"]), row_flags, seeds, tune, command)


def _claim(where: str, entry: Any, labels: Sequence[str]) -> Claim:
    """One ``claims:`` entry, ``{claim, paper, better, than, metric, than_metric}`` (``acc_local``, ``round1/x``)."""
    entry = _keys(where, entry, CLAIM_KEYS, ("claim", "better", "than", "metric"))
    for key in ("better", "than"):
        if entry[key] not in labels:
            raise _fail(where, f"{key}: no row labelled {entry[key]!r}")

    def key_of(metric: Any) -> str:
        return str(metric) if is_block(str(metric).split("/", 1)[0]) else f"final/{metric}"

    key = key_of(entry["metric"])
    than_key = None if entry.get("than_metric") is None else key_of(entry["than_metric"])
    if entry["better"] == entry["than"] and than_key in (None, key):
        raise _fail(where, "a row compared with itself needs another number: add than_metric (e.g. round1/acc_local)")
    return Claim(str(entry["claim"]), str(entry.get("paper", "")), str(entry["better"]), str(entry["than"]), key,
                 than_key)  # fmt: skip


def _across(
    where: str, entry: dict[str, Any], labels: Sequence[str]
) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """A pivot's ``across: {prefix: header}`` and the row suffixes it can show (those some prefix has)."""
    across = entry.get("across")
    if across is None:
        return (), tuple(labels)
    if not isinstance(across, dict) or not across:
        raise _fail(where, "across: write a mapping {label prefix: column header}, e.g. {b0.3: beta 0.3}")
    prefixes = {str(p) for p in across}
    suffixes = [label.split("/", 1)[1] for label in labels if "/" in label and label.split("/", 1)[0] in prefixes]
    if not suffixes:
        raise _fail(where, f"across: no row label starts with {' or '.join(sorted(prefixes))} and '/'")
    return tuple((str(p), str(h)) for p, h in across.items()), tuple(dict.fromkeys(suffixes))


def _rows_of(where: str, entry: dict[str, Any], labels: Sequence[str]) -> tuple[str, ...]:
    rows = entry.get("rows")
    if rows is None:
        return tuple(labels)
    if not isinstance(rows, list):
        raise _fail(where, "rows: write a list of row labels")
    for label in rows:
        if label not in labels:
            raise _fail(where, f"rows: no row labelled {label!r}; rows: {', '.join(labels)}")
    return tuple(rows)


def is_block(name: Any) -> bool:
    """A block of ``summary.json`` (``final``, ``last3`` ...), one federated round (``round5``) or ``last``."""
    return name in BLOCKS or name == LAST_BLOCK or (isinstance(name, str) and ROUND_BLOCK.fullmatch(name) is not None)


def _block(where: str, block: Any) -> str:
    if not is_block(block):
        known = ", ".join(BLOCKS)
        raise _fail(where, f"block {block!r}: use one of {known}, last or roundN (the value at federated round N)")
    return str(block)


def _columns(where: str, metrics: Any, block: str, labels: Sequence[str] = ()) -> tuple[Column, ...]:
    """``metrics``: names (``acc_local``, ``final/acc_local``, ``mb_per_round``) or mappings ``{name: header}``.

    A name whose first part is not a block (``domain/mnist/acc_intra``) is a metric of the table's block.

    A header may be a mapping ``{header: ..., digits: N, minus: ROW}``: other digits (wall time), or the
    paired difference to another row of the same seed (a gain over a baseline; ``-`` in the baseline's row).
    """
    if not isinstance(metrics, list) or not metrics:
        raise _fail(where, "metrics: write a non-empty list, e.g. [acc_local, {acc_server: G.acc}]")
    columns = []
    for metric in metrics:
        if isinstance(metric, dict) and len(metric) == 1:
            (name, header), = metric.items()
        elif isinstance(metric, str):
            name, header = metric, metric
        else:
            raise _fail(where, f"metrics: {metric!r} is neither a name nor a one-key mapping {{name: header}}")
        digits, minus = None, None
        if isinstance(header, dict):
            if set(header) - {"header", "digits", "minus"} or not isinstance(header.get("digits", 0), int):
                raise _fail(where, f"metrics: {name}: write {{header: TEXT, digits: N, minus: ROW}}")
            minus = header.get("minus")
            if minus is not None and minus not in labels:
                raise _fail(where, f"metrics: {name}: minus: no row labelled {minus!r}")
            header, digits = header.get("header", name), header.get("digits")
        if name in RUN_NUMBERS:
            key = name
        elif is_block(name.split("/", 1)[0]) or name.split("/", 1)[0] in SECTIONS:  # final/acc_local, round5/..
            key = name
        else:
            key = f"{block}/{name}"
        columns.append(Column(key, str(header), digits, minus))
    return tuple(columns)


def _grid_data(path: str | Path, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """A grid file's mapping, with ``extends: OTHER.yaml`` resolved: the other grid's keys, this file's on top.

    Why: a tuned page reruns the rows, claims and tables of an untuned one with a tuning stage and other
    seeds; extending it keeps every row written once (``fedftg_tuned.yaml`` extends ``fedftg_mnist.yaml``).
    A key this file sets replaces the other's whole (``rows``, ``tables`` ... are not merged item by item).
    """
    import yaml

    where = str(path)
    try:
        text = Path(path).read_text()
    except OSError:
        raise ConfigError(f"{seen[-1]}: extends: no such file {path}" if seen else f"--grid {path}: no such file") \
            from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise _fail(where, f"not valid YAML{line}: {getattr(exc, 'problem', exc)}") from None
    data = _keys(where, data, GRID_KEYS, ())
    if "extends" not in data:
        return data
    base = str(data.pop("extends"))
    missing = [key for key in ("page", "out") if key not in data]
    if missing:
        raise _fail(where, f"extends: name this grid's own {missing[0]} (the other grid's would be overwritten)")
    if base in (*seen, where):
        raise _fail(where, f"extends: {base} extends this file again (a cycle)")
    return {**_grid_data(base, (*seen, where)), **data}


def parse_grid(path: str | Path) -> Grid:
    """Read and check a grid file; every mistake is one :class:`ConfigError` line naming the file and the key."""
    where = str(path)
    data = _keys(where, _grid_data(path), GRID_KEYS, ("title", "page", "rows", "tables", "template"))
    seeds = _seeds(where, data.get("seeds", [0]))
    flags = _flags(where, data.get("flags"))
    if not isinstance(data["rows"], list) or not data["rows"]:
        raise _fail(where, "rows: write a non-empty list of {label, config, flags, set}")
    command = _command(where, data.get("command", "fit"))
    rows = tuple(row for i, entry in enumerate(data["rows"])
                 for row in _rows(f"{where}: rows[{i}]", entry, flags, seeds, command))  # fmt: skip
    labels = [r.label for r in rows]
    duplicate = next((label for label in labels if labels.count(label) > 1), None)
    if duplicate:
        raise _fail(where, f"rows: the label {duplicate!r} is used twice")
    if not isinstance(data["tables"], list) or not data["tables"]:
        raise _fail(where, "tables: write a non-empty list of {name, block, metrics, rows}")
    tables = []
    for i, entry in enumerate(data["tables"]):
        at = f"{where}: tables[{i}]"
        outcomes = entry.get("outcomes", False)
        if not isinstance(outcomes, bool):
            raise _fail(at, f"outcomes: {outcomes!r}: write true (how each row's runs ended) or false")
        entry = _keys(at, entry, TABLE_KEYS, ("name",) if outcomes else ("name", "metrics"))
        if outcomes and ("metrics" in entry or "across" in entry):
            raise _fail(at, "outcomes: an outcome table has its own columns; leave metrics and across out")
        block = _block(at, entry.get("block", "final"))
        across, shown = _across(at, entry, labels)  # a pivot's rows and minus name label suffixes
        columns = () if outcomes else _columns(at, entry["metrics"], block, shown)
        tables.append(Table(
            str(entry["name"]), _rows_of(at, entry, shown), columns,
            int(entry.get("digits", 2)), str(entry.get("label", "method")), bool(entry.get("seeds_column", False)),
            None if "seeds" not in entry else _seeds(at, entry["seeds"]), bool(entry.get("per_seed", False)), across,
            outcomes,
        ))  # fmt: skip
    figures = []
    for i, entry in enumerate(data.get("figures") or []):
        at = f"{where}: figures[{i}]"
        entry = _keys(at, entry, FIGURE_KEYS, ("name", "kind"))
        if entry["kind"] not in ("bars", "curves", "images"):
            raise _fail(at, f"kind {entry['kind']!r}: use bars (a block's values), curves (per-round values) or "
                            "images (a server's images by round, in one row's run)")  # fmt: skip
        if entry["kind"] == "images":
            figures.append(_images_figure(at, entry, labels, seeds))
            continue
        metrics = entry.get("metrics")
        if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) for m in metrics):
            raise _fail(at, "metrics: write a non-empty list of metric names")
        figures.append(Figure(str(entry["name"]), entry["kind"], _rows_of(at, entry, labels),
                              _block(at, entry.get("block", "final")), tuple(metrics)))  # fmt: skip
    names = [t.name for t in tables] + [f.name for f in figures]
    template = data["template"]
    if not isinstance(template, str):
        raise _fail(where, "template: write the page's Markdown as a string (a YAML block: 'template: |')")
    for match in ANY_PLACEHOLDER.finditer(template):
        token = match.group(1)
        if not PLACEHOLDER.fullmatch(match.group(0)) and (":" in token or token in ("table", "figure")):
            raise _fail(where, f"template: unknown placeholder {{{token}}}; use {{table:NAME}}, {{figure:NAME}}, "
                               "{title}, {command}, {json_command}, {seeds} or {missing}")  # fmt: skip
        kind, _, name = token.partition(":")
        if kind == "table" and name not in [t.name for t in tables]:
            known = ", ".join(t.name for t in tables)
            raise _fail(where, f"template: {{table:{name}}} names no table; tables: {known}")
        if kind == "figure" and name not in [f.name for f in figures]:
            raise _fail(where, f"template: {{figure:{name}}} names no figure; figures: "
                               f"{', '.join(f.name for f in figures) or 'none'}")  # fmt: skip
    if "{command}" not in template:
        raise _fail(where, "template: name the page's command with the {command} placeholder")
    if data.get("tuning") is not None and any(row.command != "fit" for row in rows):
        raise _fail(where, "tuning: the tuning stage trains fedhet fit runs; a grid with fedhet attack cells has "
                           "none, remove the tuning block")  # fmt: skip
    tuning = parse_tuning(where, data["tuning"]) if data.get("tuning") is not None else None
    claims = tuple(_claim(f"{where}: claims[{i}]", c, labels) for i, c in enumerate(data.get("claims") or []))
    for placeholder, needed in (("{tuning}", tuning is not None), ("{budget}", tuning is not None),
                                ("{claims}", bool(claims))):  # fmt: skip
        if needed and placeholder not in template:
            raise _fail(where, f"template: a grid with {placeholder[1:-1]} shows it: add the {placeholder} placeholder")
    if len(set(names)) < len(names):
        raise _fail(where, "tables and figures: two have the same name")
    page = Path(str(data["page"]))
    if page.suffix != ".md":
        raise _fail(where, f"page {page}: name the Markdown file, e.g. docs/results/{Path(where).stem}.md")
    out = Path(str(data.get("out", f"runs/grids/{Path(where).stem}")))
    selected = Path(str(data.get("selected", f"configs/selected/{Path(where).stem}")))
    grid = Grid(where, str(data["title"]), page, out, tuple(seeds), rows, tuple(tables), tuple(figures), template,
                tuning, claims, selected)  # fmt: skip
    return grid if data.get("only") is None else _only(where, grid, data["only"])


def _images_figure(where: str, entry: dict[str, Any], labels: Sequence[str], seeds: Sequence[int]) -> Figure:
    """``{name, kind: images, images: NAME, rows: [ONE_ROW], seed: S}`` (seed: the grid's first)."""
    rows = _rows_of(where, entry, labels)
    if len(rows) != 1 or "images" not in entry:
        raise _fail(where, "an images figure names one row and the server's image batch: "
                           "{kind: images, images: class_images, rows: [LABEL], seed: 0}")  # fmt: skip
    seed = entry.get("seed", seeds[0] if seeds else 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise _fail(where, f"seed: {seed!r}: write one integer seed of the grid")
    return Figure(str(entry["name"]), "images", rows, "final", (), str(entry["images"]), seed)


def _only(where: str, grid: Grid, only: Any) -> Grid:
    """``only: [LABEL, ...]``: the grid with these rows alone (an extending grid runs part of another's rows).

    Tables and figures keep the rows that remain (a pivot the suffixes some remaining row has); a claim
    about a row that is gone is dropped with it.
    """
    if not isinstance(only, list) or not only:
        raise _fail(where, "only: write a non-empty list of row labels")
    labels = {r.label for r in grid.rows}
    unknown = next((label for label in only if label not in labels), None)
    if unknown is not None:
        raise _fail(where, f"only: no row labelled {unknown!r}")
    kept = set(only)
    tables = tuple(replace(t, rows=tuple(r for r in t.rows if kept & set(t.labels(r)))) for t in grid.tables)
    figures = tuple(replace(f, rows=tuple(r for r in f.rows if r in kept)) for f in grid.figures)
    claims = tuple(c for c in grid.claims if c.better in kept and c.than in kept)
    return replace(grid, rows=tuple(r for r in grid.rows if r.label in kept), tables=tables, figures=figures,
                   claims=claims)


# ---------------------------------------------------------------------------------------------- run records
def record_of(cell: Cell, summary: dict[str, Any], grid: Grid) -> dict[str, Any]:
    """A run's entry of the page json: its cell, its tabulated numbers and its per-round curves.

    ``last3`` falls back to the mean of the last 3 rounds of ``metrics.jsonl`` when ``summary.json``
    has no ``last3`` value of that metric (a metric logged only per round). A metric the run does
    not report (``acc_server`` of a method without a server model) is left out, shown as ``-``.
    """
    values: dict[str, float] = {}
    unreached = []
    history = summary.get("history", [])
    timed = [r for r in history if "time/round_s" in r]
    for key in grid.keys():
        if key == "mb_per_round":  # a run that is not federated (fedhet attack) has no communication
            comm = summary.get("comm")
            value: Any = None if comm is None else (comm["bytes_up_per_round"] + comm["bytes_down_per_round"]) / 1e6
        elif key == "wall_s":
            value = summary.get("wall_s")
        elif key == "fit_s_per_round":
            value = sum(r["time/fit_s"] for r in timed) / len(timed) if timed else None
        elif key == "server_s_per_round":
            server_s = [r["time/round_s"] - r["time/fit_s"] - r["time/eval_s"] for r in timed]
            value = sum(server_s) / len(server_s) if timed else None
        else:
            block, metric = key.split("/", 1)
            at_round = ROUND_BLOCK.fullmatch(block)
            if at_round:
                value = value_at_round(history, int(at_round.group(1)), metric)
            elif block == LAST_BLOCK:
                value = next((r[metric] for r in reversed(history) if metric in r), None)
            else:
                value = summary.get(block, {}).get(metric)
            if value is None and block == "last3":
                value = last_mean(history, metric)
            if value is None and block == REACHED and metric in summary.get(REACHED, {}):
                unreached.append(key)  # the run tracked the target and never reached it
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            values[key] = float(value)
    curves = {m: [r[m] for r in history if isinstance(r.get(m), (int, float))] for m in grid.curve_metrics()}
    return {
        "label": cell.label, "config": cell.config, "config_sha256": config_digest(cell.config), "seed": cell.seed,
        "flags": list(cell.flags), **({"command": cell.command_name} if cell.command_name != "fit" else {}),
        "method": summary.get("method"), "values": values,
        "curves": {m: c for m, c in curves.items() if c},
        **({"unreached": unreached} if unreached else {}),
        **({"environment": summary["environment"]} if "environment" in summary else {}),
    }  # fmt: skip


def value_at_round(history: Sequence[dict[str, Any]], federated_round: int, metric: str) -> Any:
    """``metric`` at federated round ``federated_round`` (1-based; steps of a phase do not count), or None."""
    rounds = [r for r in history if "phase" not in r]
    return rounds[federated_round - 1].get(metric) if federated_round <= len(rounds) else None


def config_digest(config: str) -> str | None:
    """The SHA-256 of a config file's values as they are now (``None`` when it is gone or not YAML).

    The YAML's data, not its bytes: a comment or a reformatting changes no run, a changed value does.
    """
    import yaml

    try:
        data = yaml.safe_load(Path(config).read_text())
    except (OSError, yaml.YAMLError):
        return None
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def records_from_json(path: Path, cells: Sequence[Cell]) -> dict[tuple[str, int], dict[str, Any]]:
    """The recorded runs of a page json that are cells of this grid, by (label, seed).

    A record of a planned label and seed that was made with another config or other flags is
    refused: its numbers are not this grid's. A record whose config file has changed since (its
    ``config_sha256`` is not the file's now) is left out, so the cell runs again with the config as
    it is; records written before digests were kept have none and are used as they are.
    """
    try:
        payload = json.loads(Path(path).read_text())
    except OSError:
        raise ConfigError(f"--from_json {path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--from_json {path}: not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("runs"), list):
        raise ConfigError(f"--from_json {path}: no 'runs' list; give the .json a grid page was written with")
    planned = {(c.label, c.seed): c for c in cells}
    records = {}
    for record in payload["runs"]:
        cell = planned.get((record.get("label"), record.get("seed")))
        if cell is None:
            continue
        same_command = record.get("command", "fit") == cell.command_name
        if record.get("config") != cell.config or list(record.get("flags", [])) != list(cell.flags) or not same_command:
            raise ConfigError(
                f"--from_json {path}: {cell.label} seed {cell.seed} was run with "
                f"{'' if same_command else 'fedhet ' + str(record.get('command', 'fit')) + ' '}{record.get('config')} "
                f"{' '.join(record.get('flags', []))}, not as the grid says; rerun it or fix the grid"
            )
        if record.get("config_sha256") not in (None, config_digest(cell.config)):
            continue  # the config changed after this run: rerun the cell
        records[cell.label, cell.seed] = record
    return records


def failures_from_json(path: Path, cells: Sequence[Cell]) -> dict[tuple[str, int], str]:
    """The one-line errors a page json recorded for cells of this grid that have no numbers (same config, flags).

    A failed cell still runs again unless ``--report_only``; the recorded line shows where it is not rerun.
    """
    try:
        failed = json.loads(Path(path).read_text()).get("failed") or []
    except (OSError, json.JSONDecodeError, AttributeError):
        return {}  # records_from_json names the problem
    planned = {(c.label, c.seed): c for c in cells}
    found = {}
    for entry in failed:
        cell = planned.get((entry.get("label"), entry.get("seed")))
        same = cell is not None and entry.get("config") == cell.config and entry.get("flags", []) == list(cell.flags) \
            and entry.get("command", "fit") == cell.command_name
        if same and entry.get("config_sha256") == config_digest(cell.config):
            found[cell.label, cell.seed] = str(entry.get("message", ""))
    return found


def studies_from_json(path: Path) -> dict[str, dict[str, Any]]:
    """The tuning studies a page json recorded (rows whose selection need not be rerun)."""
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # records_from_json names the problem
    return dict(((payload.get("tuning") or {}).get("rows")) or {})


def studies_threads(path: Path | None) -> int | None:
    """The threads per run a page json recorded (its cost line), if any."""
    if path is None:
        return None
    try:
        return (json.loads(Path(path).read_text()).get("tuning") or {}).get("threads")
    except (OSError, json.JSONDecodeError):
        return None


# ---------------------------------------------------------------------------------------------- the page
def table_stats(records: Sequence[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """Mean, sample std, n and per-seed values of one number over a row's records (None: no record has it)."""
    return stats([r["values"][key] for r in records if key in r["values"]])


def stats(values: Sequence[float]) -> dict[str, Any] | None:
    """Mean, sample std, n and the values (None: no value)."""
    values = list(values)
    if not values:
        return None
    mean, std = mean_std(values)
    return {"mean": round(mean, 4), "std": round(std, 4), "n": len(values), "values": values}


def of_seeds(table: Table, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records a table shows: all, or those of its ``seeds``."""
    return [r for r in records if table.seeds is None or r["seed"] in table.seeds]


def column_values(
    column: Column,
    records: Sequence[dict[str, Any]],
    by_row: dict[str, list[dict[str, Any]]],
    label: str,
    prefix: str | None = None,
) -> list[float]:
    """A column's numbers over a row's records; with ``minus``, each minus the other row's at the same seed.

    In a pivot's column group ``prefix``, ``minus`` names a row of the same group (``prefix/minus``).
    """
    values = {r["seed"]: r["values"][column.key] for r in records if column.key in r["values"]}
    if column.minus is None:
        return list(values.values())
    minus = column.minus if prefix is None else f"{prefix}/{column.minus}"
    if label == minus:
        return []
    base = {r["seed"]: r["values"][column.key] for r in by_row.get(minus, []) if column.key in r["values"]}
    return [value - base[seed] for seed, value in values.items() if seed in base]


def markdown_table(table: Table, grid: Grid, by_row: dict[str, list[dict[str, Any]]]) -> str:
    """One table: a line per row that has records, ``mean ± std`` over seeds (one seed: the value)."""
    names = grid.names(table.labels(row)[0] for row in table.rows)
    columns = [table.header(group, column) for _, group in table.groups() for column in table.columns]
    header = [table.label, *(["seeds"] if table.seeds_column else []), *columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in table.rows:
        shown = [(label, of_seeds(table, by_row.get(label, []))) for label in table.labels(row)]
        if not any(records for _, records in shown):
            continue
        cells = []
        for (prefix, _), (label, records) in zip(table.groups(), shown, strict=True):
            for column in table.columns:
                values = column_values(column, records, by_row, label, prefix)
                digits = table.digits if column.digits is None else column.digits
                text = cell_text(values, digits)
                if table.per_seed and len(values) > 1:
                    text += " (" + ", ".join(f"{v:.{digits}f}" for v in values) + ")"
                never = sum(column.key in r.get("unreached", ()) for r in records) if column.minus is None else 0
                if never:
                    text = "never" if not values else f"{text} ({never} of {len(records)} never)"
                cells.append(text)
        first = next((label, records) for label, records in shown if records)
        seeds = [", ".join(str(r["seed"]) for r in first[1])] if table.seeds_column else []
        lines.append("| " + " | ".join([names[first[0]], *seeds, *cells]) + " |")
    return "\n".join(lines)


def outcomes_of(
    table: Table, grid: Grid, records: dict[tuple[str, int], dict[str, Any]], failures: dict[tuple[str, int], str]
) -> dict[str, dict[str, Any]]:
    """How each run of an outcome table's rows ended, by row label.

    ``completed``: seeds with a recorded run; ``diverged``: seed -> the round a non-finite training loss or
    upload stopped it in (``None`` when its error names none); ``failed``: seed -> its one-line error;
    ``not_run``: seeds with neither a record nor an error.
    """
    result: dict[str, dict[str, Any]] = {}
    for label in table.rows:
        ended: dict[str, Any] = {"completed": [], "diverged": {}, "failed": {}, "not_run": []}
        for cell in grid.cells():
            if cell.label != label or (table.seeds is not None and cell.seed not in table.seeds):
                continue
            line = failures.get((cell.label, cell.seed))
            if (cell.label, cell.seed) in records:
                ended["completed"].append(cell.seed)
            elif line and "non-finite" in line:
                stopped = STOPPED_ROUND.search(line)
                ended["diverged"][cell.seed] = int(stopped.group(1)) if stopped else None
            elif line:
                ended["failed"][cell.seed] = line
            else:
                ended["not_run"].append(cell.seed)
        result[label] = ended
    return result


def outcome_table(table: Table, grid: Grid, ended: dict[str, dict[str, Any]]) -> str:
    """An outcome table: per row the seeds run, how many completed, which diverged (and when) or failed.

    Then one line counting the rows that completed every seed (a divergence at any seed is a finding, not noise).
    """
    names = grid.names(ended)
    lines = [f"| {table.label} | seeds run | completed | diverged (seed: round) | failed (seed) |",
             "|---|---|---|---|---|"]  # fmt: skip
    complete, broken, unfinished = [], [], []
    for label, runs in ended.items():
        run = sorted([*runs["completed"], *runs["diverged"], *runs["failed"]])
        planned = len(run) + len(runs["not_run"])
        diverged = ", ".join(f"{seed}: {'?' if r is None else r}" for seed, r in sorted(runs["diverged"].items()))
        failed = ", ".join(str(seed) for seed in sorted(runs["failed"]))
        shown = ", ".join(map(str, run)) if run else "not run"
        lines.append(f"| {names[label]} | {shown} | {len(runs['completed'])} of {planned} | {diverged or '-'} | "
                     f"{failed or '-'} |")  # fmt: skip
        if runs["diverged"] or runs["failed"]:
            broken.append(names[label])
        elif runs["not_run"]:
            unfinished.append(names[label])
        else:
            complete.append(names[label])
    lines += ["", f"Completed at every seed: **{len(complete)} of {len(ended)}** rows; diverged or failed at some "
                  f"seed: {', '.join(broken) or 'none'}; not yet run at every seed: {', '.join(unfinished) or 'none'}."]
    return "\n".join(lines)


def figure_path(grid: Grid, figure: Figure) -> Path:
    """``<page stem>_<figure name>.png`` beside the page."""
    return grid.page.with_name(f"{grid.page.stem}_{figure.name}.png")


def draw_figure(grid: Grid, figure: Figure, by_row: dict[str, list[dict[str, Any]]]) -> bool:
    """Write one figure; False (and no file) when no run has its numbers (records without curves)."""
    from fedhet.bench import curves_png

    if figure.kind == "images":
        return draw_images_figure(grid, figure)
    names = grid.names(figure.rows)
    rows = [label for label in figure.rows if by_row.get(label)]
    if figure.kind == "curves":
        series = {names[label]: [[r.get("curves", {}).get(m, []) for m in figure.metrics] for r in by_row[label]]
                  for label in rows}  # fmt: skip
        if not any(c for per_seed in series.values() for curves in per_seed for c in curves):
            return False
        curves_png(figure_path(grid, figure), series, figure.metrics)
        return True
    results = {
        names[label]: {"metrics": {f"{figure.block}/{m}": table_stats(by_row[label], f"{figure.block}/{m}")
                                   for m in figure.metrics}}
        for label in rows
    }  # fmt: skip
    if not any(s for entry in results.values() for s in entry["metrics"].values()):
        return False
    bars_png(figure_path(grid, figure), results, figure.metrics, figure.block)
    return True


def draw_images_figure(grid: Grid, figure: Figure) -> bool:
    """Draw a server's kept images from the row's run directory; a figure drawn before stays when ``runs/`` is gone."""
    from fedhet.tracking.figures import IMAGES_DIR, images_figure, load_round_images

    cell = next((c for c in grid.cells() if c.label in figure.rows[:1] and c.seed == figure.seed), None)
    kept = None if cell is None else cell.run_dir(grid.out) / IMAGES_DIR / f"{figure.images}.pt"
    path = figure_path(grid, figure)
    if kept is not None and kept.is_file() and cell_state(cell.run_dir(grid.out)) == "complete":
        name = next(r.name for r in grid.rows if r.label == figure.rows[0])
        images_figure(load_round_images(kept), path, f"{name}, seed {figure.seed}: {figure.images} by round "
                                                    "(columns: the image index)")  # fmt: skip
        return True
    return path.is_file()


def claim_results(grid: Grid, by_row: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each declared claim with its paired difference over seeds and the verdict computed from it."""
    results = []
    for claim in grid.claims:
        better, than = ({r["seed"]: r["values"][key] for r in by_row.get(label, []) if key in r["values"]}
                        for label, key in ((claim.better, claim.key), (claim.than, claim.than_key or claim.key)))
        difference = paired_difference(better, than)
        results.append({"claim": claim.claim, "paper": claim.paper, "better": claim.better, "than": claim.than,
                        "metric": claim.compared, **difference.as_dict()})  # fmt: skip
    return results


def claims_markdown(results: Sequence[dict[str, Any]], names: dict[str, str]) -> str:
    """The claims table: paired difference (mean and 95 % t interval over seeds), per-seed values and tally, verdict."""
    lines = ["| claim | paper | rows compared | metric | difference, 95 % interval | per seed | won | verdict |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        n = len(r["seeds"])
        if n == 0:
            interval = "no paired seeds"
        elif n == 1:
            interval = f"{r['mean']:+.2f} (one seed: no interval)"
        else:
            interval = f"{r['mean']:+.2f} [{r['low']:+.2f}, {r['high']:+.2f}]"
        per_seed = ", ".join(f"{d:+.2f}" for d in r["differences"]) or "-"
        rows = f"{names.get(r['better'], r['better'])} vs {names.get(r['than'], r['than'])}"
        lines.append(f"| {r['claim']} | {r['paper'] or '-'} | {rows} | {r['metric']} | {interval} | {per_seed} "
                     f"| {r['wins']}/{n} | **{r['verdict']}** |")  # fmt: skip
    return "\n".join(lines)


def tuning_markdown(grid: Grid, studies: dict[str, dict[str, Any]]) -> str:
    """Per tuned row: what was searched, the trials, the selected values and their validation score."""
    assert grid.tuning is not None
    names = grid.names()
    metric = f"val/{grid.tuning.metric}"
    lines = [f"| row | searched | trials (complete / pruned / failed) | selected {metric} | selected values |",
             "|---|---|---|---|---|"]  # fmt: skip
    for row in grid.rows:
        if not grid.tuned(row):
            continue
        study = studies.get(row.label)
        if study is None:
            lines.append(f"| {names[row.label]} | (not tuned yet) | - | - | - |")
            continue
        states = [t["state"] for t in study["trials"]]
        counts = " / ".join(str(states.count(s)) for s in ("complete", "pruned", "failed"))
        searched = ", ".join(f"`{k.removeprefix('method.init_args.')}`" for k in study["space"]) or "nothing"
        if "selected" not in study:  # trials finished so far, the row's tuning still under way
            lines.append(f"| {names[row.label]} | {searched} | {len(states)} of {grid.tuning.trials} so far: "
                         f"{counts} | (tuning) | - |")  # fmt: skip
            continue
        selected = study["selected"]
        values = ", ".join(f"{k.removeprefix('method.init_args.')}={_short(v)}" for k, v in selected["params"].items())
        lines.append(f"| {names[row.label]} | {searched} | {len(states)}: {counts} | {selected['value']:.2f} "
                     f"(trial {selected['number']}) | {values or '-'} |")  # fmt: skip
    untuned = [names[r.label] for r in grid.rows if not grid.tuned(r)]
    if untuned:
        lines.append("")
        lines.append("Not tuned (run as configured): " + ", ".join(untuned) + ".")
    return "\n".join(lines)


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def environments(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The distinct machines and software stacks the test runs ran on, each with its number of runs.

    Numbers are bitwise reproducible only on the stack that made them (:func:`fedhet.tracking.rundir.run_environment`),
    so a page continued on another machine says which runs came from where.
    """
    found: dict[str, dict[str, Any]] = {}
    for record in records:
        env = record.get("environment")
        if env is None:
            continue
        what = {k: env.get(k) for k in ("torch", "cpu", "cpu_capability", "gpu")}
        key = json.dumps(what, sort_keys=True)
        found.setdefault(key, {**what, "runs": 0})["runs"] += 1
    return list(found.values())


def environments_markdown(records: Sequence[dict[str, Any]]) -> str:
    """One line: the machines of the test runs (``""`` when no run recorded its environment)."""
    found = environments(records)
    if not found:
        return ""
    shown = "; ".join(f"{e['runs']} runs on {e['gpu'] or e['cpu']} ({e['cpu_capability']}), torch {e['torch']}"
                      for e in found)  # fmt: skip
    unknown = len(records) - sum(e["runs"] for e in found)
    return f"* **Machines**: {shown}" + (f"; {unknown} runs unrecorded." if unknown else ".")


def budget_markdown(grid: Grid, studies: dict[str, dict[str, Any]], records: Sequence[dict[str, Any]],
                    threads: int | None) -> str:  # fmt: skip
    """What the page cost and how it selected: trials, trial budget, seeds, selection metric, core-hours."""
    assert grid.tuning is not None
    plan = grid.tuning.describe()
    tuning_s = sum(t["wall_s"] for study in studies.values() for t in study["trials"])
    runners = sorted({study.get("runner", LOCAL_RUNNER) for study in studies.values()})
    test_s = sum(r["values"].get("wall_s", 0.0) for r in records)
    per = f"{threads} thread(s) per run" if threads else "threads per run as recorded"
    core = (f"{(tuning_s + test_s) * threads / 3600:.2f} core-hours" if threads
            else f"{(tuning_s + test_s) / 3600:.2f} run-hours")  # fmt: skip
    flags = " ".join(plan["flags"]) or "(the row's own budget)"
    return "\n".join([
        f"* **Tuning**: {plan['trials']} trials per tuned row, {plan['sampler']}, pruner {plan['pruner']}; each "
        f"trial is `fedhet fit` with the row's flags, then `{flags}`, at seed {plan['seed']} with the test splits "
        f"sealed (`federation.seal_test`: a read of any test set stops the tuning).",
        f"* **Trials ran on**: {'; '.join(runners) or 'nothing yet'}.",
        f"* **Selection**: `{plan['metric']}` at the last evaluated round of a trial; the best trial's values are "
        f"written to `{grid.selected}/<row>.yaml`, the config each row's seeds run.",
        f"* **Test**: seeds {', '.join(map(str, grid.seeds))} of every row; the tables and claims read test "
        "numbers of those runs only.",
        f"* **Cost**: {tuning_s / 3600:.2f} h of tuning runs and {test_s / 3600:.2f} h of test runs, {per}: {core}.",
        *([environments_markdown(records)] if environments(records) else []),
        *([f"* **Shared search**: {', '.join(f'`{k}`' for k in plan['shared'])} in one range for every row."]
          if plan["shared"] else []),
        *([f"* **Never searched**: {', '.join(f'`{e}`' for e in plan['exclude'])} (every row)."]
          if plan["exclude"] else []),
    ])  # fmt: skip


def render_page(
    grid: Grid,
    records: dict[tuple[str, int], dict[str, Any]],
    studies: dict[str, dict[str, Any]] | None = None,
    threads: int | None = None,
    failures: dict[tuple[str, int], str] | None = None,
) -> tuple[str, dict[str, Any]]:
    """The page's Markdown and json from the run records (and the tuning studies); figures are written beside it.

    ``failures``: why a cell without numbers has none (its run's last log line), shown beside it on the page:
    a selected config that diverges at a test seed is a result, not a cell to leave silently blank.
    """
    studies = studies or {}
    by_row: dict[str, list[dict[str, Any]]] = {}
    for cell in grid.cells():
        if (cell.label, cell.seed) in records:
            by_row.setdefault(cell.label, []).append(records[cell.label, cell.seed])
    for label in by_row:
        by_row[label].sort(key=lambda r: r["seed"])
    failures = failures or {}
    missing = [f"{c.label} seed {c.seed}" + (f" (failed: {failures[c.label, c.seed]})" if (c.label, c.seed) in failures
               else "") for c in grid.cells() if (c.label, c.seed) not in records]  # fmt: skip
    ended = {t.name: outcomes_of(t, grid, records, failures) for t in grid.tables if t.outcomes}
    tables = {t.name: outcome_table(t, grid, ended[t.name]) if t.outcomes else markdown_table(t, grid, by_row)
              for t in grid.tables}  # fmt: skip
    figures = {f.name: draw_figure(grid, f, by_row) for f in grid.figures}
    claims = claim_results(grid, by_row)
    names = grid.names()
    ordered = [records[c.label, c.seed] for r in grid.rows for c in grid.cells()
               if c.label == r.label and (c.label, c.seed) in records]  # fmt: skip

    def fill(match: re.Match[str]) -> str:
        kind, _, name = match.group(1).partition(":")
        if kind == "table":
            return tables[name]
        if kind == "figure":
            if not figures[name]:
                return f"(figure {name}: no run has its numbers recorded)"
            return f"![{name}]({figure_path(grid, next(f for f in grid.figures if f.name == name)).name})"
        return {
            "title": grid.title,
            "command": grid.command(),
            "json_command": grid.json_command(),
            "seeds": " ".join(map(str, grid.seeds)),
            "missing": "every cell was run" if not missing else
            f"{len(missing)} of {len(grid.cells())} have no numbers (`{grid.continue_command()}` runs them and "
            "rewrites this page): " + "; ".join(missing),
            "claims": claims_markdown(claims, names) if grid.claims else "",
            "tuning": tuning_markdown(grid, studies) if grid.tuning else "",
            "budget": budget_markdown(grid, studies, ordered, threads) if grid.tuning else "",
        }[kind]

    text = PLACEHOLDER.sub(fill, grid.template).rstrip() + "\n"
    payload = {
        "grid": grid.path,
        "command": grid.command(),
        "title": grid.title,
        "std": "sample (n - 1)",
        "seeds": list(grid.seeds),
        "missing": missing,
        "tables": {
            t.name: ended[t.name] if t.outcomes else
                    {label: {c.header: stats(column_values(c, of_seeds(t, by_row[label]), by_row, label, prefix))
                             for c in t.columns}
                     for row in t.rows
                     for (prefix, _), label in zip(t.groups(), t.labels(row), strict=True) if by_row.get(label)}
            for t in grid.tables
        },
        "failed": [{"label": c.label, "seed": c.seed, "config": c.config, "config_sha256": config_digest(c.config),
                    "flags": list(c.flags), **({"command": c.command_name} if c.command_name != "fit" else {}),
                    "message": failures[c.label, c.seed]} for c in grid.cells()
                   if (c.label, c.seed) in failures and (c.label, c.seed) not in records],
        "environments": environments(ordered),
        "runs": ordered,
    }  # fmt: skip
    if grid.claims:
        payload["claims"] = claims
    if grid.tuning is not None:
        payload["tuning"] = {"plan": grid.tuning.describe(), "threads": threads, "rows": studies}
    return text, payload


def write_page(
    grid: Grid,
    records: dict[tuple[str, int], dict[str, Any]],
    studies: dict[str, dict[str, Any]] | None = None,
    threads: int | None = None,
    failures: dict[tuple[str, int], str] | None = None,
) -> str:
    """Write ``<page>.md`` and ``<page>.json`` (atomically) and the figures; returns the Markdown."""
    grid.page.parent.mkdir(parents=True, exist_ok=True)
    text, payload = render_page(grid, records, studies, threads, failures)
    atomic_write_text(grid.page.with_suffix(".json"), json.dumps(payload, indent=1) + "\n")
    atomic_write_text(grid.page, text)
    return text


# ---------------------------------------------------------------------------------------------- the command
def failure_line(log: Path) -> str:
    """Why an incomplete cell stopped: its log's last line (``fedhet fit`` ends an error with one), or ``""``."""
    line = last_log_line(log) if log.is_file() else ""
    return line.removeprefix("fedhet: error: ") if line.startswith("fedhet: error:") else ""


def grid_command(
    grid_path: str,
    out: Path | None = None,
    jobs: int = 1,
    threads: int | None = None,
    report_only: bool = False,
    from_json: Path | None = None,
    echo: Callable[[str], None] = print,
    ray_address: str | None = None,
) -> int:
    """``fedhet bench --grid FILE``: run the cells that have neither a run nor a record, then write the page.

    Records come from ``--from_json`` (cells it has are not rerun) and from the complete run
    directories under ``out`` (the grid's ``out`` by default), which replace a json record of the
    same cell. Returns 1 when a cell failed or no cell has numbers, else 0.

    The page and its json are rewritten as each row's tuning ends and as each cell ends, so an
    interrupted bench keeps what it finished in the page's json: ``--from_json`` that json
    continues it elsewhere, or after the run directories are gone.
    """
    grid = parse_grid(grid_path)
    root = Path(out) if out is not None else grid.out
    grid = replace(grid, out=root)  # the page reads this bench's run directories (an images figure among them)
    studies = studies_from_json(from_json) if from_json is not None and grid.tuning is not None else {}
    recorded = records_from_json(from_json, grid.cells()) if from_json is not None else {}
    tuned = [r for r in grid.rows if grid.tuning is not None and grid.tuned(r)
             and not ("selected" in studies.get(r.label, {}) and grid.selected_config(r).is_file())] \
        if not report_only else []  # fmt: skip

    def pending() -> list[Cell]:  # a tuned row's cells are known once its selected config is written
        cells = grid.cells()
        return [c for c in cells if (c.label, c.seed) not in recorded or cell_state(c.run_dir(root)) == "partial"]

    if tuned or (pending() and not report_only):
        threads = threads or default_threads(jobs)
    recorded_threads = threads if threads is not None else studies_threads(from_json)

    complete: dict[Cell, dict[str, Any]] = {}  # a finished run never changes: read each summary once

    def records() -> dict[tuple[str, int], dict[str, Any]]:
        found = dict(recorded)
        for cell in grid.cells():
            if cell not in complete and cell_state(cell.run_dir(root)) == "complete":
                complete[cell] = record_of(cell, load_run(cell.run_dir(root)), grid)
            if cell in complete:
                found[cell.label, cell.seed] = complete[cell]
        return found

    def write(found: dict[tuple[str, int], dict[str, Any]]) -> str:
        cells = grid.cells()
        failed = failures_from_json(from_json, cells) if from_json is not None else {}
        logged = {(c.label, c.seed): failure_line(c.log_path(root)) for c in cells}
        failed.update({cell: line for cell, line in logged.items() if line})  # a log here replaces the json's line
        failed = {cell: line for cell, line in failed.items() if cell not in found}
        return write_page(grid, found, studies, recorded_threads, failed)

    def tune(rows: Sequence[Row], queue: CellQueue) -> None:
        """Tune the rows; each row's seed cells join the queue as soon as its selected config is written."""
        plan = grid.tuning
        assert plan is not None
        validate_cells([Cell(r.label, r.config, plan.seed, (*r.flags, *plan.flags)) for r in rows], root)
        echo(f"{grid.path}: tuning {len(rows)} rows, {plan.trials} trials each, on val/{plan.metric}")
        on_ray = {}
        if ray_address is not None:  # the same search, its trials placed by Ray Tune (fedhet.tuning_ray)
            from fedhet.tuning_ray import RUNNER, ray_trials

            on_ray = {"trials": ray_trials(ray_address, threads), "runner": RUNNER}

        def selected(result: StudyResult) -> None:
            save_progress(result)
            queue.add(runnable({result.label}))
            if ray_address is None:  # Ray's trials may share this machine: its cells wait for the whole tuning
                queue.release()

        restore = {r.label: studies[r.label]["trials"] for r in rows if studies.get(r.label, {}).get("partial")}
        tune_rows([(r.label, r.config, r.flags) for r in rows], plan, root, grid.selected, grid.page.stem,
                  child_environment(threads), jobs, echo, on_selected=selected, on_trial=save_trials,
                  restore=restore, **on_ray)  # fmt: skip

    page_lock = threading.Lock()  # the tuning's rows and the cells' workers rewrite the page from their threads

    def save_progress(result: StudyResult | CellOutcome) -> None:
        with page_lock:
            if isinstance(result, StudyResult):
                studies[result.label] = result.as_dict()
            write(records())

    def save_trials(label: str, partial: dict[str, Any]) -> None:  # a row's finished trials, before it is tuned
        with page_lock:
            studies[label] = partial
            write(records())

    def runnable(labels: set[str]) -> list[Cell]:
        """The rows' cells still to run, each refused in one line before any runs (its config, flags, record)."""
        cells = [c for c in pending() if c.label in labels]
        for cell in cells:
            if not Path(cell.config).is_file():
                raise ConfigError(f"{grid.path}: {cell.label}: config {cell.config}: no such file")
        check_recorded(cells, root)
        validate_cells(cells, root)
        return cells

    outcomes: list[CellOutcome] = []
    if not report_only:
        untuned = runnable({r.label for r in grid.rows} - {r.label for r in tuned})
        if untuned or tuned:
            then = ", then the tuned rows' seeds" if tuned else ""
            echo(f"{grid.path}: {len(untuned)} of {len(grid.cells())} cells to run or check under {root}{then}, "
                 f"{jobs} at a time, {threads} threads each")  # fmt: skip
        # a tuned row's seeds run on the cores its tuning leaves idle (CellQueue): locally, each selection frees one
        order = {(c.label, c.seed): i for i, c in enumerate(grid.cells())}  # seed-major, then the grid's rows
        queue = CellQueue(root, jobs, child_environment(threads), echo=echo, on_done=save_progress,
                          reserved=len(tuned) if ray_address is None else jobs,
                          rank=lambda cell: order[cell.label, cell.seed])  # fmt: skip
        try:
            with queue.stopped_on_error():
                queue.add(untuned)
                if tuned:
                    tune(tuned, queue)
                outcomes = queue.finish()
        except KeyboardInterrupt as exc:
            exc.next_step = (f"what finished is in {grid.page.with_suffix('.json')}: continue with "  # type: ignore[attr-defined]
                             f"'{grid.continue_command()}'")  # fmt: skip
            raise
    found = records()
    if not found and not studies:
        echo(f"{grid.path}: no cell has numbers (no complete run under {root}, no record); nothing to write")
        return 1
    echo(write(found))
    echo(f"wrote {grid.page} and {grid.page.with_suffix('.json')}")
    failed = [o for o in outcomes if not o.ok]
    if failed:
        echo(f"{len(failed)} of {len(grid.cells())} cells failed (logs above); rerun the same command to retry them")
        return 1
    return 0


#: The summary page of every claim (``fedhet bench --claims configs/grids/*.yaml``).
CLAIMS_PAGE = Path("docs/results/claims.md")


def claims_page(grid_paths: Sequence[str], page: Path = CLAIMS_PAGE) -> str:
    """Every claim the grids declare, with the verdict and interval their pages' json computed; written to ``page``.

    A grid whose page has no json yet (never run) is listed as not run, its claims without verdicts.
    Only grid files: every page is a grid page (FedMD-CG's gradient-inversion attack included).
    """
    lines = [
        "# Claims of the papers and their verdicts",
        "",
        f"Generated by `fedhet bench --claims {' '.join(grid_paths)}` from the pages' json; do not edit by hand.",
        "Each verdict is computed from the paired difference over seeds (95 % Student-t interval): **holds** when",
        "the interval is above 0, **fails** when below, **inconclusive** otherwise (docs/results_pages.md);",
        "**not run** when no seed has both rows yet (a page still running), counted apart.",
        "",
    ]
    header = len(lines)  # "In all" goes right after it
    tally: dict[str, int] = {}
    for path in grid_paths:
        if path.endswith(".json"):
            raise ConfigError(f"--claims {path}: give the page's grid file (configs/grids/*.yaml), not its json")
        grid = parse_grid(path)
        record = grid.page.with_suffix(".json")
        lines.append(f"## [{grid.title}]({grid.page.name})")
        lines.append("")
        if not grid.claims:
            lines += ["(this page declares no claims)", ""]
            continue
        results = None
        if record.is_file():
            payload = json.loads(record.read_text())
            results = payload.get("claims")
        if results is None:
            lines += [f"Not run yet: `{grid.command()}`.", ""]
            lines += [f"* {c.claim} ({c.paper or 'no paper reference'})" for c in grid.claims] + [""]
            continue
        names = grid.names()
        missing = payload.get("missing") or []
        if missing:
            lines += [f"**Partial**: {len(missing)} cells of the page are not recorded yet; these verdicts are over "
                      "the seeds recorded so far.", ""]  # fmt: skip
        lines += [claims_markdown(results, names), ""]
        for result in results:
            tally[result["verdict"]] = tally.get(result["verdict"], 0) + 1
    total = ", ".join(f"{count} {verdict}" for verdict, count in sorted(tally.items())) or "no claim has a verdict yet"
    lines.insert(header, f"In all: {total}.\n")
    text = "\n".join(lines).rstrip() + "\n"
    page.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(page, text)
    return text


def grid_bench(request: PageRequest, echo: Callable[[str], None] = print) -> int:
    """``fedhet bench --grid FILE`` (everything the page needs is in the file) or ``--claims GRID ...``."""
    if request.claims is not None:
        echo(claims_page(request.claims))
        echo(f"wrote {CLAIMS_PAGE}")
        return 0
    assert request.grid is not None
    return grid_command(request.grid, request.out, request.jobs, request.threads, request.report_only,
                        request.from_json, echo, request.ray_address)  # fmt: skip


def bench_main(argv: Sequence[str], echo: Callable[[str], None] = print) -> int:
    """``fedhet bench``, grids included: :func:`fedhet.bench.bench_command` with :func:`grid_bench`."""
    return bench_command(argv, echo, grid=grid_bench)
