"""The config layer: parse, compose and instantiate an experiment, beneath the command line.

``fedhet fit``, ``test`` and ``validate`` (:mod:`fedhet.cli`), ``fedhet bench``, ``fedhet sweep``,
``compare_configs`` and the executors' workers all read configs through the public functions here,
so a config means the same thing everywhere:

* :func:`build_parser`: the jsonargparse ``ArgumentParser`` built from the typed ``__init__``
  signatures of the method (``method``: any :class:`~fedhet.algorithms.Algorithm`, chosen by
  registry name such as ``fccl_plus``, class name or ``class_path``), the scenario, the Trainer
  templates, the federation settings (:class:`fedhet.federation.FederationSettings`) and W&B,
  so ``--help``, ``--print_config`` and type and range checking come from the code itself;
* :func:`prepare_args` (``--config`` files checked, method and executor short names mapped),
  then :func:`parse_config` (a value out of range is one line naming the key and the range);
  later configs and flags override earlier ones;
* :func:`build_experiment`: the objects instantiated and the scenario set up
  (:class:`Experiment`), before anything is written; :func:`build_objects_from_yaml` is how an
  executor's worker rebuilds a run from its resolved config (the recipe's ``rebuild``).

Every user error is a :class:`~fedhet.errors.ConfigError` whose text is one line (the command
line prints it as ``fedhet: error: <problem>; <fix>``). Importing this module imports neither
torch nor the methods: the parser is built on first use, so ``fedhet --help`` and ``fedhet list``
answer at once.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from fedhet.catalog import list_methods, method_class_path
from fedhet.errors import ConfigError, FedhetError
from fedhet.hparams import RANGES, NonNegativeInt, PositiveInt

if TYPE_CHECKING:
    from fedhet.federation import FederationLoop
    from fedhet.federation.state import ClientStateStore

log = logging.getLogger("fedhet")

# ------------------------------------------------------------------------------ parsing
_PARSER_MODE = "fedhet_yaml"


def load_yaml(text: str) -> Any:
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
        value["method"] = map_method(value["method"])
    if isinstance(value, dict) and isinstance(value.get("federation"), dict) and "executor" in value["federation"]:
        value["federation"]["executor"] = map_executor(value["federation"]["executor"])
    return value


#: Short names of the executors (``--federation.executor ray``), mapped to class paths before parsing.
EXECUTOR_NAMES = {
    "sequential": "fedhet.federation.SequentialExecutor",
    "process": "fedhet.federation.ProcessExecutor",
    "ray": "fedhet.federation.RayExecutor",
}


def map_executor(node: Any) -> Any:
    """A ``federation.executor`` value with a short name (``ray``) replaced by its class path.

    A bare word that is neither a short name nor ``null`` is refused here in one line listing the
    names (jsonargparse would answer "Expected a dot import path string" inside a union dump).
    """
    name = node if isinstance(node, str) else node.get("class_path") if isinstance(node, dict) else None
    if not isinstance(name, str):
        return node
    if name.lower() in EXECUTOR_NAMES:
        mapped = EXECUTOR_NAMES[name.lower()]
        return mapped if isinstance(node, str) else {**node, "class_path": mapped}
    if "." not in name and name.strip().lower() not in ("", "null", "none", "~"):
        raise ConfigError(
            f"federation.executor={name} is not an executor; use one of {', '.join(EXECUTOR_NAMES)} "
            "(e.g. --federation.executor process) or a class path"
        )
    return node


def map_method(node: Any) -> Any:
    """A ``method`` value with a registry or class name replaced by its class path."""
    if isinstance(node, str) and not node.endswith((".yaml", ".yml", ".json")):
        return method_class_path(node)
    if isinstance(node, dict) and isinstance(node.get("class_path"), str):
        mapped = {**node, "class_path": method_class_path(node["class_path"])}
        init_args = node.get("init_args")
        if isinstance(init_args, dict) and "base" in init_args:  # a server plugin's base method
            mapped["init_args"] = {**init_args, "base": map_method(init_args["base"])}
        return mapped
    return node


def build_parser(prog: str = "fedhet fit") -> Any:
    """The ``fedhet fit`` parser (jsonargparse)."""
    from argparse import SUPPRESS

    from jsonargparse import ActionConfigFile, ArgumentParser, set_loader

    from fedhet.algorithms import Algorithm
    from fedhet.data import FederatedScenario
    from fedhet.federation.settings import FederationSettings
    from fedhet.federation.trainer import ServerTrainerTemplate, TrainerTemplate
    from fedhet.tracking import WandbConfig

    set_loader(_PARSER_MODE, load_yaml, exceptions=(yaml.YAMLError,))
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
        help="common feature dimension: a neck on every backbone whose pooled vector has another size",
    )
    parser.add_argument(
        "--feature_proj",
        type=Literal["pool", "linear"],
        default="pool",
        help="the neck to --feature_dim: pool (HtFLlib's parameter-free AdaptiveAvgPool1d) or linear (learnable)",
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


def one_line(message: str) -> str:
    """``message`` on one line (whitespace runs collapsed), cut to 400 characters: error text for users."""
    text = " ".join(str(message).split())
    return text if len(text) <= 400 else text[:397] + "..."


_KEY = re.compile(r'^(\s*)(?:- )?Parser key "([^"]+)"')
_NOT_OF_TYPE = re.compile(r"^(\s*)(?:- )?Not of type (\w+):\s*(.*)$")
_RESTRICTED_VALUE = re.compile(r"^(.*?)\s*does not conform to restriction")
_GIVEN = re.compile(r"^\s*Given value:\s*(.*)$")


def range_error(message: str) -> str | None:
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


_NOT_CONVERTIBLE = re.compile(
    r"^(\s*)(?:- )?Not of type (\w+): (?:could not convert string to float|invalid literal for int\(\) "
    r"with base \d+): '(.*)'$"
)
_EXPECTED_BUILTIN = re.compile(r"^(\s*)(?:- )?Expected a <class '(int|float|bool|str)'>\. Got value: (.*)$")
_EXPECTED_CHOICE = re.compile(r"^(\s*)(?:- )?Expected a typing\.Literal\[(.*)\]\. Got value: (.*)$")
_BUILTIN_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def type_error(message: str) -> str | None:
    """One line for a value of the wrong type (``--method.lr fast``) or not among a knob's choices, from jsonargparse.

    jsonargparse reports it as a 450-character tree of ``Parser key``/union lines with class
    reprs; users need the key, the value and what is expected (``None`` for other errors).
    """
    stack: list[tuple[int, str]] = []
    key: str | None = None
    value = ""
    expected: list[str] = []
    for line in message.splitlines():
        found = _KEY.match(line)
        if found:
            indent = len(found.group(1))
            stack = [(i, k) for i, k in stack if i < indent] + [(indent, found.group(2))]
            continue
        match = _NOT_CONVERTIBLE.match(line)
        builtin = _EXPECTED_BUILTIN.match(line)
        choice = _EXPECTED_CHOICE.match(line)
        if match and match.group(2) in RANGES:
            indent, wanted, given = len(match.group(1)), RANGES[match.group(2)], match.group(3)
        elif builtin:
            indent, wanted, given = len(builtin.group(1)), _BUILTIN_NAMES[builtin.group(2)], builtin.group(3)
        elif choice:
            indent, wanted, given = len(choice.group(1)), f"one of {choice.group(2)}", choice.group(3)
        else:
            continue
        here = ".".join(k for i, k in stack if i < indent)
        if key is None:
            key, value = here, given
        if here == key and wanted not in expected:  # each member of a union, e.g. Fraction | PositiveInt
            expected.append(wanted)
    if key is None:
        return None
    key = key or "value"
    allowed = " or ".join(expected)
    return f"{key}={value} is not a valid value: it must be {allowed}; set --{key} to such a value"


def parse_config(parser: Any, args: Sequence[str]) -> Any:
    """Parse ``args`` (after :func:`prepare_args`) with ``parser``; every parse error is one :class:`ConfigError` line.

    A value out of its type's range names the key, the value and the range; other parser errors
    are collapsed to one line pointing at ``--help``; a W&B ``--key=None`` reads as null.
    """
    from jsonargparse import ArgumentError

    try:
        return parse_accepting_none(parser, list(args))
    except ArgumentError as exc:
        message = range_error(str(exc)) or type_error(str(exc))
        if message is not None:
            raise ConfigError(message) from None
        raise ConfigError(f"{one_line(str(exc))}; see '{parser.prog} --help' or --print_config") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config is not valid YAML ({one_line(str(exc))})") from None


def check_config_file(path: str) -> None:
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
            map_method(content["method"])
        except ConfigError as exc:
            raise ConfigError(f"config file '{path}': {exc}") from None
    federation = content.get("federation") if isinstance(content, dict) else None
    if isinstance(federation, dict) and "executor" in federation:
        try:
            map_executor(federation["executor"])
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


def prepare_args(args: Sequence[str]) -> list[str]:
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
                check_config_file(value)
            elif name == "--method.help":
                value = method_class_path(value)
            else:
                value = _map_name_or_inline(value, map_method)
            out.append(f"{name}={value}")
        elif name == "--federation.executor":
            if not equals:
                value = next(iterator, "")
            out.append(f"{name}={_map_name_or_inline(value, map_executor)}")
        else:
            out.append(arg)
    return out


def changed_keys(parser: Any, config: Any, saved_config: Path, allowed: Sequence[str]) -> list[str]:
    """Top-level config keys whose values differ from a run's saved ``config.yaml`` (except ``allowed``)."""
    original = _without_empty_init_args(yaml.safe_load(saved_config.read_text(encoding="utf-8")))
    current = _without_empty_init_args(yaml.safe_load(parser.dump(config, skip_none=False)))
    return sorted(k for k in set(original) | set(current) if k not in allowed and original.get(k) != current.get(k))


