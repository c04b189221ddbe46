"""Hyperparameters: declared once per method, with their meaning, range and search space.

A method's hyperparameters are one frozen dataclass (a :class:`Hyperparameters` subclass); each
field is declared once with :func:`knob`: its type (which carries the valid range), the paper's
default, a one-line meaning and, for the tuning stage, a search distribution::

    @dataclass(frozen=True)
    class FedProxHparams(LocalOptimizer):
        mu: NonNegativeFloat = knob(0.01, "weight of the proximal term (0 gives FedAvg)", log_uniform(1e-4, 1.0))

The Algorithm, its client and its server all read that one object (``self.hp``); the command
line, YAML, ``--print_config``, ``save_hyperparameters``, ``fedhet list METHOD`` and the tuning
stage read the same declaration (:func:`knobs`), so no layer restates a name or a default.

The range types: a learning rate of ``-0.1`` or a negative loss weight used to be accepted and
fail (or train silently) minutes later. jsonargparse rejects a value outside the annotated type's
range when the config is parsed, before anything is written, with the key, the value and the
range; :class:`Hyperparameters` checks the same ranges when a method is built from Python. At run
time they are jsonargparse's restricted number types (``float``/``int`` subclasses); static type
checkers see plain ``float``/``int``. Which type to pick:

- :data:`PositiveFloat` (``> 0``): learning rates, temperatures, scales, kernel bandwidths.
- :data:`NonNegativeFloat` (``>= 0``): loss weights, lambdas, ``mu``, weight decay, noise.
- :data:`UnitInterval` (``[0, 1]``): probabilities, fractions, mixing and EMA coefficients.
- :data:`Fraction` (``(0, 1]``): a share that must not be empty (clients per round, batches).
- :data:`Momentum` (``[0, 1)``): SGD momentum.
- :data:`PositiveInt` (``>= 1``): counts, epochs, steps, batch sizes, dimensions.
- :data:`NonNegativeInt` (``>= 0``): counts that may be zero (warm-up rounds, pretraining epochs).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fedhet.errors import ConfigError

if TYPE_CHECKING:
    PositiveFloat = float
    NonNegativeFloat = float
    UnitInterval = float
    Fraction = float
    Momentum = float
    PositiveInt = int
    NonNegativeInt = int
else:
    from jsonargparse.typing import (
        ClosedUnitInterval as UnitInterval,
    )
    from jsonargparse.typing import (
        NonNegativeFloat,
        NonNegativeInt,
        PositiveFloat,
        PositiveInt,
        restricted_number_type,
    )

    Fraction = restricted_number_type("Fraction", float, [(">", 0), ("<=", 1)])
    Momentum = restricted_number_type("Momentum", float, [(">=", 0), ("<", 1)])

#: The allowed range of each type, as the one-line errors of the command line word it.
RANGES: dict[str, str] = {
    "PositiveFloat": "a number > 0",
    "NonNegativeFloat": "a number >= 0",
    "ClosedUnitInterval": "a number in [0, 1]",
    "OpenUnitInterval": "a number in (0, 1)",
    "Fraction": "a number in (0, 1]",
    "Momentum": "a number in [0, 1)",
    "PositiveInt": "an integer >= 1",
    "NonNegativeInt": "an integer >= 0",
}


def plain(value: Any) -> Any:
    """``value`` with jsonargparse's range-checked numbers (also in a list or tuple) as plain ``float``/``int``.

    They behave as numbers, but pickled into a checkpoint (a module's saved hyperparameters, a
    server's state) they would not load under ``torch.load(weights_only=True)``.
    """
    if type(value).__module__ == "jsonargparse.typing":
        return float(value) if isinstance(value, float) else int(value)
    if isinstance(value, (list, tuple)) and any(type(v).__module__ == "jsonargparse.typing" for v in value):
        return type(value)(plain(v) for v in value)
    return value



@dataclass(frozen=True)
class Search:
    """How the tuning stage samples one hyperparameter (W&B sweep / Optuna vocabulary).

    Attributes:
        distribution: ``"log_uniform"`` (between ``low`` and ``high``, both > 0), ``"uniform"``,
            ``"int_uniform"`` or ``"categorical"`` (one of ``values``).
        low: lower bound (inclusive).
        high: upper bound (inclusive).
        values: the choices of a categorical search.
    """

    distribution: Literal["log_uniform", "uniform", "int_uniform", "categorical"]
    low: float | None = None
    high: float | None = None
    values: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.distribution == "categorical":
            if not self.values:
                raise ValueError("a categorical search needs values")
            return
        if self.low is None or self.high is None or not self.low < self.high:
            raise ValueError(f"a {self.distribution} search needs low < high, got {self.low}, {self.high}")
        if self.distribution == "log_uniform" and self.low <= 0:
            raise ValueError(f"a log-uniform search needs low > 0, got {self.low}")

    def sweep_parameter(self) -> dict[str, Any]:
        """This search as one parameter of a W&B-format sweep YAML (``fedhet sweep``, ``wandb agent``)."""
        if self.distribution == "categorical":
            return {"values": list(self.values)}
        kind = {"log_uniform": "log_uniform_values", "uniform": "uniform", "int_uniform": "int_uniform"}
        return {"distribution": kind[self.distribution], "min": self.low, "max": self.high}

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is a point of this search space (defaults should be)."""
        if self.distribution == "categorical":
            return value in self.values
        assert self.low is not None and self.high is not None
        return self.low <= value <= self.high


def log_uniform(low: float, high: float) -> Search:
    """Search uniformly in ``log`` between ``low`` and ``high`` (learning rates, loss weights)."""
    return Search("log_uniform", low, high)


def uniform(low: float, high: float) -> Search:
    """Search uniformly between ``low`` and ``high`` (coefficients on a bounded scale)."""
    return Search("uniform", low, high)


def int_uniform(low: int, high: int) -> Search:
    """Search the integers ``low..high`` uniformly (epochs, steps, sizes)."""
    return Search("int_uniform", low, high)


def categorical(*values: Any) -> Search:
    """Search among ``values`` (modes, switches)."""
    return Search("categorical", values=tuple(values))


def knob(default: Any, help: str, search: Search | None = None) -> Any:
    """Declare one hyperparameter field: its default, its one-line meaning and its search space.

    The valid range is the field's type (``PositiveFloat`` ...). ``search=None`` means the tuning
    stage leaves the knob at its value (a protocol choice, not a tunable).
    """
    if search is not None and not search.contains(default):
        raise ValueError(f"default {default!r} lies outside its search space {search}")
    return dataclasses.field(default=default, metadata={"help": help, "search": search})


@dataclass(frozen=True)
class Knob:
    """One declared hyperparameter as readers see it (command line help, ``fedhet list``, tuning).

    Attributes:
        name: the field name (the config key under ``method.init_args``).
        type: the annotated type (its range: :attr:`range`).
        default: the declared default.
        help: the one-line meaning.
        range: the valid range in words (``"a number > 0"``), ``""`` when the type has none.
        search: the tuning search space, ``None`` when the knob is not tuned.
    """

    name: str
    type: Any
    default: Any
    help: str
    range: str
    search: Search | None


def _range_of(annotation: Any) -> str:
    inner = _unwrap_optional(annotation)
    if inner is not annotation:
        words = _range_of(inner)
        return f"{words} or null" if words else ""
    name = getattr(annotation, "__name__", "")
    if name in RANGES:
        return RANGES[name]
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(annotation))
    return ""


