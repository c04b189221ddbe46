"""The ``fedhet`` command line: parse, compose configs, build objects, run; nothing else.

``fedhet fit --config A.yaml [--config B.yaml ...] [--dotted.key value | --dotted.key=value ...]``
runs one experiment. The parser is a jsonargparse ``ArgumentParser`` built from the typed
``__init__`` signatures of the method (``method``: any :class:`~fedhet.algorithms.Algorithm`,
chosen by registry name such as ``fccl_plus``, class name or ``class_path``), the scenario, the
Trainer template, the federation settings and W&B, so ``--help``, ``--print_config`` and type
and range checking come from the code itself. Later configs and flags override earlier ones; W&B
sweep agents append ``--key=value`` flags after the config (``configs/sweeps/``).
``fedhet test RUN_DIR`` / ``fedhet validate RUN_DIR`` re-evaluate a run's saved state.

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

import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from fedhet import __version__
from fedhet.catalog import METHODS, MODELS, list_families, list_methods, method_class_path
from fedhet.errors import ConfigError, FedhetError
from fedhet.hparams import RANGES, Fraction, NonNegativeInt, PositiveInt

if TYPE_CHECKING:  # jsonargparse resolves these annotations without importing torch up front
    from fedhet.federation import FederationLoop
    from fedhet.federation.aggregation import Aggregator
    from fedhet.federation.attacks import UploadAttack
    from fedhet.federation.executors import Executor
    from fedhet.federation.lr_schedule import LRSchedule
    from fedhet.federation.privacy import PayloadNoise
    from fedhet.federation.state import ClientStateStore

log = logging.getLogger("fedhet")

StateStoreKind = Literal["auto", "memory", "disk"]


class FederationSettings:
    """Round-loop settings.

    Args:
        participation: fraction of clients per round (a number in (0, 1]; ``1`` and ``1.0`` mean
            all clients) or a count of clients per round (an integer >= 2).
        eval_every: evaluate every this many rounds (the last round always).
        state_store: ``"memory"``, ``"disk"`` (one file per client under the run directory) or
            ``"auto"`` (disk when there are more than ``disk_threshold`` clients).
        disk_threshold: client count above which ``"auto"`` keeps client states on disk.
        executor: where client steps run: ``null`` (sequential, in-process) or an executor class
            with its arguments, e.g. ``{class_path: fedhet.federation.ProcessExecutor, init_args:
            {workers: 2}}``; ``sequential``, ``process`` and ``ray`` name the three executors
            (``--federation.executor ray --federation.executor.workers 2``).
        eval_clients: which clients are evaluated: ``"all"``, ``"participants"`` (the round's), a
            number sampled per evaluation, or ``"auto"`` (all up to 100 clients, participants above).
        extra_rounds: full-participation rounds after the federated rounds (equal budgets for
            baselines of methods with a post-federation phase, e.g. FedVTC's).
        on_invalid_upload: ``"fail"`` (stop, naming the sender) or ``"drop"`` (continue without it,
            counted in ``comm/dropped_uploads``): non-finite values, wrong keys, shapes or dtypes
            (float16 is refused), bad counts and uploads over either bound below.
        upload_norm_bound: refuse uploads whose model weights moved more than this multiple of
            the global model's norm, naming the client (``null``: no bound; docs/concepts.md).
        upload_value_bound: refuse uploads holding any value larger in magnitude than this
            (``null``: no bound).
        aggregator: how weight-averaging methods combine uploads: ``{rule: mean}`` (FedAvg, the
            default), ``median``, ``trimmed_mean`` (``beta``) or ``krum`` (``f``, ``m``; m > 1 is
            Multi-Krum), e.g. ``--federation.aggregator.rule median``.
        upload_attack: simulated malicious clients for robustness studies, e.g. ``{clients: [0, 1],
            kind: sign_flip, factor: 4}`` (``scale``, ``sign_flip`` or ``value``); ``null``: none.
        persist_optimizer_state: carry each client's optimizer state (momentum, Adam moments)
            across rounds; off restarts the optimizer every round as HtFLlib does.
        lr_schedule: per-round factor on every client learning rate (local stages and the
            public-data phase) of every method alike: ``{kind: none}`` (constant, the default) or
            ``{kind: linear, final_fraction: 0.1}`` (the FCCL+ authors' shared loop); federated
            rounds only (``docs/concepts.md``).
        upload_noise: FedPCL-style Gaussian perturbation of every upload (privacy studies,
            FedKTL Tab. 10 "NC"); ``null``: none.
        download_noise: the same for every download ("NG"); ``null``: none.
        target_accuracy: metrics and target percentages, e.g. ``{acc_server: [75, 80]}``: the summary's
            ``rounds_to_target`` gives the first round each reached its target (``null`` if never;
            FedFTG's Table 2).
        eval_after_local_training: also score every client's model as its last local training
            left it, before the next download (``pre/`` metrics beside the usual ones): the FCCL+
            authors' scoring of homogeneous FedAvg-family clients, where the usual score is the
            global model's.
    """

    def __init__(
        self,
        participation: Fraction | PositiveInt = 1.0,
        eval_every: PositiveInt = 1,
        state_store: StateStoreKind = "auto",
        disk_threshold: NonNegativeInt = 50,
        executor: Executor | None = None,
        eval_clients: Literal["auto", "all", "participants"] | PositiveInt = "auto",
        extra_rounds: NonNegativeInt = 0,
        on_invalid_upload: Literal["fail", "drop"] = "fail",
        upload_norm_bound: float | None = 10.0,  # FederationLoop's UPLOAD_NORM_BOUND
        upload_value_bound: float | None = 1e6,  # FederationLoop's UPLOAD_VALUE_BOUND
        aggregator: Aggregator | None = None,
        upload_attack: UploadAttack | None = None,
        persist_optimizer_state: bool = True,
        upload_noise: PayloadNoise | None = None,
        download_noise: PayloadNoise | None = None,
        target_accuracy: dict[str, float | list[float]] | None = None,
        lr_schedule: LRSchedule | None = None,
        eval_after_local_training: bool = False,
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
        self.upload_value_bound = upload_value_bound
        self.aggregator = aggregator
        self.upload_attack = upload_attack
        self.persist_optimizer_state = persist_optimizer_state
        self.upload_noise = upload_noise
        self.download_noise = download_noise
        self.target_accuracy = target_accuracy
        self.lr_schedule = lr_schedule
        self.eval_after_local_training = eval_after_local_training


# ------------------------------------------------------------------------------ parsing
_PARSER_MODE = "fedhet_yaml"


def _load_yaml(text: str) -> Any:
    """Load YAML as jsonargparse does, mapping method registry names in a config (``method: fccl_plus``).

    jsonargparse resolves ``class_path`` by import path or class name only; configs and the
    README use the registry names of ``fedhet list``, so they are mapped to class paths here,
    before jsonargparse sees them.
    """
    try:
        from jsonargparse import get_loader
    except ImportError:  # jsonargparse releases before get_loader was public
        from jsonargparse._loaders_dumpers import get_loader

    value = get_loader("yaml")(text)
    if isinstance(value, dict) and "method" in value:
        value["method"] = _map_method(value["method"])
    if isinstance(value, dict) and isinstance(value.get("federation"), dict) and "executor" in value["federation"]:
        value["federation"]["executor"] = _map_executor(value["federation"]["executor"])
    return value


#: Short names of the executors (``--federation.executor ray``), mapped to class paths before parsing.
EXECUTOR_NAMES = {
    "sequential": "fedhet.federation.SequentialExecutor",
    "process": "fedhet.federation.ProcessExecutor",
    "ray": "fedhet.federation.RayExecutor",
}


def _map_executor(node: Any) -> Any:
    """A ``federation.executor`` value with a short name (``ray``) replaced by its class path."""
    if isinstance(node, str) and node.lower() in EXECUTOR_NAMES:
        return EXECUTOR_NAMES[node.lower()]
    if isinstance(node, dict) and str(node.get("class_path", "")).lower() in EXECUTOR_NAMES:
        return {**node, "class_path": EXECUTOR_NAMES[str(node["class_path"]).lower()]}
    return node


def _map_method(node: Any) -> Any:
    """A ``method`` value with a registry or class name replaced by its class path."""
    if isinstance(node, str) and not node.endswith((".yaml", ".yml", ".json")):
        return method_class_path(node)
    if isinstance(node, dict) and isinstance(node.get("class_path"), str):
        mapped = {**node, "class_path": method_class_path(node["class_path"])}
        init_args = node.get("init_args")
        if isinstance(init_args, dict) and "base" in init_args:  # a server plugin's base method
            mapped["init_args"] = {**init_args, "base": _map_method(init_args["base"])}
        return mapped
    return node


def build_parser(prog: str = "fedhet fit") -> Any:
    """The ``fedhet fit`` parser (jsonargparse)."""
    from argparse import SUPPRESS

    from jsonargparse import ActionConfigFile, ArgumentParser, set_loader

    from fedhet.algorithms import Algorithm
    from fedhet.data import FederatedScenario
    from fedhet.federation.trainer import ServerTrainerTemplate, TrainerTemplate
    from fedhet.tracking import WandbConfig

    set_loader(_PARSER_MODE, _load_yaml, exceptions=(yaml.YAMLError,))
    parser = ArgumentParser(
        prog=prog,
        description="Run one federated experiment.",
        exit_on_error=False,
        default_meta=False,
        parser_mode=_PARSER_MODE,
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config; repeat to compose (later wins)")
    if prog == "fedhet fit":
        # Taken out of the arguments before parsing (_split_resume); declared so that --help lists
        # it, with a suppressed default so that it never appears in a saved config.
        parser.add_argument(
            "--resume",
            type=str,
            default=SUPPRESS,
            help="continue an interrupted run from its run directory: fedhet fit --resume runs/<run> [--rounds N]",
        )
    parser.add_argument(
        "--seed", type=NonNegativeInt, default=0, help="experiment seed (initialisation, sampling, batch order)"
    )
    parser.add_argument("--rounds", type=PositiveInt, default=10, help="communication rounds")
    parser.add_argument(
        "--threads",
        type=PositiveInt | None,
        default=None,
        help="intra-op threads of this process (null: torch's default, one per core); results depend on the "
        "thread count, so a config that pins it gives the same numbers on every machine",
    )
    parser.add_argument(
        "--run_dir",
        type=str | None,
        default=None,
        help="run directory, new or empty (default runs/<method>-<time>-s<seed>, made unique)",
    )
    parser.add_argument(
        "--models", type=str | list[str], default="cpu4", help="model family name or list of registered model names"
    )
    parser.add_argument(
        "--feature_dim",
        type=PositiveInt | None,
        default=None,
        help="common feature dimension (linear neck on every backbone)",
    )
    parser.add_subclass_arguments(
        Algorithm, "method", required=True, help=f"the federated method: {', '.join(list_methods())} or a class path"
    )
    # No default scenario: jsonargparse would carry a default's init_args (e.g. public data) over
    # to another scenario class chosen in a config.
    parser.add_subclass_arguments(FederatedScenario, "scenario", required=True, help="the federated scenario")
    parser.add_class_arguments(TrainerTemplate, "trainer", help="Trainer template of every client fit")
    parser.add_class_arguments(
        ServerTrainerTemplate,
        "server_trainer",
        help="Trainer template of trained server stages (budgets are the method's)",
    )
    parser.add_class_arguments(FederationSettings, "federation", help="round-loop settings")
    parser.add_class_arguments(WandbConfig, "wandb", help="Weights & Biases logging")
    return parser


def _one_line(message: str) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= 400 else text[:397] + "..."


_KEY = re.compile(r'^(\s*)(?:- )?Parser key "([^"]+)"')
_NOT_OF_TYPE = re.compile(r"^(\s*)(?:- )?Not of type (\w+):\s*(.*)$")
_RESTRICTED_VALUE = re.compile(r"^(.*?)\s*does not conform to restriction")
_GIVEN = re.compile(r"^\s*Given value:\s*(.*)$")


def _range_error(message: str) -> str | None:
    """One line for a value outside its type's range, from jsonargparse's nested error text.

    jsonargparse reports ``--method.lr=-0.1`` as a tree of ``Parser key``/union lines ending in
    "Not of type PositiveFloat: -0.1 does not conform to restriction v>0"; users need the key, the
    value and the allowed range (``None`` when the error is not about a range).
    """
    lines = message.splitlines()
    stack: list[tuple[int, str]] = []
    found: tuple[int, list[str], str] | None = None
    types: list[str] = []
    for index, line in enumerate(lines):
        key = _KEY.match(line)
        if key:
            indent = len(key.group(1))
            stack = [(i, k) for i, k in stack if i < indent] + [(indent, key.group(2))]
            continue
        match = _NOT_OF_TYPE.match(line)
        if match and match.group(2) in RANGES:
            if match.group(2) not in types:  # each member of a union, e.g. Fraction | PositiveInt
                types.append(match.group(2))
            restricted = _RESTRICTED_VALUE.match(match.group(3))
            if restricted and found is None:
                indent = len(match.group(1))
                found = (index, [k for i, k in stack if i < indent], restricted.group(1))
    if found is None:  # not a range error (unknown key, wrong type ...)
        return None
    index, keys, value = found
    if not value:
        value = next((g.group(1) for g in map(_GIVEN.match, lines[index:]) if g), "?")
    key = ".".join(keys) or "value"
    allowed = " or ".join(RANGES[t] for t in types)
    return f"{key}={value} is out of range: it must be {allowed}; set --{key} to a value in range"


def _parse(parser: Any, args: Sequence[str]) -> Any:
    from jsonargparse import ArgumentError

    from fedhet.sweep import parse_accepting_none

    try:
        return parse_accepting_none(parser, list(args))
    except ArgumentError as exc:
        message = _range_error(str(exc))
        if message is not None:
            raise ConfigError(message) from None
        raise ConfigError(f"{_one_line(str(exc))}; see '{parser.prog} --help' or --print_config") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config is not valid YAML ({_one_line(str(exc))})") from None


def _check_config_file(path: str) -> None:
    """A ``--config`` file that exists and is valid YAML, with a method name that exists.

    jsonargparse's own errors for these do not say which of several ``--config`` files is wrong.
    A value that is not a file name is left to jsonargparse (``--config`` also takes YAML text).
    """
    file = Path(path)
    if not file.is_file():
        if path.endswith((".yaml", ".yml", ".json")):
            raise ConfigError(
                f"config file '{path}' not found; check the path (configs are under configs/experiments/)"
            )
        return
    try:
        content = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"config file '{path}' is not valid YAML{where} ({problem}); fix the syntax there") from None
    if isinstance(content, dict) and "method" in content:
        try:
            _map_method(content["method"])
        except ConfigError as exc:
            raise ConfigError(f"config file '{path}': {exc}") from None


def _map_name_or_inline(value: str, mapper: Callable[[Any], Any]) -> str:
    """A short name mapped to its class path, or an inline ``{class_path: ...}`` mapped inside.

    An inline value that is not valid YAML is passed through unchanged: jsonargparse reports it
    with the key it belongs to.
    """
    if not value.lstrip().startswith("{"):
        return str(mapper(value))
    try:
        return json.dumps(mapper(yaml.safe_load(value)))
    except yaml.YAMLError:
        return value


def _prepare_args(args: Sequence[str]) -> list[str]:
    """Check ``--config`` files and map method and executor names before jsonargparse parses.

    ``--method fccl_plus`` (a registry name, as ``fedhet list`` prints it) becomes the class path
    jsonargparse understands; an unknown name is one line with did-you-mean and every method.
    """
    out: list[str] = []
    iterator = iter(args)
    for arg in iterator:
        name, equals, value = arg.partition("=")
        if name in ("--config", "--method", "--method.help"):
            if not equals:
                value = next(iterator, "")
                if not value:
                    raise ConfigError(f"{name} needs a value; see 'fedhet fit --help'")
            if name == "--config":
                _check_config_file(value)
            elif name == "--method.help":
                value = method_class_path(value)
            else:
                value = _map_name_or_inline(value, _map_method)
            out.append(f"{name}={value}")
        elif name == "--federation.executor":
            if not equals:
                value = next(iterator, "")
            out.append(f"{name}={_map_name_or_inline(value, _map_executor)}")
        else:
            out.append(arg)
    return out


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


def _changed_keys(parser: Any, config: Any, saved_config: Path, allowed: Sequence[str]) -> list[str]:
    """Top-level config keys whose values differ from a run's saved ``config.yaml`` (except ``allowed``)."""
    original = yaml.safe_load(saved_config.read_text(encoding="utf-8"))
    current = yaml.safe_load(parser.dump(config, skip_none=False))
    return sorted(k for k in set(original) | set(current) if k not in allowed and original.get(k) != current.get(k))


def _quiet_numerics() -> None:
    import torch

    from fedhet.federation.trainer import silence_lightning

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
    rest = _prepare_args(rest)
    if _wants_print_config(rest):
        from fedhet.sweep import parse_accepting_none

        parser.exit_on_error = True
        parse_accepting_none(parser, rest)  # prints and exits
    config = _parse(parser, rest)
    if resume is not None:
        changed = _changed_keys(parser, config, saved.config_path, RESUMABLE_KEYS)
        if changed:
            raise ConfigError(
                "--resume continues a run with its own config; only --rounds may change "
                f"(changed: {', '.join(changed)})"
            )
        config.run_dir = resume
    return run_experiment(parser, config, resume=resume is not None, callbacks=callbacks)


# ------------------------------------------------------------------------------ building
def check_environment(config: Any, wandb: bool = True) -> None:
    """Checks that depend on the machine rather than the config's types, run before anything is built.

    A requested accelerator that is absent is an error (Lightning would raise it from the first
    client fit, after the run directory and W&B run exist); with ``wandb``, online W&B logging
    without credentials logs offline instead (``WandbConfig.effective_mode``), said in one
    warning line.
    """
    import torch

    accelerator = str(config.trainer.accelerator).lower()
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.accelerator={config.trainer.accelerator} but no CUDA GPU is available on this machine; "
            "use --trainer.accelerator=cpu (or auto)"
        )
    if accelerator == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(
            "trainer.accelerator=mps but Apple MPS is not available on this machine; "
            "use --trainer.accelerator=cpu (or auto)"
        )
    from fedhet.tracking.wandb_logger import wandb_credentials_available

    if wandb and os.environ.get("WANDB_MODE", config.wandb.mode) == "online" and not wandb_credentials_available():
        log.warning(
            "fedhet: warning: W&B mode is online but no W&B credentials were found (WANDB_API_KEY or 'wandb login'); "
            "logging offline into the run directory instead, upload it later with 'wandb sync'"
        )


def _plain_numbers(obj: Any, depth: int = 2) -> None:
    """Replace jsonargparse's range-checked numbers in ``obj``'s attributes by plain ``float``/``int``.

    The parser hands ``PositiveFloat(0.01)`` and the like to ``__init__``; they behave as floats,
    but pickled into a checkpoint (a server's state, a module's saved hyperparameters) they would
    not load under ``torch.load(weights_only=True)``. Normalising the built objects' attributes,
    before any client module or server is derived from them, keeps every downstream value plain.
    """
    attributes = getattr(obj, "__dict__", None)
    if not attributes:
        return
    for name, value in list(attributes.items()):
        plain = _plain(value)
        if plain is not value:
            object.__setattr__(obj, name, plain)
        elif depth > 1 and type(value).__module__.startswith("fedhet."):
            _plain_numbers(value, depth - 1)


def _plain(value: Any) -> Any:
    if type(value).__module__ == "jsonargparse.typing":
        return float(value) if isinstance(value, float) else int(value)
    if isinstance(value, (list, tuple)) and any(type(v).__module__ == "jsonargparse.typing" for v in value):
        return type(value)(_plain(v) for v in value)
    return value


@dataclass
class Experiment:
    """What a parsed config describes, built and set up, before anything is written.

    ``fit``, ``test`` and ``validate`` all build through :func:`build_experiment`, so evaluation
    sees exactly the objects (scenario splits, client architectures, method) training used.
    """

    config: Any
    objects: Any
    architectures: list[str]
    family_name: str

    @property
    def method(self) -> Any:
        return self.objects.method

    @property
    def scenario(self) -> Any:
        return self.objects.scenario

    def uses_disk_store(self) -> bool:
        """Whether client states live on disk under the run directory (``federation.state_store``)."""
        federation = self.objects.federation
        return federation.state_store == "disk" or (
            federation.state_store == "auto" and self.scenario.num_clients > federation.disk_threshold
        )

    def default_run_path(self) -> Path:
        """``runs/<method>-<time>-s<seed>`` (made unique when claimed)."""
        return Path(f"runs/{type(self.method).__name__.lower()}-{time.strftime('%Y%m%d-%H%M%S')}-s{self.config.seed}")

    def build_loop(self, state_store: ClientStateStore, config_yaml: str | None = None) -> FederationLoop:
        """The round loop; it checks the method/scenario/family combination as it is built.

        ``config_yaml`` (the resolved config) is the recipe from which executors that run clients
        in other processes rebuild the client runtime; without it they get the objects themselves.
        """
        from fedhet.federation import FederationLoop, RuntimeRecipe

        federation = self.objects.federation
        recipe = None
        if config_yaml is not None:
            recipe = RuntimeRecipe(
                architectures=tuple(self.architectures),
                seed=self.config.seed,
                rounds=self.config.rounds,
                persist_optimizer_state=federation.persist_optimizer_state,
                feature_dim=self.config.feature_dim,
                config_yaml=config_yaml,
                lr_schedule=federation.lr_schedule,
            )
        return FederationLoop(
            algorithm=self.method,
            scenario=self.scenario,
            architectures=self.architectures,
            trainer=self.objects.trainer,
            rounds=self.config.rounds,
            seed=self.config.seed,
            participation=federation.participation,
            eval_every=federation.eval_every,
            server_trainer=self.objects.server_trainer,
            state_store=state_store,
            executor=federation.executor,
            eval_clients=federation.eval_clients,
            extra_rounds=federation.extra_rounds,
            on_invalid_upload=federation.on_invalid_upload,
            upload_norm_bound=federation.upload_norm_bound,
            upload_value_bound=federation.upload_value_bound,
            aggregator=federation.aggregator,
            upload_attack=federation.upload_attack,
            recipe=recipe,
            persist_optimizer_state=federation.persist_optimizer_state,
            upload_noise=federation.upload_noise,
            download_noise=federation.download_noise,
            target_accuracy=federation.target_accuracy,
            lr_schedule=federation.lr_schedule,
            eval_after_local_training=federation.eval_after_local_training,
            feature_dim=self.config.feature_dim,
            family_name=self.family_name,
        )


def _instantiate(parser: Any, config: Any) -> Any:
    try:
        return parser.instantiate_classes(config)
    except FedhetError:
        raise
    except (TypeError, ValueError) as exc:
        # jsonargparse wraps what an __init__ raises in its union/subclass report; a FedhetError
        # in the chain already is the one line written for users.
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, FedhetError):
                raise cause from None
            cause = cause.__cause__ or cause.__context__
        raise ConfigError(f"invalid configuration: {_one_line(str(exc))}") from None


def build_objects_from_yaml(config_yaml: str) -> tuple[Any, Any, Any]:
    """The method, scenario and client Trainer template of a resolved config (how workers rebuild a run)."""
    parser = build_parser()
    experiment = build_experiment(parser, parser.parse_string(config_yaml), logging_run=False)
    return experiment.method, experiment.scenario, experiment.objects.trainer


def build_experiment(parser: Any, config: Any, logging_run: bool = True) -> Experiment:
    """Instantiate a parsed config, set its scenario up and resolve the client architectures.

    ``logging_run``: the experiment will log to W&B (``fit``), so its mode is checked too.
    """
    from fedhet.models import model_for_client, resolve_family

    check_environment(config, wandb=logging_run)
    if config.threads is not None:
        import torch

        torch.set_num_threads(config.threads)
    objects = _instantiate(parser, config)
    for key in ("method", "scenario", "trainer", "federation"):
        _plain_numbers(objects[key])
    family = resolve_family(objects.models)
    objects.scenario.setup()
    return Experiment(
        config=config,
        objects=objects,
        architectures=[model_for_client(family, c) for c in range(objects.scenario.num_clients)],
        family_name=objects.models if isinstance(objects.models, str) else "custom",
    )


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
        checkpoint = run_dir.load_checkpoint()
    elif config.run_dir is not None:
        RunDirectory(config.run_dir).check_available()  # the same check as claim's below, before any work
    experiment = build_experiment(parser, config)
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
            exc.run_dir = str(run_path)  # type: ignore[attr-defined]  # main() names it in the resume hint
        raise
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
    config = _parse(parser, _prepare_args(["--config", str(saved.config_path), *args]))
    changed = _changed_keys(parser, config, saved.config_path, EVALUATION_KEYS)
    if changed:
        raise ConfigError(
            f"{command} evaluates the run's own method and models; only --scenario and --trainer options may "
            f"change (changed: {', '.join(changed)})"
        )
    experiment = build_experiment(parser, config, logging_run=False)
    if "scenario" in _changed_keys(parser, config, saved.config_path, ()):
        original = build_experiment(parser, _parse(parser, ["--config", str(saved.config_path)]), logging_run=False)
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
    """Print the registered names, from the static catalog: no torch import, so it answers at once."""
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
  list      list registered methods, models and model families
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


COMMANDS = ("fit", "test", "validate", "sweep", "bench", "list", "pretrain-generator")


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
        import difflib

        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"fedhet: error: unknown command '{command}'{hint}; use one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    except FedhetError as exc:
        print(f"fedhet: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        run_dir = getattr(exc, "run_dir", "<run_dir>")
        print(f"fedhet: interrupted; continue the run with 'fedhet fit --resume {run_dir}'", file=sys.stderr)
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
    "FederationSettings",
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