def _without_empty_init_args(value: Any) -> Any:
    """``value`` with every empty ``init_args`` mapping removed, at any depth.

    A class without arguments (``--federation.executor=sequential``) dumps ``init_args: {}``
    when chosen on the command line and no ``init_args`` when read back from that dump, so the
    two spellings of one config must compare equal.
    """
    if isinstance(value, dict):
        return {k: _without_empty_init_args(v) for k, v in value.items() if not (k == "init_args" and not v)}
    if isinstance(value, list):
        return [_without_empty_init_args(v) for v in value]
    return value


# ------------------------------------------------------------------------------ null values
#: How a null may be spelled on the command line (W&B's agent writes ``None``).
NULL_SPELLINGS = ("None", "none")


def _with_null(args: Sequence[str], spellings: Sequence[str]) -> list[str]:
    """``--key=None`` / ``--key None`` (for the given spellings) rewritten as ``null``."""
    out: list[str] = []
    previous = ""
    for arg in args:
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            out.append(f"{key}=null" if value in spellings else arg)
        elif arg in spellings and previous.startswith("--") and "=" not in previous:
            out.append("null")
        else:
            out.append(arg)
        previous = arg
    return out


def parse_accepting_none(parser: Any, args: Sequence[str]) -> Any:
    """Parse ``args``, reading ``None`` and ``none`` as null for optional values.

    ``None`` is what W&B's agent writes for a swept ``null`` (it formats ``f"--{key}={value}"``),
    and no fedhet option takes the string "None", so it is always null. Lowercase ``none`` is a
    legitimate choice of some options (e.g. FCCL+'s ``local_distillation``), so the arguments are
    first parsed as written and ``none`` is read as null only when that fails.
    """
    args = _with_null(args, ("None",))
    if not any(a == "none" or a.endswith("=none") for a in args):
        return parser.parse_args(args)
    try:
        return parser.parse_args(args)
    except Exception as exc:  # e.g. --feature_dim=none: an int or null, so null was meant
        try:
            return parser.parse_args(_with_null(args, NULL_SPELLINGS))
        except Exception:
            raise exc from None


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
        from fedhet.tracking.rundir import default_run_path

        return default_run_path(type(self.method).__name__.lower(), self.config.seed)

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
                feature_proj=self.config.feature_proj,
                config_yaml=config_yaml,
                lr_schedule=federation.lr_schedule,
                rebuild=build_objects_from_yaml,
            )
        return FederationLoop(
            algorithm=self.method,
            scenario=self.scenario,
            architectures=self.architectures,
            trainer=self.objects.trainer,
            rounds=self.config.rounds,
            seed=self.config.seed,
            settings=federation,
            server_trainer=self.objects.server_trainer,
            state_store=state_store,
            recipe=recipe,
            feature_dim=self.config.feature_dim,
            feature_proj=self.config.feature_proj,
            family_name=self.family_name,
        )


