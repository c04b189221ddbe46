"""The tuning stage on a Ray cluster: each row's trials through Ray Tune, with the same search.

``fedhet bench --grid FILE --ray_address ADDRESS`` (``local`` starts Ray on this machine, ``auto``
joins the cluster this machine belongs to) runs the trials of every tuned row as Ray Tune trials,
placed on whichever node has ``threads`` free CPUs, instead of as local processes. What stays the
same as on one machine (:mod:`fedhet.tuning`):

* the row's search space (its method's declared knobs, the grid's ``shared`` and ``exclude``),
  searched by Optuna's TPE sampler (Ray Tune's ``OptunaSearch``) with the same number of random
  startup trials, the row as configured as its first trial, and ``plan.trials`` trials per row;
* each trial is the same ``fedhet fit`` command: the row's config and flags, the grid's trial
  flags, the proposal, the tuning seed and sealed test splits, its run directory under the grid's
  ``out`` (the nodes need a filesystem they share, as Ray Tune's own storage does);
* the score (``val/<metric>`` at the last evaluated round), the selection (:func:`select`) and the
  selected config, so the page's seeds run exactly what the local stage would have written.

What differs, and is said on the page (the plan's sampler line): Ray Tune's ``OptunaSearch``
keeps one sampler per row where the local stage seeds one per trial number, so the proposals
after the startup trials are not those of a local run of the same grid; the median pruner
becomes Ray Tune's ``MedianStoppingRule`` (a trial stops when its best validation value is below
the median of the other trials' at the same round, after ``startup`` trials). A killed tuning run
resumes from Ray Tune's experiment state under ``<out>/ray_tune/`` (``Tuner.restore``), and an
interrupted trial's run goes on from its checkpoint, as locally. Rows run one after another, each
with as many concurrent trials as the cluster has room for.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedhet.bench import cell_state
from fedhet.errors import EXIT_TRAINING_STOPPED, ConfigError
from fedhet.seeding import derive_seed
from fedhet.sweep_engine import Param, load_optuna, optuna_internal, optuna_point
from fedhet.tuning import (
    POLL_S,
    RowStudy,
    TrialInterrupted,
    TrialRecord,
    TrialRunner,
    read_records,
    startup_trials,
    trial_log_path,
    validation_values,
)

#: the metric every report carries (the trial's latest ``val/<metric>``)
VALUE = "value"


def import_ray_tune() -> Any:
    """``ray.tune``, or one line saying how to install it."""
    try:
        from ray import tune
    except ImportError:
        raise ConfigError(
            "--ray_address: the tuning stage on Ray needs Ray Tune, which is not installed; "
            "pip install 'fedhet[ray]' \"ray[tune]\""
        ) from None
    return tune


def connect(address: str) -> None:
    """Join the Ray cluster at ``address`` (``local``: start Ray on this machine); once per process."""
    import ray

    if ray.is_initialized():
        return
    try:
        ray.init(address=None if address == "local" else address, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)  # fmt: skip
    except ConnectionError as exc:
        raise ConfigError(f"--ray_address {address}: no Ray cluster there ({exc}); start one, or use local") from None


@dataclass(frozen=True)
class RayRow:
    """What a trial needs on the node that runs it (pickled to it): the row's command and where to write."""

    label: str
    metric: str
    space: tuple[Param, ...]
    configured: dict[str, Any]
    command_base: tuple[str, ...]  # fedhet fit with the row's config and every flag but the proposal and run dir
    resume_base: tuple[str, ...]  # fedhet fit --resume, without the run directory
    tuning_dir: str
    cwd: str
    env: dict[str, str]

    def run_dir(self, number: int) -> Path:
        return Path(self.tuning_dir) / f"trial{number}"


def trial_name(trial: Any) -> str:
    """``trial<k>``, k the trial's 0-based place in its row (Ray Tune's experiment tag starts with it, 1-based)."""
    return f"trial{int(str(trial.experiment_tag).split('_', 1)[0]) - 1}"


