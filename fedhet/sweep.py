"""``fedhet sweep``: a W&B-format sweep run offline, each run a ``fedhet fit`` process.

``fedhet sweep SWEEP.yaml [--count N] [--jobs N] [--dir DIR] [--seed S] [--dry_run] [-- fit flags]``
reads a W&B sweep config (``method: grid | random | bayes``, ``parameters:`` with ``values`` /
``value`` / distributions, ``metric: {name, goal}``, ``command:``), asks fedhet's engine
(:mod:`fedhet.sweep_engine`: W&B's grid and random rules, bayes by Optuna's TPE sampler) for
each next run, and starts it exactly as ``wandb agent`` would: the ``command:`` list with its
macros expanded (``${args}`` becomes ``--key=value`` flags formatted as the agent formats them),
plus ``--run_dir DIR/run-<k>``. Nothing needs a W&B server or the network.

The same YAML works with ``wandb sweep SWEEP.yaml`` + ``wandb agent <id>``. W&B's default
command, ``${env} ${interpreter} ${program} ${args}``, cannot start fedhet: ``${program}`` must
be a script, and fedhet needs its ``fit`` subcommand and the ``--config`` before the swept flags
(jsonargparse applies flags left to right, so a config after them would override them). The form
that works in both: ``command: [${env}, ${interpreter}, -m, fedhet, fit, --config, X.yaml, ${args}]``.

Resumable: the state is kept in ``DIR/sweep.json``; running the same command again keeps the
finished runs and starts the rest (for a grid: the points not yet finished). The results, the
sweep metric per run sorted by the goal, go to stdout (Markdown) and ``DIR/sweep_results.{md,json}``.

:func:`fedhet.config.parse_accepting_none` is the config layer's side of sweeps: W&B renders a
YAML ``null`` as ``--key=None``, which the jsonargparse parser would read as the string "None".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import yaml

from fedhet.bench import child_environment, default_threads, last_log_line, run_process
from fedhet.config import parse_accepting_none  # noqa: F401  (re-exported: the sweep side of null values)
from fedhet.errors import CommandParser, ConfigError, FedhetError
from fedhet.files import atomic_write_text
from fedhet.sweep_engine import Trial, check_spec, propose

#: The agent's command when a sweep config has none (wandb/wandb_agent.py ``DEFAULT_SWEEP_COMMAND``).
DEFAULT_COMMAND = ["${env}", "${interpreter}", "${program}", "${args}"]
#: The command that works for fedhet, offline and with ``wandb agent``.
WORKING_COMMAND = "[${env}, ${interpreter}, -m, fedhet, fit, --config, X.yaml, ${args}]"
ENVVAR = re.compile(r"\$\{envvar\:([A-Z0-9_]*)\}")
#: What ``sweep_results.json`` keeps of each run.
RESULT_KEYS = ("name", "params", "flags", "metric", "state", "exit_code", "seconds", "run_dir", "log", "error")


# ---------------------------------------------------------------------------------------------- the sweep config
def load_sweep(path: str | Path) -> dict[str, Any]:
    """Read and check a sweep YAML: every mistake is one line before anything runs.

    W&B's schema (:func:`~fedhet.sweep_engine.check_spec`), plus what fedhet needs of ``command:``.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep config '{path}' not found")
    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"sweep config '{path}' is not valid YAML ({' '.join(str(exc).split())})") from None
    check_spec(spec, f"sweep config '{path}'")
    fit_index(command_template(spec), str(path))
    return spec


def command_template(spec: dict[str, Any]) -> list[str]:
    """The sweep's ``command:`` as strings (W&B's default command when there is none)."""
    return [str(c) for c in (spec.get("command") or DEFAULT_COMMAND)]


def _fit_position(command: Sequence[str]) -> int | None:
    """Index of ``fit`` right after ``fedhet`` (the console script or ``-m fedhet``), or ``None``."""
    for index, token in enumerate(command[:-1]):
        if token == "fedhet" and command[index + 1] == "fit":
            return index + 1
    return None


