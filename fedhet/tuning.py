"""The tuning stage of ``fedhet bench --grid``: every row searched with the same budget, selected on validation.

A comparison is only as fair as the tuning behind each row. A grid file with a ``tuning:``
section gives every tuned row the same treatment before its seeds run:

1. **Search space.** The row's method declares its hyperparameters once, with their search
   spaces (:mod:`fedhet.hparams`); a wrapped base method (FedFTG's, FedDF-server's) adds its own
   under ``base.init_args``. Keys the row sets itself (an ablation's fixed switch) are not
   searched; the grid's ``exclude`` drops knob names for every row alike (budgets such as server
   iterations), and its ``shared`` entries give a knob one range for every row that has it
   (``lr``) or add a config key to every row (a dotted key).
2. **Trials.** Trial 0 of every row runs it as configured (so the selection is never below the
   shipped setting on validation); Optuna's TPE sampler proposes the others, ``trials`` in all
   per row, each one a ``fedhet fit``
   run at the tuning seed with the grid's trial flags (the same per-trial budget for every row)
   and **sealed test splits** (``federation.seal_test``: any read of a test set stops the tuning),
   scored on the validation value of the grid's metric at the last evaluated round. A trial is
   *failed* only when its training ended it (a non-finite loss or a rejected upload: exit status
   3); a run stopped by anything else (bad input, a refused resume, a full disk, a bug, a kill)
   stops the tuning with one line (:class:`TrialInterrupted`) and is resumed, uncounted, by the
   next run of the same command. Studies
   live in one SQLite file, so a killed tuning run resumes: finished trials are kept and an
   interrupted trial's run is resumed from its checkpoint. Each proposal comes from a sampler
   seeded by the row and the trial's number, so a resumed study proposes what the uninterrupted
   one would. A median pruner (``pruner: median``) may stop trials early, the same for every row.
3. **Selection.** The best trial (highest validation value; the earliest on ties) gives the
   row's selected hyperparameters, written as a complete config that ``fedhet fit --config``
   reproduces. The page's seeds run that config; its test numbers are read only then.

Every trial logs to W&B (offline unless configured) in the group ``tune/<page>/<row>``, so each
study is one group of runs.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib
import json
import math
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhet.bench import cancel_queued_on_exit, cell_state, last_log_line, override_flag
from fedhet.errors import EXIT_TRAINING_STOPPED, ConfigError
from fedhet.files import atomic_write_text
from fedhet.seeding import derive_seed
from fedhet.sweep_engine import (
    Param,
    load_optuna,
    optuna_distributions,
    optuna_internal,
    optuna_point,
    parse_parameters,
)

#: how the page names the trials run here, one ``fedhet fit`` process each (:meth:`RowStudy.run`)
LOCAL_RUNNER = "local processes (Optuna, one sampler seeded per trial)"
TUNING_KEYS = {"trials", "metric", "seed", "flags", "shared", "exclude", "pruner", "sampler_seed"}
PRUNERS = ("none", "median")
#: Trials proposed at random before TPE models the history (TPE needs a few to start from).
STARTUP_FRACTION = 3
#: Seconds between two reads of a running trial's ``metrics.jsonl`` (pruning decisions).
POLL_S = 0.5
#: Set when the tuning run is interrupted (Ctrl-C reaches the main thread only): the rows tuned in
#: other threads stop their trial's run and leave the trial running in the study, to be resumed
#: from its checkpoint, instead of recording it failed and asking for the next one.
STOP = threading.Event()


def trial_log_path(run_dir: Path) -> Path:
    """A trial's log, beside its run directory (``trial3/`` -> ``trial3.log``): every attempt appends to it."""
    return run_dir.with_name(run_dir.name + ".log")


class TrialInterrupted(ConfigError):
    """A trial's run stopped for a reason its hyperparameters do not explain: the tuning stops with it.

    Only a run ended by its training (exit :data:`~fedhet.errors.EXIT_TRAINING_STOPPED`: a non-finite
    loss, a rejected upload) is a failed trial. A refused resume, a full disk, a bug or a kill would
    otherwise be counted as one, spend the row's budget and steer the sampler away from a good point;
    the trial instead stays running in the study and is resumed by the next run of the same command.
    """

    def __init__(self, label: str, number: int, code: int | None, log: Path) -> None:
        import signal

        self.label, self.number, self.code, self.log = label, number, code, log
        reason = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else last_log_line(log)
        super().__init__(
            f"tuning {label}: trial {number + 1} stopped (exit {code}) for a reason other than its training: "
            f"{reason}; fix that and rerun the same command (the trial resumes, not counted failed; log: {log})"
        )

    def __reduce__(self) -> tuple:
        return type(self), (self.label, self.number, self.code, self.log)