def trial_number(name: str) -> int:
    """The number in a :func:`trial_name`."""
    return int(name.removeprefix("trial"))


def kill_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The trial's ``fedhet fit`` gets SIGTERM when the Ray worker running it dies (a stopped trial)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_trial(config: dict[str, Any], row: RayRow) -> None:
    """A Ray Tune function trainable: one trial's ``fedhet fit``, reporting each round's validation value.

    The last report says how the run ended (``complete``, or ``interrupted`` with its exit status when
    something other than its training stopped it), so the driver tells a failed trial from one the
    scheduler stopped (its last report is a running one) and from one to resume
    (:class:`~fedhet.tuning.TrialInterrupted`).
    """
    from ray import tune

    from fedhet.bench import override_flag

    number = trial_number(tune.get_context().get_trial_name())
    params = dict(row.configured) if number == 0 else (optuna_point(row.space, config) if row.space else {})
    run_dir = row.run_dir(number)
    state = cell_state(run_dir)
    if state == "partial":
        command = [*row.resume_base, str(run_dir)]
    else:
        if state == "stale":
            import shutil

            shutil.rmtree(run_dir)
        command = [*row.command_base, *(override_flag(k, v) for k, v in params.items()),
                   f"--wandb.name={row.label}/trial{number}", "--run_dir", str(run_dir)]  # fmt: skip
    log_path = trial_log_path(run_dir)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    reported: set[int] = set()
    code = 0
    if state != "complete":
        with open(log_path, "a", encoding="utf-8") as log:
            log.write("$ " + shlex.join(command) + "\n")
            log.flush()
            process = subprocess.Popen(command, env=row.env, stdout=log, stderr=subprocess.STDOUT, cwd=row.cwd,
                                       preexec_fn=kill_with_parent)  # fmt: skip
            while True:
                code = process.poll()
                for round_idx, value in validation_values(read_records(run_dir / "metrics.jsonl"), row.metric):
                    if round_idx not in reported:
                        reported.add(round_idx)
                        tune.report({VALUE: value, "round": round_idx, "ended": "running", "params": params,
                                     "number": number})  # fmt: skip
                if code is not None:
                    break
                time.sleep(POLL_S)
    values = validation_values(read_records(run_dir / "metrics.jsonl"), row.metric)
    complete = cell_state(run_dir) == "complete"
    wall = time.perf_counter() - started
    if complete:
        wall = float(json.loads((run_dir / "summary.json").read_text()).get("wall_s", wall))
    if not complete and code != EXIT_TRAINING_STOPPED:  # not the hyperparameters' doing: the driver stops the row
        last_round, last_value = values[-1] if values else (-1, math.nan)  # Tune wants the metric in every report
        tune.report({VALUE: last_value, "round": last_round, "ended": "interrupted", "exit": code, "params": params,
                     "number": number})  # fmt: skip
        raise RuntimeError(f"trial {number} of {row.label}: fedhet fit stopped with exit {code}; its log: {log_path}")
    if not complete or not values:  # the searcher records a failed trial, as the local stage does
        raise RuntimeError(f"trial {number} of {row.label}: fedhet fit ended with exit {code} and no "
                           f"val/{row.metric}; its log: {log_path}")  # fmt: skip
    tune.report({VALUE: values[-1][1], "round": values[-1][0], "ended": "complete", "params": params, "wall_s": wall,
                 "number": number})  # fmt: skip


def ray_row(study: RowStudy, env: dict[str, str]) -> RayRow:
    """A row's study as a trial on a node needs it: the trial command of :meth:`RowStudy.command` less its tail."""
    command = study.command(0, {})
    base = command[: command.index("--wandb.name=" + f"{study.label}/trial0")]
    resume = study.resume_command(Path("RUN_DIR"))
    return RayRow(study.label, study.plan.metric, tuple(study.space), dict(study.configured), tuple(base),
                  tuple(resume[:-1]), str(study.root / "tuning" / study.label), str(study.cwd), dict(env))  # fmt: skip


