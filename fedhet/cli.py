"""The ``fedhet`` command line: dispatch, help and one-line errors over the config layer.

``fedhet fit --config A.yaml [--config B.yaml ...] [--dotted.key value | --dotted.key=value ...]``
runs one experiment; ``fedhet test RUN_DIR`` / ``fedhet validate RUN_DIR`` re-evaluate a run's
saved state. Parsing, composing and instantiating configs is :mod:`fedhet.config` (the public
layer that ``bench``, ``sweep``, ``compare_configs`` and the executors' workers also use); this
module turns arguments into calls of it and its errors into one line each.

Why not LightningCLI itself: it fits one model with one Trainer, and its subcommands are methods
of the Trainer class, while a federated run drives many modules and Trainers from one round loop.
The modules stay LightningCLI-compatible (typed ``__init__``), so each also trains standalone.

Every user error ends in one line, ``fedhet: error: <problem>; <fix>``, and exit status 2, and
is raised before anything is written: values out of range when the config is parsed, a missing
accelerator before any object is built, method/scenario mismatches before the run directory is
claimed (exclusively: a run never writes into another's directory). The module imports neither
torch nor the methods, so ``fedhet --help``, ``--version`` and ``list`` answer at once.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from fedhet import __version__
from fedhet.catalog import METHODS, MODELS, list_families, list_methods
from fedhet.config import (
    Experiment,
    build_experiment,
    build_parser,
    changed_keys,
    check_environment,
    parse_accepting_none,
    parse_config,
    prepare_args,
)
from fedhet.errors import (
    EXIT_BAD_INPUT,
    EXIT_TRAINING_STOPPED,
    ConfigError,
    DiskError,
    FedhetError,
    TrainingError,
    disk_error,
)

if TYPE_CHECKING:
    from fedhet.federation.state import ClientStateStore

log = logging.getLogger("fedhet")


def _split_resume(args: Sequence[str]) -> tuple[str | None, list[str]]:
    rest: list[str] = []
    resume: str | None = None
    iterator = iter(args)
    for arg in iterator:
        if arg == "--resume":
            resume = next(iterator, None)
            if resume is None:
                raise ConfigError("--resume needs a run directory: fedhet fit --resume runs/<run>")
        elif arg.startswith("--resume="):
            resume = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return resume, rest


def _wants_print_config(args: Sequence[str]) -> bool:
    return any(a == "--print_config" or a.startswith("--print_config=") for a in args)


#: Keys a resumed run may differ in from the run it continues.
RESUMABLE_KEYS = ("rounds", "run_dir", "config")


def _quiet_numerics() -> None:
    import torch

    from fedhet.core.quiet import silence_lightning

    silence_lightning()
    # Adam's second moments and near-zero KL terms turn subnormal as models converge, and x86
    # arithmetic on subnormals is ~100x slower; flushing them to zero changes no result that matters.
    torch.set_flush_denormal(True)


def fit(args: Sequence[str], callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Run ``fedhet fit`` with ``args``; returns the summary. Raises :class:`FedhetError` on bad input.

    ``callbacks`` are extra round observers (``on_round_end(loop, record)``, ``on_run_end(loop,
    summary)``) for programs that drive experiments, e.g. to keep per-round server artifacts.
    """
    _quiet_numerics()
    resume, rest = _split_resume(args)
    parser = build_parser()
    if resume is not None:
        from fedhet.tracking import RunDirectory

        saved = RunDirectory(resume)
        if not saved.config_path.is_file():
            raise ConfigError(f"--resume {resume}: no config.yaml there; pass the directory of an earlier run")
        if saved.is_complete():
            raise ConfigError(
                f"--resume {resume}: that run already finished (summary.json exists); raise --rounds in a new run"
            )
        rest = ["--config", str(saved.config_path), *rest]
    rest = prepare_args(rest)
    if _wants_print_config(rest):
        parser.exit_on_error = True
        parse_accepting_none(parser, rest)  # prints and exits
    config = parse_config(parser, rest)
    if resume is not None:
        changed = changed_keys(parser, config, saved.config_path, RESUMABLE_KEYS)
        if changed:
            raise ConfigError(
                "--resume continues a run with its own config; only --rounds may change "
                f"(changed: {', '.join(changed)})"
            )
        config.run_dir = resume
    return run_experiment(parser, config, resume=resume is not None, callbacks=callbacks)