@dataclass(frozen=True)
class TuningPlan:
    """The ``tuning:`` section of a grid: one budget and one rule for every tuned row.

    Attributes:
        trials: trials per row (finished ones: complete, pruned or failed all count).
        metric: the selection metric; trials are scored on ``val/<metric>`` of their last
            evaluated round (``acc_local``: the clients' own validation splits; ``acc_server``,
            ``acc_global``, ``acc_intra``: the held-out validation sets).
        seed: the seed every trial runs at (keep it apart from the page's test seeds).
        flags: ``fedhet fit`` flags of every trial after the row's own (the per-trial budget).
        shared: W&B-format search parameters for every row: a knob name (``lr``) replaces the
            declared range of that knob wherever a row's method has it; a dotted config key is
            searched in every row.
        exclude: knob names (shell patterns) searched by no row.
        pruner: ``none`` or ``median`` (Optuna's median pruner on the per-round validation values).
        sampler_seed: seeds the TPE proposals (with the row label and the trial's number).
    """

    trials: int
    metric: str
    seed: int
    flags: tuple[str, ...] = ()
    shared: Mapping[str, Any] = field(default_factory=dict)
    exclude: tuple[str, ...] = ()
    pruner: str = "none"
    sampler_seed: int = 0

    def describe(self) -> dict[str, Any]:
        return {
            "trials": self.trials, "metric": f"val/{self.metric}", "seed": self.seed, "flags": list(self.flags),
            "shared": dict(self.shared), "exclude": list(self.exclude), "pruner": self.pruner,
            "sampler": f"Optuna TPE (seed {self.sampler_seed}, {startup_trials(self.trials)} random startup trials)",
        }  # fmt: skip