def record_of(result: Any) -> TrialRecord:
    """A finished Ray Tune trial as a :class:`TrialRecord` (pruned: stopped by the scheduler while running)."""
    metrics = result.metrics or {}
    number = metrics["number"] if "number" in metrics else trial_number(Path(result.path).name.split("_")[0])
    ended = metrics.get("ended", "failed")
    state = "complete" if ended == "complete" else "pruned" if ended == "running" and result.error is None \
        else "failed"  # fmt: skip
    value = metrics.get(VALUE) if state != "failed" else None
    return TrialRecord(number, dict(metrics.get("params") or {}), value, state,
                       float(metrics.get("wall_s") or metrics.get("time_total_s") or 0.0))  # fmt: skip


def tune_row_on_ray(
    study: RowStudy, env: dict[str, str], threads: int, echo: Callable[[str], None]
) -> list[TrialRecord]:
    """Run one row's ``plan.trials`` trials through Ray Tune (resuming its experiment) and return them in order."""
    tune = import_ray_tune()
    from ray.tune.schedulers import FIFOScheduler, MedianStoppingRule
    from ray.tune.search.optuna import OptunaSearch

    optuna = load_optuna()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    plan = study.plan
    startup = startup_trials(plan.trials)
    search = None
    if study.space:
        point = optuna_internal(study.space, study.configured)
        sampler = optuna.samplers.TPESampler(seed=derive_seed(plan.sampler_seed, study.label, 0),
                                             n_startup_trials=startup)  # fmt: skip
        search = OptunaSearch(space=study.distributions, metric=VALUE, mode="max", sampler=sampler,
                              points_to_evaluate=[point] if point is not None else None)  # fmt: skip
    scheduler = FIFOScheduler()
    if plan.pruner == "median":
        scheduler = MedianStoppingRule(time_attr="round", metric=VALUE, mode="max", grace_period=1,
                                       min_samples_required=startup)  # fmt: skip
    trainable = tune.with_resources(tune.with_parameters(run_trial, row=ray_row(study, env)), {"cpu": threads})
    storage = study.root / "ray_tune"
    name = study.label.replace("/", "__")
    if tune.Tuner.can_restore(storage / name):
        echo(f"{study.label}: resuming its Ray Tune experiment {storage / name}")
        tuner = tune.Tuner.restore(str(storage / name), trainable, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            tune_config=tune.TuneConfig(metric=VALUE, mode="max", search_alg=search, scheduler=scheduler,
                                        num_samples=plan.trials, trial_name_creator=trial_name,
                                        trial_dirname_creator=trial_name),  # fmt: skip
            run_config=tune.RunConfig(name=name, storage_path=str(storage), verbose=0),
        )
    results = tuner.fit()
    for result in results:  # as the local stage: the next run restores the experiment and reruns the trial
        metrics = result.metrics or {}
        if metrics.get("ended") == "interrupted":
            number = int(metrics["number"])
            raise TrialInterrupted(study.label, number, metrics.get("exit"), trial_log_path(study.run_dir(number)))
    records = sorted((record_of(result) for result in results), key=lambda r: r.number)
    for record in records:
        echo(f"{study.label}: trial {record.number + 1}/{plan.trials} {record.state}, val/{plan.metric} {record.value}")
    return records


def ray_trials(address: str, threads: int) -> TrialRunner:
    """The trial runner :func:`fedhet.tuning.tune_rows` takes: each row's trials on the Ray cluster at ``address``."""
    import_ray_tune()
    connect(address)

    def run(study: RowStudy, env: dict[str, str], echo: Callable[[str], None]) -> list[TrialRecord]:
        return tune_row_on_ray(study, env, threads, echo)

    return run


#: how the page names this runner (its budget line)
RUNNER = ("Ray Tune (OptunaSearch with the same TPE sampler settings, one sampler per row; the median pruner as "
          "MedianStoppingRule)")  # fmt: skip

__all__ = ["RUNNER", "RayRow", "connect", "import_ray_tune", "ray_trials", "run_trial", "tune_row_on_ray"]