def instantiate(parser: Any, config: Any) -> Any:
    """The objects of a parsed config (jsonargparse's ``instantiate_classes``), errors as one line.

    A :class:`FedhetError` an ``__init__`` raised is passed on as it is; any other ``TypeError``
    or ``ValueError`` becomes one ``invalid configuration`` line.
    """
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
        raise ConfigError(f"invalid configuration: {one_line(str(exc))}") from None


def build_objects_from_yaml(config_yaml: str) -> tuple[Any, Any, Any]:
    """The method, scenario and client Trainer template of a resolved config (how workers rebuild a run).

    The worker's intra-op thread count is not the config's ``threads``: the executor set it to
    its ``threads_per_worker`` before rebuilding (``docs/concepts.md``), so it is left alone here.
    """
    parser = build_parser()
    experiment = build_experiment(parser, parser.parse_string(config_yaml), logging_run=False, set_threads=False)
    return experiment.method, experiment.scenario, experiment.objects.trainer


def build_experiment(parser: Any, config: Any, logging_run: bool = True, set_threads: bool = True) -> Experiment:
    """Instantiate a parsed config, set its scenario up and resolve the client architectures.

    ``logging_run``: the experiment will log to W&B (``fit``), so its mode is checked too.
    ``set_threads``: apply the config's ``threads`` to this process (the driver's); off where
    the caller set the thread count itself (an executor's worker, ``threads_per_worker``).
    """
    from fedhet.models import model_for_client, resolve_family

    check_environment(config, wandb=logging_run)
    if set_threads and config.threads is not None:
        import torch

        torch.set_num_threads(config.threads)
    objects = instantiate(parser, config)
    for key in ("method", "scenario", "trainer", "federation"):
        _plain_numbers(objects[key])
    family = resolve_family(objects.models)
    objects.scenario.setup()
    if objects.federation.seal_test:  # workers rebuild from the same config, so they are sealed too
        objects.scenario.seal_test()
    return Experiment(
        config=config,
        objects=objects,
        architectures=[model_for_client(family, c) for c in range(objects.scenario.num_clients)],
        family_name=objects.models if isinstance(objects.models, str) else "custom",
    )


def parse_args(args: Sequence[str], prog: str = "fedhet fit") -> tuple[Any, Any]:
    """``(parser, config)`` for ``fedhet fit``-style arguments: :func:`prepare_args`, then :func:`parse_config`."""
    parser = build_parser(prog)
    return parser, parse_config(parser, prepare_args(args))


__all__ = [
    "EXECUTOR_NAMES",
    "NULL_SPELLINGS",
    "Experiment",
    "build_experiment",
    "build_objects_from_yaml",
    "build_parser",
    "changed_keys",
    "check_config_file",
    "check_environment",
    "instantiate",
    "load_yaml",
    "map_executor",
    "map_method",
    "one_line",
    "parse_accepting_none",
    "parse_args",
    "parse_config",
    "prepare_args",
    "range_error",
]