def startup_trials(trials: int) -> int:
    """Random trials before TPE takes over: a third of the budget, at least 2 (Optuna's default is 10)."""
    return max(2, trials // STARTUP_FRACTION)


def parse_tuning(where: str, entry: Any) -> TuningPlan:
    """Read and check a grid's ``tuning:`` section (one :class:`ConfigError` line per mistake)."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: tuning: write a mapping with the keys {', '.join(sorted(TUNING_KEYS))}")
    unknown = sorted(set(entry) - TUNING_KEYS)
    if unknown:
        raise ConfigError(f"{where}: tuning: unknown key '{unknown[0]}'; known keys: {', '.join(sorted(TUNING_KEYS))}")
    for key in ("trials", "metric", "seed"):
        if key not in entry:
            raise ConfigError(f"{where}: tuning: missing key '{key}'")
    trials, seed = entry["trials"], entry["seed"]
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise ConfigError(f"{where}: tuning: trials={trials!r}: give the number of trials per row, e.g. 8")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"{where}: tuning: seed={seed!r}: give an integer seed, apart from the page's seeds")
    metric = str(entry["metric"]).removeprefix("val/")
    flags = entry.get("flags") or []
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise ConfigError(f"{where}: tuning: flags: write a list of fedhet fit flags, e.g. ['--rounds=5']")
    shared = entry.get("shared") or {}
    if not isinstance(shared, dict):
        raise ConfigError(f"{where}: tuning: shared: write a mapping of knob names or config keys to search spaces")
    if shared:
        try:
            parse_parameters(shared)
        except ConfigError as exc:
            raise ConfigError(f"{where}: tuning: shared: {exc}") from None
    exclude = entry.get("exclude") or []
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise ConfigError(f"{where}: tuning: exclude: write a list of knob names, e.g. [iterations, '*_steps']")
    pruner = str(entry.get("pruner", "none"))
    if pruner not in PRUNERS:
        raise ConfigError(f"{where}: tuning: pruner={pruner!r}: use one of {', '.join(PRUNERS)}")
    return TuningPlan(
        trials, metric, seed, tuple(flags), dict(shared), tuple(exclude), pruner, int(entry.get("sampler_seed", 0))
    )


# ---------------------------------------------------------------------------------------------- search space
def flag_keys(flags: Sequence[str]) -> set[str]:
    """The config keys ``--key=value`` flags set (``--rounds=10`` sets ``rounds``)."""
    return {f[2:].split("=", 1)[0] for f in flags if f.startswith("--") and "=" in f}


def method_classes(config: str) -> list[tuple[str, type]]:
    """``(config key prefix, class)`` of a config's method and of every method it wraps (``base``)."""
    import yaml

    try:
        data = yaml.safe_load(Path(config).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{config}: cannot read it as YAML ({exc})") from None
    found: list[tuple[str, type]] = []

    def visit(node: Any, prefix: str) -> None:
        if not isinstance(node, dict) or "class_path" not in node:
            return
        module_name, _, name = str(node["class_path"]).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError, ValueError):
            raise ConfigError(f"{config}: method class {node['class_path']!r} not found") from None
        found.append((f"{prefix}.init_args.", cls))
        for key, value in (node.get("init_args") or {}).items():
            visit(value, f"{prefix}.init_args.{key}")

    visit(data.get("method"), "method")
    if not found:
        raise ConfigError(f"{config}: no method with a class_path; tuning reads the method's declared knobs")
    return found


def search_space(config: str, row_flags: Sequence[str], plan: TuningPlan) -> dict[str, Any]:
    """The row's search space as W&B-format parameters over dotted config keys (see the module docstring)."""
    from fedhet.hparams import knobs

    fixed = flag_keys(row_flags)
    space: dict[str, Any] = {}
    for prefix, cls in method_classes(config):
        hparams = getattr(cls, "Hparams", None)
        if hparams is None:
            continue
        for knob in knobs(hparams):
            key = prefix + knob.name
            if key in fixed or any(fnmatch.fnmatchcase(knob.name, p) for p in plan.exclude):
                continue
            if knob.name in plan.shared:
                space[key] = plan.shared[knob.name]
            elif knob.search is not None:
                space[key] = knob.search.sweep_parameter()
    for key, parameter in plan.shared.items():
        if "." in key and key not in fixed:
            space[key] = parameter
    return dict(sorted(space.items()))


@functools.lru_cache(maxsize=1)
def fit_parser() -> Any:
    """The ``fedhet fit`` parser, built once per process (building it takes about a second)."""
    from fedhet.config import build_parser

    return build_parser()


#: jsonargparse changes the working directory while it reads a config file (relative paths in it
#: resolve from the file's folder), so rows tuned in parallel threads parse one at a time.
PARSE_LOCK = threading.Lock()


def resolved_config(config: str, flags: Sequence[str]) -> Any:
    """A config file plus ``fedhet fit`` flags, parsed and checked as ``fedhet fit`` would."""
    from fedhet.config import parse_config, prepare_args

    with PARSE_LOCK:
        return parse_config(fit_parser(), prepare_args(["--config", config, *flags]))


def configured_values(config: str, row_flags: Sequence[str], keys: Sequence[str]) -> dict[str, Any]:
    """The values the row runs with as configured (its config and flags), for the searched ``keys``."""
    resolved = resolved_config(config, row_flags)
    out = {}
    for key in keys:
        try:
            value = resolved[key]
        except (KeyError, TypeError):
            continue  # a key the config leaves to a default the parser does not hold
        out[key] = plain_value(value)
    return out


def plain_value(value: Any) -> Any:
    """A parsed value as a plain Python one (the parser's range types are subclasses of int, float, str)."""
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    return value


# ---------------------------------------------------------------------------------------------- trials
@dataclass(frozen=True)
class TrialRecord:
    """One finished trial of a row's study.

    ``point`` (the sampler's own coordinates), ``reported`` (the validation value of each round, the
    pruner's input) and ``configured`` are what :meth:`RowStudy.restore` needs to rebuild the study
    exactly from a page json when the study's storage is gone.
    """

    number: int
    params: dict[str, Any]
    value: float | None
    state: str  # complete, pruned or failed
    wall_s: float
    point: dict[str, Any] = field(default_factory=dict)
    reported: dict[int, float] = field(default_factory=dict)
    configured: bool = False  # trial 0: the row as configured

    def as_dict(self) -> dict[str, Any]:
        return {"number": self.number, "params": self.params, "value": self.value, "state": self.state,
                "wall_s": round(self.wall_s, 1), "point": self.point, "reported": self.reported,
                **({"configured": True} if self.configured else {})}  # fmt: skip


@dataclass
class StudyResult:
    """A tuned row: its search space, its trials and the selected point."""

    label: str
    space: dict[str, Any]
    trials: list[TrialRecord]
    selected: TrialRecord
    config: str  # the selected config (``fedhet fit --config`` reproduces the row)
    runner: str = LOCAL_RUNNER  # where the trials ran (or fedhet.tuning_ray.RUNNER)

    def as_dict(self) -> dict[str, Any]:
        return {"space": self.space, "trials": [t.as_dict() for t in self.trials],
                "selected": self.selected.as_dict(), "config": self.config, "runner": self.runner}  # fmt: skip


def validation_values(history: Sequence[dict[str, Any]], metric: str) -> list[tuple[int, float]]:
    """``(round, val/<metric>)`` of every evaluated round of a trial's records."""
    key = f"val/{metric}"
    return [
        (int(r["round"]), float(r[key]))
        for r in history
        if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
    ]


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a (possibly growing) ``metrics.jsonl``."""
    try:
        text = path.read_text()
    except OSError:
        return []
    lines = text.split("\n")[:-1]  # the last piece is empty or a line still being written
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class RowStudy:
    """The Optuna study of one row in the grid's SQLite file, and the ``fedhet fit`` runs of its trials."""

    def __init__(self, label: str, config: str, row_flags: Sequence[str], plan: TuningPlan, root: Path,
                 group: str) -> None:  # fmt: skip
        self.label, self.config, self.row_flags, self.plan = label, config, tuple(row_flags), plan
        # absolute, and trials start in this directory: parsing a config elsewhere (another row's
        # thread) briefly changes the process's working directory
        self.cwd = Path.cwd()
        self.root = self.cwd / root
        self.group = group
        self.space_spec = search_space(config, row_flags, plan)
        self.space: list[Param] = parse_parameters(self.space_spec) if self.space_spec else []
        self.distributions = optuna_distributions(self.space) if self.space else {}
        self.storage = f"sqlite:///{(self.root / 'tuning.sqlite').resolve()}"
        self.configured = configured_values(config, row_flags, list(self.space_spec))

    # -- study ---------------------------------------------------------------------------------
    def study(self, number: int) -> Any:
        """The row's study with a sampler seeded for trial ``number`` (a resumed study proposes the same)."""
        optuna = load_optuna()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = optuna.samplers.TPESampler(
            seed=derive_seed(self.plan.sampler_seed, self.label, number),
            n_startup_trials=startup_trials(self.plan.trials),
        )
        pruner = optuna.pruners.MedianPruner(n_startup_trials=startup_trials(self.plan.trials)) \
            if self.plan.pruner == "median" else optuna.pruners.NopPruner()  # fmt: skip
        self.root.mkdir(parents=True, exist_ok=True)
        return optuna.create_study(storage=self.storage, study_name=self.label, direction="maximize",
                                   sampler=sampler, pruner=pruner, load_if_exists=True)  # fmt: skip

    def params_of(self, trial: Any) -> dict[str, Any]:
        """The values a trial runs with: the row's configured values (trial 0), or the sampler's proposal."""
        if trial.user_attrs.get("configured"):
            return dict(self.configured)
        return optuna_point(self.space, trial.params) if self.space else {}

    def enqueue_configured(self, study: Any) -> None:
        """Trial 0 of every row runs the row as configured, so tuning never selects below it on validation."""
        point = optuna_internal(self.space, self.configured) if self.space else {}
        if point is None:  # a configured categorical value the space does not list: let TPE start anywhere
            return
        study.enqueue_trial(point, user_attrs={"configured": True}, skip_if_exists=False)

    def run_dir(self, number: int) -> Path:
        return self.root / "tuning" / self.label / f"trial{number}"

    def command(self, number: int, params: Mapping[str, Any]) -> list[str]:
        """The trial's ``fedhet fit``: the row, the trial budget, the proposal, the tuning seed, sealed test splits."""
        return [
            sys.executable, "-m", "fedhet", "fit", "--config", self.config, *self.row_flags, *self.plan.flags,
            *(override_flag(k, v) for k, v in params.items()),
            "--seed", str(self.plan.seed), "--federation.seal_test=true",
            f"--wandb.group={self.group}", f"--wandb.name={self.label}/trial{number}",
            "--run_dir", str(self.run_dir(number)),
        ]  # fmt: skip

    def resume_command(self, run_dir: Path) -> list[str]:
        """An interrupted trial's run goes on from its checkpoint (same config, same numbers)."""
        return [sys.executable, "-m", "fedhet", "fit", "--resume", str(run_dir)]

    # -- one trial -----------------------------------------------------------------------------
    def run_trial(self, study: Any, trial: Any, env: dict[str, str]) -> TrialRecord:
        """Run (or resume) one trial's ``fedhet fit``, reporting each round's validation value; tell the study."""
        params = self.params_of(trial)
        run_dir = self.run_dir(trial.number)
        state = cell_state(run_dir)
        if state == "partial":
            command = self.resume_command(run_dir)
        else:
            if state == "stale":
                import shutil

                shutil.rmtree(run_dir)
            command = self.command(trial.number, params)
        log_path = trial_log_path(run_dir)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        pruned = False
        code: int | None = 0  # a complete run is not started again
        reported = {step for t in study.get_trials(deepcopy=False) if t.number == trial.number
                    for step in t.intermediate_values}  # fmt: skip
        if state != "complete":
            with open(log_path, "a", encoding="utf-8") as log:
                log.write("$ " + shlex.join(command) + "\n")
                log.flush()
                process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd)
                while True:
                    if STOP.is_set():
                        process.terminate()
                        process.wait()
                        raise KeyboardInterrupt  # the trial stays running in the study: resumed next time
                    code = process.poll()
                    records = read_records(run_dir / "metrics.jsonl")
                    for round_idx, value in validation_values(records, self.plan.metric):
                        if round_idx in reported:
                            continue
                        reported.add(round_idx)
                        trial.report(value, round_idx)
                        # a run that has already ended is told complete, whatever its curve
                        pruned = pruned or (code is None and trial.should_prune())
                    if pruned:
                        process.terminate()
                        process.wait()
                        break
                    if code is not None:
                        break
                    time.sleep(POLL_S)
        wall = time.perf_counter() - started
        values = validation_values(read_records(run_dir / "metrics.jsonl"), self.plan.metric)
        last = values[-1][1] if values else None
        if pruned:
            return self.tell(study, trial, TrialRecord(trial.number, params, last, "pruned", wall))
        if cell_state(run_dir) == "complete" and last is None:
            raise ConfigError(
                f"tuning {self.label}: trial {trial.number} finished without a val/{self.plan.metric} value: the "
                "scenario holds no validation data for it (e.g. local_val_fraction 0); give it some in the grid"
            )
        if cell_state(run_dir) != "complete" or last is None:
            if code != EXIT_TRAINING_STOPPED:
                raise TrialInterrupted(self.label, trial.number, code, log_path)
            return self.tell(study, trial, TrialRecord(trial.number, params, None, "failed", wall))
        summary = json.loads((run_dir / "summary.json").read_text())  # the whole run's seconds, resumed or not
        return self.tell(study, trial, TrialRecord(trial.number, params, last, "complete",
                                                   float(summary.get("wall_s", wall))))  # fmt: skip

    @staticmethod
    def tell(study: Any, trial: Any, record: TrialRecord) -> TrialRecord:
        """Tell the study how ``trial`` ended, keeping its run's seconds for the page's cost line.

        Optuna's own start-to-end time would count a resumed trial from its resumption only.
        """
        from optuna.trial import TrialState

        trial.set_user_attr("wall_s", record.wall_s)
        if record.state == "complete":
            study.tell(trial, record.value)
        else:
            study.tell(trial, state=TrialState.PRUNED if record.state == "pruned" else TrialState.FAIL)
        return record

    # -- the study -----------------------------------------------------------------------------
    def finished(self) -> list[TrialRecord]:
        """The row's finished trials, in order, from the study's storage."""
        from optuna.trial import TrialState

        names = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "failed"}
        out = []
        for t in self.study(0).get_trials(deepcopy=False):
            if t.state in names:
                wall = (t.datetime_complete - t.datetime_start).total_seconds() if t.datetime_complete else 0.0
                out.append(TrialRecord(t.number, self.params_of(t), t.value, names[t.state],
                                       float(t.user_attrs.get("wall_s", wall)), dict(t.params),
                                       dict(t.intermediate_values), bool(t.user_attrs.get("configured"))))  # fmt: skip
        return out

    def restore(self, trials: Sequence[Mapping[str, Any]]) -> int:
        """Rebuild an empty study from the finished trials a page json kept (its storage went with ``runs/``).

        The trials go back with their sampler coordinates, values, states and reported rounds, in
        their order, so the sampler (seeded per trial number) proposes what it would have proposed
        had the study never been lost. Returns how many were restored: none when the study already
        has trials (its storage survived) or when the json's trials are not ``0, 1, ...`` with their
        coordinates (written before they were kept): the row is then tuned from the start.
        """
        optuna = load_optuna()
        from optuna.trial import TrialState

        study = self.study(0)
        ordered = sorted(trials, key=lambda t: int(t["number"]))
        if study.get_trials(deepcopy=False) or not ordered:
            return 0
        if [int(t["number"]) for t in ordered] != list(range(len(ordered))) or \
                any("point" not in t for t in ordered):  # fmt: skip
            return 0
        states = {"complete": TrialState.COMPLETE, "pruned": TrialState.PRUNED, "failed": TrialState.FAIL}
        for t in ordered:
            state = states[t["state"]]
            study.add_trial(optuna.trial.create_trial(
                state=state,
                value=t["value"] if state == TrialState.COMPLETE else None,
                params=dict(t["point"]),
                distributions={name: self.distributions[name] for name in t["point"]},
                intermediate_values={int(step): float(v) for step, v in t.get("reported", {}).items()},
                user_attrs={"wall_s": float(t["wall_s"]), **({"configured": True} if t.get("configured") else {})},
            ))  # fmt: skip
        return len(ordered)

    def run(self, env: dict[str, str], echo: Callable[[str], None],
            on_trial: Callable[[RowStudy], None] | None = None) -> list[TrialRecord]:  # fmt: skip
        """Run the row's trials until ``plan.trials`` have finished (interrupted ones are resumed first).

        ``on_trial`` is called after each trial (a caller saves the row's finished trials with it).
        """
        optuna = load_optuna()
        from optuna.trial import TrialState

        study = self.study(0)
        if not study.get_trials(deepcopy=False):
            self.enqueue_configured(study)
        for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            # a trial the killed tuning run left running: reattach it (Optuna has no public call for
            # this; a Trial is its study plus its storage id) and resume its run from its checkpoint
            trial = optuna.trial.Trial(study, frozen._trial_id)
            record = self.run_trial(study, trial, env)
            echo(self.trial_line(record, "resumed, "))
            if on_trial is not None:
                on_trial(self)
        while True:
            done = len(self.finished())
            if done >= self.plan.trials:
                break
            if STOP.is_set():  # between two trials: the row is not tuned, and nothing may select from it
                raise KeyboardInterrupt
            study = self.study(len(study.get_trials(deepcopy=False)))
            trial = study.ask(self.distributions)
            record = self.run_trial(study, trial, env)
            echo(self.trial_line(record))
            if on_trial is not None:
                on_trial(self)
        return self.finished()[: self.plan.trials]

    def trial_line(self, record: TrialRecord, how: str = "") -> str:
        """``<row>: trial <n>/<trials> [resumed, ]<state>, val/<metric> <value>``, numbered from 1 for every trial."""
        number = f"{record.number + 1}/{self.plan.trials}"
        return f"{self.label}: trial {number} {how}{record.state}, val/{self.plan.metric} {record.value}"