def _is_restricted(annotation: Any) -> bool:
    return getattr(annotation, "__module__", "") == "jsonargparse.typing" or annotation in (Fraction, Momentum)


def _unwrap_optional(annotation: Any) -> Any:
    """``X`` for ``X | None`` (a knob that may be switched off), else ``annotation``."""
    arguments = [a for a in typing.get_args(annotation) if a is not type(None)]
    if type(None) in typing.get_args(annotation) and len(arguments) == 1:
        return arguments[0]
    return annotation


@dataclass(frozen=True)
class Hyperparameters:
    """Base of every method's hyperparameter dataclass: fields declared with :func:`knob`.

    Building one checks every value against its field's type and range (the parser does the same
    for configs), so a method built from Python cannot hold ``lr=-0.1`` either. Subclasses add
    cross-field rules in :meth:`check` (raise :class:`fedhet.errors.ConfigError`). Messages name
    the field; the Algorithm or client building the object prefixes its own name.
    """

    def __post_init__(self) -> None:
        hints = _type_hints(type(self))
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            annotation = _unwrap_optional(hints[field.name])
            if _is_restricted(annotation) and value is not None and not isinstance(value, bool):
                try:
                    annotation(value)
                except (TypeError, ValueError):
                    raise ConfigError(f"{field.name}={value!r} is not {_range_of(hints[field.name])}") from None
            elif typing.get_origin(annotation) is Literal and value not in typing.get_args(annotation):
                raise ConfigError(f"{field.name}={value!r} is not {_range_of(annotation)}")
            # the parser hands range-checked number types; kept plain, they pickle into checkpoints
            # that load under weights_only=True
            object.__setattr__(self, field.name, plain(value))
        self.check()

    def check(self) -> None:
        """Cross-field rules (one field's range depending on another); none by default."""

    def values(self) -> dict[str, Any]:
        """The hyperparameters as a plain ``{name: value}`` dict (checkpoint-safe numbers)."""
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