def run_experiment(parser: Any, config: Any, resume: bool = False, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Build the objects of a parsed config and run the round loop with results files and logging.

    Order matters for "nothing written on bad input": the config is parsed and range-checked,
    the machine checked and the objects built before the run directory is claimed; if building
    the loop then fails (an incompatible method and scenario), the still-empty directory is
    removed again.
    """
    from fedhet.federation import DiskStateStore, MemoryStateStore
    from fedhet.tracking import ConsoleCallback, RunDirectory, RunDirectoryCallback, WandbCallback
    from fedhet.tracking.figures import FiguresCallback

    resolved_yaml = parser.dump(config, skip_none=False)
    checkpoint: dict[str, Any] | None = None
    if resume:  # a run that cannot continue says so before its data is loaded
        run_dir = RunDirectory(config.run_dir)
        run_dir.lock()  # not while it still runs (a dead holder's lock died with it)
        try:
            run_dir.remove_stale_temporaries()  # a killed writer's .checkpoint.pt.tmp<pid> ...
            checkpoint = run_dir.load_checkpoint()
        except BaseException:
            run_dir.unlock()
            raise
    elif config.run_dir is not None:
        RunDirectory(config.run_dir).check_available()  # the same check as claim's below, before any work
    try:
        experiment = build_experiment(parser, config)
    except BaseException:
        if resume:
            run_dir.unlock()
        raise
    if not resume:
        explicit = config.run_dir is not None
        run_dir = RunDirectory.claim(config.run_dir if explicit else experiment.default_run_path(), unique=not explicit)
    run_path = run_dir.path
    try:
        store = DiskStateStore(run_path / "clients") if experiment.uses_disk_store() else MemoryStateStore()
        loop = experiment.build_loop(store, resolved_yaml)
        if not resume:
            run_dir.create(resolved_yaml)
    except BaseException:
        run_dir.release()
        raise
    try:  # the run directory stays locked until the run ends, however it ends
        wandb_id = checkpoint.get("wandb_id") if checkpoint else None
        wandb_callback = WandbCallback(experiment.objects.wandb, run_path, yaml.safe_load(resolved_yaml), wandb_id)
        loop.callbacks = [  # figures first: drawn before summary.json marks the run complete and W&B finishes
            FiguresCallback(run_path),
            RunDirectoryCallback(run_dir, {"wandb_id": wandb_callback.run_id}),
            ConsoleCallback(),
            wandb_callback,
            *callbacks,
        ]
        if checkpoint is not None:
            loop.load_checkpoint_state(checkpoint)
            run_dir.truncate_metrics(loop.next_round)
            log.info("resuming %s at step %d of %d", run_path, loop.next_round + 1, len(loop.schedule))
        else:
            log.info("run directory: %s", run_path)
        try:
            summary = loop.run()
        except BaseException as exc:
            wandb_callback.abort()
            if isinstance(exc, KeyboardInterrupt):
                exc.next_step = f"continue the run with 'fedhet fit --resume {run_path}'"  # type: ignore[attr-defined]
            if isinstance(exc, DiskError) and run_dir.checkpoint_path.is_file():
                raise exc.with_next_step(f"then continue the run with 'fedhet fit --resume {run_path}'") from None
            raise
    finally:
        run_dir.unlock()
    summary["run_dir"] = str(run_path)
    return summary


# ------------------------------------------------------------------------------ test / validate
#: Keys ``fedhet test``/``validate`` may change: the evaluation sets and how evaluation runs.
EVALUATION_KEYS = ("scenario", "trainer", "wandb", "run_dir", "config")


def _read_only_disk_store(directory: Path) -> ClientStateStore:
    """The run's on-disk client states, never modified.

    ``DiskStateStore.restore`` prunes files of rounds that never committed; evaluating a run
    that is still training must not delete the files of its round in progress.
    """
    from fedhet.federation import DiskStateStore

    class ReadOnlyDiskStateStore(DiskStateStore):
        def prune(self) -> None:
            """Keep every file: evaluation only reads."""

    return ReadOnlyDiskStateStore(directory)


def evaluate_run(
    run_dir: str | Path, args: Sequence[str] = (), split: Literal["test", "val"] = "test"
) -> dict[str, Any]:
    """Re-evaluate a run's saved state (``checkpoint.pt``) on its test or validation sets, without training.

    ``args`` may override the scenario (``--scenario.test_per_domain=1000``, or another
    scenario's sets through ``--scenario=...``/``--config``; the number of clients must stay the
    same) and the Trainer (``--trainer.accelerator``); nothing else, since the method, models and
    seed must be the ones the state was trained with. Nothing is written to the run directory.
    Returns a summary in the shape of ``summary.json`` (``final`` holds this evaluation).
    """
    from fedhet.federation import MemoryStateStore
    from fedhet.tracking import RunDirectory

    _quiet_numerics()
    saved = RunDirectory(run_dir)
    command = "fedhet test" if split == "test" else "fedhet validate"
    if not saved.config_path.is_file():
        raise ConfigError(f"'{run_dir}' has no config.yaml; pass the directory of a run: {command} runs/<run>")
    if not saved.checkpoint_path.is_file():
        raise ConfigError(
            f"'{run_dir}' has no checkpoint.pt: the run stopped before its first round ended, so there is no "
            f"trained state to evaluate; {saved.rerun_hint()}"
        )
    parser = build_parser(prog=command)
    config = parse_config(parser, prepare_args(["--config", str(saved.config_path), *args]))
    changed = changed_keys(parser, config, saved.config_path, EVALUATION_KEYS)
    if changed:
        raise ConfigError(
            f"{command} evaluates the run's own method and models; only --scenario and --trainer options may "
            f"change (changed: {', '.join(changed)})"
        )
    experiment = build_experiment(parser, config, logging_run=False)
    if "scenario" in changed_keys(parser, config, saved.config_path, ()):
        saved_config = parse_config(parser, ["--config", str(saved.config_path)])
        original = build_experiment(parser, saved_config, logging_run=False)
        if original.scenario.num_clients != experiment.scenario.num_clients:
            raise ConfigError(
                f"the run has {original.scenario.num_clients} clients but the overriding scenario has "
                f"{experiment.scenario.num_clients}; evaluate on a scenario with the same number of clients"
            )
    from fedhet.federation.loop import final_metrics

    store = _read_only_disk_store(saved.path / "clients") if experiment.uses_disk_store() else MemoryStateStore()
    loop = experiment.build_loop(store)
    loop.load_checkpoint_state(saved.load_checkpoint())
    round_idx = loop.next_round - 1
    started = time.perf_counter()
    metrics = loop.evaluate(round_idx)
    wall_s = time.perf_counter() - started
    if split == "test":
        final = final_metrics(metrics)
        matrix = loop.last_matrix
    else:
        final = {k.removeprefix("val/"): v for k, v in metrics.items() if k.startswith("val/")}
        matrix = {}  # the loop's matrix is over the test sets
    log.info("%s: %s after round %d of %d", command, saved.path, round_idx + 1, config.rounds)
    return {
        "method": type(experiment.method).__name__,
        "scenario": type(experiment.scenario).__name__,
        "scenario_kind": experiment.scenario.kind,
        "seed": config.seed,
        "rounds": round_idx + 1,
        "split": split,
        "run_dir": str(saved.path),
        "final": final,
        "best": {},
        "last3": {},
        "matrix": matrix,
        "wall_s": round(wall_s, 3),
    }


# ------------------------------------------------------------------------------ other commands
def _list(args: Sequence[str]) -> None:
    """Print the registered names, from the static catalog: no torch import, so it answers at once.

    ``fedhet list METHOD`` prints that method's declared hyperparameters instead (imports it).
    """
    if args:
        from fedhet.algorithms import get_algorithm
        from fedhet.hparams import describe

        for name in args:
            method = get_algorithm(name)
            print(f"{name} ({method.__module__}.{method.__name__}) hyperparameters, config keys method.init_args.*:")
            print("\n".join(describe(method.Hparams)))
        return
    print("methods: " + ", ".join(list_methods()))
    print("models: " + ", ".join(sorted(MODELS)))
    print("model families: " + ", ".join(list_families()))


USAGE = f"""usage: fedhet <command> [options]

commands:
  fit       run one experiment: fedhet fit --config configs/experiments/digits/fedproto.yaml
            (--method NAME with a name from 'fedhet list'; --resume RUN_DIR continues a run)
  test      re-evaluate a run's saved state on its test sets: fedhet test runs/<run> [--scenario...]
  validate  the same on its validation sets: fedhet validate runs/<run>
  sweep     run a W&B-format sweep offline: fedhet sweep configs/sweeps/tiny_digits.yaml [--jobs 2]
  bench     methods x seeds grid, mean ± std tables and plots:
            fedhet bench --configs A.yaml B.yaml --seeds 0 1 2 --out DIR
  attack    one gradient-inversion cell (FedMD-CG's Table 2) into a run directory:
            fedhet attack --config configs/attacks/fedmdcg_table2.yaml --target fedmdcg --seed 0
  list      list registered methods, models and model families; 'fedhet list NAME' a method's
            hyperparameters (default, range, search space, meaning)
  pretrain-generator  train FedKTL's small generator (FedKTL also does it on first use):
            fedhet pretrain-generator [--name embedded-stylegan-pool] [--steps N]

options:
  --version  print the version ({__version__})

'fedhet fit --help' shows every option; '--print_config' the resolved config."""

EVALUATE_USAGE = """usage: fedhet {command} RUN_DIR [--scenario.KEY VALUE ...] [--trainer.accelerator ...]

Re-evaluate the saved state of RUN_DIR (its config.yaml and checkpoint.pt; a finished or an
interrupted run) on its {sets} sets without training, and print the metrics table of 'fit'.
--scenario... options (or a --config with another scenario) evaluate on another scenario's
sets with the same number of clients. Nothing is written."""


def _evaluate_command(command: str, rest: Sequence[str]) -> int:
    from fedhet.tracking import format_summary

    sets = "test" if command == "test" else "validation"
    if rest and rest[0] in ("-h", "--help"):
        print(EVALUATE_USAGE.format(command=command, sets=sets))
        return 0
    if not rest or rest[0].startswith("-"):
        raise ConfigError(f"fedhet {command} needs a run directory first: fedhet {command} runs/<run> [options]")
    summary = evaluate_run(rest[0], rest[1:], split="test" if command == "test" else "val")
    print(format_summary(summary))
    return 0


COMMANDS = ("fit", "test", "validate", "sweep", "bench", "attack", "list", "pretrain-generator")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fedhet`` console script and ``python -m fedhet``."""
    # MKL adapts its thread count to the machine's load by default, which changes the order of
    # floating-point reductions and so the last bits of results between identical runs on a busy
    # machine. Fixed thread counts keep "same seed, same numbers" (set before torch loads MKL).
    os.environ.setdefault("MKL_DYNAMIC", "FALSE")
    args = list(sys.argv[1:] if argv is None else argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        if not args or args[0] in ("-h", "--help"):
            print(USAGE)
            return 0 if args else 2
        command, rest = args[0], args[1:]
        if command in ("--version", "-V", "version"):
            print(f"fedhet {__version__}")
            return 0
        if command == "fit":
            from fedhet.tracking import format_summary

            summary = fit(rest)
            print(format_summary(summary))
            print(f"results: {summary['run_dir']}/summary.json")
            return 0
        if command in ("test", "validate"):
            return _evaluate_command(command, rest)
        if command == "attack":
            from fedhet.privacy.command import attack_command

            print(attack_command(rest))
            return 0
        if command == "list":
            _list(rest)
            return 0
        if command in ("sweep", "bench"):
            from fedhet.pages import bench_main
            from fedhet.sweep import sweep_command

            return (sweep_command if command == "sweep" else bench_main)(rest)
        if command == "pretrain-generator":
            from fedhet.generators.command import pretrain_command

            print(pretrain_command(rest))
            return 0
        import difflib

        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"fedhet: error: unknown command '{command}'{hint}; use one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except FedhetError as exc:
        print(f"fedhet: error: {exc}", file=sys.stderr)
        return EXIT_TRAINING_STOPPED if isinstance(exc, TrainingError) else EXIT_BAD_INPUT
    except OSError as exc:  # a full disk or read-only directory a writer did not name itself
        error = disk_error(exc.filename or "<unknown file>", exc)
        if error is None:
            raise
        print(f"fedhet: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:
        next_step = getattr(exc, "next_step", "rerun the same command to continue")  # set by the command interrupted
        print(f"fedhet: interrupted; {next_step}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (``fedhet list | head``): stop quietly, as Unix tools do; stdout is
        # pointed at devnull so that the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    finally:
        log.removeHandler(handler)


__all__ = [
    "METHODS",
    "Experiment",
    "build_experiment",
    "build_parser",
    "check_environment",
    "evaluate_run",
    "fit",
    "main",
    "run_experiment",
]


if __name__ == "__main__":
    raise SystemExit(main())