def select(trials: Sequence[TrialRecord], label: str) -> TrialRecord:
    """The best complete trial (highest validation value; the earliest on ties)."""
    complete = [t for t in trials if t.state == "complete" and t.value is not None]
    if not complete:
        raise ConfigError(
            f"tuning {label}: none of its {len(trials)} trials completed with a validation value; see their logs "
            "(a scenario without validation data for the metric, e.g. local_val_fraction 0, records none)"
        )
    return max(complete, key=lambda t: (t.value, -t.number))


def write_selected_config(config: str, row_flags: Sequence[str], params: Mapping[str, Any], path: Path,
                          header: str) -> None:  # fmt: skip
    """The row's config with its flags and the selected values, resolved into one file ``fedhet fit --config`` runs.

    A file already there that resolves to the same run is kept byte for byte: the row's seed runs
    are tagged with its digest (:meth:`fedhet.pages.GridPage.selection_tag`), and a key that a
    later fedhet adds with its default (the file then lacks it) must not orphan runs of the same
    selection.
    """
    resolved = resolved_config(config, [*row_flags, *(override_flag(k, v) for k, v in params.items())])
    with PARSE_LOCK:
        text = fit_parser().dump(resolved, skip_none=False)
    if path.is_file():
        previous = resolved_config(str(path), [])
        with PARSE_LOCK:
            if fit_parser().dump(previous, skip_none=False) == text:
                return
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, comment + text)