def fit_index(template: Sequence[str], where: str = "sweep config") -> int:
    """Index of ``fit`` in a command that runs ``fedhet fit ... ${args}``; a one-line error otherwise."""
    index = _fit_position(template)
    if index is None:
        raise ConfigError(
            f"{where}: command: must run fedhet fit, e.g. command: {WORKING_COMMAND}; W&B's default "
            "'${env} ${interpreter} ${program} ${args}' runs ${program} as a script without 'fit' (docs/sweeps.md)"
        )
    if "${args}" not in template[index:]:
        raise ConfigError(f"{where}: command: needs ${{args}} after fit (the swept flags), e.g. {WORKING_COMMAND}")
    args_at = template.index("${args}")
    if any(t == "--config" or t.startswith("--config=") for t in template[args_at:]):
        raise ConfigError(f"{where}: command: put ${{args}} after --config, or the config overrides the swept values")
    return index


def metric_text(value: Any) -> str:
    """A metric value for the table and the progress lines (accuracies in percent: 2 decimals)."""
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value:.2f}" if abs(value) < 1e5 else f"{value:.4g}"


def plain(value: Any) -> Any:
    """A numpy scalar as the Python value it holds.

    The engine proposes plain values; state files written by older versions may hold numpy ones.
    """
    return value.item() if hasattr(value, "item") and not isinstance(value, (list, dict, str)) else value


def flag_value(value: Any) -> str:
    """A value as W&B's agent writes it into ``--key=value``: Python's ``str`` (so null is ``None``)."""
    return f"{plain(value)}"


def build_command(
    template: Sequence[str], params: dict[str, Any], program: str | None, args_json_file: Path | None = None
) -> list[str]:
    """Expand a ``command:`` list as ``wandb agent`` does (wandb/wandb_agent.py ``_command_run``).

    ``${interpreter}`` becomes this Python and a leading ``fedhet`` console script becomes
    ``python -m fedhet``, so that runs use the same installation as the sweep.
    """
    flags = [f"--{k}={flag_value(v)}" for k, v in params.items()]
    values = {k: plain(v) for k, v in params.items()}
    macros: dict[str, list[str]] = {
        "env": [],  # /usr/bin/env for the agent; here the interpreter is already absolute
        "interpreter": [sys.executable],
        "program": [program] if program else [],
        "args": flags,
        "args_no_hyphens": [f[2:] for f in flags],
        "args_no_equals": [part for k, v in values.items() for part in (f"--{k}", flag_value(v))],
        "args_append_hydra": ["+" + f[2:] for f in flags],
        "args_override_hydra": ["++" + f[2:] for f in flags],
        "args_no_boolean_flags": [
            f"--{k}" if v is True else f"--{k}={flag_value(v)}" for k, v in values.items() if v is not False
        ],
        "args_json": [json.dumps(values)],
        "args_json_file": [str(args_json_file)] if args_json_file else [],
    }
    command: list[str] = []
    for token in template:
        # ${envvar:NAME} anywhere in a token; an unset variable leaves its name, as the agent does
        token = ENVVAR.sub(lambda m: os.environ.get(m.group(1), m.group(1)), token)
        if token.startswith("${") and token.endswith("}"):
            command += macros.get(token[2:-1], [])
        else:
            command.append(token)
    if command and command[0] == "fedhet":
        command = [sys.executable, "-m", "fedhet", *command[1:]]
    return command


# ---------------------------------------------------------------------------------------------- results of a run
def summary_metrics(run_dir: Path) -> dict[str, float]:
    """The run's metrics as its W&B summary would hold them, for the engine and the sweep table.

    The last logged value of every metric, then ``final/``, ``best/``, ``last3/`` and the
    communication totals, as :class:`~fedhet.tracking.WandbCallback` writes them at the end.
    """
    metrics: dict[str, float] = {}
    jsonl = run_dir / "metrics.jsonl"
    if jsonl.is_file():
        for line in jsonl.read_text().splitlines():
            if line.strip():
                metrics.update({k: v for k, v in json.loads(line).items() if isinstance(v, (int, float))})
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        for block in ("final", "best", "last3"):
            for key, value in summary.get(block, {}).items():
                if isinstance(value, (int, float)):
                    metrics[f"{block}/{key}"] = value
        metrics["comm/bytes_up"] = summary["comm"]["bytes_up"]
        metrics["comm/bytes_down"] = summary["comm"]["bytes_down"]
        metrics["wall_s"] = summary["wall_s"]
    return metrics