_HINTS: dict[type, dict[str, Any]] = {}


def _type_hints(cls: type) -> dict[str, Any]:
    """The resolved field annotations of a hyperparameter class (cached; annotations are strings here)."""
    if cls not in _HINTS:
        import sys

        namespace: dict[str, Any] = {}
        for base in reversed(cls.__mro__):
            namespace.update(vars(sys.modules[base.__module__]))
        _HINTS[cls] = typing.get_type_hints(cls, globalns=namespace)
    return _HINTS[cls]


def knobs(hparams: type[Hyperparameters]) -> list[Knob]:
    """Every declared hyperparameter of ``hparams``, in declaration order (inherited ones first)."""
    hints = _type_hints(hparams)
    return [
        Knob(
            name=f.name,
            type=hints[f.name],
            default=f.default,
            help=f.metadata.get("help", ""),
            range=_range_of(hints[f.name]),
            search=f.metadata.get("search"),
        )
        for f in dataclasses.fields(hparams)
    ]


def describe(hparams: type[Hyperparameters]) -> list[str]:
    """One line per declared hyperparameter: name, default, range, search space and meaning (``fedhet list NAME``)."""
    lines = []
    for k in knobs(hparams):
        search = "" if k.search is None else f"; tuned: {k.search.distribution} {_search_bounds(k.search)}"
        where = f"{k.range}{search}" if k.range or search else "any value"
        lines.append(f"  {k.name} = {k.default!r}  ({where.lstrip('; ')})\n      {k.help}")
    return lines


def _search_bounds(search: Search) -> str:
    return str(list(search.values)) if search.distribution == "categorical" else f"[{search.low}, {search.high}]"


def sweep_parameters(hparams: type[Hyperparameters], prefix: str = "method.init_args.") -> dict[str, Any]:
    """The declared search space of ``hparams`` as W&B-format sweep parameters (dotted config keys).

    The tuning stage and ``fedhet sweep`` read this, so a knob's range is written once, in its
    declaration; knobs declared without a search space are left out (they keep their values).
    """
    return {prefix + k.name: k.search.sweep_parameter() for k in knobs(hparams) if k.search is not None}


def projected(hparams: type[Hyperparameters], source: Any, **overrides: Any) -> Hyperparameters:
    """``hparams`` built from the same-named fields of ``source`` (another method's or a wider set), then ``overrides``.

    A client or server declares the hyperparameters it reads; its Algorithm passes its own (wider)
    object, and each part takes its fields from it, so names and defaults cannot drift between them.
    ``source`` may also be a mapping of names to values (a config's ``hp:`` block), each checked.
    """
    names = {f.name for f in dataclasses.fields(hparams)}
    if isinstance(source, Mapping):  # a config's ``hp: {mu: 0.1, lr: 0.05}`` (LightningCLI, YAML)
        overrides = {**source, **overrides}
        source = None
    taken = {name: getattr(source, name) for name in names if source is not None and hasattr(source, name)}
    unknown = set(overrides) - names
    if unknown:
        raise ConfigError(
            f"{hparams.__name__} has no hyperparameter {', '.join(sorted(unknown))}; "
            f"it has {', '.join(sorted(names))}"
        )
    return hparams(**{**taken, **overrides})


OptimizerName = Literal["sgd", "adam", "adamw"]


@dataclass(frozen=True)
class LocalOptimizer(Hyperparameters):
    """The client optimizer every method shares (declared once for all of them)."""

    optimizer: OptimizerName = knob("sgd", "local optimizer: sgd, adam or adamw")
    lr: PositiveFloat = knob(0.01, "local learning rate", log_uniform(1e-4, 1.0))
    momentum: Momentum = knob(0.0, "SGD momentum (ignored by Adam)")
    weight_decay: NonNegativeFloat = knob(0.0, "L2 weight decay")


__all__ = [
    "RANGES",
    "Hyperparameters",
    "Knob",
    "LocalOptimizer",
    "OptimizerName",
    "Search",
    "categorical",
    "describe",
    "int_uniform",
    "knob",
    "knobs",
    "log_uniform",
    "projected",
    "sweep_parameters",
    "uniform",
    "Fraction",
    "Momentum",
    "NonNegativeFloat",
    "NonNegativeInt",
    "PositiveFloat",
    "PositiveInt",
    "UnitInterval",
    "plain",
]