#: runs one row's trials and returns them finished: (study, environment, echo) -> trials
TrialRunner = Callable[["RowStudy", dict[str, str], Callable[[str], None]], list["TrialRecord"]]


def tune_rows(
    rows: Sequence[tuple[str, str, tuple[str, ...]]],
    plan: TuningPlan,
    root: Path,
    selected_dir: Path,
    page: str,
    env: dict[str, str],
    jobs: int = 1,
    echo: Callable[[str], None] = print,
    on_selected: Callable[[StudyResult], None] | None = None,
    trials: TrialRunner | None = None,
    runner: str = LOCAL_RUNNER,
    on_trial: Callable[[str, dict[str, Any]], None] | None = None,
    restore: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> dict[str, StudyResult]:
    """Tune every ``(label, config, flags)`` row (``jobs`` rows at a time) and write each selected config.

    ``on_selected`` is called with each row's result as soon as its selection is written, one
    call at a time (so that a caller can save the study before the other rows finish).
    ``trials`` runs a row's trials elsewhere (:func:`fedhet.tuning_ray.ray_trials`: on a Ray
    cluster, one row at a time); ``runner`` names it on the page.

    ``on_trial(label, partial_study)`` is called after each local trial with the row's study so far
    (``as_dict`` form without ``selected``, marked ``partial``), and ``restore`` gives rows whose
    storage is gone their finished trials back (:meth:`RowStudy.restore`): a bench that loses
    ``runs/`` mid-row continues the row, not only the rows it finished.
    """
    from concurrent.futures import ThreadPoolExecutor, as_completed

    selected_lock = threading.Lock()

    studies = [RowStudy(label, config, flags, plan, root, f"tune/{page}/{label}") for label, config, flags in rows]
    selected_dir = Path.cwd() / selected_dir  # written from threads: see RowStudy
    for study in studies:
        study.study(0)  # create the storage and each study here, not in two threads at once
        echo(f"{study.label}: searching {', '.join(study.space_spec) or 'nothing (no declared search space)'}")
        restored = study.restore((restore or {}).get(study.label, ()))
        if restored:
            echo(f"{study.label}: {restored} finished trials restored from the page json")

    def saved(study: RowStudy) -> None:
        if on_trial is not None:
            partial = {"space": study.space_spec, "trials": [t.as_dict() for t in study.finished()],
                       "runner": runner, "partial": True}  # fmt: skip
            with selected_lock:
                on_trial(study.label, partial)

    def one(study: RowStudy) -> StudyResult:
        finished = study.run(env, echo, saved) if trials is None else trials(study, env, echo)
        best = select(finished, study.label)
        path = selected_dir / f"{study.label}.yaml"
        shown = path.relative_to(study.cwd) if path.is_relative_to(study.cwd) else path
        header = (f"{study.label}: selected by the tuning stage of 'fedhet bench --grid' for {page}: trial "
                  f"{best.number} of {plan.trials}, val/{plan.metric} = {best.value:.2f} at seed {plan.seed}.\n"
                  f"Selected: {json.dumps(best.params)}\nRun: fedhet fit --config {shown}")  # fmt: skip
        write_selected_config(study.config, study.row_flags, best.params, path, header)
        result = StudyResult(study.label, study.space_spec, list(finished), best, str(shown), runner)
        if on_selected is not None:
            with selected_lock:
                on_selected(result)
        return result

    STOP.clear()
    try:
        if jobs <= 1 or trials is not None:
            results = [one(s) for s in studies]
        else:
            with ThreadPoolExecutor(max_workers=jobs) as pool, cancel_queued_on_exit(pool, on_exit=STOP.set):
                futures = [pool.submit(one, s) for s in studies]
                for future in as_completed(futures):  # a row that raises stops the others now, not when
                    future.result()  # the rows submitted before it have finished
                results = [future.result() for future in futures]
    finally:
        STOP.clear()
    return {r.label: r for r in results}


__all__ = [
    "RowStudy",
    "StudyResult",
    "TrialInterrupted",
    "TrialRecord",
    "TuningPlan",
    "parse_tuning",
    "search_space",
    "tune_rows",
]