def history(run_dir: Path) -> list[dict[str, Any]]:
    """The per-round records of a run (kept in ``sweep.json`` with the run, as W&B keeps a run's history)."""
    jsonl = run_dir / "metrics.jsonl"
    if not jsonl.is_file():
        return []
    return [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------- the driver
class Sweep:
    """An offline sweep in a directory: proposes, runs and records runs; resumable.

    Args:
        spec: the sweep config (:func:`load_sweep`).
        directory: where run directories, logs and the state file go.
        extra: ``fedhet fit`` flags appended to every run (after the swept ones, so they win).
        seed: seed of the random and bayes proposals (each proposal is seeded with it and the
            run's index, so an offline sweep repeats exactly).
    """

    def __init__(self, spec: dict[str, Any], directory: Path, extra: Sequence[str] = (), seed: int = 0) -> None:
        self.spec = spec
        self.directory = Path(directory)
        self.extra = list(extra)
        self.seed = seed
        self.runs: list[dict[str, Any]] = []
        self.active: list[dict[str, Any]] = []  # started, not finished (saved so that a rerun cleans them up)
        self.stale: list[Path] = []  # directories of interrupted or failed runs of an earlier invocation
        self._parser: Any = None
        self.space = check_spec(spec)
        self.state_path = self.directory / "sweep.json"
        self._load()

    # state ---------------------------------------------------------------------------------------
    def _load(self) -> None:
        if not self.state_path.is_file():
            return
        state = json.loads(self.state_path.read_text())
        if state.get("sweep") != json.loads(json.dumps(self.spec)) or state.get("extra", []) != self.extra:
            raise ConfigError(
                f"{self.directory} holds another sweep (a different config or extra flags); choose another --dir"
            )
        for run in state["runs"]:
            if run["state"] == "finished":
                self.runs.append(run)
            elif Path(run["run_dir"]).exists():  # interrupted or failed: proposed again, from scratch
                self.stale.append(Path(run["run_dir"]))  # removed when runs start (a dry run keeps them)

    def save(self) -> None:
        state = {"sweep": self.spec, "extra": self.extra, "runs": [*self.runs, *self.active]}
        atomic_write_text(self.state_path, json.dumps(state, indent=1, default=str) + "\n")

    @property
    def metric(self) -> dict[str, Any] | None:
        metric = self.spec.get("metric")
        return metric if isinstance(metric, dict) and metric.get("name") else None

    # proposals -----------------------------------------------------------------------------------
    def trials(self, active: Sequence[dict[str, Any]]) -> list[Trial]:
        """The runs so far as the engine sees them: values, the sweep metric and the state."""
        def number(value: Any) -> float | None:
            return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None

        metric = self.metric or {}
        maximize = str(metric.get("goal", "minimize")) == "maximize"
        scores = [v for r in self.runs if r["state"] == "finished" and (v := number(r.get("metric"))) is not None]
        out = []
        for run in [*self.runs, *active]:
            value = number(run.get("metric"))
            state = run["state"] if run["state"] in ("finished", "running") else "failed"
            if state == "failed" and metric:
                # W&B's metric.impute (default worst): a failed run counts as the worst (or best)
                # finished value, or for "latest" its own last logged value, so that bayes learns
                # to avoid a region where runs fail; failed runs are ignored while none finished
                impute = metric.get("impute", "worst")
                if impute != "latest" or value is None:
                    value = (max if (impute == "best") == maximize else min)(scores) if scores else None
                state = "finished" if value is not None else "failed"
            out.append(Trial(run["params"], value, state))
        return out

    def target_reached(self) -> bool:
        """Whether a finished run reached ``metric.target`` (W&B then ends the sweep)."""
        metric = self.metric or {}
        target = metric.get("target")
        if not isinstance(target, (int, float)):
            return False
        maximize = str(metric.get("goal", "minimize")) == "maximize"
        return any(
            isinstance(r.get("metric"), (int, float)) and (r["metric"] >= target if maximize else r["metric"] <= target)
            for r in self.runs
            if r["state"] == "finished"
        )

    def propose(self, active: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
        """The next run's parameters, or ``None`` when a grid is exhausted.

        Seeded by the sweep seed and the run's index: the same seed proposes the same configs
        (random: the same draws; bayes: the same points given the same results).
        """
        index = len(self.runs) + len(active)
        metric = self.metric or {}
        return propose(
            self.spec["method"],
            self.space,
            self.trials(active),
            (self.seed * 1_000_003 + index) % 2**32,
            str(metric.get("goal", "minimize")),
        )

    def _name(self, active: Sequence[dict[str, Any]]) -> str:
        taken = {r["name"] for r in [*self.runs, *active]}
        index = 0
        while f"run-{index:03d}" in taken or (self.directory / f"run-{index:03d}").exists():
            index += 1
        return f"run-{index:03d}"

    def new_run(self, params: dict[str, Any], active: Sequence[dict[str, Any]], write: bool = True) -> dict[str, Any]:
        name = self._name(active)
        run_dir = self.directory / name
        args_file = self.directory / f"{name}.args.json"
        command = build_command(command_template(self.spec), params, self.spec.get("program"), args_file)
        command += ["--run_dir", str(run_dir), *self.extra]
        if write and "${args_json_file}" in command_template(self.spec):
            atomic_write_text(self.directory / f"{name}.args.json", json.dumps(params, default=str))
        return {
            "name": name,
            "params": {k: plain(v) for k, v in params.items()},
            "flags": [f"--{k}={flag_value(v)}" for k, v in params.items()],
            "command": command,
            "run_dir": str(run_dir),
            "log": str(self.directory / f"{name}.log"),
            "state": "running",
        }

    def validate(self, run: dict[str, Any]) -> None:
        """Parse a run's ``fedhet fit`` arguments in-process: bad keys or values fail before any run starts."""
        from fedhet.config import build_parser, parse_config

        if self._parser is None:
            self._parser = build_parser()
        command = run["command"]
        parse_config(self._parser, command[(_fit_position(command) or 0) + 1 :])

    # running -------------------------------------------------------------------------------------
    def run(
        self, count: int | None, jobs: int, threads: int, echo: Callable[[str], None] = print
    ) -> list[dict[str, Any]]:
        """Start up to ``count`` new runs (``None``: until a grid is exhausted or ``run_cap``), ``jobs`` at a time."""
        cap = self._check_count(count)
        for stale in self.stale:
            if stale.exists():
                shutil.rmtree(stale)
        self.stale = []
        env = child_environment(threads, {"WANDB_RUN_GROUP": os.environ.get("WANDB_RUN_GROUP", self.name)})
        # Explicit: parsing a config (validate) briefly changes this process's working directory
        # (jsonargparse resolves relative paths from the config's folder) while another run starts.
        cwd = Path.cwd()
        started = 0
        futures: dict[Future[int], dict[str, Any]] = {}
        exhausted = False
        if self.runs:
            echo(f"{len(self.runs)} finished runs kept from {self.state_path}")

        def room() -> bool:
            return (
                not exhausted
                and not self.target_reached()
                and len(self.active) < jobs
                and (count is None or started < count)
                and (cap is None or len(self.runs) + len(self.active) < int(cap))
            )

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            while True:
                while room():
                    params = self.propose(self.active)
                    if params is None:
                        exhausted = True
                        break
                    run = self.new_run(params, self.active)
                    started += 1
                    try:
                        self.validate(run)
                    except FedhetError as exc:
                        if not self.runs and not self.active:  # the first run: a mistake every run shares
                            raise ConfigError(f"{run['name']} ({' '.join(run['flags'])}): {exc}") from None
                        self._finish(run, 2, 0.0, str(exc), echo)
                        continue
                    echo(f"{run['name']} started: {' '.join(run['flags'])}")
                    run["started"] = time.time()
                    self.active.append(run)
                    self.save()
                    futures[pool.submit(run_process, run["command"], Path(run["log"]), env, cwd)] = run
                if not futures:
                    if self.target_reached():
                        echo(f"{self.metric['name']} reached its target {self.metric['target']}: no more runs start")
                    break
                done, _ = wait(list(futures), return_when=FIRST_COMPLETED)
                for future in done:
                    run = futures.pop(future)
                    self.active.remove(run)
                    self._finish(run, future.result(), time.time() - run.pop("started"), None, echo)
        return self.runs

    def _check_count(self, count: int | None) -> int | None:
        """The sweep's ``run_cap``; a one-line error when nothing would end a random or bayes search."""
        cap = self.spec.get("run_cap")
        if count is None and self.spec["method"] != "grid" and cap is None:
            raise ConfigError(
                f"{self.spec['method']} search does not end by itself: pass --count N (or run_cap: in the sweep config)"
            )
        return None if cap is None else int(cap)

    def dry_run(self, count: int | None, echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
        """The runs ``run`` would start now, each parsed as ``fedhet fit`` would parse it; starts and writes nothing.

        Bayes proposals after the first treat the planned runs as running (as ``--jobs`` would),
        so they show where the search starts, not where results would take it.
        """
        cap = self._check_count(count)
        planned: list[dict[str, Any]] = []
        while (count is None or len(planned) < count) and (cap is None or len(self.runs) + len(planned) < cap):
            params = self.propose(planned)
            if params is None:
                break
            run = self.new_run(params, planned, write=False)
            try:
                self.validate(run)
            except FedhetError as exc:
                raise ConfigError(f"{run['name']} ({' '.join(run['flags'])}): {exc}") from None
            planned.append(run)
            echo(f"{run['name']}: {shlex.join(run['command'])}")
        kept = f" ({len(self.runs)} finished runs kept from {self.state_path})" if self.runs else ""
        echo(f"dry run: {len(planned)} runs would start{kept}; nothing was started or written")
        return planned

    @property
    def name(self) -> str:
        return str(self.spec.get("name") or self.directory.name)

    def _finish(
        self, run: dict[str, Any], code: int, seconds: float, error: str | None, echo: Callable[[str], None]
    ) -> None:
        run_dir = Path(run["run_dir"])
        run["exit_code"] = code
        run["seconds"] = round(seconds, 1)
        run["state"] = "finished" if code == 0 and (run_dir / "summary.json").is_file() else "failed"
        run["summary_metrics"] = summary_metrics(run_dir)
        run["history"] = history(run_dir)
        metric = self.metric
        run["metric"] = run["summary_metrics"].get(metric["name"]) if metric else None
        if run["state"] == "finished":
            shown = f", {metric['name']} {metric_text(run['metric'])}" if metric else ""
            echo(f"{run['name']} finished in {seconds:.0f} s{shown}")
        else:
            reason = error or last_log_line(Path(run["log"]))
            run["error"] = reason
            echo(f"{run['name']} FAILED (exit {code}, log {run['log']}): {reason}")
        self.runs.append(run)
        self.save()

    # results -------------------------------------------------------------------------------------
    def ranked(self) -> list[dict[str, Any]]:
        """Runs sorted by the metric's goal (best first); runs without the metric last."""
        metric = self.metric
        if metric is None:
            return sorted(self.runs, key=lambda r: r["name"])
        sign = -1.0 if str(metric.get("goal", "minimize")).lower().startswith("max") else 1.0
        scored = [r for r in self.runs if isinstance(r.get("metric"), (int, float))]
        rest = [r for r in self.runs if r not in scored]
        return sorted(scored, key=lambda r: (sign * r["metric"], r["name"])) + sorted(rest, key=lambda r: r["name"])

    def report(self) -> str:
        """The Markdown table of the sweep metric per run (also written to ``sweep_results.{md,json}``)."""
        metric = self.metric
        keys = list(self.spec["parameters"])
        title = metric["name"] if metric else "metric"
        goal = f" ({metric.get('goal', 'minimize')})" if metric else ""
        lines = [
            f"## sweep {self.name}: {self.spec['method']} search, {len(self.runs)} runs, sorted by {title}{goal}",
            "",
            "| rank | run | " + title + " | " + " | ".join(keys) + " | state |",
            "| --- | --- | --- |" + " --- |" * len(keys) + " --- |",
        ]
        for rank, run in enumerate(self.ranked(), 1):
            shown = metric_text(run.get("metric"))
            params = [flag_value(run["params"].get(k)) for k in keys]
            lines.append(f"| {rank} | {run['name']} | {shown} | " + " | ".join(params) + f" | {run['state']} |")
        missing = [r["name"] for r in self.runs if r["state"] == "finished" and metric and r.get("metric") is None]
        if missing:
            names = self.runs[0].get("summary_metrics", {})
            available = sorted(k for k in names if "/" not in k or k.startswith(("final/", "best/", "last3/")))
            lines += ["", f"metric {title!r} is not in the runs' summaries; available: {', '.join(available[:20])}"]
        text = "\n".join(lines) + "\n"
        results = {
            "name": self.name,
            "method": self.spec["method"],
            "metric": metric,
            "runs": [
                {k: r.get(k) for k in RESULT_KEYS} for r in self.ranked()
            ],
        }
        atomic_write_text(self.directory / "sweep_results.json", json.dumps(results, indent=1, default=str) + "\n")
        atomic_write_text(self.directory / "sweep_results.md", text)
        return text


# ---------------------------------------------------------------------------------------------- the command
def build_parser() -> argparse.ArgumentParser:
    """The ``fedhet sweep`` parser."""
    parser = CommandParser(
        prog="fedhet sweep",
        description="Run a W&B-format sweep offline (grid, random, bayes), each run a fedhet fit; see docs/sweeps.md.",
        epilog="Flags after '--' go to every run after the swept ones, e.g. -- --rounds 2",
    )
    parser.add_argument("config", help="sweep YAML in W&B's format (configs/sweeps/)")
    parser.add_argument(
        "--count", type=int, default=None, help="start at most N runs (default: the whole grid, or run_cap)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (default 1)")
    parser.add_argument(
        "--threads", type=int, default=None, help="threads per run (default: cores / jobs, or OMP_NUM_THREADS)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="sweep directory (default runs/sweeps/<name>)")
    parser.add_argument("--seed", type=int, default=0, help="seed of random and bayes proposals (default 0)")
    parser.add_argument(
        "--dry_run", action="store_true", help="print the runs that would start, each parsed; start and write nothing"
    )
    return parser


def sweep_command(argv: Sequence[str], echo: Callable[[str], None] = print) -> int:
    """``fedhet sweep``: run or continue the sweep, then print the table; 1 when a run failed."""
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        index = argv.index("--")
        argv, extra = argv[:index], argv[index + 1 :]
    args = build_parser().parse_args(argv)
    if args.jobs < 1 or (args.count is not None and args.count < 1):
        raise ConfigError("--jobs and --count must be at least 1")
    spec = load_sweep(args.config)
    directory = args.dir or Path("runs") / "sweeps" / str(spec.get("name") or Path(args.config).stem)
    sweep = Sweep(spec, directory, extra, args.seed)
    if spec.get("early_terminate"):
        echo("note: early_terminate is applied by wandb agent's server only; fedhet sweep runs every run to its end")
    if args.dry_run:
        sweep.dry_run(args.count, echo)
        return 0
    threads = args.threads or default_threads(args.jobs)
    echo(f"sweep {sweep.name} ({spec['method']}) in {directory}: {args.jobs} at a time, {threads} threads each")
    sweep.run(args.count, args.jobs, threads, echo)
    text = sweep.report()
    echo(text)
    ranked = sweep.ranked()
    if sweep.metric and ranked and isinstance(ranked[0].get("metric"), (int, float)):
        best = ranked[0]
        score = f"{sweep.metric['name']} {metric_text(best['metric'])}"
        echo(f"best: {best['name']} ({score}): {shlex.join(best['flags'])}")
    failed = [r for r in sweep.runs if r["state"] != "finished"]
    if failed:
        echo(f"{len(failed)} runs failed (logs in {directory}); rerun the same command to retry them")
        return 1
    return 0
