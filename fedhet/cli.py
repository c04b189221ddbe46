"""The ``fedhet`` command line: parse, compose configs, build objects, run; nothing else.

``fedhet fit --config A.yaml [--config B.yaml ...] [--dotted.key value | --dotted.key=value ...]``
runs one experiment. The parser is a jsonargparse ``ArgumentParser`` built from the typed
``__init__`` signatures of the method (``method``: any :class:`~fedhet.algorithms.Algorithm`,
chosen by ``class_path`` or class name), the scenario, the Trainer template, the federation
settings and W&B, so ``--help``, ``--print_config`` and type checking come from the code itself.
Later configs and flags override earlier ones; W&B sweep agents append ``--key=value`` flags
after the config (``configs/sweeps/``).

Why not LightningCLI itself: it fits one model with one Trainer, and its subcommands are methods
of the Trainer class, while a federated run drives many modules and Trainers from one round loop.
The modules stay LightningCLI-compatible (typed ``__init__``), so each also trains standalone.

Every user error ends in one line, ``fedhet: error: <problem>; <fix>``, and exit status 2.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from fedhet.errors import ConfigError, FedhetError
from fedhet.federation.executors import Executor
from fedhet.federation.privacy import PayloadNoise

log = logging.getLogger("fedhet")

StateStoreKind = Literal["auto", "memory", "disk"]


class FederationSettings:
    """Round-loop settings.

    Args:
        participation: fraction of clients per round (float in (0, 1]) or a count (int).
        eval_every: evaluate every this many rounds (the last round always).
        state_store: ``"memory"``, ``"disk"`` (one file per client under the run directory) or
            ``"auto"`` (disk when there are more than ``disk_threshold`` clients).
        disk_threshold: client count above which ``"auto"`` keeps client states on disk.
        executor: where client steps run: ``null`` (sequential, in-process) or an executor class
            with its arguments, e.g. ``{class_path: fedhet.federation.ProcessExecutor, init_args:
            {workers: 2}}``.
        eval_clients: which clients are evaluated: ``"all"``, ``"participants"`` (the round's), a
            number sampled per evaluation, or ``"auto"`` (all up to 100 clients, participants above).
        extra_rounds: full-participation rounds after the federated rounds (equal budgets for
            baselines of methods with a post-federation phase, e.g. FedVTC's).
        on_invalid_upload: ``"fail"`` (stop, naming the sender) or ``"drop"`` (continue without it,
            counted in ``comm/dropped_uploads``).
        upload_norm_bound: refuse uploads whose update norm exceeds this multiple of the round's
            median, naming the client (``null``: no bound).
        persist_optimizer_state: carry each client's optimizer state (momentum, Adam moments)
            across rounds; off restarts the optimizer every round as HtFLlib does.
        upload_noise: FedPCL-style Gaussian perturbation of every upload (privacy studies,
            FedKTL Tab. 10 "NC"); ``null``: none.
        download_noise: the same for every download ("NG"); ``null``: none.
    """

    def __init__(
        self,
        participation: float | int = 1.0,
        eval_every: int = 1,
        state_store: StateStoreKind = "auto",
        disk_threshold: int = 50,
        executor: Executor | None = None,
        eval_clients: Literal["auto", "all", "participants"] | int = "auto",
        extra_rounds: int = 0,
        on_invalid_upload: Literal["fail", "drop"] = "fail",
        upload_norm_bound: float | None = None,
        persist_optimizer_state: bool = True,
        upload_noise: PayloadNoise | None = None,
        download_noise: PayloadNoise | None = None,
    ) -> None:
        self.participation = participation
        self.eval_every = eval_every
        self.state_store = state_store
        self.disk_threshold = disk_threshold
        self.executor = executor
        self.eval_clients = eval_clients
        self.extra_rounds = extra_rounds
        self.on_invalid_upload = on_invalid_upload
        self.upload_norm_bound = upload_norm_bound
        self.persist_optimizer_state = persist_optimizer_state
        self.upload_noise = upload_noise
        self.download_noise = download_noise


def build_parser() -> Any:
    """The ``fedhet fit`` parser (jsonargparse)."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    from fedhet.algorithms import Algorithm
    from fedhet.data import FederatedScenario
    from fedhet.federation.trainer import ServerTrainerTemplate, TrainerTemplate
    from fedhet.tracking import WandbConfig

    parser = ArgumentParser(
        prog="fedhet fit",
        description="Run one federated experiment.",
        exit_on_error=False,
        default_meta=False,
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config; repeat to compose (later wins)")
    parser.add_argument("--seed", type=int, default=0, help="experiment seed (initialisation, sampling, batch order)")
    parser.add_argument("--rounds", type=int, default=10, help="communication rounds")
    parser.add_argument("--run_dir", type=str | None, default=None, help="run directory (default runs/<method>-<time>)")
    parser.add_argument(
        "--models", type=str | list[str], default="cpu4", help="model family name or list of registered model names"
    )
    parser.add_argument(
        "--feature_dim", type=int | None, default=None, help="common feature dimension (linear neck on every backbone)"
    )
    parser.add_subclass_arguments(Algorithm, "method", required=True, help="the federated method")
    # No default scenario: jsonargparse would carry a default's init_args (e.g. public data) over
    # to another scenario class chosen in a config.
    parser.add_subclass_arguments(FederatedScenario, "scenario", required=True, help="the federated scenario")
    parser.add_class_arguments(TrainerTemplate, "trainer", help="Trainer template of every client fit")
    parser.add_class_arguments(
        ServerTrainerTemplate, "server_trainer", help="Trainer template of trained server stages (budgets are the method's)"
    )
    parser.add_class_arguments(FederationSettings, "federation", help="round-loop settings")
    parser.add_class_arguments(WandbConfig, "wandb", help="Weights & Biases logging")
    return parser


def _one_line(message: str) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= 400 else text[:397] + "..."


def _parse(parser: Any, args: Sequence[str]) -> Any:
    from jsonargparse import ArgumentError

    from fedhet.sweep import parse_accepting_none

    try:
        return parse_accepting_none(parser, list(args))
    except ArgumentError as exc:
        raise ConfigError(f"{_one_line(str(exc))}; see 'fedhet fit --help' or --print_config") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file is not valid YAML ({_one_line(str(exc))})") from None


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


#: Keys a resumed run may differ in from the run it continues.
RESUMABLE_KEYS = ("rounds", "run_dir", "config")


def fit(args: Sequence[str], callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Run ``fedhet fit`` with ``args``; returns the summary. Raises :class:`FedhetError` on bad input.

    ``callbacks`` are extra round observers (``on_round_end(loop, record)``, ``on_run_end(loop,
    summary)``) for programs that drive experiments, e.g. to keep per-round server artifacts.
    """
    import torch

    from fedhet.federation.trainer import silence_lightning

    silence_lightning()
    # Adam's second moments and near-zero KL terms turn subnormal as models converge, and x86
    # arithmetic on subnormals is ~100x slower; flushing them to zero changes no result that matters.
    torch.set_flush_denormal(True)
    resume, rest = _split_resume(args)
    parser = build_parser()
    if resume is not None:
        from fedhet.tracking import RunDirectory

        saved = RunDirectory(resume)
        if not saved.config_path.is_file():
            raise ConfigError(f"--resume {resume}: no config.yaml there; pass the directory of an earlier run")
        if saved.is_complete():
            raise ConfigError(f"--resume {resume}: that run already finished (summary.json exists); raise --rounds in a new run")
        rest = ["--config", str(saved.config_path), *rest]
    if any(a == "--print_config" or a.startswith("--print_config=") for a in rest):
        from fedhet.sweep import parse_accepting_none

        parser.exit_on_error = True
        parse_accepting_none(parser, rest)  # prints and exits
    config = _parse(parser, rest)
    if resume is not None:
        original = yaml.safe_load(RunDirectory(resume).config_path.read_text())
        current = yaml.safe_load(parser.dump(config, skip_none=False))
        changed = sorted(
            k for k in set(original) | set(current) if k not in RESUMABLE_KEYS and original.get(k) != current.get(k)
        )
        if changed:
            raise ConfigError(
                f"--resume continues a run with its own config; only --rounds may change (changed: {', '.join(changed)})"
            )
        config.run_dir = resume
    return run_experiment(parser, config, resume=resume is not None, callbacks=callbacks)


def _instantiate(parser: Any, config: Any) -> Any:
    try:
        return parser.instantiate_classes(config)
    except FedhetError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid configuration: {_one_line(str(exc))}") from None


def build_objects_from_yaml(config_yaml: str) -> tuple[Any, Any, Any]:
    """The method, scenario and client Trainer template of a resolved config (how workers rebuild a run)."""
    parser = build_parser()
    config = parser.parse_string(config_yaml)
    objects = _instantiate(parser, config)
    return objects.method, objects.scenario, objects.trainer


def run_experiment(parser: Any, config: Any, resume: bool = False, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Build the objects of a parsed config and run the round loop with results files and logging."""
    from fedhet.federation import DiskStateStore, FederationLoop, MemoryStateStore, RuntimeRecipe
    from fedhet.models import model_for_client, resolve_family
    from fedhet.tracking import ConsoleCallback, RunDirectory, RunDirectoryCallback, WandbCallback
    from fedhet.tracking.figures import FiguresCallback

    resolved_yaml = parser.dump(config, skip_none=False)
    objects = _instantiate(parser, config)
    method, scenario, federation = objects.method, objects.scenario, objects.federation
    family = resolve_family(objects.models)
    family_name = objects.models if isinstance(objects.models, str) else "custom"
    scenario.setup()
    architectures = [model_for_client(family, c) for c in range(scenario.num_clients)]

    run_path = Path(config.run_dir or f"runs/{type(method).__name__.lower()}-{time.strftime('%Y%m%d-%H%M%S')}-s{config.seed}")
    run_dir = RunDirectory(run_path)
    checkpoint = run_dir.load_checkpoint() if resume else None
    if not resume:
        run_dir.ensure_new()

    use_disk = federation.state_store == "disk" or (
        federation.state_store == "auto" and scenario.num_clients > federation.disk_threshold
    )
    # The loop validates the method/scenario/family combination: build it before writing anything.
    loop = FederationLoop(
        algorithm=method,
        scenario=scenario,
        architectures=architectures,
        trainer=objects.trainer,
        rounds=config.rounds,
        seed=config.seed,
        participation=federation.participation,
        eval_every=federation.eval_every,
        server_trainer=objects.server_trainer,
        state_store=DiskStateStore(run_path / "clients") if use_disk else MemoryStateStore(),
        executor=federation.executor,
        eval_clients=federation.eval_clients,
        extra_rounds=federation.extra_rounds,
        on_invalid_upload=federation.on_invalid_upload,
        upload_norm_bound=federation.upload_norm_bound,
        recipe=RuntimeRecipe(
            architectures=tuple(architectures),
            seed=config.seed,
            rounds=config.rounds,
            persist_optimizer_state=federation.persist_optimizer_state,
            feature_dim=config.feature_dim,
            config_yaml=resolved_yaml,
        ),
        persist_optimizer_state=federation.persist_optimizer_state,
        upload_noise=federation.upload_noise,
        download_noise=federation.download_noise,
        feature_dim=config.feature_dim,
        family_name=family_name,
    )
    if not resume:
        run_dir.create(resolved_yaml)
    wandb_callback = WandbCallback(
        objects.wandb, run_path, yaml.safe_load(resolved_yaml), checkpoint.get("wandb_id") if checkpoint else None
    )
    loop.callbacks = [  # figures first: drawn before summary.json marks the run complete and W&B finishes
        FiguresCallback(run_path),
        RunDirectoryCallback(run_dir, {"wandb_id": wandb_callback.run_id}), ConsoleCallback(), wandb_callback, *callbacks
    ]
    if checkpoint is not None:
        loop.load_checkpoint_state(checkpoint)
        run_dir.truncate_metrics(loop.next_round)
        log.info("resuming %s at round %d of %d", run_path, loop.next_round + 1, loop.rounds)
    else:
        log.info("run directory: %s", run_path)
    try:
        summary = loop.run()
    except BaseException:
        wandb_callback.abort()
        raise
    summary["run_dir"] = str(run_path)
    return summary


def _list(args: Sequence[str]) -> None:
    from fedhet.algorithms import list_algorithms
    from fedhet.models import list_families, list_models

    print("methods: " + ", ".join(list_algorithms()))
    print("models: " + ", ".join(list_models()))
    print("model families: " + ", ".join(list_families()))


USAGE = """usage: fedhet <command> [options]

commands:
  fit     run one experiment: fedhet fit --config configs/experiments/digits/fedproto.yaml
  list    list registered methods, models and model families
  sweep   run a W&B-format sweep offline: fedhet sweep configs/sweeps/tiny_digits.yaml [--jobs 2]
  bench   methods x seeds grid, mean ± std tables and plots:
          fedhet bench --configs A.yaml B.yaml --seeds 0 1 2 --out DIR
  pretrain-generator  train FedKTL's small generator once: fedhet pretrain-generator [--steps N]

'fedhet fit --help' shows every option; '--print_config' the resolved config."""


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
        if command == "fit":
            from fedhet.tracking import format_summary

            summary = fit(rest)
            print(format_summary(summary))
            print(f"results: {summary['run_dir']}/summary.json")
            return 0
        if command == "list":
            _list(rest)
            return 0
        if command in ("sweep", "bench"):
            from fedhet.bench import bench_command
            from fedhet.sweep import sweep_command

            return (sweep_command if command == "sweep" else bench_command)(rest)
        if command == "pretrain-generator":
            from fedhet.generators.pretrain import pretrain_command

            print(pretrain_command(rest))
            return 0
        commands = "'fit', 'list', 'sweep', 'bench' or 'pretrain-generator'"
        print(f"fedhet: error: unknown command '{command}'; use {commands}", file=sys.stderr)
        return 2
    except FedhetError as exc:
        print(f"fedhet: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedhet: interrupted; continue the run with 'fedhet fit --resume <run_dir>'", file=sys.stderr)
        return 130
    finally:
        log.removeHandler(handler)


if __name__ == "__main__":
    raise SystemExit(main())
